"""The harness's answers where Model Runner V1 is gone (0.34+), each with the negative control that must fail.

Where a release deleted V1, the harness computes slot mappings with Model Runner V2's own
``BlockTables.compute_slot_mappings`` and ``_compute_slot_mappings_kernel`` (run on the harness's CPU ``tl``
executor), and asks V2's speculator code which slot mapping the capture layer is written with.  The tests below
exist only on such releases (a fact: ``vllm.v1.worker.block_table`` is absent); the Triton-gate test runs on every
release and checks the harness answered the gate exactly where the release has one.
"""

from __future__ import annotations

import random
from typing import Any

import harness as h
import pytest
import torch

from vllm_hs_compat import api

pytestmark = pytest.mark.vllm


def test_the_triton_gate_is_answered_only_where_the_cpu_platform_refuses_and_only_inside_that_check() -> None:
    """0.34's ``CpuPlatform.check_and_update_config`` refuses any config on x86 without Triton; the harness answers
    that one read (``force_cpu_platform``), so ``HAS_TRITON`` is still False outside it.  Negative control: the
    unanswered method refuses the same config.  Releases that only warn there (0.33 and earlier) are left alone."""
    from vllm.platforms.cpu import CpuPlatform

    triton_utils = __import__("vllm.triton_utils", fromlist=["HAS_TRITON"])
    fn = CpuPlatform.__dict__["check_and_update_config"].__func__
    cfg = h.make_vllm_config(hma=True)  # built through the (answered) check
    assert triton_utils.HAS_TRITON is False, "the harness must never make Triton look installed outside the check"
    consts = getattr(fn, "__wrapped__", fn).__code__.co_consts
    refuses = any(isinstance(c, str) and "requires Triton" in c for c in consts)
    assert getattr(fn, "_hs_compat_triton_gate", False) is refuses
    if refuses:
        with pytest.raises(RuntimeError, match="requires Triton"):
            fn.__wrapped__(CpuPlatform, cfg)
        assert triton_utils.HAS_TRITON is False


if not h.has_v1_block_table():

    def _batch(rng: random.Random, block_size: int) -> list[h.ScheduledRequest]:
        free = list(range(1, 64))
        rng.shuffle(free)
        batch = []
        for i in range(4):
            n = rng.randint(1, 5 * block_size)
            start = rng.randint(0, n - 1)
            need = -(-n // block_size)
            blocks, free = free[:need], free[need:]
            batch.append(h.ScheduledRequest(f"r{i}", blocks, start, n - start))
        return batch

    def _library_slots(batch: list[h.ScheduledRequest], block_size: int) -> torch.Tensor:
        """The manager slots of each request's positions, from its block ids (the package's own arithmetic)."""
        out = []
        for r in batch:
            for p in range(r.num_computed, r.num_computed + r.num_tokens):
                out.append(r.block_ids[p // block_size] * block_size + p % block_size)
        return torch.tensor(out, dtype=torch.int64)

    def _slots(batch: list[h.ScheduledRequest], block_size: int) -> torch.Tensor:
        return h.compute_slot_mapping(
            batch, block_size=block_size, kernel_block_size=block_size, path=h.slot_mapping_path()
        )

    def test_the_v2_kernel_gives_the_slots_of_each_requests_blocks() -> None:
        path = h.slot_mapping_path()
        assert path.v2 and "compute_slot_mappings" in path.name
        rng = random.Random(34)
        for block_size in (16, 5, 64):
            batch = _batch(rng, block_size)
            assert torch.equal(_slots(batch, block_size), _library_slots(batch, block_size)), block_size

    def test_negative_control_a_kernel_whose_pad_program_writes_nothing_is_caught(
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """V2's last program pads the slot buffer past the batch with ``PAD_SLOT_ID`` (CUDA graphs replay the
        padded tail); the harness checks that it did.  An executor that drops that program's stores (the only
        stores of a constant) is caught."""
        real = h._Ptr.store

        def drop_constant_stores(self: Any, value: Any, mask: Any) -> None:
            if isinstance(value, torch.Tensor):
                real(self, value, mask)

        batch = _batch(random.Random(1), 16)
        _slots(batch, 16)  # control: the kernel as vLLM launches it
        monkeypatch.setattr(h._Ptr, "store", drop_constant_stores)
        with pytest.raises(AssertionError, match="pad program"):
            _slots(batch, 16)

    def test_negative_control_an_executor_that_misreads_the_pointer_table_is_caught(
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The kernel reads each group's block table through a table of addresses; an executor resolving an
        address to the wrong rows (here: an all-zero table) yields slots the package's arithmetic disagrees with."""
        real = h._TritonLanguage.cast

        def wrong_rows(self: Any, value: Any, to: Any) -> Any:
            ptr = real(self, value, to)
            return h._Ptr(torch.zeros_like(ptr.base)) if isinstance(to, h._PointerType) else ptr

        batch = _batch(random.Random(2), 16)
        assert torch.equal(_slots(batch, 16), _library_slots(batch, 16))
        monkeypatch.setattr(h._TritonLanguage, "cast", wrong_rows)
        assert not torch.equal(_slots(batch, 16), _library_slots(batch, 16))

    def test_the_capture_group_answer_comes_from_v2s_speculator_code(monkeypatch: pytest.MonkeyPatch) -> None:
        """A hybrid verifier with HMA gives the capture layer a group of its own: V2's per-layer slot map hands it
        that group's row.  Negative control: a per-layer map that hands every layer group 0's row (what V1's
        proposer did before 0.22) makes the answer False, and test_release then expects the package to refuse."""
        cfg = h.make_vllm_config(hma=True)
        layer = h.make_capture_layer(cfg)
        worker = h.build_kv_cache_configs(cfg, layer, "hybrid").worker
        assert h.group_index_of(worker, h.CAPTURE_LAYER) > 0
        assert h.proposer_records_capture_group(worker) is True
        assert api.get_adapter().proposer_uses_group0_slots is False
        attn_utils = __import__("vllm.v1.worker.gpu.attn_utils", fromlist=["build_slot_mappings_by_layer"])
        speculator = __import__("vllm.v1.worker.gpu.spec_decode.speculator", fromlist=["build_slot_mappings_by_layer"])

        def group0(slot_mappings: torch.Tensor, kv_cache_config: Any) -> dict[str, torch.Tensor]:
            return {n: slot_mappings[0] for g in kv_cache_config.kv_cache_groups for n in g.layer_names}

        monkeypatch.setattr(attn_utils, "build_slot_mappings_by_layer", group0)
        monkeypatch.setattr(speculator, "build_slot_mappings_by_layer", group0)
        assert h.proposer_records_capture_group(worker) is False
