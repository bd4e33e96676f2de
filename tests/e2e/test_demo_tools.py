"""``vllm-hs-compat demo`` and ``vllm-hs-compat verify`` on a real vLLM CPU engine, as a user runs them (the
console script, in a process of its own).

* the demo (default: the capture path) passes: the shipped conversations captured into a sharded, indexed tree by
  the capture command's own code, every record read by the trainer process and verified (token ids and loss mask
  equal to transformers' own chat templating of its row, every plane equal to a transformers forward), the
  drafter's loss falls and its acceptance length rises above the untrained drafter's;
* the live-serving path (``--serve``) fails when one record is corrupted in the engine's process BEFORE the sink
  checksums it (so the transport delivers it intact and only the comparison with transformers can catch it):
  exit status 1, that record named, the others streamed, verified and trained on;
* verify (0.27.1 and 0.32.0 sessions) maps every plane of the tiny model to its HF index; its analysis names an
  off-by-one and a post-norm capture when handed them (negative controls over transformers' own planes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import e2e_report
import pytest
import torch

from vllm_hs_compat.commands import verify as V
from vllm_hs_compat.reference import forward as R

pytestmark = pytest.mark.e2e

CLI = [sys.executable, "-m", "vllm_hs_compat.cli"]
demo_only = pytest.mark.skipif(
    os.environ.get("HS_E2E_DEMO") != "1", reason="the demo runs with HS_E2E_DEMO=1 (nox: the e2e session of 0.32.0)"
)


def _run(args: list[str], timeout_s: float = 480.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s, env=env, check=False)


def _work(tmp_path: Path, name: str) -> Path:
    root = os.environ.get("HS_E2E_WORK")
    out = Path(root) / name if root else tmp_path / name
    shutil.rmtree(out, ignore_errors=True)
    return out


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One demo run (capture path, 12 records) for the tests that read its tree, model and drafter."""
    out = _work(tmp_path_factory.mktemp("demo"), "demo")
    return out, _run(["demo", "--out", str(out), "--records", "12", "--steps", "40"])


@demo_only
def test_demo_captures_verifies_and_trains(demo_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    from transformers import AutoTokenizer

    from vllm_hs_compat.capture.data import CONVERSATIONS
    from vllm_hs_compat.capture.store import read_index

    out, proc = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = _summary(out)
    assert s["ok"] and s["mode"] == "capture" and s["records"] == s["records_ok"] == 12 and not s["records_failed"]
    assert s["trainer_pid"] not in (None, s["engine_pid"]), "the trainer must run in another process"
    assert s["max_rel_err"] < R.ROW_TOL
    # the tree: 12 records indexed, in two shards of at most 8; what each record carries is its row's, as
    # transformers itself templates it (checked here again, apart from the demo's trainer)
    index = [r for r in read_index(out / "tree").to_pylist() if r["status"] == "ok"]
    assert len(index) == 12 and len(s["capture"]["shards"]) == 2
    rows = {r["id"]: r for r in map(json.loads, CONVERSATIONS.read_text().splitlines()[:12])}
    tok = AutoTokenizer.from_pretrained(str(out / "model"))
    for rec in s["per_record"]:
        want = tok.apply_chat_template(
            rows[rec["sample_id"]]["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert rec["tokens"] == len(want["input_ids"]) and rec["loss_tokens"] == sum(want["assistant_masks"])
        assert 0 < rec["loss_tokens"] < rec["tokens"]
    assert sorted(r["sample_id"] for r in s["per_record"]) == sorted(rows)
    # training on the loss-masked records, and the acceptance length it buys (1.0: nothing accepted)
    assert len(s["losses"]) == 40 and s["losses"][-1] < 0.8 * s["losses"][0], s["losses"]
    before, after = s["acceptance"]["before"], s["acceptance"]["after"]
    assert before["k"] == 3 and after["mean_length"] > before["mean_length"] + 0.1, (before, after)
    assert (Path(s["drafter"]) / "drafter.safetensors").is_file()
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "all verified" in proc.stdout and "mean acceptance length" in proc.stdout
    e2e_report.add(
        f"demo (capture): {s['records']} records in {len(s['capture']['shards'])} shards, {s['tokens']} tokens "
        f"({s['loss_tokens']} in loss masks), max rel err {s['max_rel_err']:.4f}, loss {s['losses'][0]:.3f} -> "
        f"{s['losses'][-1]:.3f}, acceptance length {before['mean_length']:.3f} -> {after['mean_length']:.3f} "
        f"(k=3), times {s['times']}, total {s['wall_s']:.1f} s"
    )


class _PlanesReversed:
    """Negative control: an EAGLE-3 forward that feeds the auxiliary planes to ``fc`` high layer first (vLLM feeds
    them in ascending layer order): the simulation then computes something vLLM does not."""

    def __init__(self, drafter: Any, num_aux: int) -> None:
        self.drafter, self.num_aux = drafter, num_aux

    def propose(self, ids: Any, aux: torch.Tensor, next_id: int, k: int) -> list[int]:
        from vllm_hs_compat.drafter.eagle3 import Eagle3Proposer

        flipped = torch.cat(list(reversed(aux.chunk(self.num_aux, dim=-1))), dim=-1)
        return Eagle3Proposer(self.drafter).propose(ids, flipped, next_id, k)


#: |vLLM - simulation| of the mean acceptance length that counts as agreement (bf16 engine against the float32
#: simulation: a near-tie of the verifier's or the drafter's logits may resolve differently; docs/demo.md)
AGREE = 0.15


@demo_only
def test_eagle3_drafter_measured_by_vllm_agrees_with_the_simulation(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """An EAGLE-3 drafter in vLLM's layout, trained on the demo's capture tree, measured by vLLM's own EAGLE-3
    speculative decoding (``evaluate --backend both``: an in-process engine) and by the greedy-verification
    simulation: the two agree; trained, it beats the same drafter untrained (about 1.0 in both, a second engine
    start of about 15 s); a simulation whose forward feeds the planes in another order than vLLM measures
    something else (the agreement check can fail)."""

    out, proc = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    model = out / "model"

    def train(folder: Path, steps: int) -> dict[str, Any]:
        run = subprocess.run(
            [sys.executable, "-m", "vllm_hs_compat.drafter.eagle3", "--model", str(model), "--tree",
             str(out / "tree"), "--out", str(folder), "--steps", str(steps)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    def both(folder: Path) -> dict[str, Any]:
        run = _run(["evaluate", "--model", str(model), "--drafter", str(folder), "--backend", "both", "--json"])
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return json.loads(run.stdout)  # type: ignore[no-any-return]

    drafter, untrained = tmp_path / "eagle3", tmp_path / "untrained"
    t = train(drafter, 200)
    assert t["records"] == 12 and t["aux_layer_ids"] == [1, 2, 3] and t["loss_last"] < 0.5 * t["loss_first"], t
    r = both(drafter)
    sim, vl, diff = r["mean_length"], r["vllm"]["mean_length"], r["difference"]["mean_length"]
    assert r["vllm"]["steps"] > 0 and r["vllm"]["draft_tokens"] == 3 * r["vllm"]["steps"], r["vllm"]
    assert abs(diff) <= AGREE, (sim, vl, r["difference"])

    # control: the same drafter untrained (seed 0, no step) is accepted almost never, in vLLM and in the simulation;
    # the trained one beats it by far in vLLM's own measurement
    from vllm_hs_compat.drafter import acceptance as A
    from vllm_hs_compat.drafter.eagle3 import Eagle3Drafter, load_eagle3, save_eagle3

    hf = R.load_hf(str(model), torch.float32)
    trained, _ = load_eagle3(drafter, hf.get_input_embeddings().weight)
    torch.manual_seed(0)
    save_eagle3(
        Eagle3Drafter(trained.g, hf.get_input_embeddings().weight, hf.get_output_embeddings().weight), untrained
    )
    u = both(untrained)
    assert u["vllm"]["mean_length"] < 1.1 and u["mean_length"] < 1.1, (u["vllm"], u["mean_length"])
    assert vl > u["vllm"]["mean_length"] + 0.3, (vl, u["vllm"])

    # control: a simulation whose forward feeds the planes high layer first measures something vLLM does not
    wrong = A.measure(A.Verifier(hf, [1, 2, 3]), _PlanesReversed(trained, 3), _prompts(model), k=3, new_tokens=32)
    assert abs(wrong.mean_length - vl) > AGREE, (wrong.mean_length, vl, sim)
    e2e_report.add(
        f"evaluate --backend both (EAGLE-3 drafter in vLLM's layout, 200 steps on the demo tree, k=3, "
        f"{r['prompts']} prompts x 32 tokens): vLLM {vl:.3f} ({r['vllm']['accepted']} accepted of "
        f"{r['vllm']['draft_tokens']} drafted in {r['vllm']['steps']} drafts; per position "
        f"{[round(x, 3) for x in r['vllm']['per_position']]}), simulation {sim:.3f} ({r['accepted']} in "
        f"{r['steps']} steps), difference {diff:+.3f}, same tokens {r['difference']['same_tokens_prompts']} of "
        f"{r['prompts']} prompts; controls: untrained vLLM {u['vllm']['mean_length']:.3f} / simulation "
        f"{u['mean_length']:.3f}, planes reversed (simulation) {wrong.mean_length:.3f}; engine start "
        f"{r['vllm']['engine_start_s']} s + {u['vllm']['engine_start_s']} s"
    )


def _prompts(model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_hs_compat.commands.evaluate import prompts_of

    prompts, failed = prompts_of(None, AutoTokenizer.from_pretrained(str(model)), limit=8)
    assert failed == 0
    return prompts


@demo_only
def test_demo_serve_fails_on_a_corrupted_record(tmp_path: Path) -> None:
    out = _work(tmp_path, "demo-corrupt")
    proc = _run(["demo", "--serve", "--out", str(out), "--records", "4", "--steps", "3", "--corrupt-record", "1"])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = _summary(out)
    assert not s["ok"] and s["mode"] == "serve" and s["records"] == 4 and s["records_ok"] == 3
    assert s["trainer_pid"] not in (None, s["engine_pid"]) and s["transport"] in ("shm", "nixl")
    (bad,) = s["records_failed"]
    assert "differs from transformers" in bad["reason"] and bad["max_rel"][0] > 1.0
    assert "FAIL" in proc.stdout and "failed verification" in proc.stdout
    # the three intact records were streamed, verified and trained on
    assert s["trained_on"] == 3 and len(s["losses"]) == 3 and "after" in s["acceptance"]
    e2e_report.add(f"demo (--serve, one record corrupted): exit 1, {bad['reason']}; total {s['wall_s']:.1f} s")


verify_only = pytest.mark.skipif(
    os.environ.get("HS_E2E_VERIFY") != "1",
    reason="verify runs with HS_E2E_VERIFY=1 (nox: the e2e sessions of 0.27.1 and 0.32.0)",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from vllm_hs_compat.reference.models import make_model

    return make_model(str(tmp_path_factory.mktemp("verify") / "dense"), "dense", seed=3).path


@verify_only
def test_verify_maps_every_plane(tiny: str) -> None:
    proc = _run(["verify", "--model", tiny, "--layers", "0,1,3,4", "--json"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and [p["layer_id"] for p in report["planes"]] == [0, 1, 3, 4]
    got = [(p["best"]["label"], p["best"]["norm"]) for p in report["planes"]]
    assert got == [
        ("hidden_states[0]", "pre-norm"),
        ("hidden_states[1]", "pre-norm"),
        ("hidden_states[3]", "pre-norm"),
        ("final norm input", "pre-norm"),
    ]
    # The runner-up is far away: the match is not a tie.
    assert all(p["runner_up"]["max_rel"] > 4 * R.ROW_TOL for p in report["planes"])
    e2e_report.add(
        "verify: "
        + "; ".join(f"{p['layer_id']}->{p['best']['label']} {p['best']['max_rel']:.4f}" for p in report["planes"])
    )


def test_verify_names_off_by_one_and_post_norm(tiny: str) -> None:
    """Negative controls: planes built from transformers' own hidden states, labelled the way peers broke."""
    hf = R.load_hf(tiny)
    ids = list(range(3, 70))
    planes = R.hf_planes(hf, ids)
    n = planes.num_layers
    rows = torch.stack([planes.hidden_states[2], planes.hidden_states[n], planes.hidden_states[1]], dim=1)
    reports = V.analyse([(ids, [1, n, 0], rows)], hf)
    by_id = {r.layer_id: r for r in reports}
    assert not by_id[1].ok and "OFF BY ONE" in by_id[1].note and "next" in by_id[1].note
    assert not by_id[n].ok and "POST-NORM" in by_id[n].note
    assert not by_id[0].ok and by_id[0].best.label == "hidden_states[1]"
    good = V.analyse([(ids, [1, n], torch.stack([planes.hidden_states[1], planes.pre_norm], dim=1))], hf)
    assert all(r.ok for r in good)
