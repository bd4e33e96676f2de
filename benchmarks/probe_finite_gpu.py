"""The connector's NaN/Inf check on the device: right, and what it costs (a probe, run on the GPU host).

The worker reads a step's finished records with one batched gather (``RowReader.read_many``); the check is one
masked-bits reduction per token over each staged chunk on the side stream, its flags copied to pinned host memory
under the read's own completion event (``core.transfer._gather_to_host``), so no extra host synchronisation.

* correct: NaN and Inf planted at known tokens of some requests of a batch, in both capture-view orders: the flags
  of every request equal ``isfinite`` of the rows it read; the direct (Triton) path gives no flags (the host checks);
* cost: one step's batch (``--requests`` x ``--tokens``, ``--planes`` x ``--hidden`` bf16) read with the check and
  with the reduction replaced by a preallocated answer, interleaved over ``--reps``: wall time of issue + wait, the
  host-side issue time, and the reduction kernel alone (CUDA events) beside the step's device-to-host copy;
* the host check (CPU reads, the direct path): ``token_flags`` over host rows, one thread and all threads.

    python benchmarks/probe_finite_gpu.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from vllm_hs_compat.core import ViewOrder, describe_capture_view
from vllm_hs_compat.core import transfer as T
from vllm_hs_compat.core.finite import token_flags
from vllm_hs_compat.core.transfer import ReadOptions, RowReader

#: The capture views of the eras: [nb, n, P, C] (<= 0.28), LBNHC (0.29+, planes strided into a token-major
#: buffer) and LBHNC (0.29+, per plane).
LAYOUTS = ("BTPC", "LBNHC", "LBHNC")


def make_cache(layout: str, nb: int, n: int, p: int, c: int) -> tuple[torch.Tensor, Any]:
    """The logical capture tensor of ``layout`` (random bf16 rows) and its view."""
    if layout == "BTPC":
        cache, order = torch.randn(nb, n, p, c, device="cuda").bfloat16(), ViewOrder.BLOCK_TOKEN_PLANE
    elif layout == "LBNHC":
        cache, order = (
            torch.randn(nb, n, p, c, device="cuda").bfloat16().permute(0, 2, 1, 3),
            ViewOrder.BLOCK_PLANE_TOKEN,
        )
    else:
        cache, order = torch.randn(nb, p, n, c, device="cuda").bfloat16(), ViewOrder.BLOCK_PLANE_TOKEN
    return cache, describe_capture_view(cache, num_planes=p, group_block_size=n, order=order)


def plant(cache: torch.Tensor, layout: str, blk: int, off: int, plane: int, value: float) -> None:
    if layout == "BTPC":
        cache[blk, off, plane, 5] = value
    else:
        cache[blk, plane, off, 5] = value


def requests(gen: torch.Generator, nb: int, n: int, count: int, tokens: int) -> list[tuple[str, list[int], int, int]]:
    per = -(-tokens // n)
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    return [(f"r{i}", perm[i * per : (i + 1) * per], 0, tokens) for i in range(count)]


def correct(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    gen = torch.Generator().manual_seed(0)
    n, p, c = args.block, args.planes, 256
    for layout in LAYOUTS:
        logical, view = make_cache(layout, 512, n, p, c)
        reqs = requests(gen, 512, n, 8, 100)
        planted = {1: (7, float("nan")), 4: (99, float("inf")), 6: (0, float("-inf"))}
        for i, (tok, value) in planted.items():
            plant(logical, layout, reqs[i][1][tok // n], tok % n, p - 1, value)
        torch.cuda.synchronize()
        for path in ("staged", "direct"):
            reader = RowReader(logical, view, options=ReadOptions(path=path))
            pend = reader.read_many(reqs)
            ok = True
            flags_given = []
            for i, x in enumerate(pend):
                rows = x.wait()  # type: ignore[union-attr]
                want = torch.isfinite(rows.float()).reshape(rows.shape[0], -1).all(1)
                flags = x.finite  # type: ignore[union-attr]
                flags_given.append(flags is not None)
                got = token_flags(rows) if flags is None else flags
                ok = ok and torch.equal(got, want) and (i in planted) == (not bool(want.all()))
            res = {"layout": layout, "path": path, "ok": ok, "device_flags": all(flags_given)}
            print("correct", res, flush=True)
            out.append(res)
    return out


def cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    n, p, c = args.block, args.planes, args.hidden
    results = []
    real = T.token_flags
    for count, tokens in ((args.requests, args.tokens), (1024, 128)):
        total = count * tokens
        nb = total // n + 64
        for layout in LAYOUTS:
            logical, view = make_cache(layout, nb, n, p, c)
            reader = RowReader(logical, view)
            reqs = requests(gen, nb, n, count, tokens)
            ones = torch.ones(total, dtype=torch.bool, device="cuda")

            def answer(x: torch.Tensor, ones: torch.Tensor = ones) -> torch.Tensor:
                return ones[: x.shape[0]]

            walls: dict[str, list[float]] = {"check": [], "no-check": []}
            issues: dict[str, list[float]] = {"check": [], "no-check": []}
            for r in range(args.reps + 1):
                for variant in ("check", "no-check") if r % 2 else ("no-check", "check"):
                    T.token_flags = real if variant == "check" else answer  # type: ignore[assignment]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    pend = reader.read_many(reqs)
                    t1 = time.perf_counter()
                    for x in pend:
                        x.wait()  # type: ignore[union-attr]
                    t2 = time.perf_counter()
                    if r:
                        walls[variant].append(t2 - t0)
                        issues[variant].append(t1 - t0)
            T.token_flags = real
            nbytes = total * p * c * 2
            # the reduction alone over a stage of STAGE_BYTES (or the step), and the D2H copy of the step
            stage = torch.randn(min(total, T.STAGE_BYTES // (p * c * 2)), p * c, device="cuda").bfloat16()
            src = torch.empty(total, p * c, dtype=torch.bfloat16, device="cuda")
            pinned = torch.empty(total, p * c, dtype=torch.bfloat16, pin_memory=True)
            red, d2h = [], []
            for _ in range(args.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                token_flags(stage)
                b.record()
                b.synchronize()
                red.append(a.elapsed_time(b) / 1e3)
                a.record()
                pinned.copy_(src, non_blocking=True)
                b.record()
                b.synchronize()
                d2h.append(a.elapsed_time(b) / 1e3)
            res = {
                "case": f"{layout} {count} x {tokens} tokens, {p} x {c} bf16 ({nbytes / 2**20:.0f} MiB)",
                "wall_check_ms": statistics.median(walls["check"]) * 1e3,
                "wall_nocheck_ms": statistics.median(walls["no-check"]) * 1e3,
                "issue_check_ms": statistics.median(issues["check"]) * 1e3,
                "issue_nocheck_ms": statistics.median(issues["no-check"]) * 1e3,
                "reduction_ms_per_stage": statistics.median(red) * 1e3,
                "stage_mib": stage.numel() * 2 / 2**20,
                "reduction_gbps": stage.numel() * 2 / statistics.median(red) / 1e9,
                "d2h_step_ms": statistics.median(d2h) * 1e3,
            }
            res["overhead_pct"] = (res["wall_check_ms"] / res["wall_nocheck_ms"] - 1) * 100
            print("cost", json.dumps(res), flush=True)
            results.append(res)
            del logical, stage, src, pinned
            torch.cuda.empty_cache()
    return results


def host(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for threads in (1, torch.get_num_threads()):
        torch.set_num_threads(threads)
        for mib in (16, 256):
            rows = torch.randn(mib * 2**20 // (args.planes * args.hidden * 2), args.planes, args.hidden).bfloat16()
            token_flags(rows)
            t = []
            for _ in range(5):
                t0 = time.perf_counter()
                token_flags(rows)
                t.append(time.perf_counter() - t0)
            res = {"threads": threads, "mib": mib, "ms": statistics.median(t) * 1e3,
                   "gbps": mib * 2**20 / statistics.median(t) / 1e9}  # fmt: skip
            print("host", res, flush=True)
            out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--planes", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "correct": correct(args), "cost": cost(args), "host": host(args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
