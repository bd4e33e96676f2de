from __future__ import annotations

import pytest
import torch

from vllm_hs_compat.core import (
    GroupInfo,
    ViewOrder,
    check_views_agree,
    describe_capture_view,
    manager_slots,
    plane_labels,
    resolve_capture_group,
)
from vllm_hs_compat.errors import (
    BlockCoverageError,
    BlockRangeError,
    CaptureGroupError,
    CaptureViewError,
    LayerIdError,
)

HS = frozenset({"HiddenStateCacheSpec"})
CAP = "cache_only_layers.4"
VERIFIER = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))


def merged_worker() -> list[GroupInfo]:
    per_layer = {n: "FullAttentionSpec" for n in VERIFIER} | {CAP: "HiddenStateCacheSpec"}
    return [GroupInfo(0, (*VERIFIER, CAP), "UniformTypeKVCacheSpecs", 16, True, per_layer)]


def merged_scheduler() -> list[GroupInfo]:
    return [GroupInfo(0, (*VERIFIER, CAP), "FullAttentionSpec", 16)]


def split(bs_hs: int = 2) -> list[GroupInfo]:
    return [
        GroupInfo(0, VERIFIER[:2], "FullAttentionSpec", 16),
        GroupInfo(1, VERIFIER[2:], "SlidingWindowSpec", 16),
        GroupInfo(2, (CAP,), "HiddenStateCacheSpec", bs_hs, page_size_padded=65536),
    ]


def test_merged_worker_and_flattened_scheduler_agree() -> None:
    w = resolve_capture_group(merged_worker(), CAP, capture_spec_types=HS, view="worker")
    s = resolve_capture_group(merged_scheduler(), CAP, capture_spec_types=HS, view="scheduler")
    assert (w.index, w.block_size, w.merged, w.capture_spec_type) == (0, 16, True, "HiddenStateCacheSpec")
    assert (s.index, s.block_size, s.capture_spec_type) == (0, 16, None)
    check_views_agree(w, s)


def test_split_group_found_last_with_its_own_block_size() -> None:
    g = resolve_capture_group(split(), CAP, capture_spec_types=HS, view="scheduler")
    assert (g.index, g.block_size, g.merged) == (2, 2, False)


def test_views_that_disagree_raise() -> None:
    w = resolve_capture_group(split(2), CAP, capture_spec_types=HS, view="worker")
    s = resolve_capture_group(split(4), CAP, capture_spec_types=HS, view="scheduler")
    with pytest.raises(CaptureGroupError, match="disagree"):
        check_views_agree(w, s)


def test_missing_layer_names_every_group() -> None:
    with pytest.raises(CaptureGroupError) as err:
        resolve_capture_group(split(), "cache_only_layers.9", capture_spec_types=HS, view="worker")
    msg = str(err.value)
    assert "group 0: FullAttentionSpec block_size=16 layers=2" in msg
    assert "group 2: HiddenStateCacheSpec block_size=2 layers=1" in msg


def test_layer_in_two_groups_is_ambiguous() -> None:
    groups = [GroupInfo(0, (CAP,), "HiddenStateCacheSpec", 2), GroupInfo(1, (CAP,), "HiddenStateCacheSpec", 2)]
    with pytest.raises(CaptureGroupError, match="2 KV-cache groups"):
        resolve_capture_group(groups, CAP, capture_spec_types=HS, view="worker")


def test_wrong_spec_type_for_capture_layer_raises() -> None:
    per_layer = {n: "FullAttentionSpec" for n in (*VERIFIER, CAP)}
    groups = [GroupInfo(0, (*VERIFIER, CAP), "UniformTypeKVCacheSpecs", 16, True, per_layer)]
    with pytest.raises(CaptureGroupError, match="its spec is FullAttentionSpec"):
        resolve_capture_group(groups, CAP, capture_spec_types=HS, view="worker")


def test_slot_coverage_and_range_errors_name_the_request() -> None:
    with pytest.raises(BlockCoverageError, match="'req-7'"):
        manager_slots("req-7", [3, 4], group_block_size=16, num_tokens=33)
    with pytest.raises(BlockRangeError, match="block id 12"):
        manager_slots("req-8", [3, 12], group_block_size=16, num_tokens=20, num_manager_blocks=12)
    with pytest.raises(BlockRangeError):
        manager_slots("req-9", [-1], group_block_size=16, num_tokens=2)
    # Blocks past the tokens are not checked (vLLM may hand out spare ids).
    assert manager_slots("ok", [1, 99], group_block_size=16, num_tokens=16, num_manager_blocks=4).tolist() == list(
        range(16, 32)
    )


def test_view_checks() -> None:
    t = torch.zeros(4, 16, 3, 8)
    with pytest.raises(CaptureViewError, match="matches BLOCK_PLANE_TOKEN .blocks, planes, tokens, hidden. instead"):
        describe_capture_view(
            t.permute(0, 2, 1, 3), num_planes=3, group_block_size=16, order=ViewOrder.BLOCK_TOKEN_PLANE
        )
    with pytest.raises(CaptureViewError, match="N=16"):
        describe_capture_view(t, num_planes=3, group_block_size=24, order=ViewOrder.BLOCK_TOKEN_PLANE)
    with pytest.raises(CaptureViewError, match="has 3 dims"):
        describe_capture_view(t[0], num_planes=3, group_block_size=16, order=ViewOrder.BLOCK_TOKEN_PLANE)
    with pytest.raises(CaptureViewError, match="hidden size 8"):
        describe_capture_view(t, num_planes=3, group_block_size=16, order=ViewOrder.BLOCK_TOKEN_PLANE, hidden_size=9)


def test_plane_labels_sorted_and_validated() -> None:
    labels = plane_labels([27, 2, 14], num_hidden_layers=28)
    assert labels.layer_ids == (2, 14, 27) and labels.plane_of(27) == 2 and labels.pre_norm
    with pytest.raises(LayerIdError, match="repeats \\[2\\]"):
        plane_labels([2, 2], num_hidden_layers=28)
    with pytest.raises(LayerIdError, match="outside"):
        plane_labels([0, 5], num_hidden_layers=28, min_id=1, max_id=27)
    with pytest.raises(LayerIdError, match="empty"):
        plane_labels([], num_hidden_layers=28)
