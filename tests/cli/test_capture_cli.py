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
    # import: this environment has no vLLM), and the tree that run made is taken away again
    out2 = tmp_path / "out2"
    assert _capture(model_dir, data, out2, "--chat-template", str(plain), "--loss-mask", "all") == 2
    assert "vLLM cannot be imported" in capsys.readouterr().err
    assert not (out2 / "run.json").exists() and (out2 / "logs" / "rank-0.log").is_file()


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


def test_rows_without_a_sample_are_counted_shown_listed_and_a_resume_must_match_the_settings(
    tmp_path: Path, model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "rows.jsonl"
    rows = ["{broken", json.dumps({"id": "e", "messages": []}), json.dumps({"id": "u", "what": 1}),
            json.dumps({"id": "d", "messages": []}), json.dumps({"id": "d", "prompt": "again"})]  # fmt: skip
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    # no engine: nothing to capture, five counted failures (--loss-mask all: the rows' shapes can take it)
    assert _capture(model_dir, data, out, "--json", "--loss-mask", "all") == 1
    got = capfd.readouterr()
    summary = json.loads(got.out)
    want = {"malformed": 1, "empty": 2, "unknown_shape": 1, "duplicate_id": 1}
    assert summary["rows_read"] == 5 and summary["failed"] == want and summary["tree_failed"] == want
    assert summary["captured"] == summary["skipped"] == summary["not_run"] == 0
    assert sorted(r["reason"] for r in read_index(out).to_pylist()) == sorted(
        ["malformed", "empty", "empty", "unknown_shape", "duplicate_id"]
    )
    # the console: each failure as it happened (the first few), and why nothing ran, in words that are true
    assert f"{data}:0 (no id): malformed" in got.err and f"{data}:4 (no id): duplicate_id: sample id 'd'" in got.err
    assert "nothing to capture: of 5 rows read, 5 gave no sample (empty 2," in got.err
    assert "already in the index" not in got.err
    # every failed row of the tree, listed (exit 1: rows failed); --json for all of them
    assert main(["inspect", str(out)]) == 1
    listed = capfd.readouterr().out
    assert "failed rows: 5 (empty 2," in listed and f"{data}:1  'e'  empty:" in listed
    assert main(["inspect", str(out), "--json"]) == 1
    report = json.loads(capfd.readouterr().out)
    assert [r["source"] for r in report["failed"]] == [f"{data}:{i}" for i in range(5)]
    # the same tree with other layers is another run: refused, naming the setting
    argv = ["capture", "--model", str(model_dir), "--layers", "1,3", "--data", str(data), "--out", str(out)]
    assert main([*argv, "--loss-mask", "all"]) == 2
    assert "layers" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([{"prompt": "hello there"}, {"prompt": "and more"}], "2 `prompt` rows (text: no assistant turn)"),
        ([{"input_ids": [5, 6, 7]}], "1 `input_ids` rows without their own 'loss_mask'"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "1 `messages` rows without an assistant turn"),
    ],
    ids=["prompt", "input_ids", "user-only"],
)
def test_a_loss_mask_the_rows_cannot_take_is_refused_before_anything_is_written(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], rows: list[dict[str, object]], needle: str
) -> None:
    """Under the default ``--loss-mask assistant`` such a file would fail every row (``empty`` / ``bad_field``) and
    index nothing: refused before the tree or the engine, with the fix.  Control: the same rows with ``--loss-mask
    all`` get past it (to the engine's import, which fails here: no vLLM)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert _capture(model_dir, data, out) == 2
    err = capsys.readouterr().err
    assert needle in err and "--loss-mask all" in err and "--on-policy" in err
    assert not out.exists()
    assert _capture(model_dir, data, out, "--loss-mask", "all") == 2
    assert "vLLM cannot be imported" in capsys.readouterr().err


def test_a_source_with_nothing_readable_is_refused(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("")
    assert _capture(model_dir, data, tmp_path / "o", "--loss-mask", "all") == 2
    assert "holds no rows" in capsys.readouterr().err
    data.write_text('{"text": "x"}\n{broken\n')
    assert _capture(model_dir, data, tmp_path / "o", "--loss-mask", "all") == 2
    err = capsys.readouterr().err
    assert "none of its 2 rows" in err and "keys ['text']" in err and "--field" in err
    # control: one readable row among them passes the check
    data.write_text('{"text": "x"}\n{"prompt": "hello"}\n')
    assert _capture(model_dir, data, tmp_path / "o", "--loss-mask", "all") == 2
    assert "vLLM cannot be imported" in capsys.readouterr().err


def test_a_context_longer_than_the_models_own_is_refused_whatever_vllm_allows(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's config says 64 positions: ``--max-model-len 100`` is refused before the engine (vLLM would run
    it with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and give NaN past 64); 64 passes (to the engine's import)."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "hello"}) + "\n")
    assert _capture(model_dir, data, tmp_path / "o", "--loss-mask", "all", "--max-model-len", "100") == 2
    err = capsys.readouterr().err
    assert (
        "--max-model-len 100 is longer than the model's own context of 64 (config.json max_position_embeddings)" in err
    )
    assert not (tmp_path / "o").exists()
    assert _capture(model_dir, data, tmp_path / "o", "--loss-mask", "all", "--max-model-len", "64") == 2
    assert "vLLM cannot be imported" in capsys.readouterr().err


def test_the_model_context_is_derived_as_vllm_derives_it(tmp_path: Path) -> None:
    from vllm_hs_compat.commands.capture import model_context

    def ctx(config: dict[str, object], tokenizer: dict[str, object] | None = None) -> object:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        if tokenizer is not None:
            (d / "tokenizer_config.json").write_text(json.dumps(tokenizer))
        return model_context(str(d))

    assert ctx({"max_position_embeddings": 4096}) == (4096, "config.json max_position_embeddings")
    assert ctx({"n_positions": 1024, "max_position_embeddings": 2048})[0] == 1024  # type: ignore[index]
    assert ctx({"text_config": {"max_position_embeddings": 8192}})[0] == 8192  # type: ignore[index]
    linear = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert ctx(linear)[0] == 8192  # type: ignore[index]
    yarn = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert ctx(yarn)[0] == 4096  # type: ignore[index]  # YaRN's factor is already in it
    assert ctx({"max_position_embeddings": 4096}, {"model_max_length": 2048})[0] == 2048  # type: ignore[index]
    assert ctx({"max_position_embeddings": 4096}, {"model_max_length": 10**30})[0] == 4096  # type: ignore[index]
    assert ctx({"hidden_size": 8}) is None


def test_nothing_to_capture_says_why_truly() -> None:
    import argparse
    from collections import Counter

    from vllm_hs_compat.commands.capture import _Console, _nothing_to_capture

    args = argparse.Namespace(rank=1, world_size=2, data="rows.jsonl", out="tree")
    console = _Console("tree")
    assert "no row of rows.jsonl falls to rank 1 of 2" in _nothing_to_capture(args, Counter(), console)
    done = _nothing_to_capture(args, Counter(read=4, skipped=4), console)
    assert done == "nothing to capture: every row of rank 1 of 2's share (4) is already in the index"
    console.by_reason.update({"empty": 2})
    mixed = _nothing_to_capture(args, Counter(read=5, skipped=3), console)
    assert "3 already in the index, 2 gave no sample (empty 2)" in mixed and "every row" not in mixed


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


@pytest.mark.parametrize("gpu", [False, True])
def test_adoption_overlaps_the_engine_on_a_gpu_and_not_on_the_cpu_build(
    monkeypatch: pytest.MonkeyPatch, gpu: bool
) -> None:
    """``--adoption auto`` (the default): overlap where the engine runs on a GPU, serial on vLLM's CPU build, whose
    cores the adopter would take from the engine; ``overlap`` and ``serial`` as asked on either; anything else is
    refused by name.  Control: the GPU case must come out the other way from the CPU case."""
    from vllm_hs_compat.commands import capture as capture_cmd
    from vllm_hs_compat.demo import engine as demo_engine
    from vllm_hs_compat.errors import CaptureConfigError

    monkeypatch.setattr(demo_engine, "has_gpu", lambda: gpu)
    assert capture_cmd.adoption_overlaps("auto") is gpu
    assert capture_cmd.adoption_overlaps("overlap") is True
    assert capture_cmd.adoption_overlaps("serial") is False
    with pytest.raises(CaptureConfigError, match="--adoption 'both'"):
        capture_cmd.adoption_overlaps("both")
