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

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TransferError
from .layout import CaptureView, gather_rows
from .slots import request_slots

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


@dataclass
class PendingRows:
    """Rows being copied; ``rows`` is valid once :meth:`done` is True (or after :meth:`wait`)."""

    rows: torch.Tensor
    event: Any = None
    _keepalive: tuple[torch.Tensor, ...] = field(default=(), repr=False)

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
    if tuple(out.shape) != shape or out.dtype != dtype:
        raise TransferError(
            f"destination has shape {list(out.shape)} dtype {out.dtype}; expected {list(shape)} {dtype} "
            "([tokens, planes, hidden] in the capture cache's dtype)"
        )


def copy_rows_async(
    cache: torch.Tensor,
    view: CaptureView,
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    stream: Any = None,
    after: Any = None,
) -> PendingRows:
    """Copy the rows at ``slots`` (CPU int64, validated) into ``out`` (default: a new host tensor).

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
            return PendingRows(rows)
        out.copy_(rows)
        return PendingRows(out)
    side = stream if stream is not None else side_stream(cache.device)
    if not slots.is_pinned():
        # A copy from pageable memory would block this (the engine's) thread until the side stream -- and
        # through the event below, the compute stream -- reached it.
        slots = slots.pin_memory()
    written = after
    if written is None:
        written = _cuda.Event()
        written.record(torch.cuda.current_stream(cache.device))
    with torch.cuda.stream(side):
        side.wait_event(written)
        # Rule 2: the index tensor is born on the side stream and lives until the copy is done.
        idx = slots.to(cache.device, non_blocking=True)
        rows = gather_rows(cache, view, idx)
        if out is None:
            out = torch.empty(shape, dtype=cache.dtype, pin_memory=True)
        out.copy_(rows, non_blocking=True)
        finished = _cuda.Event()
        finished.record(side)
    return PendingRows(out, finished, (idx, rows, slots))


class RowReader:
    """Reads requests' rows out of one capture cache, ordered after the cache's last write.

    The connector calls :meth:`mark_written` right after vLLM writes the capture layer (``save_kv_layer``, on
    the stream that wrote), and :meth:`read` later (a following step), from whatever stream is current then:
    the side-stream copy waits for the marked write, not for the work queued on the current stream -- which
    may be another stream than the writer's, and would also make the copy wait for this step's forward.
    """

    def __init__(self, cache: torch.Tensor, view: CaptureView) -> None:
        self.cache = cache
        self.view = view
        self._written: Any = None

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
        slots = request_slots(req_id, block_ids, self.view, num_tokens=num_tokens, start=start)
        return copy_rows_async(self.cache, self.view, slots, out=out, after=self._written)
