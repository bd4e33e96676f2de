"""The capture connector vLLM loads: ``kv_connector="HiddenStatesCaptureConnector"``,
``kv_connector_module_path="vllm_hs_compat.connector"`` (see docs/connector.md).

Importing the class imports vLLM (the adapter supplies its base classes), so it is resolved lazily: the
configuration, sinks and the two halves import without vLLM.
"""

from __future__ import annotations

from typing import Any

from .config import ConnectorConfig
from .sinks import CallbackSink, ExportSink, FileSink, Sink

CONNECTOR_NAME = "HiddenStatesCaptureConnector"
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
]


def __getattr__(name: str) -> Any:
    if name in ("HiddenStatesCaptureConnector", "CaptureMetadata", "CaptureHandshake"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
