"""Gather bandwidth of the capture read path (a benchmark, not a test).

For each view order / physical layout: reading T tokens scattered over random blocks with
``gather_rows`` vs a contiguous device copy of the same bytes, and ``copy_rows_async`` to pinned host
memory vs a plain contiguous device-to-host copy of the same bytes.  Prints GB/s and ratios.

    python benchmarks/bench_gather.py            # CUDA if available, else CPU
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from vllm_hs_compat.core import ViewOrder, describe_capture_view, gather_rows, manager_slots
from vllm_hs_compat.core.transfer import copy_rows_async


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--planes", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t, p, c, n, nb = args.tokens, args.planes, args.hidden, args.block, args.blocks
    nbytes = t * p * c * 2
    print(f"device={dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}) torch={torch.__version__}")
    print(f"T={t} P={p} C={c} N={n} cache blocks={nb}: {nbytes / 2**20:.0f} MiB per read")
    gen = torch.Generator().manual_seed(0)
    blocks = (torch.randperm(nb - 1, generator=gen)[: t // n] + 1).tolist()
    slots = manager_slots("bench", blocks, group_block_size=n, num_tokens=t)
    contiguous = torch.empty((t, p, c), dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(contiguous)
    base = timed(lambda: dst.copy_(contiguous), dev, args.reps)
    pinned = torch.empty((t, p, c), dtype=torch.bfloat16, pin_memory=dev.type == "cuda")
    d2h = timed(lambda: pinned.copy_(contiguous, non_blocking=True), dev, args.reps)
    print(f"contiguous device copy: {nbytes / base / 1e9:7.1f} GB/s; contiguous D2H: {nbytes / d2h / 1e9:7.1f} GB/s")

    def buf(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16, device=dev)

    layouts = [
        ("[nb,N,P,C] (<=0.28)", ViewOrder.BLOCK_TOKEN_PLANE, lambda: buf(nb, n, p, c)),
        ("[nb,P,N,C] LBNHC (0.29+ default)", ViewOrder.BLOCK_PLANE_TOKEN, lambda: buf(nb, n, p, c).permute(0, 2, 1, 3)),
        ("[nb,P,N,C] LBHNC", ViewOrder.BLOCK_PLANE_TOKEN, lambda: buf(nb, p, n, c)),
    ]
    for name, order, make in layouts:
        cache = make()
        view = describe_capture_view(cache, num_planes=p, group_block_size=n, order=order)
        idx = slots.to(dev)
        g = timed(lambda cache=cache, view=view, idx=idx: gather_rows(cache, view, idx), dev, args.reps)
        h = timed(lambda cache=cache, view=view: copy_rows_async(cache, view, slots, out=pinned).wait(), dev, args.reps)
        print(
            f"{name:34s} gather {nbytes / g / 1e9:7.1f} GB/s = {base / g:4.2f}x device copy | "
            f"to host {nbytes / h / 1e9:6.1f} GB/s = {d2h / h:4.2f}x contiguous D2H"
        )


if __name__ == "__main__":
    main()
