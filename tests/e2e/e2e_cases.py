"""The end-to-end cases: prompts, engine settings, and how a case's output is checked.

Every case is run by :func:`run_case`: a fresh ``e2e_engine.py`` process (one real vLLM engine), then the records
it produced -- through the export (fetched by a consumer in another process) or through the file sink -- are
paired with the transformers forward of the same weights (:mod:`e2e_pairing`).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent.parent / "examples"  # minimal_connector.py, the README's connector for authors
sys.path.insert(0, str(HERE))

import e2e_models  # noqa: E402
import e2e_pairing  # noqa: E402
import e2e_reference  # noqa: E402
from e2e_engine import EngineSpec  # noqa: E402

FIRST_TOKEN = 3  # 0-2 are the tokenizer's special tokens
# docs/connector.md: a request overrides capture through kv_transfer_params["hs_capture"]; the finished request's
# kv_transfer_params carry the record's ticket under "hs_record" (plus the sink's own entry).
REQUEST_KEY = "hs_capture"
RESULT_KEY = "hs_record"
#: The reason a record past a two-token step fails where the engine misplaces those positions (docs/connector.md).
REASON_ASYNC_DRAFTS = "async_drafts"


def prompts_with_shared_prefixes(
    seed: int, lengths: list[int], prefixes: list[int], groups: list[int], vocab: int
) -> list[list[int]]:
    """``lengths[i]`` tokens each; prompt ``i`` starts with prefix ``groups[i]`` (of ``prefixes[groups[i]]``
    tokens; group -1: no shared prefix), the rest is its own."""
    rng = random.Random(seed)
    shared = [[rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)] for n in prefixes]
    out = []
    for n, g in zip(lengths, groups, strict=True):
        head = shared[g][: n - 1] if g >= 0 else []
        out.append(head + [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n - len(head))])
    return out


@dataclass
class Case:
    name: str
    model_kind: str
    prompts: list[list[int]]
    max_tokens: list[int]
    engine: dict[str, Any] = field(default_factory=dict)
    capture: str = "prompt"
    sink: str = "export"
    env: dict[str, str] = field(default_factory=dict)
    expect_preemptions: bool = False
    expect_prefix_hits: bool = False
    expect_own_capture_group: bool | None = None
    timeout_s: float = 600.0
    v2: bool = False  # Model Runner V2 (the Triton "cpu" shim on PYTHONPATH, kernels interpreted)
    request_params: list[dict[str, Any] | None] | None = None  # each request's kv_transfer_params


def _mk(name: str, kind: str, seed: int, lengths: list[int], prefixes: list[int], groups: list[int], **kw: Any) -> Case:
    vocab = 500
    prompts = prompts_with_shared_prefixes(seed, lengths, prefixes, groups, vocab)
    max_tokens = kw.pop("max_tokens", [4] * len(prompts))
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    return Case(name=name, model_kind=kind, prompts=prompts, max_tokens=max_tokens, **kw)


def cases() -> dict[str, Case]:
    c = [
        # Prompts longer than max_num_batched_tokens (128) are chunked; two share a 70-token prefix.
        _mk("dense", "dense", 1, [7, 45, 160, 300, 75], [70], [-1, -1, 0, -1, 0], sink="export"),
        # Sliding window 48 < most prompts: the sliding layers' early blocks are dropped while the capture
        # group keeps them.  The capture layer must get a KV-cache group of its own (HMA on).
        _mk(
            "hybrid",
            "hybrid",
            2,
            [9, 50, 140, 260, 100],
            [90],
            [-1, -1, 0, -1, 0],
            sink="file",
            expect_own_capture_group=True,
        ),
        # 20 concurrent prompts of different lengths, three shared-prefix families (one prefix spans 5 blocks),
        # several longer than max_num_batched_tokens.
        _mk(
            "concurrent",
            "dense",
            3,
            [5, 33, 64, 97, 129, 150, 180, 200, 222, 260, 300, 350, 40, 70, 190, 170, 140, 210, 31, 400],
            [40, 100, 160],
            [-1, 0, 0, 1, 1, 1, 2, 2, 2, -1, 1, 2, -1, 0, 1, 2, -1, 0, -1, 2],
            max_tokens=[3 + (i % 5) for i in range(20)],
            sink="export",
            expect_prefix_hits=True,
        ),
        # A KV cache of 16 blocks (512 tokens) for ~1,400 tokens of demand: requests are preempted and recomputed.
        _mk(
            "preempt",
            "dense",
            4,
            [100, 130, 90, 120, 140, 110, 70, 125],
            [64],
            [0, 0, -1, -1, 0, -1, -1, -1],
            max_tokens=64,
            sink="file",
            engine={"num_gpu_blocks_override": 16, "block_size": 32, "max_model_len": 448, "max_num_seqs": 8},
            expect_preemptions=True,
        ),
        # The same squeeze on the hybrid verifier: three KV-cache groups (sliding, full, capture) preempted together.
        _mk(
            "hybrid_preempt",
            "hybrid",
            4,
            [100, 130, 90, 120, 140, 110, 70, 125],
            [64],
            [0, 0, -1, -1, 0, -1, -1, -1],
            max_tokens=64,
            sink="export",
            engine={"num_gpu_blocks_override": 84, "block_size": 32, "max_model_len": 448, "max_num_seqs": 8},
            expect_preemptions=True,
            expect_own_capture_group=True,
        ),
        # Prompt and generated tokens: every position whose hidden state exists (vLLM's num_computed_tokens at finish).
        _mk(
            "prompt_output",
            "dense",
            5,
            [12, 70, 150, 33],
            [50],
            [-1, 0, 0, -1],
            max_tokens=[16, 9, 20, 5],
            capture="all",
            sink="export",
        ),
        # Per-request overrides through kv_transfer_params: capture mode, windows (Python slice semantics), an
        # opt-out (status "skipped", no record) and a window selecting nothing (status "failed", no record).
        _mk(
            "overrides",
            "dense",
            6,
            [60, 40, 150, 30, 70, 50, 45],
            [20],
            [-1, 0, -1, 0, -1, -1, -1],
            max_tokens=[3, 8, 2, 10, 6, 4, 4],
            sink="file",
            request_params=[
                None,
                {"hs_capture": {"capture": "all"}},
                {"hs_capture": {"window": [-20, None]}},
                {"hs_capture": {"capture": "output"}},
                {"hs_capture": {"capture": "all", "window": [10, -2]}},
                {"hs_capture": {"enabled": False}},
                {"hs_capture": {"window": [500, None]}},
            ],
        ),
    ]
    return {x.name: x for x in c}


def defaults_cases() -> dict[str, Case]:
    """vLLM's own batch settings for the platform (16,384 tokens and 1,024 sequences a step on an H100 or H200, 4,096
    and 256 on CPU): 150 prompts of 60-400 tokens at once (about 34,500 tokens) in four shared-prefix families, so
    that steps mix whole prompts with chunks of others.  Runs on a GPU, or anywhere with ``HS_E2E_DEFAULTS=1``.

    Prompts stay at or under 400 tokens: on the tiny verifier, rows after many hundreds of random tokens of context
    come within bf16 tolerance of each other (attention averages the context away; seen on 0.26.0: rows of other
    prompts 0.058 apart at 700 tokens, 0.026 at 3,000; >= 0.34 at 400), and the pairing could no longer tell
    records apart.  For the same reason the shared prefixes are short (with 30-280 tokens, two prompts of one
    family that drew the same token at the same position came within 0.066 of each other)."""
    rng = random.Random(31)
    lengths = [60 + (i * 340) // 149 for i in range(150)]
    rng.shuffle(lengths)
    prefixes = [32, 64, 96, 128]  # short against the prompts: rows after a family's prefix soon differ in context
    groups = [g if g >= 0 and n > prefixes[g] + 60 else -1 for g, n in ((i % 5 - 1, n) for i, n in enumerate(lengths))]
    case = _mk(
        "gpu_defaults",
        "dense",
        31,
        lengths,
        prefixes,
        groups,
        max_tokens=[2 + i % 4 for i in range(150)],
        sink="file",
        engine={"max_num_batched_tokens": None, "max_num_seqs": None},
        expect_prefix_hits=True,
    )
    return {case.name: case}


TRITON_CPU_SHIM = HERE / "triton_cpu_shim"
#: Where Model Runner V2's classes live; the engine's runner is V2 when one of its classes comes from here.
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"


def has_v1_runner() -> bool:
    """Whether the installed vLLM has Model Runner V1 (``vllm.v1.worker.gpu_model_runner``): 0.17-0.33; 0.34 deleted
    it, so every engine is V2 and ``VLLM_USE_V2_MODEL_RUNNER=0`` raises."""
    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def v2_env() -> dict[str, str]:
    """Model Runner V2 on a CPU build: Triton must report a "cpu" backend (the shim) and run kernels interpreted;
    ``VLLM_USE_V2_MODEL_RUNNER=1`` selects V2 where the release has both runners (0.29-0.33) and is left out where V1
    is gone (0.34+: redundant, vLLM warns)."""
    env = {"TRITON_INTERPRET": "1"}
    if has_v1_runner():
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return env


def v2_cases() -> dict[str, Case]:
    """Model Runner V2 runs every Triton kernel in Triton's interpreter: small prompts."""
    c = [
        _mk(
            "v2_dense",
            "dense",
            11,
            [6, 40, 90, 50],
            [30],
            [-1, -1, 0, 0],
            sink="export",
            engine={"max_num_batched_tokens": 64},
            v2=True,
        ),
        _mk(
            "v2_preempt",
            "dense",
            12,
            [70, 90, 60, 80, 100],
            [40],
            [0, 0, -1, -1, 0],
            max_tokens=40,
            sink="file",
            engine={
                "num_gpu_blocks_override": 8,
                "max_model_len": 224,
                "max_num_seqs": 5,
                "max_num_batched_tokens": 64,
            },
            expect_preemptions=True,
            v2=True,
        ),
    ]
    return {x.name: x for x in c}


def tp_cases() -> dict[str, Case]:
    c = [
        _mk(
            "tp2",
            "dense",
            21,
            [8, 50, 150, 90],
            [60],
            [-1, -1, 0, 0],
            sink="export",
            engine={"tensor_parallel_size": 2},
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        ),
    ]
    return {x.name: x for x in c}


# --------------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------------
def on_gpu() -> bool:
    """A CUDA device is here: the cases run on vLLM's GPU build (docs/gpu.md), else on ``vllm-cpu``."""
    return bool(torch.cuda.is_available())


def engine_profile(gpu: bool) -> dict[str, Any]:
    """The engine settings every case starts from (a case's own ``engine`` entries win).

    Both: 128 tokens a step, so that the same prompts are chunked.  CPU: eager, 32-token blocks (CPU attention).
    GPU: vLLM's defaults otherwise -- CUDA graphs and torch.compile on, its block size and memory share -- on
    ``TRITON_ATTN`` (the backend the carried build keeps; ``docs/gpu.md``)."""
    if gpu:
        profile: dict[str, Any] = {
            "max_num_batched_tokens": 128,
            "enforce_eager": False,
            "attention_backend": "TRITON_ATTN",
        }
        if int(os.environ.get("HS_E2E_JOBS") or "1") > 1:
            # Engines starting side by side on one card would each count the others' allocations as their own
            # during vLLM's memory profiling: each gets a fixed KV cache instead (and passes vLLM's start-up check
            # of free memory with a small share).
            profile.update(kv_cache_memory_bytes=2 << 30, gpu_memory_utilization=0.1)
        return profile
    return {"max_num_batched_tokens": 128, "block_size": 32}


def base_env(extra_pythonpath: list[str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if not on_gpu():
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"})
    paths = [str(HERE), str(EXAMPLES)] + (extra_pythonpath or [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


@dataclass
class CaseRun:
    case: Case
    spec: EngineSpec
    out: Path
    rc: int
    seconds: float
    result: dict[str, Any] | None
    log: str


def run_case(
    case: Case,
    model_dir: str,
    out: Path,
    connector: str = "ours",
    env: dict[str, str] | None = None,
    layer_ids: tuple[int, ...] = e2e_models.CAPTURE_LAYER_IDS,
) -> CaseRun:
    out.mkdir(parents=True, exist_ok=True)
    engine = {**engine_profile(on_gpu()), **case.engine}
    spec = EngineSpec(
        model=model_dir,
        out_dir=str(out),
        prompts=case.prompts,
        max_tokens=case.max_tokens,
        layer_ids=list(layer_ids),
        connector=connector,
        sink=case.sink,
        capture=case.capture,
        per_request_params=case.request_params,
        **engine,
    )
    spec.save(out / "spec.json")
    run_env = env if env is not None else base_env([str(TRITON_CPU_SHIM)] if case.v2 else None)
    run_env = {**run_env, **case.env, **(v2_env() if case.v2 else {})}
    t0 = time.monotonic()
    with open(out / "engine.log", "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, str(HERE / "e2e_engine.py"), str(out / "spec.json")],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=run_env,
                timeout=case.timeout_s,
                check=False,
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = -9
    seconds = time.monotonic() - t0
    # vLLM's CPU TP communicator leaves shared-memory segments named after this run's distributed init file
    # (its name is in the log) in /dev/shm: remove exactly those.
    for dist in set(re.findall(r"vllm_dist_[0-9a-f]{16,}", (out / "engine.log").read_text(errors="replace"))):
        for leftover in Path("/dev/shm").glob(f"{dist}*"):
            leftover.unlink(missing_ok=True)
    result_path = out / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    return CaseRun(case, spec, out, rc, seconds, result, (out / "engine.log").read_text(errors="replace"))


# --------------------------------------------------------------------------------------------------
# records, as each sink delivers them
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Expected:
    """What a request's record must be, derived from the case (not from the connector): ``status`` pending /
    skipped / failed, and for pending ones the positions ``[lo, hi)``."""

    status: str
    lo: int = 0
    hi: int = 0
    reason: str | None = None
    """For a failed one, the reason it must name where the case decides it (``async_drafts``)."""


def first_generated_repeat(prompt: list[int], output: list[int]) -> int | None:
    """The position of the first generated token equal to the generated token before it (a step that emitted two
    tokens: extract_hidden_states drafts the last sampled token), or None."""
    for k in range(1, len(output)):
        if output[k] == output[k - 1]:
            return len(prompt) + k
    return None


def expected_record(
    capture: str,
    window: list[int | None] | None,
    enabled: bool,
    prompt_len: int,
    output_len: int,
    num_computed: int | None,
    record_len: int | None,
    *,
    placeholders: int = 0,
    first_repeat: int | None = None,
) -> Expected:
    """Hidden states exist for the first ``num_computed_tokens`` positions (vLLM's own count at finish, witnessed
    in-process).  Without the witness (multiprocess engines) that is the prompt plus every generated token but
    the last -- or all of them, when the final step's accepted draft token was computed and the bonus token cut
    by ``max_tokens``; the record's own length picks one of the two, and the transformers comparison proves that
    row real.  Under async scheduling the count at finish includes a step in flight (``placeholders``), whose
    positions are not final.  ``capture`` selects prompt / all / output positions, ``window`` slices them (Python
    semantics).  ``first_repeat``: on an engine that misplaces the positions after a two-token step (async
    scheduling on Model Runner V1, vllm-project/vllm#56417), the first generated token equal to the one before it;
    a record reaching past it must fail (``async_drafts``)."""
    if not enabled:
        return Expected("skipped")
    total = prompt_len + output_len
    if num_computed is not None:
        computed = min(num_computed - placeholders, total)
    else:
        computed = total - 1
        unwindowed_len = {"all": total, "output": output_len}.get(capture)
        if window is None and record_len is not None and record_len == unwindowed_len:
            computed = total
    if capture == "prompt":
        lo, hi = 0, prompt_len
    elif capture == "all":
        lo, hi = 0, computed
    elif capture == "output":
        lo, hi = prompt_len, max(prompt_len, computed)
    else:
        raise ValueError(f"capture {capture!r}")
    if window is not None:
        picked = range(lo, hi)[slice(*window)]
        lo, hi = (picked.start, picked.stop) if len(picked) else (lo, lo)
    if hi <= lo:
        return Expected("failed")
    if first_repeat is not None and hi > first_repeat:
        return Expected("failed", reason=REASON_ASYNC_DRAFTS)
    return Expected("queued", lo, hi)


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def records_of(run: CaseRun) -> tuple[list[e2e_pairing.Record | None], list[str]]:
    """The record each request's ``kv_transfer_params`` points at, in request order (None: missing)."""
    assert run.result is not None
    notes: list[str] = []
    reqs = run.result["requests"]
    recs: list[e2e_pairing.Record | None] = [None] * len(reqs)
    spec = run.spec
    if spec.connector in ("example", "minimal"):  # one safetensors file per request, named in its params
        layer_ids = sorted(spec.layer_ids)
        for r in reqs:
            p = (r["kv_transfer_params"] or {}).get("hidden_states_path")
            if p is None or not Path(p).exists():
                notes.append(f"request {r['index']}: no example file ({p})")
                continue
            t = _load_safetensors(Path(p))
            recs[r["index"]] = e2e_pairing.Record(
                label=f"{r['index']}:{r['request_id']}",
                token_ids=t["token_ids"].tolist(),
                layer_ids=layer_ids,
                hidden_states=t["hidden_states"],
                source=f"{spec.connector}-file",
            )
        return recs, notes
    by_record_id = {}
    for r in reqs:
        cap = (r["kv_transfer_params"] or {}).get(RESULT_KEY) or {}
        if cap.get("status") != "queued":
            notes.append(f"request {r['index']}: {RESULT_KEY} {cap}")
            continue
        by_record_id[cap["record_id"]] = r["index"]
    if spec.sink == "file":
        from vllm_hs_compat.export import files

        for r in reqs:
            entry = (r["kv_transfer_params"] or {}).get("hs_file") or {}
            idx = r["index"]
            if idx not in by_record_id.values():
                continue
            manifest = Path(entry.get("manifest", ""))
            if not manifest.is_file():
                notes.append(f"request {idx}: file sink has no manifest at {manifest}")
                continue
            # The package's own reader: checksum and the manifest/tensor token ids are verified.
            rec = files.read_record(manifest)
            recs[idx] = e2e_pairing.Record(
                label=f"{idx}:{rec.meta.record_id}",
                token_ids=list(rec.meta.token_ids),
                layer_ids=list(rec.meta.layer_ids),
                hidden_states=rec.hidden_states,
                start=int(getattr(rec.meta, "start", 0) or 0),
                source="file",
            )
    else:
        d = run.out / "export_records"
        summary_path = d / "summary.json"
        if not summary_path.exists():
            # what the consumer process said (its exit status and last lines): the cause, not just the absence
            log = run.out / "consumer.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-8:] if log.exists() else ["(no consumer.log)"]
            rc = run.result.get("consumer_rc", "not run")
            notes.append(f"export consumer wrote no summary (exit {rc}):\n    " + "\n    ".join(tail))
            return recs, notes
        summary = json.loads(summary_path.read_text())
        for f in summary["fetched"]:
            rid, n = f["record_id"], f["n"]
            if rid not in by_record_id:
                notes.append(f"consumer fetched {rid}, which no request names")
                continue
            meta = json.loads((d / f"{n}.json").read_text())["meta"]
            t = _load_safetensors(d / f"{n}.safetensors")
            idx = by_record_id[rid]
            recs[idx] = e2e_pairing.Record(
                label=f"{idx}:{rid}",
                token_ids=list(meta["token_ids"]),
                layer_ids=list(meta["layer_ids"]),
                hidden_states=t["hidden_states"],
                source="export",
            )
        if summary["extra"]:
            notes.append(f"producer published records no request names: {summary['extra']}")
    return recs, notes


@dataclass
class CheckResult:
    pairing: e2e_pairing.Pairing | None
    missing: list[int]
    notes: list[str]
    text: str
    expected_status: list[str] = field(default_factory=list)


def _request_capture(run: CaseRun, i: int) -> tuple[str, list[int | None] | None, bool]:
    """The capture mode, window and opt-in of request ``i``: the engine's config, overridden by the request's
    own ``hs_capture`` entry."""
    capture, window, enabled = run.spec.capture, run.spec.window, True
    params = (run.spec.per_request_params or [None] * len(run.spec.prompts))[i] or {}
    override = params.get(REQUEST_KEY) or {}
    capture = override.get("capture", capture)
    window = override.get("window", window)
    enabled = bool(override.get("enabled", True))
    return capture, window, enabled


def check(run: CaseRun, title: str) -> CheckResult:
    """Pair the run's records with the transformers forward; render the matrix."""
    assert run.result is not None
    recs, notes = records_of(run)
    model_dir = run.spec.model
    layer_ids = sorted(run.spec.layer_ids)
    present: list[e2e_pairing.Record] = []
    refs: list[torch.Tensor] = []
    contexts: list[list[int]] = []
    offsets: list[int] = []
    missing: list[int] = []
    statuses: list[str] = []
    for r, rec in zip(run.result["requests"], recs, strict=True):
        i = r["index"]
        capture, window, enabled = _request_capture(run, i)
        at_finish = r.get("at_finish") or {}
        misplaced = run.spec.connector == "ours" and bool(run.result.get("engine_config", {}).get("misplaced_drafts"))
        exp = expected_record(
            capture,
            window,
            enabled,
            len(r["prompt"]),
            len(r["output"]),
            at_finish.get("num_computed_tokens"),
            rec.hidden_states.shape[0] if rec is not None else None,
            placeholders=int(at_finish.get("num_output_placeholders") or 0),
            first_repeat=first_generated_repeat(r["prompt"], r["output"]) if misplaced else None,
        )
        statuses.append(exp.status)
        entry = (r["kv_transfer_params"] or {}).get(RESULT_KEY) or {}
        status = entry.get("status")
        if run.spec.connector == "ours" and status != exp.status:
            notes.append(f"request {i}: status {status!r}, expected {exp.status!r}")
            missing.append(i)
        elif run.spec.connector == "ours" and exp.reason is not None and entry.get("reason") != exp.reason:
            notes.append(f"request {i}: reason {entry.get('reason')!r}, expected {exp.reason!r}")
            missing.append(i)
        if exp.status != "queued":
            if rec is not None:
                notes.append(f"request {i}: a record exists although none was expected ({exp.status})")
                missing.append(i)
            continue
        if rec is None:
            missing.append(i)
            continue
        ctx = (r["prompt"] + r["output"])[: exp.hi]
        refs.append(e2e_reference.reference(model_dir, ctx, layer_ids)[exp.lo : exp.hi])
        contexts.append(ctx)
        offsets.append(exp.lo)
        present.append(rec)
    if missing:
        text = f"{title}: FAIL, wrong or missing records for requests {sorted(set(missing))}\n" + "\n".join(notes)
        return CheckResult(None, missing, notes, text, statuses)
    pairing = e2e_pairing.pair(present, refs, contexts, layer_ids, offsets=offsets)
    pairing.notes.extend(notes)
    return CheckResult(pairing, [], notes, pairing.render(title), statuses)


# --------------------------------------------------------------------------------------------------
# what the engine and the connector logged
# --------------------------------------------------------------------------------------------------
_PROC = r"(?:\((?P<proc>[\w-]+) pid=(?P<pid>\d+)\)\s+)?"
_WORKER_RE = re.compile(_PROC + r".*vllm-hs-compat worker \(tp (?P<tp>\d+)/(?P<tps>\d+) .*?\): (?P<rest>.*)$")
_COUNTERS_RE = re.compile(_PROC + r".*vllm-hs-compat worker: (?P<counters>\{.*\})\s*$")
_SCHED_RE = re.compile(r".*vllm-hs-compat scheduler: (?P<rest>capture layer .*)$")


@dataclass
class WorkerLine:
    proc: str | None
    pid: int | None
    tp_rank: int
    tp_size: int
    owner: bool
    text: str


@dataclass
class LogFacts:
    workers: list[WorkerLine]
    scheduler: list[str]
    counters: list[dict[str, int]]
    v2_runner: bool
    chunked_prefill: bool


def runs_v2(log: str, result: dict[str, Any] | None) -> bool:
    """Whether the engine ran Model Runner V2, by fact: the runner class the in-process engine built (its bases
    include V2's), else -- engines in other processes -- the "Using V2 Model Runner" line 0.29-0.33 log (0.34, V2
    only, no longer prints it; its multi-process engines are V2 whenever V1 is absent)."""
    classes = (result or {}).get("model_runner") or []
    if classes:
        return any(str(c).startswith(V2_RUNNER_MODULE + ".") for c in classes)
    return "Using V2 Model Runner" in log or not has_v1_runner()


def log_facts(log: str, result: dict[str, Any] | None = None) -> LogFacts:
    workers, sched, counters = [], [], []
    for line in log.splitlines():
        if m := _COUNTERS_RE.match(line):
            counters.append(ast.literal_eval(m["counters"]))
        elif m := _WORKER_RE.match(line):
            workers.append(
                WorkerLine(
                    proc=m["proc"],
                    pid=int(m["pid"]) if m["pid"] else None,
                    tp_rank=int(m["tp"]),
                    tp_size=int(m["tps"]),
                    owner="owner=True" in m["rest"],
                    text=m["rest"],
                )
            )
        elif m := _SCHED_RE.match(line):
            sched.append(m["rest"])
    return LogFacts(
        workers=workers,
        scheduler=sched,
        counters=counters,
        v2_runner=runs_v2(log, result),
        chunked_prefill="Chunked prefill is enabled" in log,
    )
