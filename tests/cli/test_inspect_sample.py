"""``vllm-hs-compat inspect`` shows what a record was made for (schema 2's sample fields), and says so when a
record carries none."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from vllm_hs_compat.cli import main
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta, canonical_metadata
from vllm_hs_compat.export.files import write_record


def record(rid: str, **sample: object) -> CaptureRecord:
    rows = torch.randn(8, 2, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    meta = RecordMeta.for_tensor(rid, rows, list(range(8)), (3, 12), pre_norm=True, start=2, num_prompt_tokens=5)
    return CaptureRecord(msgspec.structs.replace(meta, **sample), rows)


def test_inspect_shows_the_sample_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = write_record(
        tmp_path,
        record(
            "a",
            sample_id="row-9",
            source="chat.jsonl:9",
            loss_mask_spans=((3, 5), (7, 10)),
            metadata_json=canonical_metadata({"lang": "de"}),
        ),
    )
    bare = write_record(tmp_path, record("b"))
    old = write_record(tmp_path, record("c", schema_version=1))
    assert main(["inspect", str(full), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["loss_mask_tokens"] == 5 and rep["manifest"]["sample_id"] == "row-9"
    assert rep["manifest"]["metadata"] == {"lang": "de"}
    assert main(["inspect", str(full)]) == 0
    out = capsys.readouterr().out
    assert "sample 'row-9'  source chat.jsonl:9" in out
    assert "loss mask: 5 of 8 rows trained: [3, 5), [7, 10)" in out and 'metadata {"lang": "de"}' in out
    assert main(["inspect", str(bare)]) == 0
    out = capsys.readouterr().out
    assert "sample (no id given)" in out and "loss mask: none given" in out and "metadata" not in out
    assert main(["inspect", str(old)]) == 0
    assert "sample: none (a schema-1 record carries no sample fields)" in capsys.readouterr().out
