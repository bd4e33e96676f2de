"""The record's sample fields (schema 2) through the export (shm) and the file sink: bit-exact round trips on
every read path, schema-1 records still read, a descriptor whose sample fields do not fit its record fails alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hsx_harness import producer_factory, wait_until
from hsx_testdata import make_meta, make_rows

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta, canonical_metadata
from vllm_hs_compat.errors import RecordFormatError
from vllm_hs_compat.export import DescriptorError, ExportConsumer, ExportProducer, files
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.batch import RecordBatch


@pytest.fixture
def producer() -> Iterator[ExportProducer]:
    with producer_factory("shm") as make:
        yield make()


def sampled(rid: str, seed: int, kind: str) -> tuple[Any, RecordMeta]:
    rows = make_rows(seed, 6, 2, 16)
    meta = msgspec.structs.replace(make_meta(rid, rows, seed), start=3, num_prompt_tokens=5)
    if kind == "sample":
        meta = msgspec.structs.replace(
            meta,
            sample_id=f"row-{seed}",
            source=f"chat.jsonl:{seed}",
            loss_mask_spans=((3, 4), (5, 9)),
            metadata_json=canonical_metadata({"seed": seed, "tags": ["a", "ü"]}),
        )
    elif kind == "v1":
        meta = msgspec.structs.replace(meta, schema_version=1)
    return rows, meta


KINDS = ["sample", "plain", "v1", "sample"]


def publish(p: ExportProducer) -> dict[str, RecordMeta]:
    sent = {}
    for i, kind in enumerate(KINDS):
        rows, meta = sampled(f"r-{i}", i, kind)
        p.publish(meta, rows)
        sent[meta.record_id] = meta
    return sent


def same(got: RecordMeta, want: RecordMeta) -> None:
    assert got == msgspec.structs.replace(want, checksum=got.checksum)


def test_sample_fields_travel_the_export_on_every_read_path(producer: ExportProducer) -> None:
    sent = publish(producer)
    with ExportConsumer(producer.endpoint, producer.token) as c:
        got = c.next_batches(max_records=16, wait_s=0.5)
        batches = [b for b in got if isinstance(b, RecordBatch)]
        assert len(got) == len(batches) == 2  # schema 2 and schema 1 records never share a batch
        for b in batches:
            for i, rid in enumerate(b.record_ids):
                same(b.meta(i), sent[rid])
                same(b[i].meta, sent[rid])
                assert b.sample(i) == sent[rid].sample
            for rec in b.records():
                same(rec.meta, sent[rec.meta.record_id])
        m = batches[0].meta(0)
        assert m.loss_mask().tolist() == [1, 0, 1, 1, 1, 1]  # type: ignore[union-attr]
        assert m.metadata == {"seed": 0, "tags": ["a", "ü"]}
    wait_until(lambda: producer.occupancy() == 0, 5.0, "every lease to be released")
    sent = publish(producer)  # the one-record path (claim + read) and the record stream
    with ExportConsumer(producer.endpoint, producer.token) as c:
        same(c.fetch("r-0").meta, sent["r-0"])
        same(c.fetch("r-2").meta, sent["r-2"])
        recs = list(c.iter_records(batch=8, wait_s=0.2, idle_timeout_s=0.3))
        assert sorted(r.meta.record_id for r in recs) == ["r-1", "r-3"]
        for r in recs:
            same(r.meta, sent[r.meta.record_id])


def test_a_descriptor_whose_spans_leave_its_record_fails_alone(producer: ExportProducer) -> None:
    """The wire bounds each field; the spans' order and range are checked against the record it describes (as the
    descriptor is decoded: a RecordMeta that describes no record cannot be made, so the bad one is sent as a map)."""
    sent = publish(producer)
    lease = producer.pool._by_record["r-3"]
    desc = msgspec.to_builtins(P.decode_descriptor(lease.wire))
    desc["meta"]["loss_mask_spans"] = [[3, 4], [8, 10]]  # rows are positions 3..8
    lease.wire = msgspec.msgpack.encode(desc)
    with ExportConsumer(producer.endpoint, producer.token) as c:
        got = c.next_batches(max_records=16, wait_s=0.5)
        errors = [g for g in got if not isinstance(g, RecordBatch)]
        ids = sorted(r for b in got if isinstance(b, RecordBatch) for r in b.record_ids)
        assert ids == ["r-0", "r-1", "r-2"]
        assert len(errors) == 1 and isinstance(errors[0], DescriptorError)
        assert "'r-3'" in str(errors[0]) and "runs past position 9" in str(errors[0])
    assert sorted(sent) == ["r-0", "r-1", "r-2", "r-3"]


def test_sample_fields_in_the_file_manifest_and_schema_1_files_still_read(tmp_path: Path) -> None:
    for kind in ("sample", "plain", "v1"):
        rows, meta = sampled(f"f-{kind}", 7, kind)
        manifest = files.write_record(tmp_path, CaptureRecord(meta, rows))
        raw = json.loads(manifest.read_text())
        assert raw["schema_version"] == meta.schema_version
        if kind == "sample":
            assert raw["sample_id"] == "row-7" and raw["loss_mask_spans"] == [[3, 4], [5, 9]]
            assert raw["metadata"] == {"seed": 7, "tags": ["a", "ü"]}
        if kind == "v1":
            assert "sample_id" not in raw and "metadata" not in raw
        same(files.read_record(manifest).meta, meta)
    # a manifest edited by hand to a span outside its record is refused by name
    path = tmp_path / "f-sample.json"
    raw = json.loads(path.read_text())
    raw["loss_mask_spans"] = [[0, 4]]
    path.write_text(json.dumps(raw))
    with pytest.raises(RecordFormatError, match="before position 3"):
        files.read_record(path)


def test_the_producer_refuses_a_record_without_its_token_ids(producer: ExportProducer) -> None:
    """A descriptor's metadata (no token ids) published as a record is refused and counted ``bad_records``; the
    control, the same record with its ids, is published."""
    rows, meta = sampled("no-ids", 1, "sample")
    with pytest.raises(RecordFormatError, match="no token ids"):
        producer.publish(meta.without_token_ids(), rows)
    assert producer.stats()["bad_records"] == 1
    producer.publish(meta, rows)
    assert producer.stats()["bad_records"] == 1 and producer.flush(5)
