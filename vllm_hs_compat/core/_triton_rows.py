"""A Triton row gather: ``dst[i] = src[idx[i]]`` for 2-D row tables, into device memory or straight into pinned
host memory (the kernel's stores cross PCIe; no device staging buffer, no separate copy).

Imported lazily by :mod:`vllm_hs_compat.core.transfer` and only where CUDA and Triton exist; ``ImportError``
means "use the torch path".
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,unused-ignore]

_BLOCK = 1024  # 4-byte words per program: the best of 1024/2048/4096/8192 x 4/8 warps on an H200


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _rows_kernel(src, idx, dst, width, src_stride, BLOCK: tl.constexpr) -> None:  # type: ignore[no-untyped-def]  # noqa: N803
    r = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(idx + r)
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
    src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, *, block: int = _BLOCK, num_warps: int = 4
) -> bool:
    """Launch ``dst[i, :] = src[idx[i], :]`` on the current stream; False (nothing launched) where the shapes
    don't fit the kernel.  ``src``: ``[R, W]`` with unit inner stride on CUDA; ``idx``: int64 on CUDA; ``dst``:
    contiguous ``[len(idx), W]`` in device or pinned host memory."""
    if src.dim() != 2 or dst.dim() != 2 or src.stride(1) != 1 or not dst.is_contiguous():
        return False
    if dst.shape[0] != idx.numel() or dst.shape[1] != src.shape[1] or dst.dtype != src.dtype:
        return False
    if dst.device.type != "cuda" and not dst.is_pinned():
        return False
    s, d = _words(src), _words(dst)
    m, width = int(d.shape[0]), int(d.shape[1])
    if m == 0:
        return True
    grid: Any = (m, triton.cdiv(width, block))
    _rows_kernel[grid](s, idx, d, width, s.stride(0), BLOCK=block, num_warps=num_warps)
    return True
