"""``vllm-hs-compat capture`` on a real vLLM CPU engine, as a user runs it (the console script, a process of its own).

The package's conversation set (24 multi-turn conversations) plus broken rows goes through the tiny model's own
chat template; the capture is SIGKILLed mid-run (records adopted, a shard half full) and run again with the same
command.  Then, independently of the package's own templating code:

* every sample has exactly one record in the index, and no file in the tree is outside it;
* each record's token ids are exactly ``tokenizer.apply_chat_template(messages)`` (transformers itself), its loss
  mask exactly transformers' ``assistant_masks`` of the same call, its sample id and source the row's;
* its hidden states equal a transformers forward of the same weights over those ids (every plane, every row);
* the broken rows are counted failures with their named reasons, nothing else is lost.

Negative controls: the same comparison fails for a record paired with another sample's ids, and with the planes
of the neighbouring layer ids.  On-policy (0.32.0 session): the record covers prompt + generated tokens, its loss
mask exactly the generated part.  Runs in the e2e sessions of 0.27.1, 0.29.0 and 0.32.0 (HS_E2E_CAPTURE=1): the
kill-and-resume case in each (about 80 s on 2 cores: two engine starts), the on-policy, two-rank, pipelined
against the serial default of a CPU engine and the engine feed's dropped request in 0.32.0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import e2e_report
import pytest
import torch

from vllm_hs_compat.capture.data import CONVERSATIONS
from vllm_hs_compat.capture.store import read_index, read_summary
from vllm_hs_compat.export.files import read_record
from vllm_hs_compat.reference import forward as R
from vllm_hs_compat.reference.models import make_model

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("HS_E2E_CAPTURE") != "1",
        reason="runs in the e2e sessions of 0.27.1, 0.29.0 and 0.32.0 (HS_E2E_CAPTURE=1)",
    ),
]

CLI = [sys.executable, "-m", "vllm_hs_compat.cli"]
LAYERS = (1, 3, 4)
MAX_LEN = 200  # three of the 24 conversations are longer: counted as too_long
BROKEN = [
    "{not json",  # malformed
    json.dumps({"id": "empty-1", "messages": []}),  # empty
    json.dumps({"id": "odd-1", "text_only": "hello"}),  # unknown_shape
]
on_demo_session = pytest.mark.skipif(
    os.environ.get("HS_E2E_DEMO") != "1", reason="runs in the e2e session of 0.32.0 (HS_E2E_DEMO=1)"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("capture-model") / "model"
    make_model(str(d), "dense", seed=5)
    return str(d)


@pytest.fixture(scope="module")
def hf(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return R.load_hf(model_dir), AutoTokenizer.from_pretrained(model_dir)


def _rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CONVERSATIONS.read_text().splitlines() if line.strip()]


def _data(tmp: Path) -> Path:
    path = tmp / "rows.jsonl"
    lines = [json.dumps(r) for r in _rows()]
    path.write_text("\n".join(lines[:5] + BROKEN + lines[5:]) + "\n")
    return path


def _cmd(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    layers = ",".join(map(str, LAYERS))
    return [*CLI, "capture", "--model", model, "--layers", layers, "--data", str(data), "--out", str(out),
            "--max-model-len", str(MAX_LEN), "--batch-size", "4", "--records-per-shard", "5", "--json",
            *extra]  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}


def _adopted(out: Path) -> int:
    return sum(1 for p in out.glob("shard-*/*.json") if not p.name.startswith("."))


def _expected(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """transformers' own ids and assistant mask of a conversation (no code of this package involved)."""
    enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(enc["input_ids"]), list(enc["assistant_masks"])


def _max_err(model: Any, rows: torch.Tensor, ids: list[int], layers: tuple[int, ...]) -> float:
    planes = R.hf_planes(model, ids)
    ref = torch.stack([R.convention_plane(planes, k) for k in layers], dim=1)
    return max(e.max_rel for e in R.record_errors(rows, ref))


def test_capture_killed_mid_run_resumes_to_one_verified_record_per_sample(
    tmp_path: Path, model_dir: str, hf: Any
) -> None:
    model, tok = hf
    data, out = _data(tmp_path), tmp_path / "tree"
    t0 = time.monotonic()
    proc = subprocess.Popen(_cmd(model_dir, data, out), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 420
    while _adopted(out) < 6 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed_at = _adopted(out)
    assert proc.poll() is None, f"the capture ended before it could be killed: {proc.communicate()[1][-3000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    first_s = time.monotonic() - t0
    assert 6 <= killed_at < 21, f"killed after {killed_at} records: not mid-run"

    t1 = time.monotonic()
    again = subprocess.run(_cmd(model_dir, data, out), env=_env(), capture_output=True, text=True, timeout=480)
    resume_s = time.monotonic() - t1
    assert again.returncode == 1, again.stderr[-3000:]  # 1: some rows failed (the broken ones), the rest captured
    summary = json.loads(again.stdout)

    index = read_index(out).to_pylist()
    ok = [r for r in index if r["status"] == "ok"]
    failed = {r["reason"] for r in index if r["status"] == "failed"}
    rows = _rows()
    long_ids = {r["id"] for r in rows if len(_expected(tok, r["messages"])[0]) > MAX_LEN}
    want_ids = {r["id"] for r in rows} - long_ids
    assert len(long_ids) == 3
    assert sorted(r["sample_id"] for r in ok) == sorted(want_ids)  # each sample exactly once
    assert failed == {"malformed", "empty", "unknown_shape", "too_long"}
    too_long = [r for r in index if r["reason"] == "too_long"]
    assert len(too_long) == 3 and all(r["tokens"] > MAX_LEN for r in too_long)  # each with its own token count
    # A kill between a record's move into its shard and its journal line leaves that one record unindexed: the
    # resume deals with it (the tree check below holds) but does not count it as skipped.  At most one such record.
    assert summary["tree_records"] == len(want_ids) and summary["skipped"] >= killed_at - 1
    on_disk = {p.relative_to(out).as_posix() for p in out.glob("shard-*/*.json")}
    assert on_disk == {r["record"] for r in ok}  # nothing in the tree outside the index
    assert not any((out / ".staging").rglob("*.json"))

    by_id = {r["id"]: r for r in rows}
    worst = 0.0
    for r in ok:
        rec = read_record(out / r["record"])  # checksum verified
        ids, mask = _expected(tok, by_id[r["sample_id"]]["messages"])
        assert list(rec.meta.token_ids) == ids, r["sample_id"]
        assert rec.meta.sample_id == r["sample_id"] and rec.meta.source == r["source"]
        got_mask = rec.meta.loss_mask()
        assert got_mask is not None and got_mask.tolist() == mask, r["sample_id"]
        assert rec.meta.layer_ids == LAYERS and rec.meta.pre_norm
        err = _max_err(model, rec.hidden_states, ids, LAYERS)
        assert err < R.ROW_TOL, (r["sample_id"], err)
        worst = max(worst, err)

    # negative controls: another sample's ids, the neighbouring layers
    a, b = ok[0], ok[1]
    rec_a = read_record(out / a["record"])
    ids_b = _expected(tok, by_id[b["sample_id"]]["messages"])[0]
    assert list(rec_a.meta.token_ids) != ids_b
    n = min(len(ids_b), rec_a.meta.shape[0])
    assert _max_err(model, rec_a.hidden_states[:n], ids_b[:n], LAYERS) > R.ROW_TOL
    ids_a = list(rec_a.meta.token_ids)
    assert _max_err(model, rec_a.hidden_states, ids_a, (0, 2, 3)) > R.ROW_TOL
    e2e_report.add(
        f"capture: killed after {killed_at} records ({first_s:.1f} s), resumed in {resume_s:.1f} s: "
        f"{len(ok)} records, {summary['tree_tokens']} tokens, failed {sorted(failed)}, worst rel err {worst:.4f}"
    )
    assert read_summary(out).tree_records == len(want_ids)


@on_demo_session
def test_on_policy_capture_covers_prompt_and_generated_tokens(tmp_path: Path, model_dir: str, hf: Any) -> None:
    model, tok = hf
    data, out = tmp_path / "few.jsonl", tmp_path / "policy"
    rows = [r for r in _rows() if len(_expected(tok, r["messages"])[0]) < 120][:4]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = subprocess.run(_cmd(model_dir, data, out, "--on-policy", "--max-new-tokens", "8"), env=_env(),
                          capture_output=True, text=True, timeout=480)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ok = [r for r in read_index(out).to_pylist() if r["status"] == "ok"]
    assert sorted(r["sample_id"] for r in ok) == sorted(r["id"] for r in rows)
    for r in ok:
        rec = read_record(out / r["record"])
        messages = next(x for x in rows if x["id"] == r["sample_id"])["messages"]
        last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        enc = tok.apply_chat_template(
            messages[:last_assistant], tokenize=True, add_generation_prompt=True, return_dict=True
        )
        prompt = list(enc["input_ids"])
        ids = list(rec.meta.token_ids)
        assert ids[: len(prompt)] == prompt and rec.meta.num_prompt_tokens == len(prompt)
        assert len(ids) > len(prompt), "no generated token in the record"
        mask = rec.meta.loss_mask()
        assert mask is not None and mask.tolist() == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        assert _max_err(model, rec.hidden_states, ids, LAYERS) < R.ROW_TOL


#: The token whose embedding row the NaN model makes NaN: every position from it on is NaN in vLLM's forward.
NAN_TOKEN = 300


def _nan_model(model_dir: str, folder: Path) -> str:
    """A copy of the tiny model whose embedding of :data:`NAN_TOKEN` is NaN (its LM head untied and finite, so
    only sequences holding that token are touched): a NaN planted at the source, in vLLM's own forward."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embed.clone()
    embed[NAN_TOKEN] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@on_demo_session
def test_nan_at_the_source_fails_its_record_and_the_breaker_stops_on_records_not_on_bad_rows(
    tmp_path: Path, model_dir: str
) -> None:
    """vLLM's start-up refusal of the user's own engine argument comes back as the command's named refusal (exit 2,
    vLLM's message, the log's path, no traceback; the tree it made is gone).  Then, on a model whose embedding of
    one token is NaN: a row holding it fails as ``non_finite`` in the connector (no record file; the message names
    the rows, values and layer ids), never ``ok``; the rows around it are captured; five malformed rows
    in a row do not trip ``--max-consecutive-failures 3``, three NaN records in a row do (exit 3, the summary
    printed, the row not run counted)."""
    model = _nan_model(model_dir, tmp_path / "nan-model")
    rng = torch.Generator().manual_seed(3)

    def ids(nan_at: int | None = None) -> list[int]:  # nan_at: where the NaN token sits
        row = [int(t) for t in torch.randint(3, NAN_TOKEN, (40,), generator=rng)]
        if nan_at is not None:
            row[nan_at] = NAN_TOKEN
        return row

    good = [{"id": f"ok-{i}", "input_ids": ids()} for i in range(4)]
    nan = [{"id": f"nan-{i}", "input_ids": ids(nan_at=10 + i)} for i in range(5)]
    lines = [json.dumps(r) for r in good[:2]] + ["{bad"] * 5 + [json.dumps(nan[0]), json.dumps(good[2])]
    lines += [json.dumps(r) for r in nan[1:]] + [json.dumps(good[3])]
    data, out = tmp_path / "rows.jsonl", tmp_path / "tree"
    data.write_text("\n".join(lines) + "\n")
    argv = [*CLI, "capture", "--model", model, "--layers", ",".join(map(str, LAYERS)), "--data", str(data),
            "--out", str(out), "--loss-mask", "all", "--batch-size", "4", "--max-consecutive-failures", "3",
            "--max-model-len", "256"]  # fmt: skip

    t0 = time.monotonic()
    refused = subprocess.run([*argv, "--engine-args", '{"max_num_seqs": 0}'], env=_env(), capture_output=True,
                             text=True, timeout=480)  # fmt: skip
    refused_s = time.monotonic() - t0
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "vLLM refused to start the engine: ValidationError" in refused.stderr and "max_num_seqs" in refused.stderr
    assert f"vLLM's output: {out / 'logs' / 'rank-0.log'}" in refused.stderr
    assert "Traceback" not in refused.stderr and not (out / "run.json").exists()

    t1 = time.monotonic()
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=480)
    run_s = time.monotonic() - t1
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "stopped after 3 consecutive failures (non_finite x3)" in proc.stderr
    assert "3 captured" in proc.stdout and "1 not run (the run stopped)" in proc.stdout, proc.stdout
    index = {r["sample_id"] or r["source"]: r for r in read_index(out).to_pylist()}
    assert sorted(k for k, r in index.items() if r["status"] == "ok") == ["ok-0", "ok-1", "ok-2"]
    for i in range(4):
        row = index[f"nan-{i}"]
        assert (row["status"], row["reason"], row["record"]) == ("failed", "non_finite", None)
        # vLLM's CPU attention lets a NaN key reach every query of its sequence (masked scores are NaN + -inf), so
        # the whole record is NaN, not only the positions from the token on
        assert "token rows hold NaN/Inf" in row["message"] and "checked by the connector" in row["message"]
    assert "nan-4" not in index and "ok-3" not in index  # not run / not read: the run stopped before them
    assert sum(r["reason"] == "malformed" for r in index.values()) == 5
    for k in ("ok-0", "ok-1", "ok-2"):
        assert read_record(out / index[k]["record"]).hidden_states.isfinite().all()
    e2e_report.add(
        f"capture: engine start refused in {refused_s:.1f} s (exit 2); NaN model: 3 records, 4 non_finite, "
        f"breaker exit 3 after {run_s:.1f} s"
    )


def _check_tree(out: Path, rows: list[dict[str, Any]], hf: Any) -> tuple[dict[int, int], float]:
    """Every row (none too long here) has exactly one verified record in ``out``; returns records per rank and the
    worst relative error against transformers."""
    model, tok = hf
    index = read_index(out).to_pylist()
    ok = [r for r in index if r["status"] == "ok"]
    assert sorted(r["sample_id"] for r in ok) == sorted(r["id"] for r in rows), index
    by_id = {r["id"]: r for r in rows}
    per_rank: dict[int, int] = {}
    worst = 0.0
    for r in ok:
        per_rank[r["rank"]] = per_rank.get(r["rank"], 0) + 1
        rec = read_record(out / r["record"])
        ids, _ = _expected(tok, by_id[r["sample_id"]]["messages"])
        assert list(rec.meta.token_ids) == ids, r["sample_id"]
        worst = max(worst, _max_err(model, rec.hidden_states, ids, LAYERS))
    assert worst < R.ROW_TOL, worst
    assert {p.relative_to(out).as_posix() for p in out.glob("shard-*/*.json")} == {r["record"] for r in ok}
    return per_rank, worst


def _short_rows(tok: Any, n: int) -> list[dict[str, Any]]:
    return [r for r in _rows() if len(_expected(tok, r["messages"])[0]) < 150][:n]


@on_demo_session
def test_two_rank_processes_write_one_tree_with_every_sample_once(tmp_path: Path, model_dir: str, hf: Any) -> None:
    """``--rank 0/1 --world-size 2`` as a job array runs them: two processes at once (each engine on a CPU of its
    own), one tree; the merged index holds every sample exactly once, each record verified."""
    rows = _short_rows(hf[1], 10)
    data, out = tmp_path / "rows.jsonl", tmp_path / "tree"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            _cmd(model_dir, data, out, "--rank", str(k), "--world-size", "2"),
            env={**_env(), "VLLM_CPU_OMP_THREADS_BIND": str(k % (os.cpu_count() or 1))},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k in range(2)
    ]
    outs = [p.communicate(timeout=480) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    per_rank, worst = _check_tree(out, rows, hf)
    assert sorted(per_rank) == [0, 1], per_rank  # both ranks took a share
    e2e_report.add(f"capture: 2 rank processes, {per_rank} records per rank, {time.monotonic() - t0:.1f} s, "
                   f"worst rel err {worst:.4f}")  # fmt: skip


@on_demo_session
def test_adoption_runs_beside_the_engine_and_keeps_the_serial_records(tmp_path: Path, model_dir: str, hf: Any) -> None:
    """The same rows captured twice at once (each engine on a CPU of its own): with ``--adoption overlap`` (the
    default on a GPU), batch k adopted while the engine runs batch k+1 with batch k+2 queued behind it, the adopter
    then following the engine into batch k+1 record by record, and as the command runs by default on vLLM's CPU
    build (``auto``: serial), each batch adopted before the next one reaches the engine.  The run's own timings (its
    summary) show the overlap: adoption time spent while the engine ran (``overlap_s``), requests of the queued
    batch finished in the steps finishing the one before (``engine_run_ahead``) and records adopted while their
    batch still ran (``adopted_while_running``) in the overlapped run; in the serial run, the negative control, none
    of any and the engine waiting through every adoption.  The overlapped run checks records ahead in processes of
    their own (``--adoption-checks processes``), the serial one in threads.  Both trees hold every sample once,
    verified, with the same hidden states."""
    rows = _short_rows(hf[1], 12)
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # serial: the default here, on a CPU; the overlapped run also checks records ahead in processes of their own
    modes = {"pipelined": ("--adoption", "overlap", "--adoption-checks", "processes"), "serial": ()}
    procs = {
        mode: subprocess.Popen(
            [*_cmd(model_dir, data, tmp_path / mode), "--batch-size", "2", *extra],
            env={**_env(), "VLLM_CPU_OMP_THREADS_BIND": str(k % (os.cpu_count() or 1))},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k, (mode, extra) in enumerate(modes.items())
    }
    outs = {mode: p.communicate(timeout=480) for mode, p in procs.items()}
    assert {m: p.returncode for m, p in procs.items()} == dict.fromkeys(modes, 0), {
        m: o[1][-2000:] for m, o in outs.items()
    }
    got = {mode: json.loads(out) for mode, (out, _) in outs.items()}
    for mode, summary in got.items():
        assert summary["captured"] == len(rows) and summary["engine_s"] > 0 and summary["adopt_s"] > 0, summary
        assert summary["engine_s"] + summary["adopt_s"] - summary["overlap_s"] <= summary["capture_s"] + 0.05, summary
        _check_tree(tmp_path / mode, rows, hf)
    pipelined, serial = got["pipelined"], got["serial"]
    assert pipelined["overlap_s"] > 0, pipelined  # the engine's next batch began before the last one was adopted
    assert serial["overlap_s"] == 0 and serial["adopt_wait_s"] == pytest.approx(serial["adopt_s"], abs=0.01), serial
    # the next batch queued behind the running one: some of its requests finished in the steps that finished the
    # batch before (the engine never ran dry between them); serial queues nothing ahead
    assert pipelined["engine_run_ahead"] > 0 and serial["engine_run_ahead"] == 0, (pipelined, serial)
    # the adopter followed the engine into the batch it ran: records taken as their requests finished, before the
    # engine's part of their batch returned; serial adopts each batch after it
    assert pipelined["adopted_while_running"] > 0 and serial["adopted_while_running"] == 0, (pipelined, serial)
    # adoption's checking processes came up beside the engine and none failed a check (whether a record is offered
    # ahead depends on the engine finishing it before the adopter reaches it: tests/capture holds the answers); the
    # serial run's checks are threads
    checks = pipelined["adoption_checks"]
    assert checks["in"] == "processes" and checks["workers"] == min(4, os.cpu_count() or 1), checks
    assert checks["ready"] == checks["workers"], checks
    assert checks["fallbacks"] == 0, checks
    assert serial["adoption_checks"]["in"] == "threads", serial["adoption_checks"]
    records = {}
    for mode in modes:
        ok = [r for r in read_index(tmp_path / mode).to_pylist() if r["status"] == "ok"]
        records[mode] = {r["sample_id"]: read_record(tmp_path / mode / r["record"]).hidden_states for r in ok}
    assert records["pipelined"].keys() == records["serial"].keys()
    assert all(torch.equal(records["pipelined"][k], records["serial"][k]) for k in records["serial"])
    e2e_report.add(
        "capture --adoption overlap vs the CPU default (serial), 12 rows in batches of 2: overlap "
        f"{pipelined['overlap_s']:.2f} s vs {serial['overlap_s']:.2f} s, engine waited on adoption "
        f"{pipelined['adopt_wait_s']:.2f} s of {pipelined['adopt_s']:.2f} s vs {serial['adopt_wait_s']:.2f} s of "
        f"{serial['adopt_s']:.2f} s; requests run ahead {pipelined['engine_run_ahead']} vs "
        f"{serial['engine_run_ahead']}; records adopted while their batch ran {pipelined['adopted_while_running']} "
        f"vs {serial['adopted_while_running']}; the tail after the engine's last batch {pipelined['adopt_tail_s']:.2f} "
        f"s vs {serial['adopt_tail_s']:.2f} s; checked ahead in processes {checks['checked_ahead']}, in threads "
        f"{serial['adoption_checks']['checked_ahead']}"
    )


@pytest.mark.skipif(os.environ.get("HS_E2E_RAY") != "1", reason="opt-in: nox -s capture_ray (installs Ray)")
def test_ray_actors_write_the_tree_a_job_array_writes(tmp_path: Path, model_dir: str, hf: Any) -> None:
    """``capture --ray 2`` on a local Ray cluster: two actors, one engine each, one tree with every sample once;
    a second run skips everything (resume through Ray)."""
    rows = _short_rows(hf[1], 10)
    data, out = tmp_path / "rows.jsonl", tmp_path / "tree"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t0 = time.monotonic()
    first = subprocess.run(_cmd(model_dir, data, out, "--ray", "2"), env=_env(), capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    elapsed = time.monotonic() - t0
    assert first.returncode == 0, (first.stdout[-2000:], first.stderr[-4000:])
    summary = json.loads(first.stdout[first.stdout.rindex("\n{") :])  # the launcher's, after the actors' logs
    assert summary["ranks"] == {"0": 0, "1": 0} and summary["tree_records"] == len(rows)
    per_rank, worst = _check_tree(out, rows, hf)
    assert sorted(per_rank) == [0, 1], per_rank
    again = subprocess.run(_cmd(model_dir, data, out, "--ray", "2"), env=_env(), capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert _check_tree(out, rows, hf)[0] == per_rank  # nothing captured twice
    e2e_report.add(f"capture --ray 2: {per_rank} records per actor in {elapsed:.1f} s, worst rel err {worst:.4f}")


@on_demo_session
def test_feed_names_a_request_dropped_in_the_engine_and_the_engine_runs_on(tmp_path: Path, model_dir: str) -> None:
    """``capture``'s engine feed (``capture/feed.py``) on a real in-process engine: a batch runs to records the
    connector read (none left unread); a batch one of whose requests is aborted through vLLM's own
    ``LLMEngine.abort_request`` after it was queued raises ``CaptureFeedError`` naming that request instead of
    stepping forever or handing back fewer outputs; the next batch on the same engine runs to its records.  The
    first and last batches are the negative control: the same calls without the abort raise nothing."""
    child = Path(__file__).with_name("e2e_feed_child.py")
    argv = [sys.executable, str(child), model_dir, str(tmp_path / "records"), ",".join(map(str, LAYERS))]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for batch in ("first", "after"):
        assert "error" not in got[batch], got
        assert len(set(got[batch]["records"])) == 3 and "None" not in got[batch]["records"], got
        assert got[batch]["unread"] == 0, got
    assert "never finished" in got["aborted"]["error"] and repr(got["aborted"]["dropped"]) in got["aborted"]["error"]
    assert got["after"]["steps"] > got["first"]["steps"], got
