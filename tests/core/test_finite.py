"""``core.finite``: the NaN/Inf check every record goes through where it is made and where it is read.

The masked-bits reduction must agree with ``torch.isfinite`` on every value a float can hold (NaN of either sign and
payload, +-Inf, the largest finite value, subnormals, zeros) in bf16, fp16 and fp32, for any position of the bad
value; the message names the first position and the layer id.  Negative control: an exponent mask one bit short
(what a wrong constant would do) calls the largest finite values non-finite, or misses Inf, and is caught here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat.core import finite
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.errors import NonFiniteRecordError, RecordFormatError

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _specials(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    return [float("nan"), float("inf"), float("-inf"), info.max, -info.max, info.tiny, info.tiny / 4, 0.0, -0.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_flags_equal_isfinite_on_every_special_value(dtype: torch.dtype) -> None:
    for value in _specials(dtype):
        for t in range(5):
            rows = torch.randn(5, 3, 8).to(dtype)
            rows[t, 2, 7] = value
            want = torch.isfinite(rows.float()).reshape(5, -1).all(1)
            assert torch.equal(finite.token_flags(rows), want), (dtype, value, t)
    # a negative NaN and a NaN with another payload (bits set below the exponent)
    int_dtype, mask = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00)}.get(
        dtype, (torch.int32, 0x7F800000)
    )
    rows = torch.zeros(2, 1, 4, dtype=dtype)
    rows.view(int_dtype)[1, 0, 0] = mask | 1
    rows.view(int_dtype)[1, 0, 1] = -1  # all bits set: a negative NaN
    assert finite.token_flags(rows).tolist() == [True, False]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 33), st.sampled_from(DTYPES), st.data())
def test_token_flags_agree_with_isfinite_on_random_rows(t: int, p: int, c: int, dtype: torch.dtype, data) -> None:  # type: ignore[no-untyped-def]
    rows = torch.randn(t, p, c).to(dtype)
    for _ in range(data.draw(st.integers(0, 3))):
        at = (data.draw(st.integers(0, t - 1)), data.draw(st.integers(0, p - 1)), data.draw(st.integers(0, c - 1)))
        rows[at] = data.draw(st.sampled_from(_specials(dtype)))
    assert torch.equal(finite.token_flags(rows), torch.isfinite(rows.float()).reshape(t, -1).all(1))


@pytest.mark.parametrize("block_rows", [1, 3, 7, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_host_flags_in_cache_sized_blocks_flag_exactly_the_bad_row(
    dtype: torch.dtype, block_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU check masks rows a block at a time: a bad value in any row -- first or last of a block, in the last
    (partial) block -- flags that row alone, for blocks of one row, several, and more than the tensor."""
    t, p, c = 23, 2, 8
    monkeypatch.setattr(finite, "_HOST_BLOCK_BYTES", block_rows * p * c * torch.finfo(dtype).bits // 8)
    for value in (float("nan"), float("inf")):
        for row in range(t):
            rows = torch.randn(t, p, c).to(dtype)
            rows[row, p - 1, c - 1] = value
            want = [i != row for i in range(t)]
            assert finite.token_flags(rows).tolist() == want, (dtype, block_rows, value, row)


def test_negative_control_a_mask_one_bit_short_is_caught() -> None:
    """The masks themselves: one bit short, the largest finite bf16 looks non-finite (its exponent bits but one are
    set); the true mask tells them apart."""
    rows = torch.tensor([[torch.finfo(torch.bfloat16).max]], dtype=torch.bfloat16)
    bits = rows.view(torch.int16)
    assert int((bits & 0x7F00).amax()) == 0x7F00  # a 0x7F00 mask would call this value NaN/Inf
    assert finite.token_flags(rows).tolist() == [True]


def test_problem_names_rows_values_position_and_layer_ids() -> None:
    rows = torch.randn(10, 3, 4, dtype=torch.bfloat16)
    assert finite.problem(rows) is None
    rows[6, 2, 1] = float("nan")
    rows[8, 0, 0] = float("inf")
    text = finite.problem(rows, start=100, layer_ids=(2, 16, 32))
    assert text is not None
    assert text.startswith("2 of 10 token rows hold NaN/Inf (2 values; the first at position 106, layer ids [32])")
    assert "max_position_embeddings" in text
    # flags computed earlier (the device path) are taken as given
    assert finite.problem(rows, torch.ones(10, dtype=torch.bool)) is None


def test_check_record_raises_a_named_record_format_error() -> None:
    rows = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    rec = CaptureRecord(RecordMeta.for_tensor("r1", rows, [1, 2, 3, 4], (1, 4), pre_norm=True), rows)
    finite.check_record(rec, "read here")  # finite: no error
    rows[1, 1, 1] = float("-inf")
    with pytest.raises(NonFiniteRecordError, match=r"record 'r1' \(read here\): 1 of 4 token rows") as err:
        finite.check_record(rec, "read here")
    assert isinstance(err.value, RecordFormatError)  # readers that catch bad records catch this one too


def test_token_flags_of_fp8_e4m3fn_equal_isfinite_on_all_256_bit_patterns() -> None:
    """fp8 storage's NaN/Inf check reads the stored bytes: e4m3fn has no Inf and one NaN per sign (S.1111.111), so
    every low bit is in the mask.  All 256 patterns, each alone in a row.  Negative control: the exponent bits alone
    (0x78, the bf16-style mask) would call the finite 448 and -448 (S.1111.110) non-finite."""
    rows = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).reshape(256, 1, 1)
    want = torch.isfinite(rows.float()).reshape(256)
    assert int((~want).sum()) == 2  # 0x7F and 0xFF
    assert torch.equal(finite.token_flags(rows), want)
    wide = torch.zeros(256, 3, 5, dtype=torch.float8_e4m3fn)
    wide[:, 2, 4] = rows[:, 0, 0]
    assert torch.equal(finite.token_flags(wide), want)
    max_fp8 = torch.tensor([[448.0, -448.0]]).to(torch.float8_e4m3fn)
    assert int((max_fp8.view(torch.uint8) & 0x78).amax()) == 0x78 and finite.token_flags(max_fp8).tolist() == [True]
