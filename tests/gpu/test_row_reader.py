"""The connector's read path (``RowReader``: mark the capture write, read in a later step) under stream races.

vLLM writes the capture layer on whatever stream runs the model, which need not be the stream that is
current when the connector issues its reads a step later.  The writer here is a separate stream held back
by a spin kernel; the reader issues from the default stream while the allocator churns.  With the write
marked (``mark_written`` under the writer's stream, as ``save_kv_layer`` does) the rows must be exact, for
both view orders and a kernel-split view; the negative control (no mark: the copy orders itself after the
current stream only) must be caught reading stale rows.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from vllm_hs_compat.core import ViewOrder, describe_capture_view, manager_slots
from vllm_hs_compat.core.transfer import RowReader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_views import NB, N, P, churn, expected, make_cache, write  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")


@pytest.fixture(params=[False, True], ids=["general", "lone"])
def lone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both lone-request paths: the general one (slots per token) and ``LoneReads`` (whole blocks, the default;
    ``VLLM_HS_COMPAT_LONE_READ=0`` turns it off)."""
    # Read when each RowReader is built and at each api.copy_request_async (ReadOptions.from_env).
    monkeypatch.setenv("VLLM_HS_COMPAT_LONE_READ", "1" if request.param else "0")
    return bool(request.param)


SPIN = 2_000_000


def run(order: ViewOrder, split: int, mark: bool, iters: int = 30) -> int:
    cache = make_cache(order, split)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    reader = RowReader(cache, view)
    writer = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(1)
    bad = 0
    for it in range(iters):
        tokens = 200
        blocks = (torch.randperm(NB - 1, generator=gen)[: -(-tokens // N)] + 1).tolist()
        slots = manager_slots(f"r{it}", blocks, group_block_size=N, num_tokens=tokens).cuda()
        value = float(it % 50 + 1)
        torch.cuda.synchronize()
        with torch.cuda.stream(writer):  # the model's stream: late, then the capture write
            torch.cuda._sleep(SPIN)
            write(cache, order, slots, value)
            if mark:
                reader.mark_written()  # what save_kv_layer does, on the writing stream
        # next step, on another (current) stream: the connector reads the finished request's rows
        pending = reader.read(f"r{it}", blocks, start=0, num_tokens=tokens)
        churn(tokens)  # the caching allocator hands freed memory out again
        got = pending.wait()
        torch.cuda.synchronize()
        if not torch.equal(got, expected(value, tokens)):
            bad += 1
    return bad


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("order", list(ViewOrder))
def test_marked_write_orders_the_read(order: ViewOrder, split: int, lone: bool) -> None:
    assert run(order, split, mark=True) == 0


@pytest.mark.parametrize("order", list(ViewOrder))
def test_negative_control_unmarked_write_is_caught(order: ViewOrder, lone: bool) -> None:
    # Without the mark the copy waits only for the current stream: it must be seen reading stale rows,
    # or the stress does not exercise the race and the test above proves nothing.
    assert run(order, 1, mark=False) > 0


def run_many(order: ViewOrder, split: int, mark: bool, path: str, iters: int = 20, per_step: int = 5) -> int:
    """The connector's batched read (``read_many``: one index upload, one gather for a step's records) under the
    same race as :func:`run`."""
    cache = make_cache(order, split)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    reader = RowReader(cache, view, path=path)
    writer = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(2)
    bad = 0
    base = [17, 64, 3, 90, 82, 1, 45][:per_step]
    for it in range(-1, iters):  # iteration -1 warms the pinned pools: no allocation inside the race below
        # Same total every step (so the same pinned sizes), random order, random blocks.
        lengths = [base[int(k)] for k in torch.randperm(per_step, generator=gen)]
        need = [-(-t // N) for t in lengths]
        free = (torch.randperm(NB - 1, generator=gen)[: sum(need)] + 1).tolist()
        tables = [free[sum(need[:k]) : sum(need[: k + 1])] for k in range(per_step)]
        values = [float((it * per_step + k) % 60 + 1) for k in range(per_step)]
        # Device slots made up front: a copy from pageable memory inside the writer's block would wait for the
        # spin on the host and serialise the race away.
        dev_slots = [
            manager_slots(f"r{it}.{k}", tables[k], group_block_size=N, num_tokens=lengths[k]).cuda()
            for k in range(per_step)
        ]
        torch.cuda.synchronize()
        with torch.cuda.stream(writer):
            torch.cuda._sleep(5 * SPIN)
            for k in range(per_step):
                write(cache, order, dev_slots[k], values[k])
            if mark:
                reader.mark_written()
        got = reader.read_many([(f"r{it}.{k}", tables[k], 0, lengths[k]) for k in range(per_step)])
        churn(sum(lengths))
        for k, pending in enumerate(got):
            assert not isinstance(pending, Exception)
            rows = pending.wait()
            if it >= 0 and not torch.equal(rows, expected(values[k], lengths[k])):
                bad += 1
    return bad


@pytest.mark.parametrize("path", ["staged", "direct"])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("order", list(ViewOrder))
def test_batched_read_is_ordered_after_the_marked_write(order: ViewOrder, split: int, path: str) -> None:
    assert run_many(order, split, mark=True, path=path) == 0


@pytest.mark.parametrize("order", list(ViewOrder))
def test_negative_control_batched_unmarked_write_is_caught(order: ViewOrder) -> None:
    assert run_many(order, 1, mark=False, path="staged") > 0


def run_reuse(order: ViewOrder, ignore_events: bool, iters: int = 20, lone: bool = False) -> int:
    """Two steps' reads back to back while the first still waits for its write: the pinned index buffer of the
    first must not be handed to the second (its upload has not run yet).  ``lone``: two lone reads
    (``RowReader.read``, the whole-block path) instead of two one-request batches."""
    cache = make_cache(order)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    reader = RowReader(cache, view)
    if ignore_events:
        reader.pool._ready = lambda event: True  # type: ignore[method-assign]  # the bug: reuse without the event
        assert reader.lone is not None
        reader.lone.pool._ready = lambda event: True  # type: ignore[method-assign]
    writer = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(3)
    bad = 0
    tokens = 64
    # Iteration 0 warms the process (CUDA context, caching and pinned allocators, first kernels) and is not
    # counted: on a cold machine its slow first allocations let the race pass unnoticed (seen once on an H200).
    for it in range(iters + 1):
        free = (torch.randperm(NB - 1, generator=gen)[: 2 * tokens // N] + 1).tolist()
        a, b = free[: tokens // N], free[tokens // N :]
        va, vb = float(2 * (it % 30) + 1), float(2 * (it % 30) + 2)
        sa = manager_slots("a", a, group_block_size=N, num_tokens=tokens).cuda()
        sb = manager_slots("b", b, group_block_size=N, num_tokens=tokens).cuda()
        torch.cuda.synchronize()
        with torch.cuda.stream(writer):
            torch.cuda._sleep(SPIN)
            write(cache, order, sa, va)
            write(cache, order, sb, vb)
            reader.mark_written()
        if lone:
            first = reader.read(f"a{it}", a, start=0, num_tokens=tokens)
            second = reader.read(f"b{it}", b, start=0, num_tokens=tokens)
        else:
            first = reader.read_many([(f"a{it}", a, 0, tokens)])[0]
            second = reader.read_many([(f"b{it}", b, 0, tokens)])[0]
        assert not isinstance(first, Exception) and not isinstance(second, Exception)
        wrong = int(not torch.equal(first.wait(), expected(va, tokens)))
        wrong += int(not torch.equal(second.wait(), expected(vb, tokens)))
        if it > 0 or not ignore_events:  # the safe path must be exact from the first iteration on
            bad += wrong
    return bad


@pytest.mark.parametrize("order", list(ViewOrder))
def test_pinned_index_buffers_are_reused_only_after_their_upload(order: ViewOrder, lone: bool) -> None:
    assert run_reuse(order, ignore_events=False, lone=lone) == 0


@pytest.mark.parametrize("order", list(ViewOrder))
def test_negative_control_reusing_a_busy_index_buffer_is_caught(order: ViewOrder, lone: bool) -> None:
    assert run_reuse(order, ignore_events=True, lone=lone) > 0


def run_api(order: ViewOrder, split: int, on_current: bool, iters: int = 30) -> int:
    """``api.copy_request_async`` (the lone path: whole blocks, pinned index pool per cache, no marked event) orders
    itself after the current stream: the write late on the current stream must be read exactly; written on
    another stream (``on_current=False``, the negative control) it must be caught reading stale rows."""
    from vllm_hs_compat import api

    cache = make_cache(order, split)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    other = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(6)
    bad = 0
    for it in range(iters):
        tokens = 150
        blocks = (torch.randperm(NB - 1, generator=gen)[: -(-(tokens + 5) // N)] + 1).tolist()
        slots = manager_slots(f"r{it}", blocks, group_block_size=N, num_tokens=tokens, start=5).cuda()
        value = float(it % 50 + 1)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.current_stream() if on_current else other):
            torch.cuda._sleep(SPIN)
            write(cache, order, slots, value)
        pending = api.copy_request_async(cache, view, f"r{it}", blocks, tokens, start=5)
        churn(tokens)
        got = pending.wait()
        torch.cuda.synchronize()
        if not torch.equal(got, expected(value, tokens)):
            bad += 1
    return bad


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("order", list(ViewOrder))
def test_api_lone_read_is_ordered_after_the_current_stream(order: ViewOrder, split: int, lone: bool) -> None:
    assert run_api(order, split, on_current=True) == 0


@pytest.mark.parametrize("order", list(ViewOrder))
def test_negative_control_api_write_on_another_stream_is_caught(order: ViewOrder, lone: bool) -> None:
    assert run_api(order, 1, on_current=False) > 0


@pytest.mark.parametrize("dest", ["new", "pinned", "pageable"])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("physical", ["NPC", "LBNHC", "LBHNC", "LBNHC_gap"])
def test_lone_read_exact_in_every_layout(physical: str, split: int, dest: str, lone: bool) -> None:
    """Random bits through ``api.copy_request_async`` and ``RowReader.read``: whole-block gathers (per-plane ones
    rearranged by the copy), unaligned starts and ends, a cache with a gap after every block (chunk offsets)."""
    from vllm_hs_compat import api
    from vllm_hs_compat.core import gather_rows

    nb, n = NB * split, N // split
    if physical == "LBHNC":
        cache = torch.empty(nb, P, n, 1024, dtype=torch.bfloat16, device="cuda")
        order = ViewOrder.BLOCK_PLANE_TOKEN
    elif physical == "LBNHC_gap":
        cache = torch.empty(nb, 2 * n, P, 1024, dtype=torch.bfloat16, device="cuda")[:, :n].permute(0, 2, 1, 3)
        order = ViewOrder.BLOCK_PLANE_TOKEN
    else:
        cache = torch.empty(nb, n, P, 1024, dtype=torch.bfloat16, device="cuda")
        order = ViewOrder.BLOCK_TOKEN_PLANE if physical == "NPC" else ViewOrder.BLOCK_PLANE_TOKEN
        cache = cache if physical == "NPC" else cache.permute(0, 2, 1, 3)
    cache.view(torch.int16).random_(-(2**15), 2**15)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    reader = RowReader(cache, view)
    assert reader.lone is not None and reader.lone.plan is not None
    gen = torch.Generator().manual_seed(7)
    for start, tokens in [(0, 16), (0, 160), (7, 300), (3, 1), (16, 45), (0, 33)]:
        blocks = (torch.randperm(NB - 1, generator=gen)[: -(-(start + tokens) // N)] + 1).tolist()
        slots = manager_slots("r", blocks, group_block_size=N, num_tokens=tokens, start=start).cuda()
        want = gather_rows(cache, view, slots).cpu().view(torch.int16)
        for fn in (api.copy_request_async, None):
            out = None
            if dest != "new":
                out = torch.empty((tokens, P, 1024), dtype=torch.bfloat16, pin_memory=dest == "pinned")
            if fn is None:
                got = reader.read("r", blocks, start=start, num_tokens=tokens, out=out).wait()
            else:
                got = fn(cache, view, "r", blocks, tokens, start=start, out=out).wait()
            assert out is None or got is out
            assert torch.equal(got.view(torch.int16), want), f"start={start} tokens={tokens}"


@pytest.mark.parametrize("dst_kind", ["pinned_host", "device"])
def test_triton_row_kernel_copies_exactly(dst_kind: str) -> None:
    pytest.importorskip("triton")
    from vllm_hs_compat.core._triton_rows import gather_rows_into

    gen = torch.Generator(device="cuda").manual_seed(4)
    src = torch.randint(-(2**31), 2**31 - 1, (300, 2056), dtype=torch.int32, device="cuda", generator=gen)
    src = src.view(torch.bfloat16)[:, 8:4104]  # bf16 rows of 4096 at a row stride of 4112, random bits
    idx = torch.randint(0, 300, (777,), device="cuda", generator=gen)
    if dst_kind == "device":
        dst = torch.full((777, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
    else:
        dst = torch.full((777, 4096), float("nan"), dtype=torch.bfloat16, pin_memory=True)
    assert gather_rows_into(src, idx, dst)  # the kernel ran (no silent fallback)
    torch.cuda.synchronize()
    assert torch.equal(dst.cuda().view(torch.int16), src[idx].view(torch.int16))


@pytest.mark.parametrize("kernel", ["triton", "index_select"])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("physical", ["NPC", "LBNHC", "LBHNC"])
def test_gather_rows_exact_in_every_layout(
    physical: str, split: int, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random bits through both gathers (the Triton kernel forced for every size, or switched off)."""
    from vllm_hs_compat.core import gather_rows
    from vllm_hs_compat.core import layout as L

    if kernel == "triton":
        pytest.importorskip("triton")
        monkeypatch.setattr(L, "TRITON_MIN_BYTES", 0)
    else:
        monkeypatch.setattr(L, "_triton", False)
    nb, n = NB * split, N // split
    if physical == "LBHNC":
        cache = torch.empty(nb, P, n, 1024, dtype=torch.bfloat16, device="cuda")
        order = ViewOrder.BLOCK_PLANE_TOKEN
    else:
        cache = torch.empty(nb, n, P, 1024, dtype=torch.bfloat16, device="cuda")
        order = ViewOrder.BLOCK_TOKEN_PLANE if physical == "NPC" else ViewOrder.BLOCK_PLANE_TOKEN
        cache = cache if physical == "NPC" else cache.permute(0, 2, 1, 3)
    cache.view(torch.int16).random_(-(2**15), 2**15)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    gen = torch.Generator().manual_seed(5)
    blocks = (torch.randperm(NB - 1, generator=gen)[:20] + 1).tolist()
    slots = manager_slots("r", blocks, group_block_size=N, num_tokens=300, start=7).cuda()
    blk, off = slots // n, slots % n
    want = cache[blk, off] if order is ViewOrder.BLOCK_TOKEN_PLANE else cache[blk, :, off]
    assert torch.equal(gather_rows(cache, view, slots).view(torch.int16), want.view(torch.int16))


def _poison(rows: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> list[int]:
    """NaN, +Inf or -Inf (float8 e4m3fn: its two NaNs) at one random element of a random fifth of ``rows``'
    ``[T, ...]`` token rows (the low and the high half of a word, the masked tail of a row); the rows poisoned."""
    t = int(rows.shape[0])
    flat = rows.view(t, -1)
    chosen = sorted(torch.randperm(t, generator=gen)[: max(1, t // 5)].tolist())
    for i, r in enumerate(chosen):
        col = int(torch.randint(0, int(flat.shape[1]), (1,), generator=gen))
        if i % 3 == 0:
            col = int(flat.shape[1]) - 1  # the last element: in the kernel's masked tail where the row has one
        if dtype == torch.float8_e4m3fn:
            flat.view(torch.uint8)[r, col] = 0x7F if i % 2 else 0xFF
        else:
            flat[r, col] = (float("nan"), float("inf"), float("-inf"))[i % 3]
    return chosen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("physical", ["NPC", "LBHNC"])
@pytest.mark.parametrize("flagged", [True, False], ids=["flags", "control_no_flags"])
def test_triton_row_kernel_flags_exactly_the_non_finite_tokens(
    physical: str, dtype: torch.dtype, flagged: bool
) -> None:
    """The kernel clears a token's flag exactly where its rows (every plane) hold NaN/Inf, as ``token_flags`` of the
    same rows says, for every dtype it has a bit test for, packed and per-plane tables, a row width that leaves a
    masked tail; the rows it moves stay exact.  Control: launched without flags, the flags stay all True and
    miss every poisoned token."""
    pytest.importorskip("triton")
    from vllm_hs_compat.core import _triton_rows as K
    from vllm_hs_compat.core.finite import token_flags
    from vllm_hs_compat.core.layout import kernel_gather_into, row_table

    nb, n, p, c = 64, 16, 4, 1000  # 1000: the rows' words leave a masked tail in the last program
    gen = torch.Generator().manual_seed(6)
    if physical == "LBHNC":
        cache = torch.empty(nb, p, n, c, dtype=dtype, device="cuda")
        order = ViewOrder.BLOCK_PLANE_TOKEN
    else:
        cache = torch.empty(nb, n, p, c, dtype=dtype, device="cuda")
        order = ViewOrder.BLOCK_TOKEN_PLANE
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[cache.element_size()]
    cache.view(bits).copy_(torch.randn(cache.shape, generator=gen).to(dtype).view(bits))
    view = describe_capture_view(cache, num_planes=p, group_block_size=n, order=order)
    table = row_table(cache, view)
    assert table is not None
    blocks = (torch.randperm(nb - 1, generator=gen)[:20] + 1).tolist()
    slots = manager_slots("r", blocks, group_block_size=n, num_tokens=300, start=5)
    blk, off = (slots // n).cuda(), (slots % n).cuda()
    # the slots' token rows [T, P, C], poisoned on the host and written back (integer views: no float8 indexing)
    cells = (blk, off) if order is ViewOrder.BLOCK_TOKEN_PLANE else (blk, slice(None), off)
    tokens = cache.view(bits)[cells].cpu().view(dtype)
    poisoned = _poison(tokens, dtype, gen)
    cache.view(bits)[cells] = tokens.view(bits).cuda()
    want = token_flags(tokens)
    assert (~want).nonzero().flatten().tolist() == poisoned  # the reference sees every poisoned token
    out = torch.empty(tokens.shape, dtype=dtype, pin_memory=True)
    flags = torch.ones(int(slots.numel()), dtype=torch.bool, pin_memory=True)
    assert K.flag_spec(dtype, 4) is not None
    assert kernel_gather_into(K, table, slots.cuda(), table.out_alias(out), flags if flagged else None)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.uint8), tokens.view(torch.uint8))
    if flagged:
        assert torch.equal(flags, want), f"flagged {(~flags).nonzero().flatten().tolist()}, poisoned {poisoned}"
    else:
        assert bool(flags.all()) and not bool(want.all())


def test_direct_batched_read_hands_the_kernels_flags_to_the_record_check() -> None:
    """``RowReader.read_many`` on the direct path: each request's ``finite`` is the kernel's flags for its own tokens
    (no host check left to run), and the record check names the first poisoned position of each request."""
    pytest.importorskip("triton")
    from vllm_hs_compat.core import finite

    cache = make_cache(ViewOrder.BLOCK_PLANE_TOKEN)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=ViewOrder.BLOCK_PLANE_TOKEN)
    reader = RowReader(cache, view, path="direct")
    gen = torch.Generator().manual_seed(7)
    lengths = [40, 77, 33]
    free = (torch.randperm(NB - 1, generator=gen)[:20] + 1).tolist()
    tables, at = [], 0
    for t in lengths:
        k = -(-t // N)
        tables.append(free[at : at + k])
        at += k
    bad = {0: [5, 39], 2: [0]}  # request -> poisoned token positions (request 1 clean)
    for k, t in enumerate(lengths):
        slots = manager_slots(f"r{k}", tables[k], group_block_size=N, num_tokens=t).cuda()
        write(cache, ViewOrder.BLOCK_PLANE_TOKEN, slots, float(k + 1))
        for pos in bad.get(k, []):
            blk, off = int(slots[pos]) // N, int(slots[pos]) % N
            cache[blk, pos % P, off, pos * 7 % 1024] = float("nan") if pos % 2 else float("inf")
    reader.mark_written()
    got = reader.read_many([(f"r{k}", tables[k], 0, t) for k, t in enumerate(lengths)])
    for k, pending in enumerate(got):
        assert not isinstance(pending, Exception)
        rows = pending.wait()
        assert pending.finite is not None, "the direct path left the NaN/Inf check to the host"
        assert torch.equal(pending.finite, finite.token_flags(rows))
        assert (~pending.finite).nonzero().flatten().tolist() == bad.get(k, [])
        message = finite.problem(rows, pending.finite, start=100)
        if k in bad:
            assert message is not None and f"at position {100 + bad[k][0]}" in message
        else:
            assert message is None


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_batched_reads_land_in_the_pinned_arena_exactly_and_give_their_pieces_back(path: str) -> None:
    """The worker's pinned slab: a step's batched read takes its destination from it (pinned, inside the slab), the
    rows exact on both paths, and the piece goes back once the last record's rows are dropped.  Control: an arena
    too small for the step -- counted as a miss, the rows still exact in memory of torch's own allocator."""
    import gc

    from vllm_hs_compat.core.pinned import PinnedArena

    order = ViewOrder.BLOCK_PLANE_TOKEN
    cache = make_cache(order)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    lengths = [40, 77, 33]
    tables = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11]]
    for k, t in enumerate(lengths):
        write(cache, order, manager_slots(f"r{k}", tables[k], group_block_size=N, num_tokens=t).cuda(), k + 1.0)
    for size, inside in ((64 << 20, True), (1 << 20, False)):
        reader = RowReader(cache, view, path=path)
        arena = reader.arena = PinnedArena(size)
        assert arena.slab.is_pinned()
        reader.mark_written()
        got = reader.read_many([(f"r{k}", tables[k], 0, t) for k, t in enumerate(lengths)])
        for k, pending in enumerate(got):
            assert not isinstance(pending, Exception)
            rows = pending.wait()
            assert torch.equal(rows, expected(k + 1.0, lengths[k]))
            assert rows.is_pinned()
            offset = rows.data_ptr() - arena.slab.data_ptr()
            assert (0 <= offset < size) == inside, (size, offset)
        assert arena.stats["misses"] == (0 if inside else 1)
        del got, pending, rows
        gc.collect()
        assert arena.live_bytes == 0
