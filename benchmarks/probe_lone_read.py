"""Where the host time of one lone request's read to host goes (a probe, not a test): each step of the lone path
(``LoneReads.read``, what ``api.copy_request_async`` runs on CUDA) timed alone on the host, the old per-token
path's steps beside them, and the issue time of whole reads.

    python benchmarks/probe_lone_read.py [--tokens 128,512] [--json out.json]

Each figure is the median over 30 rounds of (host time of 20 back-to-back calls) / 20, the device synchronized
between rounds (not timed); microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_hs_compat import api
from vllm_hs_compat.core import ViewOrder, describe_capture_view, request_slots
from vllm_hs_compat.core.layout import chunk_plan, gather_slots, row_table
from vllm_hs_compat.core.slots import check_blocks
from vllm_hs_compat.core.transfer import PendingRows, PinnedIndexPool, side_stream

ROWS: list[dict[str, Any]] = []


def host_us(fn: Callable[[], object], rounds: int = 30, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return statistics.median(per) * 1e6


def row(case: str, step: str, us: float) -> None:
    ROWS.append({"case": case, "step": step, "us": us})
    print(f"{case:28s} {step:58s} {us:8.2f} us", flush=True)


def probe(layout: str, t: int) -> None:
    p, c, n = 4, 4096, 16
    nb = 4096
    if layout == "LBNHC":
        cache = torch.empty((nb, n, p, c), dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3)
    else:
        cache = torch.empty((nb, p, n, c), dtype=torch.bfloat16, device="cuda")
    cache.view(torch.int16).random_(-(2**15), 2**15)
    view = describe_capture_view(cache, num_planes=p, group_block_size=n, order=ViewOrder.BLOCK_PLANE_TOKEN)
    blocks = (torch.randperm(nb - 1)[: -(-t // n)] + 1).tolist()
    case = f"{layout} {t} tokens"
    table = row_table(cache, view)
    assert table is not None
    plan = chunk_plan(table, view)
    assert plan is not None
    k = len(blocks)
    count = k * len(plan.offsets)
    pool = PinnedIndexPool()
    side = side_stream(cache.device)
    cur = torch.cuda.current_stream()
    dev = cache.device
    ev = torch.cuda.Event()
    done = torch.cuda.Event()
    done.record()
    buf = pool.take(count)
    words = pool.words(buf)
    host_idx = buf[:count]
    plan.fill(blocks, host_idx, words)
    idx = host_idx.to(dev)
    out = torch.empty((t, p, c), dtype=torch.bfloat16, pin_memory=True)
    # --- the lone path, step by step ---
    row(case, "check_blocks (validation, Python)", host_us(lambda: check_blocks("r", blocks, group_block_size=n,
        num_tokens=t, num_manager_blocks=view.num_manager_blocks)))  # fmt: skip

    def take_give() -> None:
        b = pool.take(count)
        pool.words(b)
        pool.give(b, done)

    row(case, "pinned index buffer: pool take + give (event query)", host_us(take_give))
    row(
        case, f"chunk indices into pinned memory (ctypes, {count})", host_us(lambda: plan.fill(blocks, host_idx, words))
    )
    row(case, "slice of the index buffer", host_us(lambda: buf[:count]))
    row(case, "pinned destination: torch.empty(pin_memory=True)", host_us(
        lambda: torch.empty((t, p, c), dtype=torch.bfloat16, pin_memory=True)))  # fmt: skip
    row(case, "torch.cuda.current_stream()", host_us(torch.cuda.current_stream))
    row(case, "event.record(current stream) (reused event)", host_us(lambda: ev.record(cur)))

    def switch() -> None:
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(cur)

    row(case, "set_stream(side) + set_stream(cur)", host_us(switch))

    def ctx() -> None:
        with torch.cuda.stream(side):
            pass

    row(case, "(old) with torch.cuda.stream(side): enter + exit", host_us(ctx))
    row(case, "side.wait_event(event)", host_us(lambda: side.wait_event(ev)))
    row(case, f"index upload .to(device, non_blocking) ({count} int64)", host_us(
        lambda: host_idx.to(dev, non_blocking=True)))  # fmt: skip
    row(case, f"index_select of {count} chunks", host_us(lambda: torch.index_select(plan.chunks, 0, idx)))
    stage = torch.index_select(plan.chunks, 0, idx)

    def arrange_copy() -> None:
        src = plan.arrange(stage, k, 0, t)
        dst = out.view(t * plan.rows_per_token, -1).view(plan.chunks.dtype)
        dst.view(src.shape).copy_(src, non_blocking=True)

    row(case, "arrange + D2H copy_ issue (4 views + copy_)", host_us(arrange_copy, rounds=10, calls=5))

    def ev_new() -> None:
        e = torch.cuda.Event()
        e.record(side)

    row(case, "completion event: Event() + record", host_us(ev_new))
    row(case, "PendingRows(...)", host_us(lambda: PendingRows(out, done, (idx, host_idx, out))))
    row(case, "event.synchronize() (completed)", host_us(done.synchronize))
    row(case, "(old) request_slots (tensor ops)", host_us(lambda: request_slots("r", blocks, view, num_tokens=t)))
    row(case, "(old) row_table per call (api before)", host_us(lambda: row_table(cache, view)))
    slots = request_slots("r", blocks, view, num_tokens=t)
    row(case, "(old) slots.pin_memory() (api before)", host_us(slots.pin_memory))
    dslots = slots.to(dev)
    if table.rows_per_token > 1:
        stage_t = torch.empty((t * p, table.table.shape[1]), dtype=table.table.dtype, device="cuda")
        row(case, "(old) Triton row kernel launch (per-plane)", host_us(
            lambda: gather_slots(table, dslots, stage_t)))  # fmt: skip
    else:
        row(
            case, "(old) index_select per token", host_us(lambda: gather_slots(table, dslots, kernel_min_bytes=1 << 62))
        )
    # --- whole reads ---
    # The result is dropped at once: its pinned block goes back to torch's caching host allocator (reused once
    # its copy completed), as a caller that keeps the rows only until it has written them would.
    lone_issue = lambda: api.copy_request_async(cache, view, "r", blocks, t)  # noqa: E731
    row(case, "api.copy_request_async issue (whole call)", host_us(lone_issue, rounds=10, calls=5))
    row(case, "api.copy_request_async issue + wait", host_us(lambda: api.copy_request_async(
        cache, view, "r", blocks, t).wait(), rounds=30, calls=1))  # fmt: skip

    src = torch.empty((t, p, c), dtype=torch.bfloat16, device="cuda")

    def plain() -> None:
        out.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    row(case, "limit: contiguous D2H + synchronize", host_us(plain, rounds=30, calls=1))

    def floor() -> None:
        out.copy_(table.unpack(gather_slots(table, dslots, kernel_min_bytes=1 << 62), t), non_blocking=True)
        torch.cuda.synchronize()

    row(case, "floor: per-token gather + D2H + synchronize", host_us(floor, rounds=30, calls=1))

    def chunk_floor() -> None:
        plan.copy_into(idx, k, 0, t, out, non_blocking=True)
        torch.cuda.synchronize()

    row(case, "chunk floor: chunk gather + D2H + synchronize", host_us(chunk_floor, rounds=30, calls=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--layouts", default="LBNHC,LBHNC")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__}", flush=True)
    for layout in args.layouts.split(","):
        for t in [int(x) for x in args.tokens.split(",")]:
            probe(layout, t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
