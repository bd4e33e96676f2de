"""Property tests: every request reads back exactly the rows written for it.

The writer here follows vLLM's kernel-block path (manager block ``b`` -> kernel blocks ``b*r .. b*r+r-1``,
then the kernel block table is indexed per token), not the manager-slot formula the reader uses, and the
batch is written in a shuffled order with one scatter, as the model runner does.
"""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat.core import ViewOrder, describe_capture_view, gather_rows, manager_slots


def make_view(order: ViewOrder, physical: str, nb_k: int, n: int, p: int, c: int, pad: int) -> torch.Tensor:
    """A capture view of logical shape per ``order`` over a buffer laid out as ``physical``."""
    if order is ViewOrder.BLOCK_TOKEN_PLANE:
        shape = (nb_k, n, p, c)
        inner = (p * c, c, 1)  # [N, P, C] packed
    else:
        shape = (nb_k, p, n, c)
        inner = (c, p * c, 1) if physical == "token_major" else (n * c, c, 1)  # LBNHC vs LBHNC
    page = n * p * c + pad
    backing = torch.full((nb_k * page + 7,), -1.0, dtype=torch.bfloat16)
    return backing.as_strided(shape, (page, *inner), storage_offset=7)


@settings(max_examples=60, deadline=None)
@given(
    order=st.sampled_from(list(ViewOrder)),
    physical=st.sampled_from(["token_major", "plane_major"]),
    kbs=st.sampled_from([1, 2, 4, 8, 16]),
    ratio=st.sampled_from([1, 2, 4]),
    p=st.integers(1, 5),
    c=st.sampled_from([1, 3, 8]),
    pad=st.sampled_from([0, 5]),
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    seed=st.integers(0, 2**31),
)
def test_reads_return_exactly_each_requests_rows(
    order: ViewOrder,
    physical: str,
    kbs: int,
    ratio: int,
    p: int,
    c: int,
    pad: int,
    lengths: list[int],
    seed: int,
) -> None:
    rng = random.Random(seed)
    bs = kbs * ratio  # manager (group) block size
    need = [-(-t // bs) for t in lengths]
    num_blocks = sum(need) + 1 + rng.randint(0, 3)  # + null block 0 + spare
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = []
    for k in need:
        tables.append(free[:k])
        free = free[k:]
    cache = make_view(order, physical, num_blocks * ratio, kbs, p, c, pad)

    # Distinct values per request / token / plane, exactly representable in bf16.
    data = [
        torch.stack(
            [
                torch.tensor([[(r * 7 + 1) * 1000 + pl * 100 + (t % 97) for _ in range(c)] for pl in range(p)])
                for t in range(n)
            ]
        ).to(torch.bfloat16)
        for r, n in enumerate(lengths)
    ]

    # One scatter for the batch, requests in shuffled order, kernel-block addressing.
    order_idx = list(range(len(lengths)))
    rng.shuffle(order_idx)
    kb, ko, rows = [], [], []
    for r in order_idx:
        kernel_table = [b * ratio + j for b in tables[r] for j in range(ratio)]
        for t in range(lengths[r]):
            kb.append(kernel_table[t // kbs])
            ko.append(t % kbs)
        rows.append(data[r])
    kbt, kot, batch = torch.tensor(kb), torch.tensor(ko), torch.cat(rows)
    if order is ViewOrder.BLOCK_TOKEN_PLANE:
        cache[kbt, kot] = batch
    else:
        cache[kbt, :, kot] = batch

    view = describe_capture_view(cache, num_planes=p, group_block_size=bs, order=order, hidden_size=c)
    assert view.kernel_split == ratio and view.num_manager_blocks == num_blocks
    for r in rng.sample(range(len(lengths)), len(lengths)):
        slots = manager_slots(
            f"r{r}", tables[r], group_block_size=bs, num_tokens=lengths[r], num_manager_blocks=num_blocks
        )
        got = gather_rows(cache, view, slots)
        assert torch.equal(got, data[r]), f"request {r} read other rows"
        # A chunk in the middle (chunked prefill / partial reads) reads the same rows.
        start = lengths[r] // 3
        mid = manager_slots(f"r{r}", tables[r], group_block_size=bs, num_tokens=lengths[r] - start, start=start)
        assert torch.equal(gather_rows(cache, view, mid), data[r][start:])


@settings(max_examples=40, deadline=None)
@given(order=st.sampled_from(list(ViewOrder)), p=st.integers(1, 6), n=st.sampled_from([2, 4, 16]))
def test_inferred_order_matches_declared_or_refuses(order: ViewOrder, p: int, n: int) -> None:
    from vllm_hs_compat.errors import AmbiguousViewError

    cache = make_view(order, "token_major", 3, n, p, 4, 0)
    if p == n:
        try:
            describe_capture_view(cache, num_planes=p, group_block_size=n, order=None)
        except AmbiguousViewError:
            pass
        else:
            raise AssertionError("P == N must be refused without a declared order")
    else:
        assert describe_capture_view(cache, num_planes=p, group_block_size=n, order=None).order is order
    # The declared order always decides.
    assert describe_capture_view(cache, num_planes=p, group_block_size=n, order=order).order is order


@settings(max_examples=30, deadline=None)
@given(
    order=st.sampled_from(list(ViewOrder)),
    physical=st.sampled_from(["token_major", "plane_major"]),
    c=st.sampled_from([1, 2, 4, 8, 24]),
    pad=st.sampled_from([0, 1, 4]),
    seed=st.integers(0, 2**31),
)
def test_gather_copies_bits_exactly(order: ViewOrder, physical: str, c: int, pad: int, seed: int) -> None:
    """Random bit patterns (NaNs, infinities, denormals included) survive the wide-element gather."""
    gen = torch.Generator().manual_seed(seed)
    p, n, nb = 3, 4, 6
    cache = make_view(order, physical, nb, n, p, c, pad)
    bits = torch.randint(-(2**15), 2**15, tuple(cache.shape), generator=gen, dtype=torch.int16)
    cache.copy_(bits.view(torch.bfloat16))
    view = describe_capture_view(cache, num_planes=p, group_block_size=n, order=order)
    slots = torch.randperm(nb * n, generator=gen)[:9]
    got = gather_rows(cache, view, slots)
    blk, off = slots // n, slots % n
    want = cache[blk, off] if order is ViewOrder.BLOCK_TOKEN_PLANE else cache[blk, :, off]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
