"""RecordMeta validation and the checksums (pure; no second process needed)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta, compute_checksum, dtype_name
from vllm_hs_compat.errors import ChecksumMismatchError, RecordFormatError


def reference_bsum64(data: bytes) -> int:
    """Independent implementation of the documented bsum64 definition (numpy, explicit modulo)."""
    n = len(data)
    whole = n // 4096 * 4096
    crc = zlib.crc32(n.to_bytes(8, "little"))
    if whole:
        words = np.frombuffer(data[:whole], dtype="<u8").reshape(-1, 512)
        sums = [int(sum(int(w) for w in row) % (1 << 64)) for row in words[:2]]  # first blocks by hand
        fast = words.sum(axis=1, dtype=np.uint64)
        assert [int(x) for x in fast[:2]] == sums
        crc = zlib.crc32(fast.astype("<u8").tobytes(), crc)
    if whole < n:
        crc = zlib.crc32(data[whole:], crc)
    return crc & 0xFFFFFFFF


def u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=20_000))
def test_bsum64_matches_its_definition_and_crc32_matches_zlib(data: bytes) -> None:
    t = u8(data)
    assert compute_checksum(t, "bsum64") == reference_bsum64(data)
    assert compute_checksum(t, "crc32") == zlib.crc32(data) & 0xFFFFFFFF


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3 * 4096 + 77), st.data())
def test_bsum64_detects_any_single_byte_change_and_block_swaps(n: int, data: st.DataObject) -> None:
    raw = bytearray(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes())
    base = compute_checksum(u8(bytes(raw)))
    i = data.draw(st.integers(0, n - 1))
    delta = data.draw(st.integers(1, 255))
    bent = bytearray(raw)
    bent[i] = (bent[i] + delta) % 256
    assert compute_checksum(u8(bytes(bent))) != base
    if n >= 2 * 4096:
        swapped = raw[4096:8192] + raw[:4096] + raw[8192:]
        if swapped != raw:
            assert compute_checksum(u8(bytes(swapped))) != base
    assert compute_checksum(u8(bytes(raw[:-1]))) != base  # truncation


def meta(**kw: object) -> RecordMeta:
    base: dict[str, object] = dict(
        request_id="r", token_ids=(1, 2), layer_ids=(3, 7), pre_norm=True, dtype="bfloat16", shape=(2, 2, 8)
    )
    base.update(kw)
    return RecordMeta(**base)  # type: ignore[arg-type]


def test_meta_round_trips_through_a_plain_dict() -> None:
    m = meta(checksum=123, vllm_version="0.21.0", adapter="v0_21")
    assert RecordMeta.from_dict(m.to_dict()) == m
    assert m.nbytes == 2 * 2 * 8 * 2


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"token_ids": (1,)}, "token ids"),
        ({"layer_ids": (7, 3)}, "ascending"),
        ({"layer_ids": (3, 3)}, "ascending"),
        ({"layer_ids": (3,)}, "layer ids"),
        ({"dtype": "complex64"}, "dtype"),
        ({"shape": (2, 2)}, "shape"),
        ({"shape": (0, 2, 8), "token_ids": ()}, "tokens"),
        ({"checksum": -1}, "checksum"),
        ({"checksum_algorithm": "md5"}, "checksum"),
        ({"request_id": ""}, "request_id"),
        ({"token_ids": (1, -5)}, "token_ids"),
        ({"pre_norm": 1}, "pre_norm"),
        ({"schema_version": 2}, "schema"),
    ],
)
def test_meta_validation_names_the_problem(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(RecordFormatError, match=needle):
        meta(**kw)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("shape"),
        lambda d: d.update(extra=1),
        lambda d: d.update(shape=[2, 2, "8"]),
        lambda d: d.update(token_ids="12"),
        lambda d: d.update(checksum=True),
        lambda d: d.update(shape=[2, 2, 8, 1]),
    ],
)
def test_from_dict_is_strict(mutate: object) -> None:
    d = meta().to_dict()
    mutate(d)  # type: ignore[operator]
    with pytest.raises(RecordFormatError):
        RecordMeta.from_dict(d)
    with pytest.raises(RecordFormatError):
        RecordMeta.from_dict([1, 2])


def test_for_tensor_and_check() -> None:
    rows = torch.randn(4, 2, 16).to(torch.float16)
    m = RecordMeta.for_tensor("q", rows, [5, 6, 7, 8], [1, 9], pre_norm=False)
    assert m.shape == (4, 2, 16) and m.dtype == "float16" and m.checksum is None
    flat = rows.contiguous().view(torch.uint8).reshape(-1)
    rec = CaptureRecord(m.with_checksum(compute_checksum(flat)), rows)
    rec.check()
    rows.view(torch.int16)[0, 0, 0] ^= 1
    with pytest.raises(ChecksumMismatchError):
        rec.check()
    with pytest.raises(RecordFormatError):
        CaptureRecord(m, rows[:2]).check()
    with pytest.raises(RecordFormatError):
        dtype_name(torch.complex64)
    with pytest.raises(RecordFormatError):
        RecordMeta.for_tensor("q", rows[0], [5], [1, 9], pre_norm=False)
    with pytest.raises(RecordFormatError):
        compute_checksum(rows)
