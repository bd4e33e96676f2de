"""The capture view: which axis of the registered capture tensor holds planes, which holds tokens.

vLLM hands the connector one 4-D tensor for the capture layer (``cache_only_layers.<n>``).  Its axes are
declared by the release (the adapter knows the order); this module checks the declaration against the
tensor and never infers an axis from position alone.

* ``BLOCK_TOKEN_PLANE`` -- ``[num_blocks, N, P, C]`` (vLLM 0.17 - 0.28)
* ``BLOCK_PLANE_TOKEN`` -- logical ``[num_blocks, P, N, C]``, possibly strided (vLLM 0.29+)

``num_blocks`` counts *view* blocks: when the capture layer shares a group with attention backends that
need smaller kernel blocks, every manager block of ``group_block_size`` tokens is cut into ``r`` kernel
blocks of ``N`` tokens and ``num_blocks = manager_blocks * r``.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import envs
from ..errors import AmbiguousViewError, CaptureViewError


class ViewOrder(enum.Enum):
    """Logical axis order of the capture view."""

    BLOCK_TOKEN_PLANE = "[blocks, tokens, planes, hidden]"
    BLOCK_PLANE_TOKEN = "[blocks, planes, tokens, hidden]"

    @property
    def label(self) -> str:
        """The one name used in logs, errors, the doctor and the docs: ``BLOCK_TOKEN_PLANE [blocks, tokens, ...]``."""
        return f"{self.name} {self.value}"

    @property
    def plane_axis(self) -> int:
        return 2 if self is ViewOrder.BLOCK_TOKEN_PLANE else 1

    @property
    def token_axis(self) -> int:
        return 1 if self is ViewOrder.BLOCK_TOKEN_PLANE else 2


@dataclass(frozen=True)
class CaptureView:
    """Checked description of a registered capture tensor."""

    order: ViewOrder
    num_blocks: int
    block_tokens: int
    num_planes: int
    hidden_size: int
    strides: tuple[int, int, int, int]
    dtype: torch.dtype
    group_block_size: int

    @property
    def kernel_split(self) -> int:
        """Kernel blocks per manager block (1 when the view is not split)."""
        return self.group_block_size // self.block_tokens

    @property
    def num_manager_blocks(self) -> int:
        """Blocks as the scheduler counts them (in units of ``group_block_size``)."""
        return self.num_blocks // self.kernel_split

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_tokens

    def describe(self) -> str:
        split = f", kernel split x{self.kernel_split}" if self.kernel_split > 1 else ""
        return (
            f"{self.order.label} blocks={self.num_blocks} N={self.block_tokens} P={self.num_planes} "
            f"C={self.hidden_size} strides={self.strides} dtype={self.dtype} "
            f"group_block_size={self.group_block_size}{split}"
        )


def _infer_order(shape: tuple[int, ...], num_planes: int, group_block_size: int) -> ViewOrder:
    def fits(order: ViewOrder) -> bool:
        n = shape[order.token_axis]
        return shape[order.plane_axis] == num_planes and n > 0 and group_block_size % n == 0

    candidates = [o for o in ViewOrder if fits(o)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise CaptureViewError(
            f"capture tensor of shape {list(shape)} fits neither {ViewOrder.BLOCK_TOKEN_PLANE.label} nor "
            f"{ViewOrder.BLOCK_PLANE_TOKEN.label} with P={num_planes} planes and group block size "
            f"{group_block_size}. Check that P equals len(eagle_aux_hidden_state_layer_ids) and that the "
            "tensor is the one registered for the capture layer (cache_only_layers.<n>)."
        )
    raise AmbiguousViewError(
        f"capture tensor of shape {list(shape)}: P={num_planes} equals the token-axis length, so the plane "
        "and token axes cannot be told apart from the shape. Pass the order the adapter declares "
        "(adapter.view_order) or choose a capture layer count different from the block size."
    )


def describe_capture_view(
    tensor: torch.Tensor,
    *,
    num_planes: int,
    group_block_size: int,
    order: ViewOrder | None,
    hidden_size: int | None = None,
) -> CaptureView:
    """Check ``tensor`` against the declared ``order`` and return its :class:`CaptureView`.

    ``order=None`` infers the order from the shape and raises :class:`AmbiguousViewError` when ``P == N``
    leaves both readings possible.
    """
    if tensor.dim() != 4:
        raise CaptureViewError(
            f"capture tensor has {tensor.dim()} dims (shape {list(tensor.shape)}); expected 4 "
            f"({ViewOrder.BLOCK_TOKEN_PLANE.label} or {ViewOrder.BLOCK_PLANE_TOKEN.label}). Register the "
            "capture layer's own tensor, not a backing buffer or another layer's KV tensor."
        )
    if num_planes <= 0 or group_block_size <= 0:
        raise CaptureViewError(f"num_planes={num_planes} and group_block_size={group_block_size} must both be positive")
    shape = tuple(int(s) for s in tensor.shape)
    if order is None:
        order = _infer_order(shape, num_planes, group_block_size)
    planes = shape[order.plane_axis]
    tokens = shape[order.token_axis]
    if planes != num_planes:
        other = ViewOrder.BLOCK_PLANE_TOKEN if order is ViewOrder.BLOCK_TOKEN_PLANE else ViewOrder.BLOCK_TOKEN_PLANE
        hint = (
            f" The shape matches {other.label} instead: the adapter's declared order does not fit this "
            "vLLM build; set VLLM_HS_COMPAT_ADAPTER to the adapter of the right era."
            if shape[other.plane_axis] == num_planes
            else " Check that P equals len(eagle_aux_hidden_state_layer_ids)."
        )
        raise CaptureViewError(
            f"capture tensor of shape {list(shape)} read as {order.label} has {planes} planes on axis "
            f"{order.plane_axis}; expected P={num_planes}.{hint}"
        )
    if tokens <= 0 or group_block_size % tokens != 0:
        raise CaptureViewError(
            f"capture tensor of shape {list(shape)} read as {order.label} has N={tokens} tokens per block on "
            f"axis {order.token_axis}; expected the group block size {group_block_size} or a kernel block "
            "size dividing it. Take the block size from the capture group's kv_cache_spec, not from "
            "cache_config.block_size (vLLM changes the latter for hybrid models)."
        )
    if hidden_size is not None and shape[3] != hidden_size:
        raise CaptureViewError(
            f"capture tensor of shape {list(shape)} has hidden size {shape[3]} on axis 3; expected "
            f"{hidden_size} (the verifier's hidden_size)"
        )
    if shape[0] % (group_block_size // tokens) != 0:
        raise CaptureViewError(
            f"capture tensor of shape {list(shape)} has {shape[0]} kernel blocks, not a multiple of the "
            f"kernel split {group_block_size // tokens} (group block size {group_block_size} / N={tokens})"
        )
    strides = tuple(int(s) for s in tensor.stride())
    return CaptureView(
        order=order,
        num_blocks=shape[0],
        block_tokens=tokens,
        num_planes=planes,
        hidden_size=shape[3],
        strides=(strides[0], strides[1], strides[2], strides[3]),
        dtype=tensor.dtype,
        group_block_size=group_block_size,
    )


def gather_rows(tensor: torch.Tensor, view: CaptureView, slots: torch.Tensor) -> torch.Tensor:
    """Read the rows at manager ``slots`` from the capture tensor: returns ``[len(slots), P, C]``.

    ``slots`` must already be validated (see :func:`vllm_hs_compat.core.slots.manager_slots`) and live on
    ``tensor``'s device.  The index tensors are made on the caller's current stream; a caller reading on a
    side stream must call this under that stream (and make the stream wait for the compute stream).
    """
    table = cached_row_table(tensor, view)
    if table is None:
        return _gather_indexed(tensor, view, slots)
    return table.unpack(gather_slots(table, slots), int(slots.numel()))


_triton: Any = None  # the Triton row kernel module, False where unavailable (resolved on first CUDA gather)

#: Reads of at least this many bytes use the Triton row kernel where it exists (0.89-0.93x of a device copy at
#: 256 MiB - 4 GiB on an H200 against 0.86-0.88x for ``index_select``); smaller ones use ``index_select``, whose
#: lower launch cost keeps a 64 MiB read on the device's pace (0.92-1.0x).  Per-plane tables (LBHNC) always take
#: the kernel, which computes their row indices itself.  docs/benchmarks.md has the figures.
TRITON_MIN_BYTES = 128 << 20


def _triton_rows() -> Any:
    global _triton
    if _triton is None:
        _triton = False
        if envs.flag(envs.TRITON):
            try:
                from . import _triton_rows as module
            except ImportError:
                pass
            else:
                _triton = module
    return _triton


def kernel_gather_into(
    kernel: Any, table: RowTable, slots: torch.Tensor, dst: torch.Tensor, flags: torch.Tensor | None = None
) -> bool:
    """The Triton row kernel (``kernel``: the ``_triton_rows`` module) reads the rows of manager ``slots`` into
    ``dst``; False where it cannot (the caller falls back to ``index_select``).  ``flags`` (``[len(slots)]`` bool,
    all True): cleared by the kernel where a token's rows hold NaN/Inf (check ``kernel.flag_spec`` first)."""
    return bool(
        kernel.gather_rows_into(
            table.table,
            slots,
            dst,
            n=table.block_tokens,
            block_stride=table.block_stride,
            token_stride=table.token_stride,
            planes=table.rows_per_token,
            plane_stride=table.plane_stride,
            flags=flags,
            dtype=table.dtype,
        )
    )


def gather_slots(
    table: RowTable, slots: torch.Tensor, out: torch.Tensor | None = None, *, kernel_min_bytes: int | None = None
) -> torch.Tensor:
    """The rows of manager ``slots`` (on the table's device) as ``[len(slots) * rows_per_token, W]``.

    On CUDA the Triton row kernel reads reads of at least ``kernel_min_bytes`` (default
    :data:`TRITON_MIN_BYTES`) and per-plane tables (``VLLM_HS_COMPAT_TRITON=0`` turns it off), else
    ``torch.index_select`` over :meth:`RowTable.rows`.  ``out``: a contiguous destination of that shape (device
    memory, or pinned host memory for the kernel)."""
    m = int(slots.numel()) * table.rows_per_token
    width = int(table.table.shape[1])
    if slots.is_cuda:
        limit = TRITON_MIN_BYTES if kernel_min_bytes is None else kernel_min_bytes
        big = m * width * table.table.element_size() >= limit
        kernel: Any = _triton_rows() if big or not table.identity else False
        if kernel:
            dst = out if out is not None else table.table.new_empty((m, width))
            if kernel_gather_into(kernel, table, slots, dst):
                return dst
    rows = table.rows(slots)
    if out is None:
        return torch.index_select(table.table, 0, rows)
    if out.device != table.table.device:
        out.copy_(torch.index_select(table.table, 0, rows), non_blocking=True)
        return out
    return torch.index_select(table.table, 0, rows, out=out)


def _gather_indexed(tensor: torch.Tensor, view: CaptureView, slots: torch.Tensor) -> torch.Tensor:
    """Fallback for views no :class:`RowTable` describes (a hidden axis that is not contiguous)."""
    n = view.block_tokens
    blk = torch.div(slots, n, rounding_mode="floor")
    off = slots - blk * n
    wide = _widest_alias(tensor)
    if view.order is ViewOrder.BLOCK_TOKEN_PLANE:
        rows = wide[blk, off]
    else:
        # Advanced indices separated by a slice: the indexed dims come first -> [T, P, C].
        rows = wide[blk, :, off]
    return rows if wide is tensor else rows.view(tensor.dtype)


@dataclass(frozen=True)
class RowTable:
    """The capture tensor as a 2-D table of contiguous rows (an alias of its storage, widest element type).

    A token's values are one row of ``P * C`` when its planes are packed (``BLOCK_TOKEN_PLANE`` and LBNHC), else
    ``P`` rows of ``C`` (LBHNC).  Reading a request is then one ``index_select`` (or one kernel) over row
    indices computed once per request, instead of block/offset arithmetic and a 2-index gather on the device.
    """

    table: torch.Tensor
    """``[R, W]`` alias of the cache (rows of ``W`` wide elements)."""
    rows_per_token: int
    block_tokens: int
    block_stride: int
    """Rows between consecutive (kernel) blocks."""
    token_stride: int
    """Rows between consecutive tokens of a block."""
    plane_stride: int
    """Rows between planes of a token (0 when ``rows_per_token == 1``)."""
    num_planes: int
    hidden_size: int
    dtype: torch.dtype

    @property
    def identity(self) -> bool:
        """True when a manager slot is its own row index (no index arithmetic at all)."""
        return self.rows_per_token == 1 and self.token_stride == 1 and self.block_stride == self.block_tokens

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Row indices (int64, on ``slots``' device, ``len(slots) * rows_per_token``) of manager ``slots``."""
        n = self.block_tokens
        if self.token_stride * n == self.block_stride:
            tok = slots if self.token_stride == 1 else slots * self.token_stride
        else:
            blk = torch.div(slots, n, rounding_mode="floor")
            tok = blk * self.block_stride + (slots - blk * n) * self.token_stride
        if self.rows_per_token == 1:
            return tok
        planes = torch.arange(self.rows_per_token, dtype=torch.int64, device=slots.device) * self.plane_stride
        return (tok.view(-1, 1) + planes).view(-1)

    def unpack(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[num_tokens * rows_per_token, W]`` gathered rows as ``[num_tokens, P, C]`` in the cache's dtype."""
        out = rows if rows.dtype == self.dtype else rows.view(self.dtype)
        return out.view(num_tokens, self.num_planes, self.hidden_size)

    def out_alias(self, out: torch.Tensor) -> torch.Tensor:
        """A contiguous ``[T, P, C]`` destination in the cache's dtype as the ``[T * rows_per_token, W]`` rows a
        gather of this table writes."""
        flat = out.view(-1, self.num_planes * self.hidden_size // self.rows_per_token)
        return flat if flat.dtype == self.table.dtype else flat.view(self.table.dtype)


_TABLES: dict[int, tuple[weakref.ref[torch.Tensor], CaptureView, RowTable | None]] = {}


def cached_row_table(tensor: torch.Tensor, view: CaptureView) -> RowTable | None:
    """:func:`row_table`, remembered per tensor object and view (the entry goes when the tensor does)."""
    key = id(tensor)
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is tensor and hit[1] == view:
        return hit[2]
    table = row_table(tensor, view)
    _TABLES[key] = (weakref.ref(tensor, lambda _, key=key: _TABLES.pop(key, None)), view, table)  # type: ignore[misc]
    return table


def row_table(tensor: torch.Tensor, view: CaptureView) -> RowTable | None:
    """The :class:`RowTable` of a capture tensor, or None when its hidden axis is not contiguous."""
    p, c, n, nb = view.num_planes, view.hidden_size, view.block_tokens, view.num_blocks
    if c > 1 and int(tensor.stride(3)) != 1:
        return None
    s0 = int(tensor.stride(0)) if nb > 1 else 0
    sn = int(tensor.stride(view.order.token_axis)) if n > 1 else 0
    sp = int(tensor.stride(view.order.plane_axis)) if p > 1 else 0
    packed = p == 1 or sp == c
    width, per_token = (p * c, 1) if packed else (c, p)
    unit = math.gcd(math.gcd(s0, sn), 0 if packed else sp)
    if unit <= 0:
        if s0 or sn or sp or nb * n > 1:
            return None  # broadcast (zero) strides: not a cache
        unit = 1
    if min(s0, sn, sp) < 0:
        return None
    last = (nb - 1) * s0 + (n - 1) * sn + (0 if packed else (p - 1) * sp)
    table = tensor.as_strided((last // unit + 1, width), (unit, 1), tensor.storage_offset())
    block_stride = s0 // unit
    token_stride = sn // unit if n > 1 else block_stride  # one token per block: the block's row
    if nb == 1:
        block_stride = n * token_stride
    return RowTable(
        table=_widest_alias(table),
        rows_per_token=per_token,
        block_tokens=n,
        block_stride=block_stride,
        token_stride=token_stride,
        plane_stride=0 if packed else sp // unit,
        num_planes=p,
        hidden_size=c,
        dtype=tensor.dtype,
    )


# Gathering 2-byte elements one by one runs at ~0.18x of a device copy on an H200; the same bytes moved as
# 16-byte elements run at ~0.82x (benchmarks/bench_gather.py).  Indexing copies bits, so the alias is exact.
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32)


def _widest_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` reinterpreted with the widest element type its hidden axis and strides allow."""
    el = tensor.element_size()
    if tensor.dim() == 0 or tensor.stride(-1) != 1:
        return tensor
    for dt in _WIDE_DTYPES:
        w = torch.empty((), dtype=dt).element_size()
        if w <= el or w % el:
            continue
        k = w // el
        if (
            tensor.shape[-1] % k == 0
            and tensor.storage_offset() % k == 0
            and tensor.data_ptr() % w == 0
            and all(st % k == 0 for st in tensor.stride()[:-1])
        ):
            return tensor.view(dt)
    return tensor


@dataclass(frozen=True)
class ChunkPlan:
    """A :class:`RowTable` cut into chunks of whole blocks, for reads of a few manager blocks.

    A chunk is one kernel block's ``N`` token rows of one plane (per-plane tables) or of all planes (packed), or,
    where a manager block's rows are one contiguous run, the whole manager block.  A request's tokens are whole
    blocks but for the first and last, so a read gathers ``k`` manager blocks' chunks (``k * len(offsets)``
    indices instead of ``tokens * rows_per_token``, computed on the host without tensor operations) and drops the
    rows before ``start`` and past the end.  Chunk ``i`` of manager block ``m`` is ``m * per_block + offsets[i]``.
    """

    chunks: torch.Tensor
    """``[num_chunks, chunk_rows * W]`` alias of the row table."""
    per_block: int
    offsets: tuple[int, ...]
    group_block_size: int
    kernel_split: int
    block_tokens: int
    rows_per_token: int
    width: int
    """``W``: wide elements per row."""

    @property
    def whole_blocks(self) -> bool:
        """True when a manager block is one chunk whose index is the block id itself."""
        return self.per_block == 1 and self.offsets == (0,)

    def indices(self, used: Sequence[int]) -> list[int]:
        """Chunk indices of manager blocks ``used``, in token order (block, kernel block, plane)."""
        if self.whole_blocks:
            return list(used)
        pb, offs = self.per_block, self.offsets
        return [m * pb + o for m in used for o in offs]

    def fill(self, used: Sequence[int], out: torch.Tensor, words: Any = None, *, python_max: int = 512) -> None:
        """Store the chunk indices of ``used`` into ``out`` (int64, CPU, exactly that many elements): with one
        slice assignment into ``words`` (a ``ctypes`` array over ``out``'s memory) when given and the count is at
        most ``python_max`` (any count for whole blocks), else with two tensor operations."""
        count = int(out.numel())
        if words is not None and (self.whole_blocks or count <= python_max):
            words[:count] = self.indices(used)
            return
        ids = torch.tensor(list(used), dtype=torch.int64).view(-1, 1)
        offsets = torch.tensor(self.offsets, dtype=torch.int64)
        torch.add(ids * self.per_block, offsets, out=out.view(len(used), len(self.offsets)))

    def copy_into(
        self, idx: torch.Tensor, k: int, head: int, num_tokens: int, out: torch.Tensor, *, non_blocking: bool = False
    ) -> None:
        """Gather the chunks ``idx`` (on the table's device; :meth:`indices` of ``k`` manager blocks) and copy the
        rows of tokens ``[head, head + num_tokens)`` of them into ``out`` (contiguous ``[num_tokens, P, C]`` in the
        cache's dtype: pinned host or device memory)."""
        stage = torch.index_select(self.chunks, 0, idx)
        if self.rows_per_token == 1:  # rows in token order: a slice of them, one copy
            w = self.width
            dst = out.view(num_tokens, -1)
            dst = dst if dst.dtype == self.chunks.dtype else dst.view(self.chunks.dtype)
            dst.copy_(stage.view(-1, w)[head : head + num_tokens], non_blocking=non_blocking)
            return
        src = self.arrange(stage, k, head, num_tokens)
        dst = out.view(num_tokens * self.rows_per_token, -1)
        dst = dst if dst.dtype == self.chunks.dtype else dst.view(self.chunks.dtype)
        dst.view(src.shape).copy_(src, non_blocking=non_blocking)

    def arrange(self, stage: torch.Tensor, k: int, head: int, num_tokens: int) -> torch.Tensor:
        """Gathered chunks ``stage`` of ``k`` manager blocks as the rows of tokens ``[head, head + num_tokens)``
        of them: ``[num_tokens, rows_per_token, W]`` (a view where the rows allow it, else a device copy)."""
        per, w, n = self.rows_per_token, self.width, self.block_tokens
        if per == 1:
            return stage.view(k * self.group_block_size, 1, w)[head : head + num_tokens]
        rows = stage.view(k * self.kernel_split, per, n, w).transpose(1, 2)  # [kernel blocks, N, planes, W]
        if head == 0 and num_tokens == k * self.group_block_size:
            return rows  # same elements in token order: the copy to the destination arranges them
        return rows.reshape(k * self.group_block_size, per, w)[head : head + num_tokens]


def chunk_plan(table: RowTable, view: CaptureView) -> ChunkPlan | None:
    """The :class:`ChunkPlan` of ``table``, or None where its tokens are not runs of whole rows per block."""
    n, per, r = table.block_tokens, table.rows_per_token, view.kernel_split
    t = table.table
    if t.dim() != 2 or t.stride(1) != 1 or t.stride(0) != t.shape[1]:
        return None  # rows are not back to back
    if table.token_stride != 1 or table.block_stride % n or (per > 1 and table.plane_stride % n):
        return None
    width = int(t.shape[1])
    offsets: tuple[int, ...]
    if table.block_stride == per * n and (per == 1 or table.plane_stride == n):
        # A manager block (its r kernel blocks, all planes) is one run of r * per * n rows at m * r * per * n.
        rows = r * per * n
        per_block, offsets = 1, (0,)
    else:
        rows = n
        per_block = r * table.block_stride // n
        offsets = tuple((j * table.block_stride + p * table.plane_stride) // n for j in range(r) for p in range(per))
    count = int(t.shape[0]) // rows
    if count == 0:
        return None
    return ChunkPlan(
        chunks=t[: count * rows].view(count, rows * width),
        per_block=per_block,
        offsets=offsets,
        group_block_size=view.group_block_size,
        kernel_split=r,
        block_tokens=n,
        rows_per_token=per,
        width=width,
    )
