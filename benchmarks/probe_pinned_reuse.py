"""How often the engine thread waits in ``cudaHostAlloc``: one pinned buffer per step's read vs one per record (a
probe, not a test).

    python benchmarks/probe_pinned_reuse.py [--steps 40] [--write-gbs 1.5] [--json out.json]

The connector's worker reads each step's finished records with one batched read into ONE pinned host tensor, which
torch's pinned allocator rounds up to a power of two and keeps until the last record in it has been written by the
sink; on an H100 (docs/gpu.md, "Seventh session") that cost the 8B capture 47 new pinned blocks, 1.19 s of
``cudaHostAlloc`` on the engine's thread, up to 424 ms for one.  This probe replays the allocation pattern alone --
an "engine" thread allocating every ``--gap`` seconds the rows of ``--step-tokens`` tokens of 512-2,048-token
records (8B shape: 32 KiB a token), a "sink" thread writing them at ``--write-gbs`` and dropping each when written,
the engine waiting while more than ``--backlog-gib`` are unwritten (the worker's bound) -- once with one buffer per
step and once with one buffer per record, each in a fresh process (torch's pinned cache is per process).  Printed
per layout: pinned blocks created, milliseconds the engine thread spent allocating (total, max), the most bytes
handed out.  Without CUDA it runs the same pattern on pageable memory to check itself (its figures say nothing).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import subprocess
import sys
import threading
import time

import torch

from vllm_hs_compat.core.transfer import pinned_host_stats


def run(layout: str, args: argparse.Namespace) -> dict[str, float | str]:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()  # type: ignore[no-untyped-call]
    rng = random.Random(0)
    q: queue.Queue[tuple[torch.Tensor, int] | None] = queue.Queue()
    unwritten = [0]
    cond = threading.Condition()
    limit = int(args.backlog_gib * 2**30)

    def sink() -> None:
        while (item := q.get()) is not None:
            rows, nbytes = item
            time.sleep(nbytes / (args.write_gbs * 1e9))
            del rows, item
            with cond:
                unwritten[0] -= nbytes
                cond.notify_all()

    th = threading.Thread(target=sink)
    th.start()
    alloc_ms: list[float] = []
    waited = 0.0
    for _ in range(args.steps):
        sizes, left = [], args.step_tokens
        while left > 0:
            t = min(left, rng.randint(512, 2048))
            sizes.append(t * args.token_bytes)
            left -= t
        step = sum(sizes)
        with cond:
            t0 = time.perf_counter()
            cond.wait_for(lambda step=step: unwritten[0] == 0 or unwritten[0] + step <= limit)  # type: ignore[misc]
            waited += time.perf_counter() - t0
            unwritten[0] += step
        t0 = time.perf_counter()
        if layout == "step":
            buf = torch.empty(step, dtype=torch.uint8, pin_memory=cuda)
            parts, at = [], 0
            for n in sizes:
                parts.append(buf[at : at + n])  # views: the block lives until the last is written
                at += n
            del buf
        else:
            parts = [torch.empty(n, dtype=torch.uint8, pin_memory=cuda) for n in sizes]
        alloc_ms.append((time.perf_counter() - t0) * 1e3)
        for part in parts:
            q.put((part, int(part.numel())))
        del parts
        time.sleep(args.gap)
    q.put(None)
    th.join()
    out: dict[str, float | str] = {
        "layout": layout,
        "alloc_ms_total": sum(alloc_ms),
        "alloc_ms_max": max(alloc_ms),
        "engine_waited_s": waited,
    }
    stats = pinned_host_stats()  # what the connector's worker logs at shutdown (None without CUDA)
    if stats is not None:
        out["blocks_created"] = stats["allocs"]
        out["active_gib_peak"] = stats["active_gib_peak"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-tokens", type=int, default=16384)
    ap.add_argument("--token-bytes", type=int, default=4 * 4096 * 2, help="bytes of one token's rows (8B: 32 KiB)")
    ap.add_argument("--gap", type=float, default=0.45, help="seconds between steps (8B on an H100: ~0.45)")
    ap.add_argument("--write-gbs", type=float, default=1.5, help="the sink's write rate, GB/s")
    ap.add_argument("--backlog-gib", type=float, default=4.0)
    ap.add_argument("--layout", choices=["step", "record"], default=None, help="one layout, in this process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.layout:
        print(json.dumps(run(args.layout, args)))
        return 0
    rows = []
    for layout in ("step", "record"):  # a fresh process each: torch's pinned cache is per process
        argv = [sys.executable, __file__, "--layout", layout]
        for key in ("steps", "step_tokens", "token_bytes", "gap", "write_gbs", "backlog_gib"):
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        done = subprocess.run(argv, check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
