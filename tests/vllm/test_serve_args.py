"""``vllm-hs-compat serve-args`` against the installed release: its flags parse with that release's own
``EngineArgs`` command line into the speculative and KV-transfer configs the capture needs, and the connector's
own config reader accepts the extra config."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import harness as h
import pytest

from vllm_hs_compat import api
from vllm_hs_compat.commands import serve_args as S
from vllm_hs_compat.connector import ConnectorConfig

pytestmark = pytest.mark.vllm

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "architectures": ["LlamaForCausalLM"],
}


def _layers() -> list[int]:
    """EAGLE-3's usual ids, the last one the highest this release captures (0.17.x: not id L itself)."""
    return [2, 16, 29, api.get_adapter().layer_id_bounds(32)[1]]


def _engine_args(flags: list[str]) -> Any:
    """The release's ``EngineArgs`` from ``flags``, through its own argument parser (``vllm serve`` adds these
    engine arguments to its parser on every supported release)."""
    from vllm.engine.arg_utils import EngineArgs

    mod = None
    for name in ("vllm.utils.argparse_utils", "vllm.utils"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "FlexibleArgumentParser"):
            break
    assert mod is not None
    parser = EngineArgs.add_cli_args(mod.FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(flags))


@pytest.mark.parametrize("sink", ["export", "file"])
def test_flags_parse_with_the_releases_cli(tmp_path: Path, sink: str, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    layers = _layers()
    rc = S.main(["--model", str(tmp_path), "--layers", ",".join(map(str, layers)), "--sink", sink, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    assert out["vllm"] == h.vllm_version()
    assert out["adapter"].startswith(api.get_adapter().name + " ")
    argv = out["argv"]
    assert argv[:2] == ["serve", str(tmp_path)]
    ea = _engine_args(["--model", argv[1], *argv[2:]])
    spec = ea.speculative_config
    spec = spec if isinstance(spec, dict) else json.loads(spec)
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == layers
    kv = ea.kv_transfer_config
    assert kv.kv_connector == "HiddenStatesCaptureConnector"
    assert kv.kv_connector_module_path == "vllm_hs_compat.connector"
    assert kv.kv_role == "kv_producer"
    cfg = ConnectorConfig.from_extra(kv.kv_connector_extra_config)
    assert cfg.sink == sink and cfg.capture.mode == "prompt"
    assert out["cost"]["hs_bytes_per_token"] == 4 * 4096 * 2


@pytest.mark.parametrize("capture", ["all", "prompt"])
def test_generated_positions_turn_async_scheduling_off_where_v1_misplaces_them(
    tmp_path: Path, capture: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--capture all`` on a release whose Model Runner V1 misplaces the positions after a two-token step under
    async scheduling (tests/vllm/test_async_drafts.py) adds ``--no-async-scheduling``, which this release's own
    CLI parses to ``async_scheduling=False``; control: ``--capture prompt`` leaves vLLM's default."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    rc = S.main(["--model", str(tmp_path), "--layers", ",".join(map(str, _layers())), "--capture", capture, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    ea = _engine_args(["--model", out["argv"][1], *out["argv"][2:]])
    turned_off = capture == "all" and api.get_adapter().generated_rows_need_sync_scheduling()
    assert ("--no-async-scheduling" in out["argv"]) == turned_off
    assert (ea.async_scheduling is False) == turned_off  # vLLM's default (None or True) where not turned off
    assert any("#56417" in w for w in out["warnings"]) == turned_off


def test_layer_ids_outside_the_releases_bounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    lo, hi = api.get_adapter().layer_id_bounds(32)
    rc = S.main(["--model", str(tmp_path), "--layers", f"2,{hi + 1}"])
    text = capsys.readouterr().out
    assert rc == 1 and f"[{lo}, {hi}]" in text and "ERROR" in text


def test_text_output_names_release_and_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    layers = ",".join(map(str, _layers()))
    assert S.main(["--model", str(tmp_path), "--layers", layers, "--kv-budget-gib", "40"]) == 0
    text = capsys.readouterr().out
    assert f"vLLM {h.vllm_version()}" in text and "32,768 B per token" in text and "262,144 with" in text


def test_the_release_defaults_serve_args_states_are_vllms_own() -> None:
    """What serve-args says the installed release does without flags (its adapter's facts: block size, the
    extensible KV cache and its margin) against vLLM's own ``CacheConfig`` and ``extensible_kv_cache`` module."""
    import dataclasses

    from vllm.config import CacheConfig

    adapter = api.get_adapter()
    named = getattr(CacheConfig, "DEFAULT_BLOCK_SIZE", None)
    if named is not None:  # the releases that name their default (0.33: 16, 0.34: 64)
        assert adapter.default_block_size == named
        assert CacheConfig().block_size == named  # what a server without --block-size gets
    fields = {f.name for f in dataclasses.fields(CacheConfig)}
    assert ("enable_extensible_kv_cache" in fields) is adapter.extensible_kv_cache
    margin = adapter.kv_cache_margin
    assert (margin is not None) is adapter.extensible_kv_cache
    if margin is not None:
        ext = importlib.import_module("vllm.v1.worker.extensible_kv_cache")
        assert ext.KV_CACHE_MARGIN_FRACTION == margin.fraction
        assert ext.KV_CACHE_MARGIN_FLOOR_BYTES == margin.floor_bytes  # CUDA's (the test platform is not ROCm)
        assert ext.KV_CACHE_NON_TORCH_RESERVE_BYTES == margin.non_torch_bytes
        assert CacheConfig(enable_extensible_kv_cache=True).resolved_gpu_memory_utilization == 1.0
