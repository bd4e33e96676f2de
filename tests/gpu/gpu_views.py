"""Synthetic capture caches of both eras on the GPU, and the rows the stress tests write into them."""

from __future__ import annotations

import torch

from vllm_hs_compat.core import ViewOrder

NB, N, P, C = 512, 16, 4, 1024  # manager blocks, group block size, planes, hidden


def make_cache(order: ViewOrder, split: int = 1) -> torch.Tensor:
    """A zeroed cache: ``[nb, n, P, C]`` (<= 0.28) or a logical ``[nb, P, n, C]`` over a token-major buffer (LBNHC,
    0.29+); ``split`` kernel blocks per manager block (``n = N // split``)."""
    nb, n = NB * split, N // split
    cache = torch.zeros(nb, n, P, C, dtype=torch.bfloat16, device="cuda")
    return cache if order is ViewOrder.BLOCK_TOKEN_PLANE else cache.permute(0, 2, 1, 3)


def write(cache: torch.Tensor, order: ViewOrder, slots: torch.Tensor, value: float) -> None:
    """What vLLM's capture writer does at ``slots`` (kernel slots == manager slots), with rows ``value + plane``."""
    n = cache.shape[order.token_axis]
    blk, off = slots // n, slots % n
    rows = torch.full((slots.numel(), P, C), value, dtype=torch.bfloat16, device="cuda")
    rows += torch.arange(P, device="cuda", dtype=torch.bfloat16).view(1, P, 1)
    if order is ViewOrder.BLOCK_TOKEN_PLANE:
        cache[blk, off] = rows
    else:
        cache[blk, :, off] = rows


def expected(value: float, tokens: int) -> torch.Tensor:
    base = torch.full((tokens, P, C), value, dtype=torch.bfloat16)
    return base + torch.arange(P, dtype=torch.bfloat16).view(1, P, 1)


def churn(numel: int) -> None:
    """Reuse freed compute-stream memory: same-size int64 tensors full of slot 0 (the null block, never a
    request's), so a stale index reads wrong rows instead of faulting."""
    for _ in range(4):
        junk = torch.zeros((numel,), dtype=torch.int64, device="cuda")
        junk += 0
        del junk
