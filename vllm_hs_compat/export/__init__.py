"""Export API: stream capture records from the serving process to trainers.

Producer side (the capture connector's worker)::

    from vllm_hs_compat.export import ExportProducer, RecordMeta
    producer = ExportProducer(backend="auto")            # NIXL if installed, else the /dev/shm ring
    ticket = producer.publish(RecordMeta.for_tensor(req_id, rows, token_ids, layer_ids, pre_norm=True), rows)
    kv_transfer_params.update(ticket.kv_transfer_params())

Trainer side (the trainer token: ``$VLLM_HS_COMPAT_EXPORT_TOKEN`` or the token file), or a client holding only
its ticket (whose capability opens that one record)::

    from vllm_hs_compat.export import ExportConsumer
    consumer = ExportConsumer.from_params(kv_transfer_params)
    record = consumer.fetch(kv_transfer_params["hs_export"]["record_id"], wait_s=30)

See docs/export.md for the wire protocol, the capability model, the ledger, UCX settings and fault semantics.
"""

from typing import TYPE_CHECKING, Any

from vllm_hs_compat.core.checksums import compute_checksum
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.errors import (
    AuthError,
    CapabilityError,
    ChecksumMismatchError,
    ControlPlaneError,
    DescriptorError,
    DuplicateRecordError,
    ExportClosedError,
    ExportConfigError,
    ExportError,
    ExportTimeoutError,
    LandingBufferFullError,
    LeaseExpiredError,
    PoolFullError,
    ProducerUnreachableError,
    ProtocolError,
    RecordFailedError,
    RecordFormatError,
    RecordTooLargeError,
    RemoteDisconnectedError,
    RemoteError,
    StaleMetadataError,
    TransportError,
    TransportSettingsMismatchError,
    TransportUnavailableError,
    UnknownRecordError,
    WireVersionError,
)

if TYPE_CHECKING:
    from vllm_hs_compat.export.batch import BatchSchema, RecordBatch
    from vllm_hs_compat.export.capabilities import CapabilityKey, mint, new_publication
    from vllm_hs_compat.export.consumer import Claim, ExportConsumer
    from vllm_hs_compat.export.nixl_backend import UcxSettings, nixl_available
    from vllm_hs_compat.export.producer import ExportProducer
    from vllm_hs_compat.export.protocol import PARAMS_KEY, WIRE_VERSION, ExportTicket
    from vllm_hs_compat.export.settings import ExportSettings

#: Imported on first use (PEP 562), so ``import vllm_hs_compat.export`` does not pay for ZeroMQ and msgspec
#: until a producer, a consumer or a ticket is asked for.
_LAZY = {
    "BatchSchema": "batch",
    "RecordBatch": "batch",
    "CapabilityKey": "capabilities",
    "mint": "capabilities",
    "new_publication": "capabilities",
    "Claim": "consumer",
    "ExportConsumer": "consumer",
    "UcxSettings": "nixl_backend",
    "nixl_available": "nixl_backend",
    "ExportProducer": "producer",
    "PARAMS_KEY": "protocol",
    "WIRE_VERSION": "protocol",
    "ExportTicket": "protocol",
    "ExportSettings": "settings",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "PARAMS_KEY",
    "WIRE_VERSION",
    "AuthError",
    "BatchSchema",
    "CapabilityError",
    "CapabilityKey",
    "CaptureRecord",
    "ChecksumMismatchError",
    "Claim",
    "ControlPlaneError",
    "DescriptorError",
    "DuplicateRecordError",
    "ExportClosedError",
    "ExportConfigError",
    "ExportConsumer",
    "ExportError",
    "ExportProducer",
    "ExportSettings",
    "ExportTicket",
    "ExportTimeoutError",
    "LandingBufferFullError",
    "LeaseExpiredError",
    "PoolFullError",
    "ProducerUnreachableError",
    "ProtocolError",
    "RecordFailedError",
    "RecordFormatError",
    "RecordBatch",
    "RecordMeta",
    "RecordTooLargeError",
    "RemoteDisconnectedError",
    "RemoteError",
    "StaleMetadataError",
    "TransportError",
    "TransportSettingsMismatchError",
    "TransportUnavailableError",
    "UcxSettings",
    "UnknownRecordError",
    "WireVersionError",
    "compute_checksum",
    "mint",
    "new_publication",
    "nixl_available",
]
