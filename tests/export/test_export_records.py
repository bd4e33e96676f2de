"""RecordMeta validation and the checksums (pure; no second process needed)."""

from __future__ import annotations

import warnings
import zlib

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat.core.records import (
    CaptureRecord,
    ChecksumState,
    RecordMeta,
    checksum_bytes,
    compute_checksum,
    dtype_name,
)
from vllm_hs_compat.errors import ChecksumMismatchError, RecordFormatError


def u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=20_000))
def test_checksums_are_the_libraries_own(data: bytes) -> None:
    t = u8(data)
    assert compute_checksum(t, "xxh3_64") == xxhash.xxh3_64_intdigest(data)
    assert compute_checksum(t, "crc32") == zlib.crc32(data) & 0xFFFFFFFF
    assert checksum_bytes(data, "xxh3_64") == compute_checksum(t) == checksum_bytes(memoryview(data))
    if len(data) > 4:  # chunked updates give the same value
        s = ChecksumState("xxh3_64", len(data)).update(t[:3]).update(t[3:])
        assert s.digest() == compute_checksum(t)


@settings(max_examples=60, deadline=None)
@given(st.integers(16, 3 * 4096 + 77), st.data())
def test_checksum_detects_byte_changes_word_swaps_block_swaps_and_truncation(n: int, data: st.DataObject) -> None:
    raw = bytearray(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes())
    base = compute_checksum(u8(bytes(raw)))
    i = data.draw(st.integers(0, n - 1))
    delta = data.draw(st.integers(1, 255))
    bent = bytearray(raw)
    bent[i] = (bent[i] + delta) % 256
    assert compute_checksum(u8(bytes(bent))) != base
    # two 8-byte words swapped inside one 4 KiB block: the case the old bsum64 (per-block sums) could not see
    w = data.draw(st.integers(0, n // 8 - 2))
    swapped = bytearray(raw)
    swapped[8 * w : 8 * w + 8], swapped[8 * w + 8 : 8 * w + 16] = raw[8 * w + 8 : 8 * w + 16], raw[8 * w : 8 * w + 8]
    if swapped != raw:
        assert compute_checksum(u8(bytes(swapped))) != base
    if n >= 2 * 4096:
        blocks = raw[4096:8192] + raw[:4096] + raw[8192:]
        if blocks != raw:
            assert compute_checksum(u8(bytes(blocks))) != base
    assert compute_checksum(u8(bytes(raw[:-1]))) != base  # truncation


def test_unknown_or_removed_checksum_algorithms_are_named() -> None:
    for name in ("bsum64", "md5"):
        with pytest.raises(RecordFormatError, match="xxh3_64"):
            compute_checksum(u8(b"abc"), name)


def meta(**kw: object) -> RecordMeta:
    base: dict[str, object] = dict(
        record_id="r", token_ids=(1, 2), layer_ids=(3, 7), pre_norm=True, dtype="bfloat16", shape=(2, 2, 8)
    )
    base.update(kw)
    return RecordMeta(**base)  # type: ignore[arg-type]


def test_meta_round_trips_through_a_plain_dict() -> None:
    m = meta(checksum=(1 << 64) - 1, vllm_version="0.21.0", adapter="v0_21")  # xxh3_64 fills 64 bits
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
        ({"checksum": 1 << 64}, "checksum"),
        ({"checksum_algorithm": "md5"}, "checksum"),
        ({"record_id": ""}, "record_id"),
        ({"token_ids": (1, -5)}, "token_ids"),
        ({"pre_norm": 1}, "pre_norm"),
        ({"schema_version": 3}, "schema"),
        ({"schema_version": 0}, "schema"),
    ],
)
def test_meta_validation_names_the_problem(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(RecordFormatError, match=needle):
        meta(**kw)


def test_request_id_still_works_with_a_deprecation_warning() -> None:
    """The id's old name (``request_id``, before ``record_id`` was its one name) works for one more release, as a
    keyword and as an attribute, and says so each time; the control: the new name does not warn."""
    with pytest.warns(DeprecationWarning, match="'request_id' is now 'record_id'"):
        old = RecordMeta(  # type: ignore[call-arg]
            request_id="r", token_ids=(1, 2), layer_ids=(3, 7), pre_norm=True, dtype="bfloat16", shape=(2, 2, 8)
        )
    assert old == meta()
    with pytest.warns(DeprecationWarning, match="'request_id' is now 'record_id'"):
        assert old.request_id == "r"
    with pytest.raises(TypeError, match="both"), pytest.warns(DeprecationWarning):
        RecordMeta("r", (1, 2), (3, 7), True, "bfloat16", (2, 2, 8), request_id="r")  # type: ignore[call-arg]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert meta().record_id == "r"


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
