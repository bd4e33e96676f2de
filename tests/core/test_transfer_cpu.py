from __future__ import annotations

import pytest
import torch

from vllm_hs_compat.core import ViewOrder, describe_capture_view, manager_slots
from vllm_hs_compat.core.transfer import copy_rows_async
from vllm_hs_compat.errors import TransferError


def test_cpu_copy_is_complete_at_once_and_checks_the_destination() -> None:
    cache = torch.arange(6 * 4 * 2 * 3, dtype=torch.float32).view(6, 4, 2, 3)
    view = describe_capture_view(cache, num_planes=2, group_block_size=4, order=ViewOrder.BLOCK_TOKEN_PLANE)
    slots = manager_slots("r", [5, 2], group_block_size=4, num_tokens=6)
    out = torch.empty(6, 2, 3)
    pending = copy_rows_async(cache, view, slots, out=out)
    assert pending.done() and pending.wait() is out
    assert torch.equal(out, torch.cat([cache[5], cache[2, :2]]))
    with pytest.raises(TransferError, match="expected \\[6, 2, 3\\]"):
        copy_rows_async(cache, view, slots, out=torch.empty(5, 2, 3))
