"""Our adapters against vLLM's own code, for the installed release (one nox session per release).

For each case vLLM builds the specs, groups them, flattens the scheduler copy, allocates the views,
computes slot mappings for requests in a shuffled batch order and writes known hidden states with the
capture layer's own cache writer.  The library then reads every request back from the worker view and
from the scheduler view; the rows must equal what was written, bit for bit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import harness as h
import pytest
import torch

from vllm_hs_compat import api
from vllm_hs_compat.core import ViewOrder
from vllm_hs_compat.errors import CaptureGroupError

pytestmark = pytest.mark.vllm

KERNEL_SPLIT = 4  # kernel blocks per manager block in the split cases
NUM_REQUESTS = 6

VLLM_VERSION = h.vllm_version()


@dataclass(frozen=True)
class Case:
    verifier: str  # dense | mla | hybrid
    hma: bool
    split: bool
    layout: str | None  # None = the layout vLLM resolves by default (0.29+), or the only one (<= 0.28)

    @property
    def merged(self) -> bool:
        """vLLM puts the capture layer into one merged group with the verifier layers unless the
        verifier mixes attention types with HMA on."""
        return not (self.verifier == "hybrid" and self.hma)

    @property
    def id(self) -> str:
        parts = [self.verifier, "hma" if self.hma else "nohma", "split" if self.split else "nosplit"]
        parts.append(self.layout or "default-layout")
        return "-".join(parts)


def _cases() -> list[Case]:
    layouts: list[str | None] = [None, "LBHNC"] if h.has_layout_module() else [None]
    cases = []
    for verifier, hma in (("dense", True), ("mla", True), ("hybrid", True), ("hybrid", False)):
        for split in (False, True):
            for layout in layouts:
                case = Case(verifier, hma, split, layout)
                if split and not case.merged:
                    continue  # a group of its own is never kernel-split (CacheOnly backend: MultipleOf(1))
                cases.append(case)
    return cases


CASES = _cases()


@dataclass
class Built:
    case: Case
    cfg: object
    layer: object
    kv: h.KvConfigs
    gid: int
    block_size: int
    kernel_block_sizes: list[int]
    views: dict[str, torch.Tensor]


def _build(case: Case) -> Built:
    cfg = h.make_vllm_config(hma=case.hma, layout=case.layout)
    layer = h.make_capture_layer(cfg)
    kv = h.build_kv_cache_configs(cfg, layer, case.verifier)
    gid = h.group_index_of(kv.worker, h.CAPTURE_LAYER)
    bs = h.group_block_size(kv.worker, gid)
    kbs = [h.group_block_size(kv.worker, i) for i in range(len(kv.worker.kv_cache_groups))]
    if case.split:
        assert bs % KERNEL_SPLIT == 0, bs
        kbs[gid] = bs // KERNEL_SPLIT
    views = h.allocate_views(cfg, kv.worker, layer, kbs)
    return Built(case, cfg, layer, kv, gid, bs, kbs, views)


@pytest.fixture(scope="module")
def slot_path() -> h.SlotPath:
    return h.slot_mapping_path()


def _allocate_requests(rng: random.Random, num_blocks: int, block_size: int) -> list[tuple[str, int, list[int]]]:
    """Requests with random lengths over several blocks and block ids from a shuffled free list
    (block 0 is the null block on 0.25+, never handed out)."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    reqs = []
    max_len = min(h.MAX_MODEL_LEN, h.BLOCK_SIZE * 5)
    for i in range(NUM_REQUESTS):
        n = rng.randint(1, max_len) if i else max_len  # at least one request spans many blocks
        need = -(-n // block_size)
        assert need <= len(free), "the KV cache is too small for the test requests"
        blocks, free = free[:need], free[need:]
        reqs.append((f"req-{i}-{rng.randrange(1 << 30):x}", n, blocks))
    return reqs


def _hidden_states(gen: torch.Generator, n: int) -> torch.Tensor:
    """Distinct bf16 rows: random values cast to bf16 (the reference is the bf16 tensor itself)."""
    return (torch.randn(n, h.NUM_PLANES, h.HIDDEN, generator=gen) * 4).to(h.DTYPE)


def _token_rows_written(view: torch.Tensor, order: ViewOrder) -> int:
    """How many (block, token) positions of the capture view hold anything but zeros."""
    per_token = view if order is ViewOrder.BLOCK_TOKEN_PLANE else view.transpose(1, 2)
    return int((per_token != 0).flatten(2).any(-1).sum())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_capture_roundtrip(case: Case, slot_path: h.SlotPath) -> None:
    adapter = api.get_adapter()

    b = _build(case)
    worker, scheduler = b.kv.worker, b.kv.scheduler
    wgroup = worker.kv_cache_groups[b.gid]
    sgroup = scheduler.kv_cache_groups[b.gid]
    capture_spec = b.kv.specs[h.CAPTURE_LAYER]
    groups = "; ".join(
        f"{type(g.kv_cache_spec).__name__} bs={g.kv_cache_spec.block_size} n={len(g.layer_names)}"
        for g in worker.kv_cache_groups
    )

    # ---- what vLLM did (facts the adapter must agree with) ----------------------------------------
    assert type(capture_spec).__name__ in adapter.capture_spec_types
    assert scheduler.num_blocks == worker.num_blocks
    if case.merged:
        assert len(worker.kv_cache_groups) == 1, groups
        assert type(wgroup.kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"
        assert b.block_size == h.BLOCK_SIZE
        # the scheduler's copy is flattened to the first per-layer spec, layer names kept
        flat = next(iter(wgroup.kv_cache_spec.kv_cache_specs.values()))
        assert type(sgroup.kv_cache_spec) is type(flat)
        assert type(sgroup.kv_cache_spec).__name__ != "UniformTypeKVCacheSpecs"
    else:
        assert b.gid == len(worker.kv_cache_groups) - 1, f"the capture group is appended last: {groups}"
        assert wgroup.layer_names == [h.CAPTURE_LAYER]
        if adapter.hidden_state_cache_spec:
            # 0.22+: the capture layer is re-sized to fit the verifier's page (smaller block, padded page)
            assert b.block_size < h.BLOCK_SIZE, groups
            assert wgroup.kv_cache_spec.page_size_padded is not None
        else:
            # 0.17-0.21: page unification raises the verifier's block size instead
            assert b.block_size == h.BLOCK_SIZE, groups
            assert all(g.kv_cache_spec.block_size > h.BLOCK_SIZE for g in worker.kv_cache_groups[:-1])
    assert sgroup.layer_names == wgroup.layer_names

    # ---- the adapter's reading of both views --------------------------------------------------------
    name = api.capture_layer_name(worker, b.cfg)
    assert name == h.CAPTURE_LAYER
    assert api.capture_layer_name(scheduler) == h.CAPTURE_LAYER
    if not case.merged:
        records = h.proposer_records_capture_group(worker)
        assert adapter.proposer_uses_group0_slots is (not records)
        if not records:
            # The release writes the capture layer with group 0's slots: the library must refuse.
            for cfg, view in ((worker, "worker"), (scheduler, "scheduler")):
                with pytest.raises(CaptureGroupError, match="group 0's slot mapping"):
                    api.resolve_capture_group(cfg, view=view)
            return
    gw = api.resolve_capture_group(worker, view="worker")
    gs = api.resolve_capture_group(scheduler, view="scheduler")
    assert (gw.index, gw.block_size, gw.layer_name) == (b.gid, b.block_size, name)
    assert (gs.index, gs.block_size, gs.layer_name) == (b.gid, b.block_size, name)
    assert gw.merged is case.merged and gs.merged is case.merged
    assert gw.capture_spec_type == type(capture_spec).__name__
    if case.merged:
        assert gs.capture_spec_type is None  # flattened: the capture spec is not visible
    api.check_views_agree(gw, gs)

    tensor = b.views[name]
    order = adapter.view_order
    kbs = b.kernel_block_sizes[b.gid]
    assert tensor.dtype == h.DTYPE
    assert tensor.shape[order.plane_axis] == h.NUM_PLANES
    assert tensor.shape[order.token_axis] == kbs
    assert tensor.shape[3] == h.HIDDEN
    assert tensor.shape[0] == worker.num_blocks * (b.block_size // kbs)
    if h.has_layout_module():
        resolved = b.cfg.cache_config.kv_cache_layout
        assert worker.kv_cache_layout == resolved
        assert api.kv_cache_layout(b.cfg, worker) == resolved
        if case.layout is not None:
            assert resolved == case.layout
        # LB?NC layouts: within one block, which of planes/tokens is outermost
        if resolved == "LBHNC":
            assert (tensor.stride(1), tensor.stride(2)) == (kbs * h.HIDDEN, h.HIDDEN)
        elif resolved == "LBNHC":
            assert (tensor.stride(1), tensor.stride(2)) == (h.HIDDEN, h.NUM_PLANES * h.HIDDEN)

    wview = api.describe_capture_view(tensor, gw, num_planes=h.NUM_PLANES, hidden_size=h.HIDDEN)
    sview = api.describe_capture_view(tensor, gs, num_planes=h.NUM_PLANES, hidden_size=h.HIDDEN)
    for view in (wview, sview):
        assert view.order is order
        assert view.block_tokens == kbs
        assert view.kernel_split == b.block_size // kbs
        assert view.num_manager_blocks == worker.num_blocks

    # ---- write with vLLM's writer, two steps, shuffled batch order -----------------------------------
    rng = random.Random(f"{VLLM_VERSION}-{case.id}")
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    reqs = _allocate_requests(rng, worker.num_blocks, b.block_size)
    expected = {rid: _hidden_states(gen, n) for rid, n, _ in reqs}
    blocks = {rid: blk for rid, _, blk in reqs}
    lengths = {rid: n for rid, n, _ in reqs}
    first_chunk = {rid: rng.randint(1, n) for rid, n, _ in reqs}  # chunked prefill: step 1, then the rest

    for step in (0, 1):
        batch = []
        for rid, n, blk in reqs:
            start = 0 if step == 0 else first_chunk[rid]
            count = first_chunk[rid] if step == 0 else n - first_chunk[rid]
            if count:
                batch.append(h.ScheduledRequest(rid, blk, start, count))
        rng.shuffle(batch)  # batch order is not scheduler order (V1 fills holes, V2 re-sorts)
        slots = h.compute_slot_mapping(batch, block_size=b.block_size, kernel_block_size=kbs, path=slot_path)
        to_cache = torch.cat([expected[r.req_id][r.num_computed : r.num_computed + r.num_tokens] for r in batch])
        assert slots.shape[0] == to_cache.shape[0]
        # vLLM's slots for each request are the manager slots the library computes from block ids
        offset = 0
        for r in batch:
            ours = api.request_slots(r.req_id, r.block_ids, wview, num_tokens=r.num_tokens, start=r.num_computed)
            assert torch.equal(slots[offset : offset + r.num_tokens], ours), (step, r.req_id)
            offset += r.num_tokens
        h.write_hidden_states(b.layer, tensor, to_cache, slots)

    total = sum(lengths.values())
    assert _token_rows_written(tensor, order) == total, "vLLM's writer did not write exactly the tokens sent"

    # ---- read back through the library, both views, bit for bit --------------------------------------
    for g, view in ((gw, wview), (gs, sview)):
        for rid in expected:
            slots = api.request_slots(rid, blocks[rid], view, num_tokens=lengths[rid])
            rows = api.gather_rows(tensor, view, slots)
            assert rows.shape == expected[rid].shape
            assert torch.equal(rows, expected[rid]), f"{g.view} view, request {rid}"
            again = api.read_request(tensor, view, rid, blocks[rid], lengths[rid])
            assert torch.equal(again, expected[rid])

    # ---- the comparison can fail: another request's blocks give other rows ---------------------------
    a, c = reqs[0][0], reqs[1][0]
    n = min(lengths[a], lengths[c])
    wrong = api.gather_rows(tensor, wview, api.request_slots(a, blocks[c], wview, num_tokens=n))
    assert not torch.equal(wrong, expected[a][:n])


def test_padding_slot_lands_where_the_adapter_says() -> None:
    """A padding token (vLLM's ``PAD_SLOT_ID``) written by vLLM's own writer lands in the null block 0
    (0.25+) or in the last slot of the last block (before): the adapter must state which."""
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    adapter = api.get_adapter()
    b = _build(Case("dense", True, False, None))
    tensor = b.views[h.CAPTURE_LAYER]
    assert not tensor.any()
    junk = torch.ones(1, h.NUM_PLANES, h.HIDDEN, dtype=h.DTYPE)
    h.write_hidden_states(b.layer, tensor, junk, torch.tensor([PAD_SLOT_ID], dtype=torch.int64))
    order = adapter.view_order
    per_token = tensor if order is ViewOrder.BLOCK_TOKEN_PLANE else tensor.transpose(1, 2)
    hits = per_token.flatten(2).any(-1).nonzero().tolist()
    last = [tensor.shape[0] - 1, tensor.shape[order.token_axis] - 1]
    where = {"null-block-0": [[0, 0]], "last-slot-of-last-block": [last]}[adapter.padding_slots_write]
    assert hits == where, f"padding landed at {hits}; the adapter says {adapter.padding_slots_write}"
