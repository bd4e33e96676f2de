"""Copy a request's rows out of the capture cache without stalling the engine's compute stream.

On CUDA the copy runs on a side stream.  Three ordering rules make it safe (each one broke a connector in
the field):

1. the side stream waits on an event recorded on the compute stream *after* the hidden states were
   written, so it never reads rows the drafter has not written yet;
2. every index tensor used on the side stream is created on the side stream (never on the compute
   stream, whose caching allocator could hand the memory to another tensor while the side stream still
   reads it), and is kept alive by the returned :class:`PendingRows` until the copy is complete;
3. the caller must not free or reuse the request's blocks before :meth:`PendingRows.done` (hold them, e.g.
   by returning True from ``request_finished``).

On CPU the copy is synchronous and the handle is complete at once.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import envs
from ..errors import SlotError, TransferError
from .finite import token_flags
from .layout import (
    CaptureView,
    ChunkPlan,
    RowTable,
    _triton_rows,
    cached_row_table,
    chunk_plan,
    gather_rows,
    gather_slots,
    kernel_gather_into,
    row_table,
)
from .pinned import PinnedArena
from .slots import batch_slots, check_blocks, request_slots

_cuda: Any = torch.cuda  # torch.cuda.Stream / Event are untyped
_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> Any:
    """One side stream per CUDA device, shared by all copies of this process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _cuda.Stream(device=index)
            _streams[index] = stream
        return stream


def host_waited_event() -> Any:
    """A CUDA event a host thread waits for (``synchronize``): made with blocking sync, so the waiting thread
    sleeps in the driver until the GPU reaches it instead of spinning a core beside the engine's threads (CUDA's
    default on a host with more cores than contexts is to spin; a copies' thread spun 5.2 CPU-seconds of an 8B
    run that way).  Events only streams wait for (``wait_event``) need no host wake-up and stay plain."""
    return _cuda.Event(blocking=True)


def pinned_host_stats() -> dict[str, float] | None:
    """What torch's pinned host allocator did in this process (every user of it: the reads here and vLLM's own):
    blocks created (``cudaHostAlloc`` calls), the milliseconds spent in them, the most bytes it held and the
    most bytes handed out at once.  None without CUDA or on a torch that does not count them."""
    stats_of = getattr(torch.cuda, "host_memory_stats", None)
    if stats_of is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    s = stats_of()
    return {
        "allocs": float(s.get("num_host_alloc", 0)),
        "alloc_ms": float(s.get("host_alloc_time.total", 0)) / 1e3,
        "alloc_max_ms": float(s.get("host_alloc_time.max", 0)) / 1e3,
        "held_gib_peak": float(s.get("allocated_bytes.peak", 0)) / 2**30,
        "active_gib_peak": float(s.get("active_bytes.peak", 0)) / 2**30,
    }


@dataclass
class PendingRows:
    """Rows being copied; ``rows`` is valid once :meth:`done` is True (or after :meth:`wait`).

    ``finite``: ``[T]`` bool on the host, True where token row ``t`` holds no NaN/Inf
    (:func:`~vllm_hs_compat.core.finite.token_flags`), computed where the rows were read (on CUDA beside the copy,
    valid with the rows; on CPU with the synchronous gather); None where the read has no device pass to fold it
    into (the direct kernel path): the reader checks the host rows then."""

    rows: torch.Tensor
    event: Any = None
    _keepalive: tuple[torch.Tensor, ...] = field(default=(), repr=False)
    finite: torch.Tensor | None = None

    def done(self) -> bool:
        if self.event is None or self.event.query():
            self._keepalive = ()
            return True
        return False

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        self._keepalive = ()
        return self.rows


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise TransferError(
            f"destination has shape {list(out.shape)} dtype {out.dtype} contiguous={out.is_contiguous()}; "
            f"expected {list(shape)} {dtype} contiguous ([tokens, planes, hidden] in the capture cache's dtype)"
        )


#: Largest device staging buffer of one gather (bytes): a big step is gathered and copied in chunks of this size,
#: so the read never holds more than this much extra device memory.
STAGE_BYTES = 256 << 20

#: How rows reach host memory on CUDA: ``staged`` (gather into a device buffer, then one D2H copy per chunk) or
#: ``direct`` (a Triton kernel gathers straight into the pinned host destination; falls back to ``staged`` where
#: Triton is missing).
CAPTURE_PATHS = ("staged", "direct")
#: Keys of ``kv_connector_extra_config["read"]`` (the fields of :class:`ReadOptions`).
READ_KEYS = ("path", "lone_reads", "lone_chunks")


def _default_path() -> str:
    path = envs.get(envs.CAPTURE_PATH)
    if path not in CAPTURE_PATHS:
        raise TransferError(f"{envs.CAPTURE_PATH}={path!r}; expected one of {list(CAPTURE_PATHS)}")
    return path


@dataclass(frozen=True)
class ReadOptions:
    """How the worker reads rows to host, chosen once per reader (never frozen at import).

    ``path``: :data:`CAPTURE_PATHS`.  ``lone_reads``: a request read alone gathers whole blocks
    (:class:`LoneReads`; False: the per-token path).  ``lone_chunks``: per-plane (LBHNC) lone reads gather
    whole-block chunks with ``index_select`` (False: the Triton row kernel).  Defaults come from the environment
    (:mod:`vllm_hs_compat.envs`); a deployment sets them in ``kv_connector_extra_config["read"]``."""

    path: str = "staged"
    lone_reads: bool = True
    lone_chunks: bool = True

    def __post_init__(self) -> None:
        if self.path not in CAPTURE_PATHS:
            raise TransferError(f"read path {self.path!r}; expected one of {list(CAPTURE_PATHS)}")

    @classmethod
    def from_env(cls) -> ReadOptions:
        """The defaults as the environment sets them now (``VLLM_HS_COMPAT_CAPTURE_PATH``, ``_LONE_READ``,
        ``_LONE_CHUNKS``)."""
        return cls(path=_default_path(), lone_reads=envs.flag(envs.LONE_READ), lone_chunks=envs.flag(envs.LONE_CHUNKS))

    @classmethod
    def parse(cls, raw: Any, what: str) -> ReadOptions:
        """Options from a config map over :meth:`from_env`; unknown keys and wrong types raise
        :class:`~vllm_hs_compat.errors.TransferError` naming ``what``."""
        base = cls.from_env()
        if raw is None:
            return base
        if not isinstance(raw, Mapping):
            raise TransferError(f"{what} must be a JSON object with keys {list(READ_KEYS)}, found {raw!r}")
        unknown = sorted(str(k) for k in raw if k not in READ_KEYS)
        if unknown:
            raise TransferError(f"{what} has unknown keys {unknown}; expected any of {list(READ_KEYS)}")
        path = raw.get("path", base.path)
        if path not in CAPTURE_PATHS:
            raise TransferError(f"{what}.path must be one of {list(CAPTURE_PATHS)}, found {path!r}")
        flags = {}
        for key in ("lone_reads", "lone_chunks"):
            value = raw.get(key, getattr(base, key))
            if not isinstance(value, bool):
                raise TransferError(f"{what}.{key} must be true or false, found {value!r}")
            flags[key] = value
        return cls(path=str(path), **flags)


class PinnedIndexPool:
    """Pinned host buffers for row indices, reused across reads.

    A buffer goes back to the pool with the completion event of the read that uploads from it; it is handed out
    again only once that event completed -- the upload of a read still waiting on the side stream (behind the
    compute stream) must not see the next read's indices.  Busy buffers are never waited for: a new one is
    allocated instead, so the engine thread never blocks here.
    """

    def __init__(self, max_buffers: int = 8) -> None:
        self.max_buffers = max_buffers
        self._free: list[tuple[torch.Tensor, Any]] = []
        self._words: dict[tuple[int, int], Any] = {}
        self.allocated = 0

    @staticmethod
    def _ready(event: Any) -> bool:
        return event is None or bool(event.query())

    def take(self, numel: int) -> torch.Tensor:
        """A pinned int64 buffer of at least ``numel`` elements that no queued upload still reads."""
        for i, (buf, event) in enumerate(self._free):
            if buf.numel() >= numel and self._ready(event):
                del self._free[i]
                return buf
        self.allocated += 1
        return torch.empty(max(4096, 1 << max(0, numel - 1).bit_length()), dtype=torch.int64, pin_memory=True)

    def words(self, buf: torch.Tensor) -> Any:
        """A ``ctypes`` int64 array over a buffer of this pool: Python ints are stored into the pinned memory with
        one slice assignment, no tensor operation."""
        key = (buf.data_ptr(), buf.numel())
        arr = self._words.get(key)
        if arr is None:
            arr = self._words[key] = (ctypes.c_int64 * buf.numel()).from_address(buf.data_ptr())
        return arr

    def give(self, buf: torch.Tensor, uploaded: Any) -> None:
        """Return ``buf``; ``uploaded`` is an event recorded (on the side stream) after the copy that reads it."""
        self._free.append((buf, uploaded))
        if len(self._free) > self.max_buffers:
            self._free.sort(key=lambda item: item[0].numel())
            dropped = self._free.pop(0)[0]
            self._words.pop((dropped.data_ptr(), dropped.numel()), None)


def _gather_to_host(
    cache: torch.Tensor,
    table: RowTable,
    slots: torch.Tensor,
    out: torch.Tensor,
    *,
    side: Any,
    written: Any,
    pool: PinnedIndexPool | None,
    path: str,
) -> tuple[Any, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """Queue the copy of the rows of manager ``slots`` (int64, CPU) into the pinned host ``out`` on ``side`` after
    ``written``; returns the completion event, the tensors to keep alive until it completes, and the per-token
    finite flags (pinned host, valid with the rows: the direct kernel computes them as it moves the rows, a staged
    read over each stage on the device; None where the kernel has no bit test for the rows' dtype)."""
    t = int(slots.numel())
    flags: torch.Tensor | None = None
    buf = None
    if pool is not None:
        buf = pool.take(t)
        host_idx = buf[:t]
        host_idx.copy_(slots)
    else:
        host_idx = slots if slots.is_pinned() else slots.pin_memory()
    dst = table.out_alias(out)
    per = table.rows_per_token
    with torch.cuda.stream(side):
        _wait(side, written)
        # Rule 2: the index tensor is born on the side stream and lives until the copy is done.
        idx = host_idx.to(cache.device, non_blocking=True)
        direct = False
        if path == "direct":
            direct, flags = _direct_gather(table, idx, dst)
        if not direct:
            row_bytes = int(dst.shape[1]) * dst.element_size() * per
            step = max(1, STAGE_BYTES // max(1, row_bytes))
            # NaN/Inf per token, one masked reduction over each staged chunk while it is on the device (born on
            # the side stream like the stage); the flags reach the host with the rows, under the same event
            on_device = torch.empty(t, dtype=torch.bool, device=cache.device)
            for lo in range(0, t, step):
                whole = t <= step
                # Born on the side stream and freed there: the allocator reuses it only after this copy.  The
                # copy to host dominates, so packed tables take index_select (its launch costs the engine thread
                # less than the Triton kernel's); per-plane tables take the kernel (no index kernels before it).
                chunk = idx if whole else idx[lo : lo + step]
                stage = gather_slots(table, chunk, kernel_min_bytes=1 << 62)
                k = int(chunk.numel())
                on_device[lo : lo + k] = token_flags(stage.view(table.dtype).view(k, -1))
                (dst if whole else dst[lo * per : (lo + step) * per]).copy_(stage, non_blocking=True)
            flags = torch.empty(t, dtype=torch.bool, pin_memory=True)
            flags.copy_(on_device, non_blocking=True)
        finished = host_waited_event()
        finished.record(side)
    if buf is not None and pool is not None:
        pool.give(buf, finished)  # reusable once this read completed (its upload long before)
    return finished, (idx, host_idx), flags


def _wait(side: Any, written: Any) -> None:
    """Make ``side`` wait for ``written``: an event, or a stream (everything queued on it so far)."""
    if isinstance(written, _cuda.Event):
        side.wait_event(written)
    else:
        side.wait_stream(written)


def _direct_gather(table: RowTable, idx: torch.Tensor, dst: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """Gather straight into ``dst`` (pinned host) with the Triton row kernel, which flags each token's NaN/Inf as it
    moves the rows: (launched, the flags -- pinned host, valid with the rows; None where the kernel has no bit test
    for the rows' dtype and the host checks them)."""
    kernel = _triton_rows()
    if not kernel:
        return False, None
    flags = torch.ones(int(idx.numel()), dtype=torch.bool, pin_memory=True)
    if kernel_gather_into(kernel, table, idx, dst, flags):
        return True, flags
    return kernel_gather_into(kernel, table, idx, dst), None


def copy_rows_async(
    cache: torch.Tensor,
    view: CaptureView,
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    stream: Any = None,
    after: Any = None,
    pool: PinnedIndexPool | None = None,
    path: str | None = None,
    table: RowTable | None = None,
    arena: PinnedArena | None = None,
) -> PendingRows:
    """Copy the rows at ``slots`` (CPU int64, validated) into ``out`` (default: a piece of ``arena`` where it has
    room, else a new pinned host tensor).

    The side stream waits for ``after`` (a CUDA event recorded right after the last write of the rows, on
    the stream that wrote them) or, without it, for everything queued so far on the current stream: call it
    on the compute stream once the hidden states were written.  Returns at once on CUDA.
    """
    shape = (int(slots.numel()), view.num_planes, view.hidden_size)
    if out is not None:
        _check_out(out, shape, cache.dtype)
    if cache.device.type != "cuda":
        rows = gather_rows(cache, view, slots.to(cache.device))
        if out is None:
            return PendingRows(rows, finite=token_flags(rows))
        out.copy_(rows)
        return PendingRows(out, finite=token_flags(out))
    if table is None:
        table = row_table(cache, view)
    if out is None and arena is not None:
        out = arena.take(shape, cache.dtype)
    if out is None:
        out = torch.empty(shape, dtype=cache.dtype, pin_memory=True)
    side = stream if stream is not None else side_stream(cache.device)
    written = after
    if written is None:
        written = torch.cuda.current_stream(cache.device)
    if table is None or not out.is_pinned():
        return _copy_indexed(cache, view, slots, out, side, written)
    event, keep, flags = _gather_to_host(
        cache, table, slots, out, side=side, written=written, pool=pool, path=path or _default_path()
    )
    return PendingRows(out, event, (*keep, out), finite=flags)


def _copy_indexed(
    cache: torch.Tensor, view: CaptureView, slots: torch.Tensor, out: torch.Tensor, side: Any, written: Any
) -> PendingRows:
    """The general path (views without a row table, pageable destinations)."""
    if not slots.is_pinned():
        # A copy from pageable memory would block this (the engine's) thread until the side stream -- and
        # through the event below, the compute stream -- reached it.
        slots = slots.pin_memory()
    with torch.cuda.stream(side):
        _wait(side, written)
        # Rule 2: the index tensor is born on the side stream and lives until the copy is done.
        idx = slots.to(cache.device, non_blocking=True)
        rows = gather_rows(cache, view, idx)
        out.copy_(rows, non_blocking=True)
        flags = torch.empty(int(slots.numel()), dtype=torch.bool, pin_memory=True)
        flags.copy_(token_flags(rows.contiguous()), non_blocking=True)
        finished = host_waited_event()
        finished.record(side)
    return PendingRows(out, finished, (idx, rows, slots), finite=flags)


#: One request's token range: ``(req_id, block_ids, start, num_tokens)``.
RowRequest = tuple[str, Sequence[int], int, int]


def copy_requests_async(
    cache: torch.Tensor,
    view: CaptureView,
    requests: Sequence[RowRequest],
    *,
    stream: Any = None,
    after: Any = None,
    pool: PinnedIndexPool | None = None,
    path: str | None = None,
    table: RowTable | None = None,
    arena: PinnedArena | None = None,
) -> list[PendingRows | SlotError]:
    """Copy many requests' rows to host with one index upload and one gather (per chunk) for all of them.

    Per request: a :class:`PendingRows` whose ``rows`` is a view of one host tensor shared by the batch (pinned on
    CUDA; all complete together), or the :class:`~vllm_hs_compat.errors.SlotError` its block ids raised (that request
    alone is left out).  Ordering as :func:`copy_rows_async`.
    """
    slots, where = batch_slots(
        requests, group_block_size=view.group_block_size, num_manager_blocks=view.num_manager_blocks
    )
    total = int(slots.numel())
    pending = None
    if cache.device.type == "cuda" and total:
        pending = copy_rows_async(
            cache, view, slots, stream=stream, after=after, pool=pool, path=path, table=table, arena=arena
        )
    elif total:  # CPU: synchronous, one gather (one allocation) for the whole batch, and its NaN/Inf flags: here,
        # in the engine's thread and its thread pool, not in the publisher's (a torch op there starts a second
        # OpenMP team that competes with the engine's threads: measured 2.2x slower capture on 2 cores)
        rows = gather_rows(cache, view, slots)
        pending = PendingRows(rows, finite=token_flags(rows))
    result: list[PendingRows | SlotError] = []
    for (_, _, _, num_tokens), at in zip(requests, where, strict=True):
        if isinstance(at, SlotError):
            result.append(at)
        elif pending is not None:
            # A view of the batch's host tensor (pinned on CUDA): the memory goes with the last view.
            finite = None if pending.finite is None else pending.finite[at : at + num_tokens]
            result.append(PendingRows(pending.rows[at : at + num_tokens], pending.event, pending._keepalive, finite))
        else:  # nothing to read at all (zero-token ranges)
            result.append(PendingRows(torch.empty((0, view.num_planes, view.hidden_size), dtype=cache.dtype)))
    return result


#: Chunk indices of a lone read computed in Python up to this many (above it, a few tensor operations).
_PY_INDEX_MAX = 512
#: A lone read gathers whole blocks while the rows it drops (before ``start``, past the end) stay within this many
#: bytes or half the rows it keeps; else it takes the per-token path.
_OVERREAD_BYTES = 4 << 20
#: Per-plane (LBHNC) lone reads gather whole-block chunks with ``index_select`` (then one transposing copy) instead
#: of the Triton row kernel, expected to cost the host less than its launch (``benchmarks/probe_lone_read.py`` times
#: both; ``ReadOptions.lone_chunks``).  The whole-block lone read (:class:`LoneReads`) is on by default (tests/gpu
#: races and figures ran on an H200, docs/benchmarks.md); ``ReadOptions.lone_reads`` False takes the general path.


class LoneReads:
    """The lone-request read (one request issued alone, :meth:`RowReader.read`, ``api.copy_request_async``) with
    as little host work as the ordering rules allow.

    The request's manager blocks are gathered whole (:class:`~vllm_hs_compat.core.layout.ChunkPlan`): their chunk
    indices -- the block ids themselves for packed caches -- are stored straight into a reused pinned buffer from
    Python, uploaded on the side stream after the wait on the written event, gathered with one ``index_select``
    and copied to host from the rows of the range.  The side stream is made current with ``torch.cuda.set_stream``
    (no stream context object) and the completion event is the one handed back.  Reads this plan does not fit
    (no chunk plan, a pageable destination, a stage over :data:`STAGE_BYTES`, many rows dropped, another device
    current) return None: the caller takes the general path.  Thread-safe (the pinned pool is locked).
    """

    def __init__(self, table: RowTable, view: CaptureView, device: torch.device, *, chunks: bool = True) -> None:
        self.view = view
        self.plan: ChunkPlan | None = chunk_plan(table, view)
        if self.plan is not None and self.plan.rows_per_token > 1 and not chunks:
            self.plan = None
        self.device = device
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.pool = PinnedIndexPool()
        self.side: Any = side_stream(device)
        self.shape_tail = (view.num_planes, view.hidden_size)
        self.token_bytes = view.num_planes * view.hidden_size * view.dtype.itemsize
        self._lock = threading.Lock()
        self._marks = threading.local()  # per thread: an event recorded on the current stream ("written so far")

    def read(
        self,
        req_id: str,
        block_ids: Sequence[int],
        start: int,
        num_tokens: int,
        out: torch.Tensor | None,
        after: Any,
    ) -> PendingRows | None:
        """Queue the copy of tokens ``[start, start + num_tokens)`` of ``req_id`` to host after ``after`` (an event
        or a stream; None: the current stream); None where the caller must take the general path."""
        plan = self.plan
        if plan is None or num_tokens <= 0:
            return None
        view = self.view
        bs = view.group_block_size
        first, need = check_blocks(
            req_id,
            block_ids,
            group_block_size=bs,
            num_tokens=num_tokens,
            start=start,
            num_manager_blocks=view.num_manager_blocks,
        )
        k = need - first
        staged = k * bs * self.token_bytes
        dropped = staged - num_tokens * self.token_bytes
        if staged > STAGE_BYTES or dropped > max(_OVERREAD_BYTES, num_tokens * self.token_bytes // 2):
            return None
        if out is not None:
            _check_out(out, (num_tokens, *self.shape_tail), view.dtype)
            if not out.is_pinned():
                return None
        cur = _current_stream(self.device_index)
        if cur is None:
            return None  # set_stream would change the current device: the general path uses a stream context
        used = block_ids[first:need]
        count = k * len(plan.offsets)
        with self._lock:
            buf = self.pool.take(count)
            words = self.pool.words(buf)
        host_idx = buf[:count]
        plan.fill(used, host_idx, words, python_max=_PY_INDEX_MAX)
        if out is None:
            out = torch.empty((num_tokens, *self.shape_tail), dtype=view.dtype, pin_memory=True)
        written = after
        if written is None:
            written = getattr(self._marks, "event", None)
            if written is None:
                written = self._marks.event = _cuda.Event()
            written.record(cur)
        side = self.side
        torch.cuda.set_stream(side)
        try:
            # Rule 1: after the written event.  Rule 2: the index tensor is born on the side stream, from a
            # pinned buffer no queued upload still reads, and is kept alive with the result.
            _wait(side, written)
            idx = host_idx.to(self.device, non_blocking=True)
            plan.copy_into(idx, k, start - first * bs, num_tokens, out, non_blocking=True)
            finished = host_waited_event()
            finished.record(side)
        finally:
            torch.cuda.set_stream(cur)
        with self._lock:
            self.pool.give(buf, finished)
        return PendingRows(out, finished, (idx, host_idx, out))


_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device: Any = getattr(torch._C, "_cuda_getDevice", None)
#: per device index: (raw handle, torch Stream) of the stream last seen current there
_current: dict[int, tuple[int, Any]] = {}


def _current_stream(device_index: int) -> Any:
    """The current stream if the current device is ``device_index``, else None.  ``torch.cuda.current_stream()``
    makes a new Python object each call (~7 us on the H200's host); the stream object made for a raw handle is
    kept and handed out again while that handle is current (the current stream is per thread: the handle is
    compared on every call)."""
    if _raw_stream is None or _get_device is None:  # pragma: no cover - torch without these bindings
        cur = torch.cuda.current_stream()
        return cur if cur.device_index == device_index else None
    if _get_device() != device_index:
        return None
    raw = _raw_stream(device_index)
    hit = _current.get(device_index)
    if hit is not None and hit[0] == raw:
        return hit[1]
    cur = torch.cuda.current_stream(device_index)
    _current[device_index] = (raw, cur)
    return cur


_LONE: dict[tuple[int, ReadOptions | None], tuple[Any, CaptureView, LoneReads | None]] = {}
_LONE_LOCK = threading.Lock()


def lone_reads(cache: torch.Tensor, view: CaptureView, options: ReadOptions | None = None) -> LoneReads | None:
    """The :class:`LoneReads` of a CUDA capture tensor, made once per tensor object, view and ``options`` (the entry
    goes when the tensor does); None on CPU, where the tensor has no row table, or where the options turn the lone
    read off.  ``options`` None: :meth:`ReadOptions.from_env`, read when the entry is made (once per capture
    tensor, not per read: the lone read is the hot path)."""
    if cache.device.type != "cuda":
        return None
    key = (id(cache), options)
    hit = _LONE.get(key)
    if hit is not None and hit[0]() is cache and (hit[1] is view or hit[1] == view):
        return hit[2]
    opts = options if options is not None else ReadOptions.from_env()
    table = cached_row_table(cache, view)
    lone = LoneReads(table, view, cache.device, chunks=opts.lone_chunks) if table is not None else None
    if not opts.lone_reads:
        lone = None
    with _LONE_LOCK:
        _LONE[key] = (weakref.ref(cache, lambda _, key=key: _LONE.pop(key, None)), view, lone)  # type: ignore[misc]
    return lone


def read_request_async(
    cache: torch.Tensor,
    view: CaptureView,
    req_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    *,
    start: int = 0,
    out: torch.Tensor | None = None,
    options: ReadOptions | None = None,
) -> PendingRows:
    """One request's rows to host (``api.copy_request_async``): the :class:`LoneReads` path where it fits, else
    :func:`copy_rows_async` of its slots.  Ordered after everything queued so far on the current stream.
    ``options``: its lone-read switches (the path is always staged here); None: the environment's, read once per
    capture tensor (:func:`lone_reads`)."""
    lone = lone_reads(cache, view, options)
    if lone is not None:
        pending = lone.read(req_id, block_ids, start, num_tokens, out, None)
        if pending is not None:
            return pending
    slots = request_slots(req_id, block_ids, view, num_tokens=num_tokens, start=start)
    table = cached_row_table(cache, view) if cache.device.type == "cuda" else None
    return copy_rows_async(cache, view, slots, out=out, table=table)


class RowReader:
    """Reads requests' rows out of one capture cache, ordered after the cache's last write.

    The connector calls :meth:`mark_written` right after vLLM writes the capture layer (``save_kv_layer``, on
    the stream that wrote), and :meth:`read` / :meth:`read_many` later (a following step), from whatever stream
    is current then: the side-stream copy waits for the marked write, not for the work queued on the current
    stream -- which may be another stream than the writer's, and would also make the copy wait for this step's
    forward.
    """

    def __init__(
        self, cache: torch.Tensor, view: CaptureView, *, path: str | None = None, options: ReadOptions | None = None
    ) -> None:
        """``options``: default :meth:`ReadOptions.from_env`, read now; ``path`` overrides its ``path``."""
        opts = options if options is not None else ReadOptions.from_env()
        if path is not None:
            opts = dataclasses.replace(opts, path=path)
        self.options = opts
        self.cache = cache
        self.view = view
        self.path = opts.path
        self._written: Any = None
        self.pool = PinnedIndexPool()
        #: Pinned host memory the batched reads take their destinations from (None: torch's pinned allocator);
        #: the connector's worker sets it when it starts (:class:`~vllm_hs_compat.core.pinned.PinnedArena`).
        self.arena: PinnedArena | None = None
        self.table = row_table(cache, view) if cache.device.type == "cuda" else None
        self.lone = (
            LoneReads(self.table, view, cache.device, chunks=opts.lone_chunks) if self.table is not None else None
        )

    def mark_written(self) -> None:
        """Record the point after the latest capture write on the current (writing) stream (CUDA only)."""
        if self.cache.device.type == "cuda":
            event = _cuda.Event()
            event.record(torch.cuda.current_stream(self.cache.device))
            self._written = event

    def read(
        self,
        req_id: str,
        block_ids: Sequence[int],
        *,
        start: int,
        num_tokens: int,
        out: torch.Tensor | None = None,
    ) -> PendingRows:
        """Copy positions ``[start, start + num_tokens)`` of ``req_id`` to host; raises the named
        :class:`~vllm_hs_compat.errors.SlotError` when its blocks cannot address them."""
        if self.lone is not None and self.options.lone_reads and self.path == "staged":
            pending = self.lone.read(req_id, block_ids, start, num_tokens, out, self._written)
            if pending is not None:
                return pending
        slots = request_slots(req_id, block_ids, self.view, num_tokens=num_tokens, start=start)
        return copy_rows_async(
            self.cache,
            self.view,
            slots,
            out=out,
            after=self._written,
            pool=self.pool,
            path=self.path,
            table=self.table,
        )

    def read_many(self, requests: Sequence[RowRequest]) -> list[PendingRows | SlotError]:
        """:func:`copy_requests_async` of ``requests`` (one step's finished records) after the marked write."""
        return copy_requests_async(
            self.cache,
            self.view,
            requests,
            after=self._written,
            pool=self.pool,
            path=self.path,
            table=self.table,
            arena=self.arena,
        )
