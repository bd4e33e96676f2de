"""``vllm-hs-compat capture`` refuses what it can before an engine starts (no vLLM here: a path that reached the
engine would fail on the import), and counts rows that yield no sample.  The engine path itself runs in the e2e
sessions (tests/e2e/test_capture.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hs_compat.capture.store import read_index
from vllm_hs_compat.cli import main
from vllm_hs_compat.reference.models import make_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(d))
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    return d


def _capture(model: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["capture", "--model", str(model), "--layers", "1,2", "--data", str(data), "--out", str(out), *extra])


def test_a_template_without_generation_markers_is_refused_before_the_engine(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert _capture(model_dir, data, tmp_path / "out", "--chat-template", str(plain)) == 2
    err = capsys.readouterr().err
    assert str(plain) in err and "generation" in err
    # positive control: the same rows with --loss-mask all get past the check (and fail later, on the engine's
    # import: this environment has no vLLM)
    with pytest.raises(ImportError):
        _capture(model_dir, data, tmp_path / "out2", "--chat-template", str(plain), "--loss-mask", "all")


def test_bad_arguments_are_refused_with_the_fix(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("")
    for extra, needle in (
        (["--rank", "2", "--world-size", "2"], "--rank 2"),
        (["--records-per-shard", "0"], "--records-per-shard 0"),
        (["--field", "messages"], "NAME=COLUMN"),
    ):
        assert _capture(model_dir, data, tmp_path / "o", *extra) == 2
        assert needle in capsys.readouterr().err
    assert main(["capture", "--model", str(model_dir), "--layers", "x", "--data", str(data), "--out", "o"]) == 2
    assert "--layers" in capsys.readouterr().err


def test_rows_without_a_sample_are_counted_and_a_resume_must_match_the_settings(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "rows.jsonl"
    rows = ["{broken", json.dumps({"id": "e", "messages": []}), json.dumps({"id": "u", "what": 1})]
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    assert _capture(model_dir, data, out, "--json") == 1  # no engine: nothing to capture, three counted failures
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows_read"] == 3 and summary["failed"] == {"malformed": 1, "empty": 1, "unknown_shape": 1}
    assert sorted(r["reason"] for r in read_index(out).to_pylist()) == ["empty", "malformed", "unknown_shape"]
    # the same tree with other layers is another run: refused, naming the setting
    assert main(["capture", "--model", str(model_dir), "--layers", "1,3", "--data", str(data), "--out", str(out)]) == 2
    assert "layers" in capsys.readouterr().err


def test_ray_ranks_get_the_command_less_the_launchers_flags() -> None:
    from vllm_hs_compat.capture.ray_path import rank_argv

    argv = ["--model", "m", "--ray", "2", "--ray-address=auto", "--json", "--out", "o", "--world-size", "3",
            "--ray-cpus-per-actor", "2", "--layers", "1,2"]  # fmt: skip
    assert rank_argv(argv, 1, 2) == [
        "--model",
        "m",
        "--out",
        "o",
        "--layers",
        "1,2",
        "--rank",
        "1",
        "--world-size",
        "2",
    ]


def test_ray_refuses_a_rank_of_its_own_and_a_missing_ray_before_anything_starts(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert _capture(model_dir, data, tmp_path / "o", "--ray", "2", "--rank", "1", "--world-size", "2") == 2
    assert "leave out --rank/--world-size" in capsys.readouterr().err
    try:
        import ray  # noqa: F401
    except ImportError:
        assert _capture(model_dir, data, tmp_path / "o", "--ray", "2", "--loss-mask", "all") == 2
        assert "capture --ray needs Ray" in capsys.readouterr().err


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_the_engine_gets_the_platforms_settings_and_engine_args_win(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, gpu: bool
) -> None:
    """The settings the capture engine is built with: the CPU build's (eager, 32-token blocks, 128 tokens and 32
    sequences a step) on CPU, vLLM's own on a GPU; ``--engine-args`` over either (``null``: vLLM's own)."""
    from vllm_hs_compat.adapters import engine_api
    from vllm_hs_compat.demo import engine as demo_engine
    from vllm_hs_compat.errors import ToolError

    seen: list[dict[str, object]] = []

    def offline_llm(args: dict[str, object], kv: dict[str, object]) -> None:  # records what vLLM would get
        seen.append(dict(args))
        raise ToolError("no engine in this test")

    monkeypatch.setattr(engine_api, "offline_llm", offline_llm)
    monkeypatch.setattr(demo_engine, "has_gpu", lambda: gpu)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert _capture(model_dir, data, tmp_path / "o1", "--loss-mask", "all") == 2
    cpu_keys = set(demo_engine.CPU_DEFAULTS)
    if gpu:
        assert not cpu_keys & set(seen[0]), seen[0]  # vLLM's defaults for the card
    else:
        assert {k: seen[0][k] for k in cpu_keys} == demo_engine.CPU_DEFAULTS
    assert seen[0]["enable_chunked_prefill"] is True and seen[0]["enable_prefix_caching"] is True
    assert seen[0]["max_model_len"] == 64  # the model's own context
    engine_args = json.dumps({"max_num_seqs": 4, "gpu_memory_utilization": 0.5, "block_size": None})
    assert _capture(model_dir, data, tmp_path / "o2", "--loss-mask", "all", "--engine-args", engine_args) == 2
    assert seen[1]["max_num_seqs"] == 4 and seen[1]["gpu_memory_utilization"] == 0.5
    assert "block_size" not in seen[1]  # null: vLLM's own default, on either platform
