"""``PinnedArena``: pieces of one slab handed out in ring order, each back when its memory is referenced no more.

On this CPU-only host the slab is ordinary memory (``pin=False``); the pinning itself, and reads into the pieces,
run on a GPU (tests/gpu/test_row_reader.py)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from vllm_hs_compat.core.pinned import ALIGN, PinnedArena
from vllm_hs_compat.errors import TransferError

MIB = 1 << 20


def offset(arena: PinnedArena, t: torch.Tensor) -> int:
    return t.data_ptr() - arena.slab.data_ptr()


def test_pieces_are_disjoint_aligned_views_of_the_slab_in_ring_order() -> None:
    arena = PinnedArena(8 * MIB, pin=False)
    a = arena.take((1000, 4, 3), torch.bfloat16)
    b = arena.take((10,), torch.float32)
    c = arena.take((MIB,), torch.uint8)
    assert a is not None and b is not None and c is not None
    assert a.shape == (1000, 4, 3) and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert [offset(arena, t) for t in (a, b, c)] == [0, 24576, 24576 + ALIGN]  # 24,000 bytes -> 6 pages
    a.fill_(1.5)
    b.fill_(-2.0)
    c.fill_(7)
    assert bool((a == 1.5).all()) and bool((b == -2.0).all()) and bool((c == 7).all())  # no piece wrote another's
    assert arena.live_bytes == 24576 + ALIGN + MIB


def test_a_piece_goes_back_with_its_last_view_and_the_ring_wraps_into_freed_room() -> None:
    arena = PinnedArena(4 * MIB, pin=False)
    first = arena.take((MIB,), torch.uint8)
    second = arena.take((2 * MIB,), torch.uint8)
    assert first is not None and second is not None
    view = first.view(torch.int16)[10:20]  # a record's rows: a view of its step's piece
    del first
    assert arena.live_bytes == 3 * MIB  # the view keeps the piece
    assert arena.take((2 * MIB,), torch.uint8) is None  # control: 1 MiB left at the head, the start still held
    assert arena.stats["misses"] == 1
    del view
    gc.collect()
    assert arena.live_bytes == 2 * MIB
    at_head = arena.take((MIB,), torch.uint8)  # ring order: the head's room first, not the freed start
    assert at_head is not None and offset(arena, at_head) == 3 * MIB
    wrapped = arena.take((MIB,), torch.uint8)  # no room left at the head: wraps to the freed start
    assert wrapped is not None and offset(arena, wrapped) == 0
    assert arena.take((1,), torch.uint8) is None  # full


def test_a_request_larger_than_the_slab_is_refused_and_counted() -> None:
    arena = PinnedArena(MIB, pin=False)
    assert arena.take((MIB + 1,), torch.uint8) is None
    assert arena.stats == {"pieces": 0, "misses": 1, "live_peak_bytes": 0}
    with pytest.raises(TransferError, match="positive size"):
        PinnedArena(0, pin=False)


def test_pieces_dropped_in_other_threads_come_back() -> None:
    arena = PinnedArena(64 * MIB, pin=False)
    pieces = [arena.take((MIB,), torch.uint8) for _ in range(32)]
    assert all(p is not None for p in pieces)

    def drop(k: int) -> None:
        for i in range(k, 32, 4):
            pieces[i] = None

    threads = [threading.Thread(target=drop, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert arena.live_bytes == 0 and arena.stats["live_peak_bytes"] == 32 * MIB
    assert arena.take((64 * MIB,), torch.uint8) is not None  # the whole slab free again


def test_a_piece_keeps_the_slab_alive_after_the_arena_is_dropped() -> None:
    """A record a sink or a trainer still holds when the connector shuts down: its rows stay valid memory."""
    import weakref

    arena = PinnedArena(MIB, pin=False)
    piece = arena.take((1000,), torch.int32)
    assert piece is not None
    piece.copy_(torch.arange(1000, dtype=torch.int32))
    slab = weakref.ref(arena.slab)
    del arena
    gc.collect()
    assert slab() is not None  # control below: it goes with the last piece
    junk = [torch.full((1 << 18,), -1, dtype=torch.int32) for _ in range(8)]  # the allocator hands memory out again
    assert torch.equal(piece, torch.arange(1000, dtype=torch.int32))
    del piece, junk
    gc.collect()
    assert slab() is None
