"""A Triton row gather over a capture cache's row table: output row ``r`` (token ``r // P``, plane ``r % P``) is
table row ``(s // n) * block_stride + (s % n) * token_stride + plane * plane_stride`` with ``s`` the token's
manager slot, so the kernel takes the slots as they are (no index arithmetic kernels before it).  It writes to
device memory or straight into pinned host memory (the stores cross PCIe: no staging buffer, no separate copy).

Imported lazily by :mod:`vllm_hs_compat.core.layout` and only where CUDA and Triton exist; ``ImportError`` means
"use the torch path".
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-not-found,import-untyped,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,import-untyped,unused-ignore]

#: 4-byte words per program: the best of 1024/2048/4096/8192 x 4/8 warps on an H200 (docs/benchmarks.md).
BLOCK = 1024
NUM_WARPS = 4


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _rows_kernel(  # type: ignore[no-untyped-def]
    src,
    slots,
    dst,
    width,
    src_stride,
    n,
    block_stride,
    token_stride,
    planes,
    plane_stride,
    BLOCK: tl.constexpr,  # noqa: N803
) -> None:
    r = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(slots + r // planes)
    row = (s // n) * block_stride + (s % n) * token_stride + (r % planes) * plane_stride
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    v = tl.load(src + row * src_stride + offs, mask=mask)
    tl.store(dst + r.to(tl.int64) * width + offs, v, mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` as 4-byte words where its rows allow (Triton has no 16-byte scalar type; it vectorises the words)."""
    if t.element_size() >= 4 and t.element_size() % 4 == 0:
        return t.view(torch.int32)
    return t.view(torch.int16) if t.element_size() == 2 else t


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
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> bool:
    """Launch the gather on the current stream; False (nothing launched) where the tensors don't fit the kernel.

    ``src``: ``[R, W]`` row table on CUDA (unit inner stride); ``slots``: int64 on CUDA; ``dst``: contiguous
    ``[len(slots) * planes, W]`` of ``src``'s dtype in device or pinned host memory.  The defaults make row ``i``
    ``src[slots[i]]``."""
    if src.dim() != 2 or dst.dim() != 2 or src.stride(1) != 1 or not dst.is_contiguous() or not slots.is_cuda:
        return False
    if dst.shape[0] != slots.numel() * planes or dst.shape[1] != src.shape[1] or dst.dtype != src.dtype:
        return False
    if dst.device.type != "cuda" and not dst.is_pinned():
        return False
    s, d = _words(src), _words(dst)
    m, width = int(d.shape[0]), int(d.shape[1])
    if m == 0:
        return True
    grid: Any = (m, triton.cdiv(width, block))
    _rows_kernel[grid](
        s,
        slots,
        d,
        width,
        s.stride(0),
        n,
        block_stride,
        token_stride,
        planes,
        plane_stride,
        BLOCK=block,
        num_warps=num_warps,
    )
    return True
