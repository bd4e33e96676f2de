"""The connector class vLLM loads, against the installed release's base class: no abstract method left, the
era's hook forms, loadable by name (plugin) and by module path through vLLM's own factory."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest

from vllm_hs_compat import api

pytestmark = pytest.mark.vllm


def _base() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return KVConnectorBase_V1


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _connector_class(which: str) -> type:
    if which == "package":
        from vllm_hs_compat.connector import HiddenStatesCaptureConnector

        return HiddenStatesCaptureConnector
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module("minimal_connector").MinimalCaptureConnector  # type: ignore[no-any-return]
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize("which", ["package", "examples/minimal_connector.py"])
def test_connector_implements_every_abstract_hook_of_this_release(which: str) -> None:
    """The package's connector and README's minimal connector for authors (built on connector_bases())."""
    cls = _connector_class(which)
    assert not getattr(cls, "__abstractmethods__", frozenset())
    assert issubclass(cls, _base())
    # every abstract method of the base is overridden by the connector, not inherited
    for name in getattr(_base(), "__abstractmethods__", ()):
        assert getattr(cls, name) is not getattr(_base(), name), name
    # the era's shims forward to methods every connector built on connector_bases() has
    assert callable(cls.capture_on_preemptions) and callable(cls.capture_on_handshake)


def test_era_hook_forms_match_the_base_class() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from vllm_hs_compat.adapters.shims import PpAwareHandshake
    from vllm_hs_compat.connector import HiddenStatesCaptureConnector as C

    adapter = api.get_adapter()
    base = _base()
    assert issubclass(C, SupportsHMA) is adapter.supports_hma
    # handle_preemptions takes the argument the base names (a set <= 0.18, the metadata from 0.19)
    ours = [p for p in inspect.signature(C.handle_preemptions).parameters if p != "self"]
    theirs = [p for p in inspect.signature(base.handle_preemptions).parameters if p != "self"]
    assert ours == theirs
    if adapter.cross_layer_hooks:
        assert hasattr(base, "register_cross_layers_kv_cache")
        prop = inspect.getattr_static(C, "prefer_cross_layer_blocks")
        assert isinstance(prop, property) and prop.fget is not None and prop.fget(None) is False
    else:
        assert not hasattr(C, "prefer_cross_layer_blocks") and not hasattr(C, "register_cross_layers_kv_cache")
    if adapter.requires_kv_delivery:
        prop = inspect.getattr_static(C, "requires_kv_delivery")
        assert isinstance(prop, property) and prop.fget is not None and prop.fget(None) is False
    # 0.23+: the owner's handshake may come from a pipeline stage > 0; the base would refuse it
    assert (PpAwareHandshake in C.__mro__) is adapter.handshake_pp_aware


def test_vllm_factory_finds_the_class_by_name_and_by_module_path() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_hs_compat.connector import HiddenStatesCaptureConnector
    from vllm_hs_compat.plugin import register

    register()
    register()  # idempotent: vLLM runs general plugins in several places of one process
    for extra in ({}, {"kv_connector_module_path": "vllm_hs_compat.connector"}):
        ktc = KVTransferConfig(kv_connector="HiddenStatesCaptureConnector", kv_role="kv_producer", **extra)
        assert KVConnectorFactory.get_connector_class(ktc) is HiddenStatesCaptureConnector
