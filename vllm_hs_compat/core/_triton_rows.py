"""A Triton row gather over a capture cache's row table: output row ``r`` (token ``r // P``, plane ``r % P``) is
table row ``(s // n) * block_stride + (s % n) * token_stride + plane * plane_stride`` with ``s`` the token's
manager slot, so the kernel takes the slots as they are (no index arithmetic kernels before it).  It writes to
device memory or straight into pinned host memory (the stores cross PCIe: no staging buffer, no separate copy).
With ``flags`` it also answers :func:`~vllm_hs_compat.core.finite.token_flags` for the rows it moves: a value is
NaN/Inf exactly when its exponent bits are all set, so each program tests the words it already holds and clears its
token's flag where one is; the host then checks nothing (its check runs at 1.5-3.2 GB/s a core, docs/gpu.md).

Imported lazily by :mod:`vllm_hs_compat.core.layout` and only where CUDA and Triton exist; ``ImportError`` means
"use the torch path".
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-not-found,import-untyped,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,import-untyped,unused-ignore]

from vllm_hs_compat.core.finite import exponent_mask

#: 4-byte words per program: the best of 1024/2048/4096/8192 x 4/8 warps on an H200 (docs/benchmarks.md).
BLOCK = 1024
NUM_WARPS = 4


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _rows_kernel(  # type: ignore[no-untyped-def]
    src,
    slots,
    dst,
    flags,
    width,
    src_stride,
    n,
    block_stride,
    token_stride,
    planes,
    plane_stride,
    BLOCK: tl.constexpr,  # noqa: N803
    EXP: tl.constexpr,  # noqa: N803  # an element's exponent mask (0: no flags)
    EBITS: tl.constexpr,  # noqa: N803  # bits of an element
    K: tl.constexpr,  # noqa: N803  # elements per word
) -> None:
    r = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(slots + r // planes)
    row = (s // n) * block_stride + (s % n) * token_stride + (r % planes) * plane_stride
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    v = tl.load(src + row * src_stride + offs, mask=mask, other=0)
    tl.store(dst + r.to(tl.int64) * width + offs, v, mask=mask)
    if EXP != 0:
        # each element of the word: its exponent bits all set is NaN/Inf (bits above it are masked off, so the
        # sign extension of a shifted word never counts); masked lanes hold 0, never flagged
        bad = (v & EXP) == EXP
        for j in tl.static_range(1, K):
            bad = bad | (((v >> (j * EBITS)) & EXP) == EXP)
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            tl.store(flags + r // planes, 0)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` as 4-byte words where its rows allow (Triton has no 16-byte scalar type; it vectorises the words),
    else as integers of its own width (the bits are copied, never converted)."""
    if t.element_size() >= 4 and t.element_size() % 4 == 0:
        return t.view(torch.int32)
    return t.view({2: torch.int16, 1: torch.int8}.get(t.element_size(), t.dtype))


def flag_spec(dtype: torch.dtype, word_bytes: int) -> tuple[int, int, int] | None:
    """``(exponent mask, bits, elements per word)`` for rows of ``dtype`` moved as words of ``word_bytes``; None
    where the kernel cannot flag them (a dtype without a bit test, or wider than the word)."""
    mask = exponent_mask(dtype)
    if mask is None or word_bytes % dtype.itemsize:
        return None
    return mask, 8 * dtype.itemsize, word_bytes // dtype.itemsize


def gather_rows_into(
    src: torch.Tensor,
    slots: torch.Tensor,
    dst: torch.Tensor,
    *,
    n: int = 1,
    block_stride: int = 1,
    token_stride: int = 1,
    planes: int = 1,
    plane_stride: int = 0,
    flags: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> bool:
    """Launch the gather on the current stream; False (nothing launched) where the tensors don't fit the kernel.

    ``src``: ``[R, W]`` row table on CUDA (unit inner stride); ``slots``: int64 on CUDA; ``dst``: contiguous
    ``[len(slots) * planes, W]`` of ``src``'s dtype in device or pinned host memory.  The defaults make row ``i``
    ``src[slots[i]]``.  ``flags``: ``[len(slots)]`` bool, True on entry (device or pinned host memory), cleared
    where a token's rows hold NaN/Inf read as ``dtype`` (the rows' own dtype, which ``src`` aliases); only with a
    ``dtype`` :func:`flag_spec` covers (else False, nothing launched: check :func:`flag_spec` first)."""
    if src.dim() != 2 or dst.dim() != 2 or src.stride(1) != 1 or not dst.is_contiguous() or not slots.is_cuda:
        return False
    if dst.shape[0] != slots.numel() * planes or dst.shape[1] != src.shape[1] or dst.dtype != src.dtype:
        return False
    if dst.device.type != "cuda" and not dst.is_pinned():
        return False
    s, d = _words(src), _words(dst)
    spec = (0, 0, 0)
    if flags is not None:
        got = None if dtype is None else flag_spec(dtype, s.element_size())
        if got is None or flags.dtype != torch.bool or flags.shape != (slots.numel(),) or not flags.is_contiguous():
            return False
        if flags.device.type != "cuda" and not flags.is_pinned():
            return False
        spec = got
    m, width = int(d.shape[0]), int(d.shape[1])
    if m == 0:
        return True
    grid: Any = (m, triton.cdiv(width, block))
    _rows_kernel[grid](
        s,
        slots,
        d,
        d if flags is None else flags.view(torch.uint8),
        width,
        s.stride(0),
        n,
        block_stride,
        token_stride,
        planes,
        plane_stride,
        BLOCK=block,
        EXP=spec[0],
        EBITS=spec[1],
        K=spec[2],
        num_warps=num_warps,
    )
    return True
