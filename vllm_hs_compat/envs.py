"""Every environment variable the package reads, in one place (as vLLM keeps its ``envs``).

Each is read when it is used, never frozen at import: a test or a benchmark that sets one sees it in the next
reader it builds.  Settings a deployment owns have a proper home besides: the read path in
``kv_connector_extra_config["read"]`` (:class:`vllm_hs_compat.core.transfer.ReadOptions`), the export in
``kv_connector_extra_config["export"]``.  The variables below are the fallbacks and the process-wide switches.

Standard library only: the core (torch-only) imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

ADAPTER: Final = "VLLM_HS_COMPAT_ADAPTER"
UNTESTED: Final = "VLLM_HS_COMPAT_UNTESTED"
EXPORT_TOKEN: Final = "VLLM_HS_COMPAT_EXPORT_TOKEN"
EXPORT_TOKEN_FILE: Final = "VLLM_HS_COMPAT_EXPORT_TOKEN_FILE"
CAPTURE_PATH: Final = "VLLM_HS_COMPAT_CAPTURE_PATH"
LONE_READ: Final = "VLLM_HS_COMPAT_LONE_READ"
LONE_CHUNKS: Final = "VLLM_HS_COMPAT_LONE_CHUNKS"
TRITON: Final = "VLLM_HS_COMPAT_TRITON"
PINNED_MIB: Final = "VLLM_HS_COMPAT_PINNED_MIB"

#: name -> (default, what it does).  docs/connector.md ("Environment variables") lists the same.
VARIABLES: Final[Mapping[str, tuple[str, str]]] = {
    ADAPTER: ("", "the era adapter to use whatever the version says (forks, nightlies); the probes must agree"),
    UNTESTED: (
        "probe",
        "a vLLM newer than the supported range: `probe` runs it when every probe agrees (warning, slot checks on "
        "every request), `refuse` refuses it",
    ),
    EXPORT_TOKEN: ("", "the trainer token (else the token file); never put it in `kv_transfer_params`"),
    EXPORT_TOKEN_FILE: ("", "where the trainer token lives (default `~/.cache/vllm-hs-compat/export.token`)"),
    CAPTURE_PATH: ("staged", "default read path on CUDA: `staged` (device buffer + D2H) or `direct` (Triton)"),
    LONE_READ: ("1", "`0`: a request read alone takes the per-token path instead of whole blocks"),
    LONE_CHUNKS: ("1", "`0`: per-plane lone reads use the Triton row kernel instead of whole-block chunks"),
    TRITON: ("1", "`0`: never use the Triton row kernel (process-wide; index_select only)"),
    PINNED_MIB: (
        "2048",
        "MiB of pinned host memory the capture owner allocates at start for its step reads (`0`: none; torch's "
        "pinned allocator then makes blocks on the engine's first steps)",
    ),
}


def get(name: str) -> str:
    """The variable's value, or its default (:data:`VARIABLES`); a name not listed there is a programming error."""
    default, _ = VARIABLES[name]
    return os.environ.get(name, default)


def flag(name: str) -> bool:
    """A ``1``/``0`` switch: anything but ``0`` is on."""
    return get(name) != "0"
