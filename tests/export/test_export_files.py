"""The file sink's record format: safetensors + JSON manifest, written atomically, verified on read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.errors import ChecksumMismatchError, RecordFailedError, RecordFormatError
from vllm_hs_compat.export import files


def _record(rid: str, tokens: int = 7) -> CaptureRecord:
    rows = torch.randn(tokens, 3, 16).to(torch.bfloat16)
    meta = RecordMeta.for_tensor(
        rid, rows, list(range(100, 100 + tokens)), [0, 2, 4], pre_norm=True, start=2, num_prompt_tokens=5
    )
    return CaptureRecord(meta, rows)


def test_a_record_without_its_token_ids_is_refused_by_the_sink_and_by_check(tmp_path: Path) -> None:
    """A descriptor's metadata (no token ids: they travel in the pool) is not a record's: the file sink and
    CaptureRecord.check refuse it by name; the control, the same record with its ids, is written and checks."""
    rec = _record("whole")
    header = CaptureRecord(rec.meta.without_token_ids(), rec.hidden_states)
    assert rec.meta.has_token_ids and not header.meta.has_token_ids
    with pytest.raises(RecordFormatError, match="no token ids"):
        files.write_record(tmp_path, header)
    with pytest.raises(RecordFormatError, match="no token ids"):
        header.check()
    assert not list(tmp_path.iterdir())
    rec.check()
    back = files.read_record(files.write_record(tmp_path, rec)).meta
    assert back == rec.meta.with_checksum(back.checksum or 0)


def test_roundtrip_keeps_rows_tokens_and_manifest(tmp_path: Path) -> None:
    rec = _record("cmpl-1")
    manifest = files.write_record(tmp_path, rec)
    got = files.read_record(manifest)
    assert torch.equal(got.hidden_states, rec.hidden_states)
    assert got.meta.token_ids == rec.meta.token_ids and got.meta.layer_ids == (0, 2, 4)
    assert got.meta.start == 2 and got.meta.num_prompt_tokens == 5 and got.meta.checksum is not None
    info = json.loads(manifest.read_text())
    assert info["shape"] == [7, 3, 16] and info["pre_norm"] is True and info["tensors"] == "cmpl-1.safetensors"
    assert [r.meta.record_id for r in files.iter_records(tmp_path)] == ["cmpl-1"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_unsafe_ids_get_distinct_file_names(tmp_path: Path) -> None:
    stems = {files.record_stem(r) for r in ("a/b", "a_b", "a:b", "../x", ".hidden")}
    assert len(stems) == 5 and all("/" not in s and not s.startswith(".") for s in stems)
    for rid in ("a/b", "a_b"):
        files.write_record(tmp_path, _record(rid))
    assert sorted(r.meta.record_id for r in files.iter_records(tmp_path)) == ["a/b", "a_b"]


def test_failure_and_damage_are_named(tmp_path: Path) -> None:
    files.write_failure(tmp_path, "r-x", "blocks", "ran past the cache")
    _, manifest, _ = files.record_paths(tmp_path, "r-x")
    with pytest.raises(RecordFailedError, match="blocks: ran past the cache"):
        files.read_record(manifest)
    good = files.write_record(tmp_path, _record("r-y"))
    tensors = good.with_name("r-y.safetensors")
    blob = bytearray(tensors.read_bytes())
    blob[-3] ^= 0xFF  # flip bits inside the hidden states
    tensors.write_bytes(bytes(blob))
    with pytest.raises(ChecksumMismatchError):
        files.read_record(good)
    bad = json.loads(good.read_text())
    bad["token_ids"] = bad["token_ids"][::-1]
    good.write_text(json.dumps(bad))
    with pytest.raises(RecordFormatError):
        files.read_record(good)


# --- compact storage ----------------------------------------------------------------------------------------------
def _outliers(rid: str, tokens: int = 40, hidden: int = 64) -> CaptureRecord:
    """Rows like a transformer's residual stream: most channels small, a few large outlier channels per plane."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(tokens, 3, hidden, generator=g)
    rows[:, :, 5] *= 40.0
    rows[:, 1, 17] += 300.0
    rows = rows.to(torch.bfloat16)
    return CaptureRecord(RecordMeta.for_tensor(rid, rows, list(range(tokens)), [2, 5, 9], pre_norm=True), rows)


def test_fp8_storage_halves_the_bytes_reads_back_in_the_captured_dtype_and_says_its_error(tmp_path: Path) -> None:
    rec = _outliers("r", tokens=64, hidden=1024)
    (tmp_path / "bf16").mkdir()
    (tmp_path / "fp8").mkdir()
    plain = files.write_record(tmp_path / "bf16", rec)
    compact = files.write_record(tmp_path / "fp8", rec, storage="fp8_e4m3")
    size = {k: (p.with_suffix(".safetensors")).stat().st_size for k, p in (("bf16", plain), ("fp8", compact))}
    assert size["fp8"] / size["bf16"] < 0.505, size  # 1 byte + 4 / 1024 per element, against 2
    got = files.read_record(compact)
    assert got.hidden_states.dtype == torch.bfloat16 and got.hidden_states.shape == rec.hidden_states.shape
    worst, mean = files.relative_error(got.hidden_states, rec.hidden_states)
    entry = json.loads(compact.read_text())["storage"]
    assert entry["kind"] == "fp8_e4m3" and entry["scales"] == "per_row"
    assert 0 < mean <= worst < 0.07, (worst, mean)  # e4m3: 3 mantissa bits, each row scaled onto [-448, 448]
    # the manifest's figures were measured on the exact rows (the read-back adds the bf16 rounding only)
    assert abs(entry["rel_error_max"] - worst) < 0.01
    assert got.meta.checksum == files.read_record(plain).meta.checksum  # the captured bytes' checksum, kept
    # control: the captured storage is bit for bit
    assert torch.equal(files.read_record(plain).hidden_states, rec.hidden_states)


def test_fp8_measured_in_one_go_equals_quantizing_and_measuring_apart() -> None:
    rows = _outliers("r", tokens=48, hidden=512).hidden_states.clone()
    rows[3, 1] = 0.0  # a row of zeros: scale 1, error 0
    q, scales, worst, mean = files.quantize_fp8_measured(rows)
    q2, scales2 = files.quantize_fp8(rows)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scales, scales2)
    assert (worst, mean) == files.relative_error(files.dequantize_fp8(q2, scales2, rows.dtype), rows)
    assert scales[3, 1] == 1.0 and 0 < mean < worst
    # control: measured against other rows, the one-go figures are not the apart ones
    assert files.relative_error(files.dequantize_fp8(q2, scales2, rows.dtype), rows.roll(1, 0))[0] > worst


def test_fp8_quantized_piece_by_piece_equals_the_whole_record_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long record is quantized in pieces (FP8_HOST_PIECE_BYTES here; bounded temporaries, the unit the device
    path copies): the same bytes, scales and figures as one piece.  Control: rows of another record differ."""
    rows = _outliers("r", tokens=48, hidden=512).hidden_states.clone()
    whole = files.quantize_fp8_measured(rows)
    monkeypatch.setattr(files, "FP8_HOST_PIECE_BYTES", 7 * 512 * rows.element_size())  # 7 rows a piece: ragged end
    pieces = files.quantize_fp8_measured(rows)
    assert torch.equal(pieces[0].view(torch.uint8), whole[0].view(torch.uint8)) and torch.equal(pieces[1], whole[1])
    assert pieces[2:] == whole[2:]
    other = files.quantize_fp8_measured(rows.roll(1, 0))
    assert not torch.equal(other[0].view(torch.uint8), whole[0].view(torch.uint8))


def test_fp8_storage_checks_its_stored_bytes(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    manifest = files.write_record(tmp_path, _outliers("r"), storage="fp8_e4m3")
    tensors_path = manifest.with_suffix(".safetensors")
    tensors = load_file(str(tensors_path))
    files.read_record(manifest)  # control: untouched, it reads
    q = tensors["hidden_states_fp8"].view(torch.uint8).clone()
    q[3, 1, 7] ^= 0x01
    tensors["hidden_states_fp8"] = q.view(torch.float8_e4m3fn)
    save_file(tensors, str(tensors_path))
    with pytest.raises(ChecksumMismatchError, match="stored fp8 bytes"):
        files.read_record(manifest)
    files.read_record(manifest, verify_checksum=False)  # asked not to verify: it reads


def test_a_storage_this_version_does_not_know_is_refused_by_name(tmp_path: Path) -> None:
    manifest = files.write_record(tmp_path, _outliers("r"), storage="fp8_e4m3")
    info = json.loads(manifest.read_text())
    info["storage"]["kind"] = "int4_grouped"
    manifest.write_text(json.dumps(info))
    with pytest.raises(RecordFormatError, match="stored as 'int4_grouped', which this version cannot read"):
        files.read_record(manifest)
    with pytest.raises(Exception, match="record storage 'zstd'"):
        files.write_record(tmp_path, _outliers("q"), storage="zstd")


def test_the_dataset_reads_a_compact_tree_as_it_reads_a_captured_one(tmp_path: Path) -> None:
    from vllm_hs_compat.trainer.dataset import HiddenStatesDataset

    recs = [_outliers(f"r{i}", tokens=10 + i) for i in range(3)]
    for rec in recs:
        files.write_record(tmp_path, rec, storage="fp8_e4m3")
    items = {item["record_id"]: item for item in HiddenStatesDataset.from_files(tmp_path)}
    assert sorted(items) == ["r0", "r1", "r2"]
    for rec in recs:
        got = items[rec.meta.record_id]["hidden_states"]
        assert got.dtype == torch.bfloat16 and files.relative_error(got, rec.hidden_states[:, -1])[0] < 0.07


def test_the_file_sink_takes_a_compact_storage_for_native_records_only(tmp_path: Path) -> None:
    from vllm_hs_compat.connector.config import ConnectorConfig
    from vllm_hs_compat.connector.sinks import FileSink
    from vllm_hs_compat.errors import CaptureConfigError

    sink = FileSink(str(tmp_path), storage="fp8_e4m3")
    sink.write(_outliers("r"))
    assert json.loads((tmp_path / "r.json").read_text())["storage"]["kind"] == "fp8_e4m3"
    for bad in ({"storage": "fp8_e4m3", "format": "speculators"}, {"storage": "fp4"}):
        with pytest.raises(CaptureConfigError, match="file.storage must be one of"):
            ConnectorConfig.from_extra({"sink": "file", "file": {"path": str(tmp_path), **bad}})
