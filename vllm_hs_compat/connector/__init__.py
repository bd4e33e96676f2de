"""The capture connector vLLM loads: ``kv_connector="HiddenStatesCaptureConnector"``,
``kv_connector_module_path="vllm_hs_compat.connector"`` (see docs/connector.md).

Importing the class imports vLLM (the adapter supplies its base classes), so it is resolved lazily: the
configuration, sinks and the two halves import without vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from vllm_hs_compat.errors import HsCompatError

from .config import CONNECTOR_NAME, ConnectorConfig
from .sinks import CallbackSink, ExportSink, FileSink, Sink

MODULE_PATH = __name__

__all__ = [
    "CONNECTOR_NAME",
    "MODULE_PATH",
    "CallbackSink",
    "ConnectorConfig",
    "ExportSink",
    "FileSink",
    "HiddenStatesCaptureConnector",
    "Sink",
    "flush",
    "pending_records",
    "unread",
]


def pending_records() -> int:
    """Records whose blocks the scheduler halves of this process hold, not read yet (0 when the engine core
    runs in another process: it keeps stepping until they are read)."""
    from .scheduler import LIVE

    return sum(s.held for s in list(LIVE))


def unread(record_ids: Collection[str]) -> int:
    """Of ``record_ids`` (the ``record_id`` of each request's result), the records the scheduler halves of this
    process still hold blocks for: not read yet.  Once a record is read its files follow from the connector's
    publisher thread without more engine steps."""
    from .scheduler import LIVE

    return sum(s.holds(record_ids) for s in list(LIVE))


def flush(llm: Any, timeout_s: float = 60.0) -> None:
    """Step an in-process engine until every record of its finished requests is read.

    With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` an offline ``LLM.generate`` returns when the outputs are done; the
    capture connector reads the records in the engine's following steps, which ``generate`` does not run.  Call
    this before looking for the records (or shutting the engine down).  Raises :class:`HsCompatError` naming the
    count when ``timeout_s`` passes first.
    """
    from vllm_hs_compat.adapters import get_adapter

    adapter = get_adapter()
    deadline = time.monotonic() + timeout_s
    while pending_records() and time.monotonic() < deadline:
        adapter.step_engine(llm)
    left = pending_records()
    if left:
        raise HsCompatError(f"{left} capture record(s) still unread after {timeout_s} s of engine steps")
    from .worker import LIVE as WORKERS

    for worker in list(WORKERS):  # read records still on their way to the sink
        if not worker.drain(max(0.0, deadline - time.monotonic())):
            raise HsCompatError(f"capture records still on their way to the sink after {timeout_s} s")


def __getattr__(name: str) -> Any:
    if name in ("HiddenStatesCaptureConnector", "CaptureMetadata", "CaptureHandshake"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
