"""What one engine step's batched read costs the engine's thread on a GPU (a probe, not a test).

    python benchmarks/probe_step_read.py [--steps 24] [--step-tokens 16384] [--json out.json]

An 8B-shaped capture cache (4 planes x 4,096 hidden, bf16, 16-token blocks, the <= 0.28 order vLLM 0.26.0 has) on
the GPU; each step reads ``--step-tokens`` tokens of records of 512-2,048 tokens with ``RowReader.read_many`` (the
one batched read the connector's worker issues per step), while a "publisher" thread waits for each step's copy
and keeps its rows ``--hold`` seconds (the sink's write) before dropping them.  Printed: the engine thread's host
time per ``read_many`` (median, max; first step apart), the copy's time (from the issue until the publisher thread
saw it complete: an upper bound of the side stream's copy), what ``torch.empty(pin_memory=True)`` of one step's
rows costs cold and from torch's pinned cache, and the D2H rate.  Without CUDA it runs the same reads on a CPU
cache (synchronous: the figures say nothing about a GPU; the run checks the probe itself).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import threading
import time

import torch

from vllm_hs_compat.core import ViewOrder, describe_capture_view
from vllm_hs_compat.core.transfer import RowReader, pinned_host_stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--step-tokens", type=int, default=16384)
    ap.add_argument("--hold", type=float, default=0.1, help="seconds the publisher keeps a step's rows")
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between steps (the forward of one step)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    p, c, n = 4, 4096, 16
    nb = 2 * args.step_tokens // n + 64
    cuda = torch.cuda.is_available()
    cache = torch.zeros((nb, n, p, c), dtype=torch.bfloat16, device="cuda" if cuda else "cpu")
    view = describe_capture_view(cache, num_planes=p, group_block_size=n, order=ViewOrder.BLOCK_TOKEN_PLANE)
    reader = RowReader(cache, view)
    rng = random.Random(0)
    out: dict[str, object] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "step_tokens": args.step_tokens,
    }
    step_bytes = args.step_tokens * p * c * 2
    if cuda:
        t0 = time.perf_counter()
        cold = torch.empty(step_bytes, dtype=torch.uint8, pin_memory=True)
        out["pinned_alloc_cold_ms"] = (time.perf_counter() - t0) * 1e3
        del cold
        t0 = time.perf_counter()
        warm = torch.empty(step_bytes, dtype=torch.uint8, pin_memory=True)
        out["pinned_alloc_cached_ms"] = (time.perf_counter() - t0) * 1e3
        del warm

    q: queue.Queue = queue.Queue()
    copy_ms: list[float] = []

    def publisher() -> None:
        while True:
            item = q.get()
            if item is None:
                return
            results, issued = item
            results[-1].wait()
            copy_ms.append((time.perf_counter() - issued) * 1e3)
            time.sleep(args.hold)
            del results

    th = threading.Thread(target=publisher)
    th.start()
    issue_ms: list[float] = []
    for _ in range(args.steps):
        reqs = []
        left, blk = args.step_tokens, 1 + rng.randrange(32)
        while left > 0:
            t = min(left, rng.randint(512, 2048))
            k = -(-t // n)
            if blk + k >= nb:
                blk = 1
            reqs.append((f"r{len(reqs)}", list(range(blk, blk + k)), 0, t))
            blk += k
            left -= t
        cache.add_(0)  # the "forward" writing the step
        reader.mark_written()
        if cuda:
            torch.cuda.synchronize()  # the step's forward done: the copy alone on the side stream below
        t0 = time.perf_counter()
        results = reader.read_many(reqs)
        issue_ms.append((time.perf_counter() - t0) * 1e3)
        q.put((results, t0))
        time.sleep(args.gap)
    q.put(None)
    th.join()
    out["issue_ms_first"] = issue_ms[0]
    out["issue_ms_median"] = statistics.median(issue_ms[1:])
    out["issue_ms_max"] = max(issue_ms[1:])
    out["copy_ms_median"] = statistics.median(copy_ms[1:])
    out["d2h_gb_s"] = step_bytes / (statistics.median(copy_ms[1:]) / 1e3) / 1e9
    out["issue_ms_all"] = [round(x, 2) for x in issue_ms]
    out["pinned_host"] = pinned_host_stats()  # blocks torch's pinned allocator created, ms in cudaHostAlloc
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
