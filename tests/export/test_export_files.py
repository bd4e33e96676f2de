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


def test_roundtrip_keeps_rows_tokens_and_manifest(tmp_path: Path) -> None:
    rec = _record("cmpl-1")
    manifest = files.write_record(tmp_path, rec)
    got = files.read_record(manifest)
    assert torch.equal(got.hidden_states, rec.hidden_states)
    assert got.meta.token_ids == rec.meta.token_ids and got.meta.layer_ids == (0, 2, 4)
    assert got.meta.start == 2 and got.meta.num_prompt_tokens == 5 and got.meta.checksum is not None
    info = json.loads(manifest.read_text())
    assert info["shape"] == [7, 3, 16] and info["pre_norm"] is True and info["tensors"] == "cmpl-1.safetensors"
    assert [r.meta.request_id for r in files.iter_records(tmp_path)] == ["cmpl-1"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_unsafe_ids_get_distinct_file_names(tmp_path: Path) -> None:
    stems = {files.record_stem(r) for r in ("a/b", "a_b", "a:b", "../x", ".hidden")}
    assert len(stems) == 5 and all("/" not in s and not s.startswith(".") for s in stems)
    for rid in ("a/b", "a_b"):
        files.write_record(tmp_path, _record(rid))
    assert sorted(r.meta.request_id for r in files.iter_records(tmp_path)) == ["a/b", "a_b"]


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
