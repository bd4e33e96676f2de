"""``RowBatches``: the capture's rows in batches, retries first, and the tail of a run whose adoption overlaps the
engine in halving batches (the batch adopted after the engine's last step is small)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_hs_compat.capture.batches import TAIL_MIN_SHARE, RowBatches
from vllm_hs_compat.errors import CaptureConfigError


class Counted:
    """An iterator over ``range(n)`` that counts the rows read from it."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, 0

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self.read >= self.n:
            raise StopIteration
        self.read += 1
        return self.read - 1


def sizes(source: RowBatches) -> tuple[list[int], list[int]]:
    got: list[int] = []
    order: list[int] = []
    while batch := source.take():
        got.append(len(batch))
        order += batch
    return got, order


@pytest.mark.parametrize(
    ("rows", "size", "want"),
    [
        (256, 64, [64, 64, 64, 32, 16, 8, 8]),
        (100, 64, [50, 25, 13, 8, 4]),
        (12, 2, [2, 2, 2, 2, 2, 1, 1]),
        (5, 64, [5]),  # fewer rows than the smallest tail batch: one batch
        (0, 64, []),
    ],
)
def test_the_tail_halves_down_to_its_smallest_batch_and_every_row_goes_once_in_order(
    rows: int, size: int, want: list[int]
) -> None:
    got, order = sizes(RowBatches(Counted(rows), size, shrink=True))
    assert got == want
    assert order == list(range(rows))
    assert not want or want[-1] <= max(1, size // TAIL_MIN_SHARE) or len(want) == 1


def test_control_without_shrink_the_last_batch_is_a_whole_one() -> None:
    """A serial run (each batch adopted before the next reaches the engine): whole batches to the end."""
    got, order = sizes(RowBatches(Counted(256), 64, shrink=False))
    assert got == [64, 64, 64, 64]
    assert order == list(range(256))


@pytest.mark.parametrize("shrink", [True, False])
def test_reads_at_most_two_batches_ahead_of_what_was_taken(shrink: bool) -> None:
    rows = Counted(1000)
    source = RowBatches(rows, 10, shrink=shrink)
    taken = 0
    for _ in range(30):
        taken += len(source.take())
        assert rows.read - taken <= (20 if shrink else 0)
    assert taken == 300


def test_rows_to_try_again_go_first_and_count_in_the_batch() -> None:
    source = RowBatches(Counted(40), 8, shrink=True)
    assert source.take() == list(range(8))
    source.retry.extend(["a", "b", "c"])
    assert source.take() == ["a", "b", "c", 8, 9, 10, 11, 12]
    rest = sizes(source)[1]
    assert rest == list(range(13, 40))
    source.retry.extend(["d"])  # retried after the rows ran out: still handed out
    assert source.take() == ["d"] and source.take() == []


def test_a_batch_size_below_one_is_refused() -> None:
    with pytest.raises(CaptureConfigError, match="--batch-size 0"):
        RowBatches(Counted(3), 0, shrink=True)
