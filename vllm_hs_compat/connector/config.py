"""The connector's settings, read from ``kv_transfer_config.kv_connector_extra_config`` (see docs/connector.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from vllm_hs_compat.core.capture import CaptureSpec
from vllm_hs_compat.errors import CaptureConfigError

SinkKind = Literal["export", "file", "callback"]
SINKS: Final[tuple[SinkKind, ...]] = ("export", "file", "callback")
#: ``ExportProducer`` keyword arguments a deployment may set (plus ``token_file``).
EXPORT_KEYS: Final = frozenset(
    {
        "backend",
        "num_slots",
        "slot_bytes",
        "lease_ttl_s",
        "ready_ttl_s",
        "on_full",
        "wait_timeout_s",
        "host",
        "port",
        "advertise_host",
        "checksum",
        "shm_dir",
        "token_file",
        "handshake_timeout_s",
        "max_redeliveries",
    }
)
KNOWN_KEYS: Final = frozenset({"capture", "window", "sink", "export", "file", "callback", "check_requests"})
#: Keys of ``"file"``: the directory, and the trainer format written there (see vllm_hs_compat.trainer.formats).
FILE_KEYS: Final = frozenset(
    {"path", "format", "verifier", "num_hidden_layers", "loss_mask", "drafter_config", "compress", "final_norm"}
)


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings."""

    capture: CaptureSpec = field(default_factory=CaptureSpec)
    sink: SinkKind = "export"
    export: Mapping[str, Any] = field(default_factory=dict)
    file_path: str | None = None
    callback: str | None = None
    check_requests: int = 8
    """The first N requests have every derived slot checked against the slot mapping vLLM wrote with."""
    file_options: Mapping[str, Any] = field(default_factory=dict)
    """``"file"`` options besides ``path``: ``format`` (``native`` default, ``speculators``, ``specforge-eagle3``,
    ``specforge-dflash``, ``modelopt``), ``verifier`` (the model folder), ``num_hidden_layers``, ``loss_mask``,
    ``drafter_config``, ``compress``, ``final_norm`` (see :class:`~vllm_hs_compat.trainer.formats.FormatWriter`)."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; unknown or malformed keys raise :class:`CaptureConfigError`."""
        what = "kv_connector_extra_config"
        unknown = sorted(str(k) for k in extra if k not in KNOWN_KEYS)
        if unknown:
            raise CaptureConfigError(f"{what} has unknown keys {unknown}; expected any of {sorted(KNOWN_KEYS)}")
        capture = CaptureSpec.parse({k: extra[k] for k in ("capture", "window") if k in extra}, what=what)
        sink = extra.get("sink", "export")
        if sink not in SINKS:
            raise CaptureConfigError(f"{what}: sink must be one of {list(SINKS)}, found {sink!r}")
        export = extra.get("export", {})
        if not isinstance(export, Mapping):
            raise CaptureConfigError(f"{what}: export must be a map, found {type(export).__name__}")
        bad = sorted(str(k) for k in export if k not in EXPORT_KEYS)
        if bad:
            raise CaptureConfigError(f"{what}: export has unknown keys {bad}; expected any of {sorted(EXPORT_KEYS)}")
        file_path: str | None = None
        file_options: dict[str, Any] = {}
        if "file" in extra:
            f = extra["file"]
            if not isinstance(f, Mapping) or not isinstance(f.get("path"), str) or not f["path"]:
                raise CaptureConfigError(f'{what}: file must be {{"path": "<directory>"}}, found {f!r}')
            file_path = str(f["path"])
            bad_file = sorted(str(k) for k in f if k not in FILE_KEYS)
            if bad_file:
                raise CaptureConfigError(
                    f"{what}: file has unknown keys {bad_file}; expected any of {sorted(FILE_KEYS)}"
                )
            file_options = {str(k): v for k, v in f.items() if k != "path"}
            fmt = file_options.get("format", "native")
            from vllm_hs_compat.trainer.formats import FORMATS

            if fmt not in FORMATS:
                raise CaptureConfigError(f"{what}: file.format must be one of {list(FORMATS)}, found {fmt!r}")
        if sink == "file" and file_path is None:
            raise CaptureConfigError(f'{what}: sink "file" needs "file": {{"path": "<directory>"}}')
        callback = extra.get("callback")
        if callback is not None and (not isinstance(callback, str) or ":" not in callback):
            raise CaptureConfigError(f'{what}: callback must be "module:function", found {callback!r}')
        if sink == "callback" and callback is None:
            raise CaptureConfigError(f'{what}: sink "callback" needs "callback": "module:function"')
        checks = extra.get("check_requests", 8)
        if isinstance(checks, bool) or not isinstance(checks, int) or checks < 0:
            raise CaptureConfigError(f"{what}: check_requests must be a non-negative int, found {checks!r}")
        return cls(capture, sink, dict(export), file_path, callback, checks, file_options)
