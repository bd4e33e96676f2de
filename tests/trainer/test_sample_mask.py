"""A record's own loss mask (schema 2 ``loss_mask_spans``) reaches the trainer: dataset items (files and the
export stream), the map-style dataset's metadata, the padded batch, and the trainer formats' ``loss_mask`` field;
a record without one gets the documented default (all ones) and every output says which mask it used."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from hsx_harness import producer_factory, wait_until

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta, canonical_metadata
from vllm_hs_compat.errors import LayoutError
from vllm_hs_compat.export.files import write_record
from vllm_hs_compat.trainer import FormatWriter, HiddenStatesDataset, RecordFileDataset, collate_padded

LAYERS = (2, 5, 9, 12)
T, C = 6, 8
SPANS = ((11, 13), (14, 16))  # rows are positions 10..15
MASK = [0, 1, 1, 0, 1, 1]


def rec(rid: str, seed: int, spans: tuple[tuple[int, int], ...] | None) -> CaptureRecord:
    rows = torch.randn(T, len(LAYERS), C, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    meta = RecordMeta.for_tensor(rid, rows, [seed + i for i in range(T)], LAYERS, True, start=10, num_prompt_tokens=12)
    if spans is not None:
        meta = msgspec.structs.replace(
            meta,
            sample_id=f"s-{seed}",
            source=f"d.jsonl:{seed}",
            loss_mask_spans=spans,
            metadata_json=canonical_metadata({"k": seed}),
        )
    return CaptureRecord(meta, rows)


def test_file_items_carry_the_records_mask_and_say_which(tmp_path: Path) -> None:
    write_record(tmp_path, rec("a", 1, SPANS))
    write_record(tmp_path, rec("b", 2, None))  # negative control: no mask given
    write_record(tmp_path, rec("c", 3, ()))  # a mask that trains nothing
    items = {i["record_id"]: i for i in HiddenStatesDataset.from_files(tmp_path)}  # default loss_mask="auto"
    assert items["a"]["loss_mask"].tolist() == MASK and items["a"]["loss_mask_from"] == "record"
    assert items["a"]["sample_id"] == "s-1"
    assert items["b"]["loss_mask"].tolist() == [1] * T and items["b"]["loss_mask_from"] == "all"
    assert items["b"]["sample_id"] == ""
    assert items["c"]["loss_mask"].tolist() == [0] * T and items["c"]["loss_mask_from"] == "record"
    # asked explicitly: other masks ignore the record's, and "record" refuses a record without one
    gen = {i["record_id"]: i for i in HiddenStatesDataset.from_files(tmp_path, loss_mask="generated")}
    assert gen["a"]["loss_mask"].tolist() == [0, 0, 1, 1, 1, 1] and gen["a"]["loss_mask_from"] == "generated"
    ds = HiddenStatesDataset.from_files(tmp_path, loss_mask="record", on_error="skip")
    assert [i["record_id"] for i in ds] == ["a", "c"] and ds.stats["layout_refused"] == 1
    with pytest.raises(LayoutError, match="'b' carries no loss mask"):
        list(HiddenStatesDataset.from_files(tmp_path, loss_mask="record"))
    batch = collate_padded([items["a"], items["b"]])
    assert batch["loss_mask_from"] == ["record", "all"] and batch["sample_id"] == ["s-1", ""]
    mapped = RecordFileDataset(tmp_path)
    assert mapped[0]["loss_mask"].tolist() == MASK and all(isinstance(v, torch.Tensor) for v in mapped[0].values())
    m = mapped.metadata(0)
    assert (m["sample_id"], m["source"], m["loss_mask_spans"], m["metadata"]) == (
        "s-1",
        "d.jsonl:1",
        [[11, 13], [14, 16]],
        {"k": 1},
    )
    assert mapped.metadata(1)["loss_mask_spans"] is None


def test_export_items_carry_the_records_mask() -> None:
    """Shared memory only: the sample fields travel in the descriptor, the same on every transport."""
    with producer_factory("shm") as make:
        p = make()
        for r in (rec("a", 1, SPANS), rec("b", 2, None)):
            p.publish(r.meta, r.hidden_states)
        ds = HiddenStatesDataset.from_export(p.endpoint, token=p.token, max_records=2, wait_s=5.0)
        items = {i["record_id"]: i for i in ds}
        assert items["a"]["loss_mask"].tolist() == MASK and items["a"]["loss_mask_from"] == "record"
        assert items["b"]["loss_mask_from"] == "all"
        wait_until(lambda: p.occupancy() == 0, 5.0, "every lease to be released")


def test_formats_write_the_records_mask_and_count_which(tmp_path: Path) -> None:
    for fmt in ("specforge-dflash", "modelopt"):
        out = tmp_path / fmt
        w = FormatWriter(out, fmt, num_hidden_layers=12)
        w.write(rec("a", 1, SPANS))
        w.write(rec("b", 2, None))  # negative control: the documented default, counted as such
        summary = w.close()
        assert summary["loss_mask"] == {"asked": "auto", "used": {"all": 1, "record": 1}}
        assert json.loads((out / "hs_format.json").read_text())["loss_mask"] == summary["loss_mask"]
        files = sorted(out.rglob("*.ckpt")) if fmt == "specforge-dflash" else [out / "a.pt", out / "b.pt"]
        masks = [torch.load(f, weights_only=True)["loss_mask"].tolist() for f in files]
        assert masks == [MASK, [1] * T]
    sp = FormatWriter(tmp_path / "sp", "speculators", num_hidden_layers=12)  # rows.jsonl: its Arrow rows' source
    sp.write(rec("a", 1, SPANS))
    sp.write(rec("b", 2, None))
    rows = [json.loads(line) for line in (tmp_path / "sp" / "rows.jsonl").read_text().splitlines()]
    assert [r["loss_mask"] for r in rows] == [MASK, [1] * T]
    assert sp.summary()["loss_mask"] == {"asked": "auto", "used": {"all": 1, "record": 1}}
    w = FormatWriter(tmp_path / "all", "modelopt", num_hidden_layers=12, loss_mask="all")
    w.write(rec("a", 1, SPANS))
    assert w.close()["loss_mask"] == {"asked": "all", "used": {"all": 1}}
    assert torch.load(tmp_path / "all" / "a.pt", weights_only=True)["loss_mask"].tolist() == [1] * T
