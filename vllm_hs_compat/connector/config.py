"""The connector's settings, read from ``kv_transfer_config.kv_connector_extra_config`` (see docs/connector.md).

:meth:`ConnectorConfig.from_extra` checks everything that can be checked without the engine: key names, value
types and ranges, the sink's needs.  :func:`check_kv_transfer_config` runs it on a ``kv_transfer_config`` that
names this connector; the ``vllm.general_plugins`` entry point calls it in the process that turns vLLM's
arguments into a config, before any engine process starts or the model loads (see :mod:`vllm_hs_compat.plugin`).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from vllm_hs_compat.core.capture import CaptureSpec
from vllm_hs_compat.errors import CaptureConfigError, ExportConfigError, TransferError

if TYPE_CHECKING:
    from vllm_hs_compat.core.transfer import ReadOptions

SinkKind = Literal["export", "file", "callback"]
SINKS: Final[tuple[SinkKind, ...]] = ("export", "file", "callback")


def export_keys() -> frozenset[str]:
    """Keys of ``"export"``: the fields of :class:`~vllm_hs_compat.export.settings.ExportSettings` (every
    ``ExportProducer`` argument but the token) and ``token_file``.  Imported on use: the general plugin imports this
    module in every vLLM process, also those whose config names no connector of ours (the export's modules and
    pyzmq would cost each of them about 70 ms)."""
    from vllm_hs_compat.export.settings import ExportSettings

    return ExportSettings.keys()


KNOWN_KEYS: Final = frozenset(
    {"capture", "window", "sink", "export", "file", "callback", "check_requests", "read", "self_test"}
)
#: Keys of ``"self_test"``: faults a user injects on purpose to see a reader's verification fail.
SELF_TEST_KEYS: Final = frozenset({"corrupt_record"})
#: Keys of ``"file"``: the directory, and the trainer format written there (see vllm_hs_compat.trainer.formats).
FILE_KEYS: Final = frozenset(
    {
        "path",
        "format",
        "verifier",
        "num_hidden_layers",
        "loss_mask",
        "drafter_config",
        "compress",
        "final_norm",
        "storage",
        "writers",
    }
)
#: The names vLLM may be given for this connector (``kv_connector``) and its module (``kv_connector_module_path``).
CONNECTOR_NAME: Final = "HiddenStatesCaptureConnector"
CONNECTOR_MODULE: Final = "vllm_hs_compat.connector"
WHAT: Final = "kv_connector_extra_config"
FIX: Final = (
    "fix it where the config is given (--kv-transfer-config, or --extra-config of vllm-hs-compat serve); "
    "docs/connector.md lists every key"
)


def _unknown(keys: list[str], known: frozenset[str]) -> str:
    hints = []
    for k in keys:
        close = difflib.get_close_matches(k, sorted(known), n=1)
        if close:
            hints.append(f"{close[0]!r} for {k!r}")
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def check_export_options(export: Mapping[str, Any]) -> None:
    """Types and ranges of the export sink's options (:class:`~vllm_hs_compat.export.settings.ExportSettings`; the
    producer checks them again when it starts)."""
    from vllm_hs_compat.export.settings import TOKEN_FILE_KEY, ExportSettings

    token_file = export.get(TOKEN_FILE_KEY)
    if TOKEN_FILE_KEY in export and (not isinstance(token_file, str) or not token_file):
        raise CaptureConfigError(
            f'{WHAT}: "export": "{TOKEN_FILE_KEY}": {token_file!r} must be a non-empty string; {FIX}'
        )
    try:
        ExportSettings.from_options({k: v for k, v in export.items() if k != TOKEN_FILE_KEY})
    except ExportConfigError as e:
        raise CaptureConfigError(f'{WHAT}: "export": {e}; {FIX}') from None


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
    read: ReadOptions | None = None
    """``"read"``: how the worker reads rows to host (``path``, ``lone_reads``, ``lone_chunks``; see
    :class:`~vllm_hs_compat.core.transfer.ReadOptions`).  None: the environment's defaults, read when the worker
    starts."""
    corrupt_record: int | None = None
    """``"self_test": {"corrupt_record": N}``: the N-th record this worker makes (0-based, in the order records
    are built) gets one row of its first plane negated *before* it is built and checksummed, so the sink stores and
    checksums the corrupted rows and only a comparison with a reference forward can see it (``vllm-hs-compat
    demo --corrupt-record N``).  A self-test of a reader's verification: never set it in production."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; unknown or malformed keys raise :class:`CaptureConfigError`
        naming what was found, what is expected and how to fix it."""
        if not isinstance(extra, Mapping):
            raise CaptureConfigError(f"{WHAT} must be a JSON object, found {type(extra).__name__}; {FIX}")
        unknown = sorted(str(k) for k in extra if k not in KNOWN_KEYS)
        if unknown:
            raise CaptureConfigError(
                f"{WHAT} has unknown keys {unknown}{_unknown(unknown, KNOWN_KEYS)}; expected any of "
                f"{sorted(KNOWN_KEYS)}; {FIX}"
            )
        try:
            capture = CaptureSpec.parse({k: extra[k] for k in ("capture", "window") if k in extra}, what=WHAT)
        except CaptureConfigError as e:
            raise CaptureConfigError(f"{e}; {FIX}") from None
        sink = extra.get("sink", "export")
        if sink not in SINKS:
            raise CaptureConfigError(f'{WHAT}: "sink" must be one of {list(SINKS)}, found {sink!r}; {FIX}')
        export = extra.get("export", {})
        if not isinstance(export, Mapping):
            raise CaptureConfigError(f'{WHAT}: "export" must be a JSON object, found {type(export).__name__}; {FIX}')
        keys = export_keys()
        bad = sorted(str(k) for k in export if k not in keys)
        if bad:
            raise CaptureConfigError(
                f'{WHAT}: "export" has unknown keys {bad}{_unknown(bad, keys)}; expected any of {sorted(keys)}; {FIX}'
            )
        check_export_options(export)
        file_path: str | None = None
        file_options: dict[str, Any] = {}
        if "file" in extra:
            f = extra["file"]
            if not isinstance(f, Mapping) or not isinstance(f.get("path"), str) or not f["path"]:
                raise CaptureConfigError(f'{WHAT}: "file" must be {{"path": "<directory>"}}, found {f!r}; {FIX}')
            file_path = str(f["path"])
            if os.path.exists(file_path) and not os.path.isdir(file_path):
                raise CaptureConfigError(
                    f'{WHAT}: "file": {{"path": {file_path!r}}} exists and is not a directory; name a directory'
                )
            bad_file = sorted(str(k) for k in f if k not in FILE_KEYS)
            if bad_file:
                raise CaptureConfigError(
                    f'{WHAT}: "file" has unknown keys {bad_file}{_unknown(bad_file, FILE_KEYS)}; expected any of '
                    f"{sorted(FILE_KEYS)}; {FIX}"
                )
            file_options = {str(k): v for k, v in f.items() if k != "path"}
            fmt = file_options.get("format", "native")
            from vllm_hs_compat.trainer.specs import FORMATS

            if fmt not in FORMATS:
                raise CaptureConfigError(f"{WHAT}: file.format must be one of {list(FORMATS)}, found {fmt!r}; {FIX}")
            from vllm_hs_compat.export.files import STORAGES

            storage = file_options.get("storage", "captured")
            if storage not in STORAGES or (storage != "captured" and fmt != "native"):
                raise CaptureConfigError(
                    f"{WHAT}: file.storage must be one of {list(STORAGES)} (a compact storage with the native "
                    f"format only), found {storage!r} with format {fmt!r}; {FIX}"
                )
            writers = file_options.get("writers")
            if writers is not None and (
                isinstance(writers, bool) or not isinstance(writers, int) or not 1 <= writers <= 64
            ):
                raise CaptureConfigError(f"{WHAT}: file.writers must be an integer in 1..64, found {writers!r}; {FIX}")
            if writers not in (None, 1) and fmt != "native":
                raise CaptureConfigError(
                    f"{WHAT}: file.writers={writers} with format {fmt!r}: a trainer format numbers its files in "
                    f"order and takes one writer; {FIX}"
                )
        if sink == "file" and file_path is None:
            raise CaptureConfigError(f'{WHAT}: "sink": "file" needs "file": {{"path": "<directory>"}}; {FIX}')
        callback = extra.get("callback")
        if callback is not None and (not isinstance(callback, str) or ":" not in callback):
            raise CaptureConfigError(f'{WHAT}: "callback" must be "module:function", found {callback!r}; {FIX}')
        if sink == "callback" and callback is None:
            raise CaptureConfigError(f'{WHAT}: "sink": "callback" needs "callback": "module:function"; {FIX}')
        checks = extra.get("check_requests", 8)
        if isinstance(checks, bool) or not isinstance(checks, int) or checks < 0:
            raise CaptureConfigError(f'{WHAT}: "check_requests" must be an int >= 0, found {checks!r}; {FIX}')
        read = None
        if "read" in extra:
            try:
                from vllm_hs_compat.core.transfer import ReadOptions

                read = ReadOptions.parse(extra["read"], what=f'{WHAT}: "read"')
            except TransferError as e:
                raise CaptureConfigError(f"{e}; {FIX}") from None
        corrupt = None
        if "self_test" in extra:
            st = extra["self_test"]
            corrupt = st.get("corrupt_record") if isinstance(st, Mapping) and set(st) <= SELF_TEST_KEYS else None
            if isinstance(corrupt, bool) or not isinstance(corrupt, int) or corrupt < 0:
                raise CaptureConfigError(
                    f'{WHAT}: "self_test" must be {{"corrupt_record": <int >= 0>}}, found {st!r}; {FIX}'
                )
        return cls(capture, sink, dict(export), file_path, callback, checks, file_options, read, corrupt)


def names_this_connector(kv_transfer_config: Any) -> bool:
    """Whether a ``kv_transfer_config`` (vLLM's object or a plain map) loads this package's connector."""
    get = kv_transfer_config.get if isinstance(kv_transfer_config, Mapping) else None

    def attr(name: str) -> Any:
        return get(name) if get is not None else getattr(kv_transfer_config, name, None)

    if kv_transfer_config is None:
        return False
    module = attr("kv_connector_module_path")
    return attr("kv_connector") == CONNECTOR_NAME and module in (None, "", CONNECTOR_MODULE)


def check_kv_transfer_config(kv_transfer_config: Any) -> ConnectorConfig | None:
    """Validate the connector's settings in a ``kv_transfer_config`` that names this connector (None for any
    other config).  Also checks what the sink needs from this machine and can be checked without starting it:
    the callback's module can be found, ``$VLLM_HS_COMPAT_EXPORT_TOKEN`` is a well-formed token."""
    if not names_this_connector(kv_transfer_config):
        return None
    if isinstance(kv_transfer_config, Mapping):
        extra = kv_transfer_config.get("kv_connector_extra_config")
    else:
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
    config = ConnectorConfig.from_extra({} if extra is None else extra)
    if config.sink == "callback" and config.callback is not None:
        module = config.callback.split(":", 1)[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise CaptureConfigError(
                f'{WHAT}: "callback": {config.callback!r}: module {module!r} cannot be found; install it or put '
                "its folder on PYTHONPATH (the worker processes import it)"
            )
    if config.sink == "export":
        from vllm_hs_compat.export.credentials import TOKEN_ENV, check_token

        env = os.environ.get(TOKEN_ENV)
        if env:
            check_token(env)
    return config
