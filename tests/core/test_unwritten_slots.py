"""``core.slots.unwritten_slots``: the device-side slot check (the connector queues it on the writing stream and
reads its verdicts later).  Held against a plain Python reading of the same question on random steps: ranges of
slots (some written, some not), vLLM's padding slot -1 and out-of-range garbage in the slot mapping, empty ranges.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat.core.slots import unwritten_slots


def _reference(ranges: list[list[int]], written: list[int]) -> list[tuple[int, int]]:
    """Per range: how many slots ``written`` lacks and the offset of the first (0 where none)."""
    have = set(written)
    out = []
    for r in ranges:
        gone = [i for i, s in enumerate(r) if s not in have]
        out.append((len(gone), gone[0] if gone else 0))
    return out


def _run(ranges: list[list[int]], written: list[int], num_slots: int) -> torch.Tensor:
    slots = torch.tensor([s for r in ranges for s in r], dtype=torch.int64)
    which = torch.tensor([i for i, r in enumerate(ranges) for _ in r], dtype=torch.int64)
    starts = torch.tensor([0, *[len(r) for r in ranges]][:-1], dtype=torch.int64).cumsum(0)
    return unwritten_slots(slots, which, starts, torch.tensor(written, dtype=torch.int64), num_slots=num_slots)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), num_slots=st.integers(1, 200), k=st.integers(1, 6))
def test_verdicts_match_a_plain_reading_of_the_step(data: st.DataObject, num_slots: int, k: int) -> None:
    slot = st.integers(0, num_slots - 1)
    ranges = [data.draw(st.lists(slot, min_size=0, max_size=12, unique=True)) for _ in range(k)]
    kept = [s for r in ranges for s in r if data.draw(st.booleans())]
    noise = data.draw(st.lists(st.one_of(st.just(-1), slot, st.integers(num_slots, num_slots + 50),
                                         st.integers(-50, -2)), max_size=10))  # fmt: skip
    written = data.draw(st.permutations(kept + noise))
    got = _run(ranges, written, num_slots)
    assert [(int(a), int(b)) for a, b, _ in got.tolist()] == _reference(ranges, written)
    for r, (_, first, s) in zip(ranges, got.tolist(), strict=True):
        if r:
            assert s == r[first]  # the first missing slot (the one the message names), else the range's first


def test_a_step_that_wrote_every_slot_finds_nothing_and_one_missing_slot_is_named() -> None:
    ranges = [[12, 13, 14, 15, 29], [16, 17, 18]]
    everything = [12, 13, 14, 15, 29, 16, 17, 18, -1, -1]
    assert _run(ranges, everything, 64).tolist() == [[0, 0, 12], [0, 0, 16]]
    # the control: slot 29 (position 4 of the first range) written as 28 instead
    assert _run(ranges, [28 if s == 29 else s for s in everything], 64).tolist()[0] == [1, 4, 29]
