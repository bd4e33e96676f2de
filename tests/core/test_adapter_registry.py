"""Adapter selection by version (no vLLM needed: the probes are not run here)."""

from __future__ import annotations

import pytest

from vllm_hs_compat.adapters import (
    ADAPTERS,
    SUPPORTED_VLLM,
    TESTED_RELEASES,
    UNTESTED_ENV,
    adapter_for_version,
    choose_adapter,
)
from vllm_hs_compat.core import ViewOrder
from vllm_hs_compat.errors import UnsupportedVllmError


@pytest.mark.parametrize(
    ("version", "name", "order"),
    [
        ("0.17.0", "v0_17", ViewOrder.BLOCK_TOKEN_PLANE),
        ("0.21.0", "v0_17", ViewOrder.BLOCK_TOKEN_PLANE),
        ("0.22.1", "v0_22", ViewOrder.BLOCK_TOKEN_PLANE),
        ("0.28.0", "v0_22", ViewOrder.BLOCK_TOKEN_PLANE),
        ("0.29.0", "v0_29", ViewOrder.BLOCK_PLANE_TOKEN),
        ("0.29.1rc1", "v0_29", ViewOrder.BLOCK_PLANE_TOKEN),
        ("0.32.0+cpu", "v0_29", ViewOrder.BLOCK_PLANE_TOKEN),
        ("0.33.0", "v0_29", ViewOrder.BLOCK_PLANE_TOKEN),
        ("0.34.0", "v0_29", ViewOrder.BLOCK_PLANE_TOKEN),
        ("0.34.9", "v0_29", ViewOrder.BLOCK_PLANE_TOKEN),
    ],
)
def test_era_boundaries(version: str, name: str, order: ViewOrder) -> None:
    adapter = adapter_for_version(version)
    assert adapter.name == name and adapter.view_order is order
    assert not adapter.untested and not adapter.check_every_request


def test_every_tested_release_has_exactly_one_adapter() -> None:
    for release in TESTED_RELEASES:
        assert sum(release in a.versions for a in ADAPTERS) == 1, release
        assert release in SUPPORTED_VLLM


@pytest.mark.parametrize("version", ["0.16.0", "0.16.9", "0.8.5"])
def test_a_release_older_than_every_era_names_version_range_and_override(version: str) -> None:
    with pytest.raises(UnsupportedVllmError) as err:
        adapter_for_version(version)
    msg = str(err.value)
    assert version in msg and str(SUPPORTED_VLLM) in msg and "VLLM_HS_COMPAT_ADAPTER" in msg


@pytest.mark.parametrize("version", ["0.35.0", "0.35.0.dev12+gabc", "0.36.1", "1.0.0"])
def test_a_release_newer_than_every_era_gets_the_newest_adapter_marked_untested(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Judged by its facts, not its number: the newest era's adapter, untested (its probes decide, see
    tests/vllm/test_selection.py), with the slot checks on every request -- never a refusal by the number alone."""
    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    adapter = adapter_for_version(version)
    assert adapter.name == ADAPTERS[-1].name and adapter.untested and adapter.check_every_request
    assert "UNTESTED" in adapter.describe()
    # every delta of the newest era holds for it (the probes check them against the install)
    assert adapter.resumed_field == "absent" and adapter.v1_runner is False and adapter.model_runners == ("v2",)


def test_the_strict_switch_refuses_a_newer_release_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UNTESTED_ENV, "refuse")
    with pytest.raises(UnsupportedVllmError) as err:
        adapter_for_version("0.35.0")
    msg = str(err.value)
    assert "0.35.0" in msg and f"{UNTESTED_ENV}=refuse" in msg and TESTED_RELEASES[-1] in msg
    assert adapter_for_version("0.34.0").name == "v0_29"  # the switch leaves the supported range alone
    monkeypatch.setenv(UNTESTED_ENV, "sometimes")
    with pytest.raises(UnsupportedVllmError, match="expected one of"):
        adapter_for_version("0.35.0")


def test_override_picks_by_name_and_rejects_unknown_names() -> None:
    assert choose_adapter("0.34.0.dev1", "v0_29").name == "v0_29"
    assert not choose_adapter("0.34.0.dev1", "v0_29").untested
    assert choose_adapter("0.35.0.dev1", "v0_29").untested  # a nightly past the range, chosen by name
    with pytest.raises(UnsupportedVllmError, match="names no adapter"):
        choose_adapter("0.29.0", "v9_99")


@pytest.mark.parametrize(
    ("version", "facts"),
    [
        ("0.17.1", dict(handle_preemptions_takes_metadata=False, connector_ctor_requires_kv_cache_config=False)),
        ("0.19.1", dict(handle_preemptions_takes_metadata=True, connector_module_path_wins=False)),
        ("0.20.2", dict(connector_module_path_wins=True, connector_ctor_requires_kv_cache_config=False)),
        ("0.21.0", dict(connector_ctor_requires_kv_cache_config=True, hma_with_connector="forced-off")),
        ("0.22.1", dict(hidden_state_cache_spec=True, hma_with_connector="on-if-SupportsHMA")),
        ("0.24.0", dict(padding_slots_write="last-slot-of-last-block")),
        ("0.25.1", dict(padding_slots_write="null-block-0", requires_kv_delivery=False)),
        ("0.27.1", dict(requires_kv_delivery=True, cross_layer_hooks=True)),
        ("0.29.0", dict(cross_layer_hooks=False, default_runner="v2", get_transfer_results=False)),
        ("0.30.0", dict(get_transfer_results=True)),
        ("0.33.0", dict(get_kv_cache_groups_module="vllm.v1.core.kv_cache_planning")),
        ("0.33.0", dict(resumed_field="resumed_req_ids", v1_runner=True, model_runners=("v2", "v1"))),
        ("0.33.0", dict(default_block_size=16, extensible_kv_cache=False)),
        ("0.28.0", dict(v1_runner=True, model_runners=("v1",))),
        ("0.34.0", dict(resumed_field="absent", v1_runner=False, model_runners=("v2",), default_runner="v2")),
        ("0.34.0", dict(default_block_size=64, extensible_kv_cache=True)),
    ],
)
def test_version_deltas(version: str, facts: dict[str, object]) -> None:
    adapter = adapter_for_version(version)
    for name, value in facts.items():
        assert getattr(adapter, name) == value, (version, name)


def test_layer_id_bounds_changed_in_0_18() -> None:
    assert adapter_for_version("0.17.1").layer_id_bounds(28) == (1, 27)
    assert adapter_for_version("0.18.1").layer_id_bounds(28) == (0, 28)
