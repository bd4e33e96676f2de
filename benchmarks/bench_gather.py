"""Capture read path: device gather and capture to host, each against its limit measured in the same run.

A benchmark, not a test.  Every case prints the limit it is compared with (measured in this process, same sizes):

* device gather (``gather_rows``) of T scattered tokens vs a contiguous device-to-device copy of the same bytes,
  per layout: ``[nb,N,P,C]`` (<= 0.28), LBNHC and LBHNC (0.29+), LBNHC kernel-split x4;
* capture to host of one request (wall time of issue + wait, host work included: slots from block ids, index
  upload, gather, copy) vs a plain contiguous D2H of the same bytes into a preallocated pinned buffer: ``api``
  (``api.copy_request_async``, whole-block lone read) and ``api-general`` (its per-token fallback), ``staged`` /
  ``direct`` (``RowReader.read``, lone read per ``VLLM_HS_COMPAT_LONE_READ``), ``floor`` (indices already on the
  device, one gather, one D2H);
* one step's batch (``--step-requests`` x ``--step-tokens`` issued together) vs one D2H of all its bytes, and the
  host-side time per request at 1,024 finished requests per step.

``--before DIR`` imports an older copy of the package from ``DIR/vhc_before`` (e.g. main's
``vllm_hs_compat`` copied under that name) and times its path side by side ("before" rows).

    python benchmarks/bench_gather.py                 # CUDA if available, else a small CPU smoke run
    python benchmarks/bench_gather.py --json out.json --before /tmp/before
"""

# ruff: noqa: B023  (every closure below is called at once, inside its loop iteration)
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_hs_compat.core import ViewOrder, describe_capture_view, gather_rows
from vllm_hs_compat.core.layout import row_table
from vllm_hs_compat.core.transfer import RowReader

RESULTS: list[dict[str, Any]] = []
#: (BLOCK in 4-byte words, num_warps) of the Triton row kernel, each timed.
TRITON_CONFIGS = [(2048, 4), (4096, 8)]  # "after" is the default (1024 words, 4 warps)


def record(kind: str, case: str, variant: str, seconds: list[float], limit: list[float], nbytes: int) -> None:
    med, lim = statistics.median(seconds), statistics.median(limit)
    RESULTS.append(
        {
            "kind": kind,
            "case": case,
            "variant": variant,
            "median_s": med,
            "min_s": min(seconds),
            "limit_median_s": lim,
            "limit_min_s": min(limit),
            "bytes": nbytes,
            "ratio_median": lim / med,
            "ratio_min": min(limit) / min(seconds),
        }
    )
    print(
        f"{kind:7s} {case:40s} {variant:14s} {nbytes / med / 1e9:8.1f} GB/s  limit {nbytes / lim / 1e9:8.1f} GB/s"
        f"  = {lim / med:5.2f}x (min/min {min(limit) / min(seconds):5.2f}x)",
        flush=True,
    )


def dev_times(fn: Callable[[], object], reps: int, batch: int = 1) -> list[float]:
    """Device time of ``fn`` per call (CUDA events around ``batch`` calls queued back to back, so host launch
    time overlaps the device work as in a running engine), after a warm-up."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / batch)
    return out


def wall_times(fn: Callable[[], object], reps: int, warm: int = 2) -> list[float]:
    """Wall time of ``fn`` (which must wait for its own result), host work included."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def torch_only(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the Triton row kernel switched off (``torch.index_select`` gathers)."""
    from vllm_hs_compat.core import layout

    def run() -> Any:
        saved, layout._triton = layout._triton, False
        try:
            return fn()
        finally:
            layout._triton = saved

    return run


def make_cache(layout: str, nb: int, n: int, p: int, c: int) -> tuple[torch.Tensor, Any]:
    """A capture cache of ``nb`` manager blocks of ``n`` tokens, random bits, and its view."""
    split = 4 if layout.endswith("split4") else 1
    k_nb, k_n = nb * split, n // split
    if layout.startswith("NPC"):
        cache = torch.empty((k_nb, k_n, p, c), dtype=torch.bfloat16, device="cuda")
        order = ViewOrder.BLOCK_TOKEN_PLANE
    elif layout.startswith("LBNHC"):
        cache = torch.empty((k_nb, k_n, p, c), dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3)
        order = ViewOrder.BLOCK_PLANE_TOKEN
    else:  # LBHNC
        cache = torch.empty((k_nb, p, k_n, c), dtype=torch.bfloat16, device="cuda")
        order = ViewOrder.BLOCK_PLANE_TOKEN
    cache.view(torch.int16).random_(-(2**15), 2**15)
    return cache, describe_capture_view(cache, num_planes=p, group_block_size=n, order=order)


def block_lists(gen: torch.Generator, nb: int, n: int, lengths: list[int]) -> list[list[int]]:
    need = [-(-t // n) for t in lengths]
    free = (torch.randperm(nb - 1, generator=gen)[: sum(need)] + 1).tolist()
    out, at = [], 0
    for k in need:
        out.append(free[at : at + k])
        at += k
    return out


def bench_gather(args: argparse.Namespace, before: Any) -> None:
    p, c, n = args.planes, args.hidden, args.block
    per_token = p * c * 2
    sizes = [int(s) << 20 for s in args.gather_mib.split(",")]
    nb = max(sizes) // per_token // n * 2 + 1
    gen = torch.Generator().manual_seed(0)
    triton_rows = None
    try:
        from vllm_hs_compat.core import _triton_rows as triton_rows
    except ImportError as e:
        print(f"triton kernel unavailable: {e}")
    for layout in ["NPC", "LBNHC", "LBHNC", "LBNHC_split4"]:
        _gather_layout(layout, nb, sizes, gen, triton_rows, before, args)
        torch.cuda.empty_cache()


def _gather_layout(
    layout: str, nb: int, sizes: list[int], gen: torch.Generator, triton_rows: Any, before: Any, args: Any
) -> None:
    p, c, n = args.planes, args.hidden, args.block
    per_token = p * c * 2
    cache, view = make_cache(layout, nb, n, p, c)
    table = row_table(cache, view)
    if True:
        for size in sizes:
            t = size // per_token
            (blocks,) = block_lists(gen, nb, n, [t])
            from vllm_hs_compat.core import manager_slots

            slots = manager_slots("g", blocks, group_block_size=n, num_tokens=t).cuda()
            src = torch.empty((t, p, c), dtype=torch.bfloat16, device="cuda")
            dst = torch.empty_like(src)
            reps = 20 if size <= 256 << 20 else 6
            k = 10 if size <= 256 << 20 else 2
            limit = dev_times(lambda dst=dst, src=src: dst.copy_(src), reps, k)
            ref = cache.view(torch.int16)  # exactness against a plain index of the 4-D view
            blk, off = slots // view.block_tokens, slots % view.block_tokens
            want = ref[blk, off] if view.order is ViewOrder.BLOCK_TOKEN_PLANE else ref[blk, :, off]
            case = f"{layout} {size >> 20} MiB"
            got = gather_rows(cache, view, slots)
            ok = torch.equal(got.view(torch.int16), want)
            del want, got
            if before is not None:
                bview = before.view(cache, view)
                record(
                    "gather",
                    case,
                    "before",
                    dev_times(lambda: before.gather_rows(cache, bview, slots), reps, k),
                    limit,
                    size,
                )
            record(
                "gather",
                case,
                "after" + ("" if ok else " WRONG"),
                dev_times(lambda: gather_rows(cache, view, slots), reps, k),
                limit,
                size,
            )
            if triton_rows is not None and table is not None:
                rows = table.rows(slots)
                out = torch.empty((rows.numel(), table.table.shape[1]), dtype=table.table.dtype, device="cuda")
                triton_rows.gather_rows_into(table.table, rows, out)
                ok = torch.equal(
                    table.unpack(out, t).view(torch.int16), gather_rows(cache, view, slots).view(torch.int16)
                )
                record(
                    "gather",
                    case,
                    "index_select",
                    dev_times(lambda: torch.index_select(table.table, 0, rows), reps, k),
                    limit,
                    size,
                )
                for blk_, warps in TRITON_CONFIGS if args.triton_configs else []:
                    record(
                        "gather",
                        case,
                        f"triton {blk_}/{warps}" + ("" if ok else " WRONG"),
                        dev_times(
                            lambda: triton_rows.gather_rows_into(table.table, rows, out, block=blk_, num_warps=warps),
                            reps,
                            k,
                        ),
                        limit,
                        size,
                    )
                del out
            del src, dst


def bench_host(args: argparse.Namespace, before: Any) -> None:
    n = args.block
    step_tokens = args.step_requests * args.step_tokens
    nb = max(step_tokens, 1024 * 128) // n * 2 + 1
    gen = torch.Generator().manual_seed(1)
    for layout in args.host_layouts.split(","):
        _host_layout(layout, nb, gen, before, args)
        torch.cuda.empty_cache()


def _host_layout(layout: str, nb: int, gen: torch.Generator, before: Any, args: Any) -> None:
    p, c, n = args.planes, args.hidden, args.block
    per_token = p * c * 2
    if True:
        cache, view = make_cache(layout, nb, n, p, c)
        readers = {
            path: RowReader(cache, view, path=path.split("-")[0]) for path in ("staged", "direct", "staged-torch")
        }
        # --- one request ---
        for t in [int(x) for x in args.request_tokens.split(",")]:
            nbytes = t * per_token
            (blocks,) = block_lists(gen, nb, n, [t])
            src = torch.empty((t, p, c), dtype=torch.bfloat16, device="cuda")
            pinned = torch.empty((t, p, c), dtype=torch.bfloat16, pin_memory=True)

            def d2h(pinned: torch.Tensor = pinned, src: torch.Tensor = src) -> None:
                pinned.copy_(src, non_blocking=True)
                torch.cuda.synchronize()

            reps = 30 if t <= 2048 else 10
            limit = wall_times(d2h, reps)
            case = f"{layout} 1 request x {t} tokens"
            if before is not None:
                bview = before.view(cache, view)

                def old(blocks: list[int] = blocks, t: int = t) -> None:
                    slots = before.request_slots("r", blocks, bview, num_tokens=t)
                    before.copy_rows_async(cache, bview, slots).wait()

                record("host", case, "before", wall_times(old, reps), limit, nbytes)
            # The floor of any capture path: indices already on the device, one gather, one D2H, one sync.
            idx = torch.as_tensor((torch.tensor(blocks).view(-1, 1) * n + torch.arange(n)).view(-1)[:t], device="cuda")
            tab = row_table(cache, view)
            if tab is not None:

                def floor(idx: torch.Tensor = idx, pinned: torch.Tensor = pinned, tab: Any = tab) -> None:
                    pinned.copy_(gather_rows(cache, view, idx), non_blocking=True)
                    torch.cuda.synchronize()

                record("host", case, "floor", wall_times(floor, reps), limit, nbytes)
            if args.profile_dir and t == 128:
                from torch.profiler import ProfilerActivity, profile

                reader = readers["staged"]
                for _ in range(3):
                    reader.read("r", blocks, start=0, num_tokens=t).wait()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        reader.read("r", blocks, start=0, num_tokens=t).wait()
                with open(f"{args.profile_dir}/profile_{layout}_{t}.txt", "w") as f:
                    f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            want = None
            from vllm_hs_compat import api, envs
            from vllm_hs_compat.core.transfer import ReadOptions

            # "api": the whole-block lone read (LoneReads); "api-general": the per-token path it falls back to.
            for variant, on in [("api-general", False), ("api", True)]:  # want: the per-token rows
                opts = ReadOptions(lone_reads=on, lone_chunks=envs.flag(envs.LONE_CHUNKS))

                def lone(blocks: list[int] = blocks, t: int = t, opts: ReadOptions = opts) -> torch.Tensor:
                    return api.copy_request_async(cache, view, "r", blocks, t, options=opts).wait()

                got = lone()
                want = got.clone() if want is None else want
                ok = torch.equal(got.view(torch.int16), want.view(torch.int16))
                record("host", case, variant + ("" if ok else " WRONG"), wall_times(lone, reps), limit, nbytes)
            for path, reader in readers.items():

                def new(reader: RowReader = reader, blocks: list[int] = blocks, t: int = t) -> torch.Tensor:
                    return reader.read("r", blocks, start=0, num_tokens=t).wait()

                fn = torch_only(new) if path.endswith("-torch") else new
                got = fn()
                want = got.clone() if want is None else want
                ok = torch.equal(got.view(torch.int16), want.view(torch.int16))
                record("host", case, path + ("" if ok else " WRONG"), wall_times(fn, reps), limit, nbytes)
            del src, pinned
        # --- one step's batch ---
        for count, t in [] if args.no_step else [(args.step_requests, args.step_tokens), (1024, 128)]:
            nbytes = count * t * per_token
            tables = block_lists(gen, nb, n, [t] * count)
            src = torch.empty((count * t, p, c), dtype=torch.bfloat16, device="cuda")
            pinned = torch.empty((count * t, p, c), dtype=torch.bfloat16, pin_memory=True)

            def d2h_all(pinned: torch.Tensor = pinned, src: torch.Tensor = src) -> None:
                pinned.copy_(src, non_blocking=True)
                torch.cuda.synchronize()

            reps = args.step_reps
            limit = wall_times(d2h_all, reps, warm=1)
            case = f"{layout} step {count} x {t} tokens"
            issue_s: dict[str, list[float]] = {}
            if before is not None:
                bview = before.view(cache, view)

                def old_step(tables: list[list[int]] = tables, t: int = t) -> None:
                    t0 = time.perf_counter()
                    pend = [
                        before.copy_rows_async(cache, bview, before.request_slots("r", b, bview, num_tokens=t))
                        for b in tables
                    ]
                    issue_s.setdefault("before", []).append(time.perf_counter() - t0)
                    for x in pend:
                        x.wait()

                record("step", case, "before", wall_times(old_step, reps, warm=1), limit, nbytes)
            for path, reader in readers.items():
                reqs = [(f"r{i}", b, 0, t) for i, b in enumerate(tables)]

                def new_step(reader: RowReader = reader, reqs: list[Any] = reqs, path: str = path) -> None:
                    t0 = time.perf_counter()
                    pend = reader.read_many(reqs)
                    issue_s.setdefault(path, []).append(time.perf_counter() - t0)
                    for x in pend:
                        x.wait()  # type: ignore[union-attr]

                fn = torch_only(new_step) if path.endswith("-torch") else new_step
                record("step", case, path, wall_times(fn, reps, warm=1), limit, nbytes)
            for variant, times in issue_s.items():
                per = statistics.median(times) / count * 1e6
                RESULTS.append({"kind": "issue", "case": case, "variant": variant, "us_per_request": per})
                print(f"issue   {case:40s} {variant:14s} host-side {per:7.1f} us per request (median)", flush=True)
            del src, pinned


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--planes", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--gather-mib", default="64,256,4096")
    ap.add_argument("--request-tokens", default="128,512,2048,8192")
    ap.add_argument("--step-requests", type=int, default=256)
    ap.add_argument("--step-tokens", type=int, default=512)
    ap.add_argument("--step-reps", type=int, default=5)
    ap.add_argument("--host-layouts", default="LBNHC,LBHNC")
    ap.add_argument("--no-step", action="store_true", help="host cases: one request only (no step batches)")
    ap.add_argument("--only", choices=["gather", "host", "all"], default="all")
    ap.add_argument("--before", default=None, help="folder holding an older copy of the package as vhc_before")
    ap.add_argument("--json", default=None)
    ap.add_argument("--triton-configs", action="store_true", help="also time other Triton block/warp choices")
    ap.add_argument("--profile-dir", default=None, help="write a torch.profiler table of a 128-token read here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (the capture read path is synchronous on CPU)")
        return
    before = None
    if args.before:
        sys.path.insert(0, args.before)
        old_layout = importlib.import_module("vhc_before.core.layout")

        def old_view(cache: torch.Tensor, view: Any) -> Any:  # the old package's own enum and view class
            order = old_layout.ViewOrder[view.order.name]
            return old_layout.describe_capture_view(
                cache, num_planes=view.num_planes, group_block_size=view.group_block_size, order=order
            )

        before = argparse.Namespace(
            view=old_view,
            gather_rows=old_layout.gather_rows,
            copy_rows_async=importlib.import_module("vhc_before.core.transfer").copy_rows_async,
            request_slots=importlib.import_module("vhc_before.core.slots").request_slots,
        )
    print(
        f"device={torch.cuda.get_device_name()} torch={torch.__version__} P={args.planes} C={args.hidden} "
        f"N={args.block} bf16",
        flush=True,
    )
    if args.only in ("gather", "all"):
        bench_gather(args, before)
    if args.only in ("host", "all"):
        bench_host(args, before)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
