"""Where finished records go.  A sink lives in the capture owner's worker process; the scheduler half only knows
its locator (from the start-up handshake) to write the ticket a client gets back.

* :class:`ExportSink` -- the export producer: trainers pull records over NIXL or ``/dev/shm``.
* :class:`FileSink` -- ``<dir>/<record>.safetensors`` + ``<record>.json`` (see :mod:`vllm_hs_compat.export.files`).
* :class:`CallbackSink` -- a ``module:function`` called with each :class:`CaptureRecord` or :class:`RecordFailure`.
"""

from __future__ import annotations

import importlib
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from vllm_hs_compat.core.capture import RecordFailure
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.errors import CaptureConfigError
from vllm_hs_compat.export import files
from vllm_hs_compat.export.protocol import ExportTicket

from .config import ConnectorConfig

log = logging.getLogger("vllm.vllm_hs_compat.connector")


class Sink(ABC):
    """Receives the capture owner's records, one call per record, from the connector's publisher thread."""

    kind: ClassVar[str]
    #: How many publisher threads may call :meth:`write` at once (records in any order); 1 keeps their order.
    writers: int = 1

    def locator(self) -> dict[str, Any]:
        """What the scheduler half needs to write tickets (sent in the start-up handshake)."""
        return {}

    @abstractmethod
    def write(self, record: CaptureRecord, publication: str | None = None) -> None:
        """Take a finished record.  Raising fails this record only (counted and reported).  ``publication``: the
        nonce the record's ticket is bound to (see :func:`sink_ticket`); only the export sink uses it."""

    @abstractmethod
    def fail(self, failure: RecordFailure) -> None:
        """Note that a record whose ticket was handed out will not exist, and why."""

    def close(self) -> None:  # noqa: B027 - optional hook: most sinks hold nothing to release
        """Release resources (the publisher has drained)."""


class ExportSink(Sink):
    """Publish into an :class:`~vllm_hs_compat.export.ExportProducer` pool."""

    kind = "export"

    def __init__(self, options: Mapping[str, Any]) -> None:
        from vllm_hs_compat.export.credentials import load_or_create_token
        from vllm_hs_compat.export.producer import ExportProducer
        from vllm_hs_compat.export.settings import TOKEN_FILE_KEY, ExportSettings

        opts = dict(options)
        token, self.token_file = load_or_create_token(opts.pop(TOKEN_FILE_KEY, None))
        self.producer = ExportProducer(ExportSettings.from_options(opts), token=token)

    def locator(self) -> dict[str, Any]:
        """Endpoint, instance, backend, the producer's public CURVE key and its capability key.  The capability
        key (a :class:`~vllm_hs_compat.export.capabilities.CapabilityKey`) prints redacted in logs; it lets the
        scheduler mint each ticket's per-record capability, never the trainer token."""
        p = self.producer
        return {
            "endpoint": p.endpoint,
            "producer": p.instance,
            "backend": p.backend,
            "server_key": p.server_key,
            "capability_key": p.capability_key,
        }

    def write(self, record: CaptureRecord, publication: str | None = None) -> None:
        self.producer.publish(record.meta, record.hidden_states, publication)

    def fail(self, failure: RecordFailure) -> None:
        self.producer.fail(failure.record_id, failure.reason, failure.message, failure.publication)

    def close(self) -> None:
        self.producer.close()


class FileSink(Sink):
    """Records into a directory: the package's own files (``format="native"``: one safetensors file and one JSON
    manifest per record), or a drafter trainer's own on-disk contract (``speculators``, ``specforge-eagle3``,
    ``specforge-dflash``, ``modelopt``; see :mod:`vllm_hs_compat.trainer.formats`; ``options`` go to its
    :class:`~vllm_hs_compat.trainer.formats.FormatWriter`)."""

    kind = "file"

    def __init__(
        self, path: str, format: str = "native", *, dp_rank: int = 0, device: Any = None, **options: Any
    ) -> None:
        # A trainer format numbers its files per output (speculators' hs_<i> = row i of one dataset): the
        # data-parallel engines of one deployment each write their own complete output, rank k > 0 in dp<k>/.
        self.path = Path(path) if format == "native" or dp_rank == 0 else Path(path) / f"dp{dp_rank}"
        self.path.mkdir(parents=True, exist_ok=True)
        if not os.access(self.path, os.W_OK):
            raise CaptureConfigError(f"file sink directory {self.path} is not writable")
        self.format = format
        #: where a compact storage quantizes: the capture layer's CUDA device (else the host, in the publisher)
        self.device = device
        #: how the native format stores rows (``export.files.STORAGES``); trainer formats keep the captured dtype
        self.storage = str(options.pop("storage", "captured"))
        # Native records are files of their own: several threads write them at once (safetensors' save_file lets
        # the interpreter go while it writes).  Default: 4 beside a GPU engine, whose records come faster than one
        # thread writes them (8B on an H100: 1.2 GB/s of records, one writer 1.5 GB/s; ~1B: 3 GB/s), else 1 (a
        # CPU engine's cores run the model).
        writers = options.pop("writers", None)
        self.writers = int(writers) if writers is not None else (4 if device is not None and format == "native" else 1)
        if self.storage not in files.STORAGES or (self.storage != "captured" and format != "native"):
            raise CaptureConfigError(
                f"file sink storage {self.storage!r} with format {format!r}: expected one of {list(files.STORAGES)}, "
                "a compact storage with the native format only"
            )
        self.writer: Any = None
        if format != "native":
            from vllm_hs_compat.errors import HsCompatError
            from vllm_hs_compat.trainer.formats import FormatWriter

            if "final_norm" in options:
                options["final_norm_kind"] = options.pop("final_norm")
            try:
                self.writer = FormatWriter(self.path, format, **options)
            except HsCompatError as exc:
                raise CaptureConfigError(f"file sink format {format!r}: {exc}") from None
            except TypeError as exc:
                raise CaptureConfigError(f"file sink format {format!r}: bad options ({exc})") from None

    def locator(self) -> dict[str, Any]:
        return {"path": str(self.path.resolve()), "format": self.format}

    def write(self, record: CaptureRecord, publication: str | None = None) -> None:
        if self.writer is not None:
            first = self.writer.layer_map is None
            self.writer.write(record)
            if first and self.writer.layer_map is not None:
                log.info("file sink (%s): %s", self.format, self.writer.layer_map.line())
            return
        files.write_record(self.path, record, storage=self.storage, device=self.device)

    def fail(self, failure: RecordFailure) -> None:
        if self.writer is not None:
            self.writer.fail(failure.record_id, failure.reason, failure.message)
            return
        files.write_failure(self.path, failure.record_id, failure.reason, failure.message)

    def close(self) -> None:
        if self.writer is not None:
            from vllm_hs_compat.errors import HsCompatError

            try:
                summary = self.writer.close()
            except HsCompatError as exc:  # the files written so far stay; the message says how to finish
                log.error("file sink (%s) could not finish %s: %s", self.format, self.path, exc)
                return
            log.info(
                "file sink (%s) closed: %d records; %s",
                self.format,
                summary["records"],
                summary.get("layer_ids_line", ""),
            )


class CallbackSink(Sink):
    """Call ``module:function`` with each record (and each :class:`RecordFailure`) in the worker process."""

    kind = "callback"

    def __init__(self, target: str) -> None:
        module, _, name = target.partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise CaptureConfigError(f"callback {target!r} cannot be imported in the worker: {e}") from None
        if not callable(fn):
            raise CaptureConfigError(f"callback {target!r} is not callable")
        self.fn: Callable[[CaptureRecord | RecordFailure], Any] = fn
        self.target = target

    def locator(self) -> dict[str, Any]:
        return {"callback": self.target}

    def write(self, record: CaptureRecord, publication: str | None = None) -> None:
        self.fn(record)

    def fail(self, failure: RecordFailure) -> None:
        self.fn(failure)


def make_sink(config: ConnectorConfig, dp_rank: int = 0, device: Any = None) -> Sink:
    """The sink ``config`` names (in the capture owner's worker).  A fixed export ``port`` is offset by the
    data-parallel rank, so the DP engines of one host listen on distinct endpoints.  ``device``: the capture
    layer's CUDA device, where the file sink's ``fp8_e4m3`` storage quantizes (None: on the host)."""
    if config.sink == "export":
        opts = dict(config.export)
        if int(opts.get("port", 0) or 0) > 0:
            opts["port"] = int(opts["port"]) + dp_rank
        return ExportSink(opts)
    if config.sink == "file":
        if config.file_path is None:  # config validation guarantees it; keep the error named anyway
            raise CaptureConfigError('sink "file" needs "file": {"path": "<directory>"}')
        return FileSink(config.file_path, dp_rank=dp_rank, device=device, **dict(config.file_options))
    if config.callback is None:
        raise CaptureConfigError('sink "callback" needs "callback": "module:function"')
    return CallbackSink(config.callback)


def sink_ticket(
    kind: str, locator: Mapping[str, Any] | None, record_id: str, nbytes: int, publication: str
) -> dict[str, Any]:
    """The sink's own ``kv_transfer_params`` entry for a pending record (beside ``hs_record``).  These params
    reach whoever sent the request, so the only credential in them is the export's per-publication capability,
    which opens this record and nothing else (never the trainer token; not a later record of the same id).
    ``publication`` (:func:`~vllm_hs_compat.export.capabilities.new_publication`) must travel with the record to
    :meth:`Sink.write` / :meth:`Sink.fail`."""
    if not locator:
        return {}
    if kind == "export":
        return ExportTicket.from_locator(locator, record_id, nbytes, publication).kv_transfer_params()
    if kind == "file" and locator.get("format", "native") != "native":
        return {files.PARAMS_KEY: {"v": 1, "record_id": record_id, "format": locator["format"], "dir": locator["path"]}}
    if kind == "file":
        tensors, manifest, error = files.record_paths(locator["path"], record_id)
        return {
            files.PARAMS_KEY: {
                "v": 1,
                "record_id": record_id,
                "manifest": str(manifest),
                "tensors": str(tensors),
                "error": str(error),
            }
        }
    return {}
