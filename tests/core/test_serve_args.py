"""``serve-args`` without vLLM: the cost arithmetic from model configs, and each era's answers (asked of the
adapter of that release, constructed by version -- no vLLM import)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from vllm_hs_compat.adapters import adapter_for_version
from vllm_hs_compat.commands import serve_args as S
from vllm_hs_compat.errors import ModelConfigError

LLAMA_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}
GEMMA_LIKE = {  # hybrid: 5 sliding layers to 1 full, as Gemma 3 does
    "model_type": "gemma3_text",
    "num_hidden_layers": 12,
    "hidden_size": 1024,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "torch_dtype": "bfloat16",
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
}
MLA = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "torch_dtype": "bfloat16",
}


def args(model: Path, layers: str, **kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    S.register(sub)
    ns = parser.parse_args(["serve-args", "--model", str(model), "--layers", layers])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def model_dir(tmp_path: Path, config: dict[str, object]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_dense_cost_is_planes_times_hidden_times_dtype(tmp_path: Path) -> None:
    m = model_dir(tmp_path, LLAMA_8B)
    plan = S.plan(
        args(m, "2,16,29,32", kv_budget_gib=40.0), adapter_for_version("0.33.0"), "0.33.0", S.load_config(str(m))
    )
    c = plan.cost
    assert c["hs_bytes_per_token"] == 4 * 4096 * 2
    assert c["hs_bytes_per_block"] == 4 * 4096 * 2 * 16
    assert c["hs_bytes_for_tokens"] == 4 * 4096 * 2 * (1 << 20)
    assert c["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128
    assert c["hs_over_kv"] == pytest.approx(0.25)
    assert c["token_capacity_loss"] == pytest.approx(0.2)
    assert c["tokens_without_capture"] == (40 << 30) // (2 * 32 * 8 * 128 * 2)
    assert c["tokens_with_capture"] == (40 << 30) // (2 * 32 * 8 * 128 * 2 + 4 * 4096 * 2)
    assert not plan.errors and not plan.warnings


def test_mla_kv_is_one_latent_per_layer() -> None:
    f = S.model_facts(MLA)
    assert f.mla and f.kv_bytes_per_token == 61 * (512 + 64) * 2


def test_dtype_override_and_unknown_dtype() -> None:
    assert S.model_facts(LLAMA_8B, "float32").kv_bytes_per_token == 2 * 32 * 8 * 128 * 4
    with pytest.raises(ModelConfigError, match="unknown dtype"):
        S.model_facts(LLAMA_8B, "int3")
    with pytest.raises(ModelConfigError, match="hidden_size"):
        S.model_facts({"num_hidden_layers": 2})


@pytest.mark.parametrize(
    ("release", "bad"),
    [("0.17.1", [32]), ("0.18.1", []), ("0.33.0", [])],
)
def test_layer_id_bounds_are_the_releases(tmp_path: Path, release: str, bad: list[int]) -> None:
    """0.17.x cannot capture id 0 nor id num_hidden_layers (0.18.0 made them capturable)."""
    m = model_dir(tmp_path, LLAMA_8B)
    plan = S.plan(args(m, "2,16,29,32"), adapter_for_version(release), release, S.load_config(str(m)))
    assert bool(plan.errors) == bool(bad)
    if bad:
        assert f"{bad}" in plan.errors[0] and "[1, 31]" in plan.errors[0]


def test_hybrid_verifier_per_era(tmp_path: Path) -> None:
    m = model_dir(tmp_path, GEMMA_LIKE)
    cfg = S.load_config(str(m))
    old = S.plan(args(m, "2,6,9,12"), adapter_for_version("0.21.0"), "0.21.0", cfg)
    assert any("turns the hybrid KV-cache manager off" in w for w in old.warnings) and not old.errors
    forced = S.plan(args(m, "2,6,9,12", hybrid_kv_cache_manager="on"), adapter_for_version("0.21.0"), "0.21.0", cfg)
    assert any("refused" in e for e in forced.errors)
    assert "--no-disable-hybrid-kv-cache-manager" in forced.argv
    new = S.plan(args(m, "2,6,9,12", hybrid_kv_cache_manager="on"), adapter_for_version("0.22.1"), "0.22.1", cfg)
    assert not new.errors and any("group of its own" in w for w in new.warnings)
    # Sliding layers hold KV per token too (bounded by the window with HMA on).
    assert new.facts.kv_bytes_per_token == 12 * 2 * 1 * 256 * 2 and new.facts.sliding_layers == 10


def test_flags_and_warnings(tmp_path: Path) -> None:
    m = model_dir(tmp_path, LLAMA_8B)
    plan = S.plan(
        args(m, "29,2,16", sink="file", file_path="/data/hs"),
        adapter_for_version("0.29.0"),
        "0.29.0",
        S.load_config(str(m)),
    )
    assert any("ascending" in w for w in plan.warnings) and any("no base plane" in w for w in plan.warnings)
    spec = json.loads(plan.argv[plan.argv.index("--speculative-config") + 1])
    kv = json.loads(plan.argv[plan.argv.index("--kv-transfer-config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [29, 2, 16]
    assert kv["kv_connector_extra_config"] == {"capture": "prompt", "sink": "file", "file": {"path": "/data/hs"}}
    assert plan.layer_ids == [2, 16, 29] and plan.env == {}


def test_export_network_settings_reach_a_config_the_connector_accepts(tmp_path: Path) -> None:
    from vllm_hs_compat.connector.config import ConnectorConfig

    m = model_dir(tmp_path, LLAMA_8B)
    ns = args(m, "2,16,29,32", backend="nixl", export_host="0.0.0.0", export_port=7001, advertise_host="10.0.0.5")
    plan = S.plan(ns, adapter_for_version("0.33.0"), "0.33.0", S.load_config(str(m)))
    kv = json.loads(plan.argv[plan.argv.index("--kv-transfer-config") + 1])
    export = kv["kv_connector_extra_config"]["export"]
    assert export == {"backend": "nixl", "host": "0.0.0.0", "port": 7001, "advertise_host": "10.0.0.5"}
    assert ConnectorConfig.from_extra(kv["kv_connector_extra_config"]).export == export
    assert "VLLM_HS_COMPAT_EXPORT_TOKEN" in plan.env


def test_missing_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ModelConfigError):
        S.load_config(str(tmp_path))


def test_trainer_format_prints_the_trainers_layer_ids(tmp_path: Path) -> None:
    from vllm_hs_compat.connector.config import ConnectorConfig

    m = model_dir(tmp_path, LLAMA_8B)
    ns = args(m, "2,16,29,32", sink="file", file_path="/data/hs", format="modelopt")
    plan = S.plan(ns, adapter_for_version("0.33.0"), "0.33.0", S.load_config(str(m)))
    assert plan.trainer is not None and plan.trainer["trainer_layer_ids"] == [1, 15, 28]
    assert "vLLM id - 1" in S.render(plan) and not plan.errors
    kv = json.loads(plan.argv[plan.argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert kv["file"]["format"] == "modelopt" and ConnectorConfig.from_extra(kv).file_options["format"] == "modelopt"
    speculators = S.plan(
        args(m, "2,16,29,32", format="speculators"), adapter_for_version("0.33.0"), "0.33.0", S.load_config(str(m))
    )
    assert speculators.trainer is not None and speculators.trainer["trainer_layer_ids"] == [2, 16, 29]
    no_base = S.plan(
        args(m, "2,16,29", format="specforge-eagle3"), adapter_for_version("0.33.0"), "0.33.0", S.load_config(str(m))
    )
    assert any("base plane" in e for e in no_base.errors)


def test_the_block_size_default_is_the_releases(tmp_path: Path) -> None:
    """0.34 raised vLLM's default block size from 16 to 64: the cost per block follows the release (asked of its
    adapter); an explicit --block-size wins."""
    m = model_dir(tmp_path, LLAMA_8B)
    cfg = S.load_config(str(m))
    old = S.plan(args(m, "2,16,29,32"), adapter_for_version("0.33.0"), "0.33.0", cfg)
    new = S.plan(args(m, "2,16,29,32"), adapter_for_version("0.34.0"), "0.34.0", cfg)
    assert (old.cost["block_size"], new.cost["block_size"]) == (16, 64)
    assert new.cost["hs_bytes_per_block"] == 4 * 4096 * 2 * 64
    assert "2.00 MiB per 64-token block" in S.render(new) and "512.00 KiB per 16-token block" in S.render(old)
    chosen = S.plan(args(m, "2,16,29,32", block_size=32), adapter_for_version("0.34.0"), "0.34.0", cfg)
    assert chosen.cost["block_size"] == 32
    assert new.release_defaults["model_runners"] == ["v2"] and old.release_defaults["model_runners"] == ["v2", "v1"]


def test_the_connectors_device_memory_is_stated_against_the_margin_where_vllm_keeps_only_that(
    tmp_path: Path,
) -> None:
    """0.34 commits the KV cache after warm-up and keeps a margin (the extensible KV cache): the connector's own
    device buffers (staging at most STAGE_BYTES, index tensors) are stated against it with the flag that reserves
    them.  Control: 0.33 sizes the KV cache before warm-up from gpu_memory_utilization; no such warning."""
    from vllm_hs_compat.core.transfer import STAGE_BYTES

    m = model_dir(tmp_path, LLAMA_8B)
    cfg = S.load_config(str(m))
    new = S.plan(args(m, "2,16,29,32"), adapter_for_version("0.34.0"), "0.34.0", cfg)
    mem = new.device_memory
    token_bytes = 4 * 4096 * 2
    assert mem["tokens_read_in_one_step"] == 1 << 20 and mem["staging_bytes"] == STAGE_BYTES
    chunk = STAGE_BYTES // token_bytes
    assert mem["index_bytes"] == 8 * (1 << 20) + 2 * 8 * 4 * chunk
    assert mem["peak_bytes"] == STAGE_BYTES + mem["index_bytes"]
    (warning,) = [w for w in new.warnings if "margin" in w]
    assert "--gpu-memory-utilization" in warning and "1.00 GiB" in warning and "0.996 on an 80 GiB GPU" in warning
    assert new.release_defaults["gpu_memory_utilization"] == 1.0 and new.release_defaults["kv_cache_margin"]
    small = S.plan(args(m, "2,16,29,32", tokens=1000), adapter_for_version("0.34.0"), "0.34.0", cfg)
    assert small.device_memory["staging_bytes"] == 1000 * token_bytes  # a small step stages only its rows
    old = S.plan(args(m, "2,16,29,32"), adapter_for_version("0.33.0"), "0.33.0", cfg)
    assert not old.warnings and old.release_defaults["kv_cache_margin"] is None
    assert old.device_memory == mem  # the connector's buffers are the same; only vLLM's sizing moved
    assert "connector device memory" in S.render(old)


def test_an_untested_release_is_planned_with_a_warning(tmp_path: Path) -> None:
    m = model_dir(tmp_path, LLAMA_8B)
    plan = S.plan(args(m, "2,16,29,32"), adapter_for_version("0.35.0"), "0.35.0", S.load_config(str(m)))
    assert any("newer than every release" in w for w in plan.warnings) and not plan.errors
