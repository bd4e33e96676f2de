"""HiddenStatesDataset against real export producers (shared memory and NIXL over loopback, consumers in
DataLoader worker processes) and real file-sink records."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hsx_harness import ledger_balanced, wait_until
from torch.utils.data import DataLoader

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.errors import (
    ChecksumMismatchError,
    DatasetConfigError,
    LayoutError,
    RecordFailedError,
    RecordFormatError,
)
from vllm_hs_compat.export import ExportProducer
from vllm_hs_compat.export.control import TOKEN_ENV, TOKEN_FILE_ENV
from vllm_hs_compat.export.files import record_paths, write_failure, write_record
from vllm_hs_compat.trainer import LAYOUTS, HiddenStatesDataset, collate_padded, to_item

Make = Callable[..., ExportProducer]
LAYERS = (2, 5, 9, 12)  # 12 = num_hidden_layers of a 12-layer verifier: the base plane
T, C = 6, 8


def rows_of(seed: int, tokens: int = T, planes: int = 4, hidden: int = C, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, planes, hidden, generator=g).to(dtype)


def record_of(rid: str, seed: int, planes: int = 4, **kw: Any) -> CaptureRecord:
    rows = rows_of(seed, planes=planes, dtype=kw.pop("dtype", torch.bfloat16))
    ids = [(seed * 31 + i) % 1000 for i in range(rows.shape[0])]
    meta = RecordMeta.for_tensor(rid, rows, ids, LAYERS[-planes:], pre_norm=True, **kw)
    return CaptureRecord(meta, rows)


def publish(p: ExportProducer, rid: str, seed: int, **kw: Any) -> CaptureRecord:
    rec = record_of(rid, seed, **kw)
    p.publish(rec.meta, rec.hidden_states)
    return rec


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def loader(ds: HiddenStatesDataset, backend: str, workers: int = 2) -> DataLoader[Any]:
    # fork for shared memory (the dataset must not have opened anything before the fork); NIXL's UCX is not
    # fork-safe once initialised in the parent (the producer lives here), so its workers are spawned
    ctx = "fork" if backend == "shm" else "spawn"
    return DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=ctx)


# --- layouts ------------------------------------------------------------------------------------------------
def test_every_layout_places_the_planes_as_documented() -> None:
    rec = record_of("r", 1, dtype=torch.float32, start=2, num_prompt_tokens=4)
    hs = rec.hidden_states
    items = {layout: to_item(rec, layout) for layout in LAYOUTS}
    for item in items.values():
        assert item["record_id"] == "r" and item["num_prompt_tokens"] == 4 and item["start"] == 2
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].tolist() == list(rec.meta.token_ids)
        assert item["layer_ids"].tolist() == list(LAYERS)
        assert item["loss_mask"].tolist() == [1] * T
    e = items["eagle3"]
    assert same(e["hidden_states"], hs[:, 3])  # the base plane: layer 12, the largest id
    assert same(e["aux_hidden_states"], torch.cat([hs[:, 0], hs[:, 1], hs[:, 2]], dim=-1))  # [T, 3C]
    s = items["speculators"]
    assert same(s["hidden_states"], e["aux_hidden_states"]) and same(s["verifier_last_hidden_states"], hs[:, 3])
    assert s["lengths"].tolist() == [T] and s["position_ids"].tolist() == list(range(2, 2 + T))
    assert same(items["dflash"]["hidden_states"], torch.cat([hs[:, i] for i in range(4)], dim=-1))  # [T, 4C]
    assert same(items["planes"]["hidden_states"], hs)
    assert to_item(rec, "eagle3", dtype=torch.bfloat16)["aux_hidden_states"].dtype == torch.bfloat16
    # rows at positions 2..7, prompt of 4 tokens: positions 4.. are generated
    assert to_item(rec, "dflash", "generated")["loss_mask"].tolist() == [0, 0, 1, 1, 1, 1]
    assert to_item(rec, "dflash", lambda r: torch.arange(T) % 2)["loss_mask"].tolist() == [0, 1, 0, 1, 0, 1]


def test_a_one_plane_record_is_refused_by_the_eagle3_layouts_only() -> None:
    rec = record_of("one", 2, planes=1)
    for layout in ("eagle3", "speculators"):
        with pytest.raises(LayoutError, match="needs the auxiliary layers"):
            to_item(rec, layout)
    assert to_item(rec, "dflash")["hidden_states"].shape == (T, C)
    with pytest.raises(DatasetConfigError):
        HiddenStatesDataset.from_files(".", layout="eagle2")
    with pytest.raises(DatasetConfigError):
        HiddenStatesDataset.from_files(".", on_error="ignore")


# --- export -------------------------------------------------------------------------------------------------
def test_export_stream_yields_every_record_once(backend: str, make_producer: Make) -> None:
    p = make_producer()
    sent = {f"rec-{i}": publish(p, f"rec-{i}", i) for i in range(6)}
    ds = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=0.5)
    got = list(ds)
    assert [g["record_id"] for g in got] == list(sent)  # oldest first
    for g in got:
        hs = sent[g["record_id"]].hidden_states
        assert same(g["hidden_states"], hs[:, 3]) and same(g["aux_hidden_states"], hs[:, :3].reshape(T, 3 * C))
    assert ds.stats["records"] == 6 and ds.stats["errors"] == 0
    st = p.stats()
    assert st["delivered"] == 6
    ledger_balanced(st)


def test_two_dataloader_workers_share_the_stream_without_duplicates(backend: str, make_producer: Make) -> None:
    p = make_producer()
    ids = [f"w-{i}" for i in range(12)]
    for i, rid in enumerate(ids):
        publish(p, rid, i)
    # max_records: each worker stops at its share (6), so the pass ends as soon as the 12 are taken; wait_s is
    # the deadline should a worker see none (spawned NIXL workers take seconds to start)
    ds = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=30.0, max_records=12)
    got = [item["record_id"] for item in loader(ds, backend)]
    assert sorted(got) == sorted(ids) and len(got) == len(ids)  # each record to exactly one worker
    assert ds.stats["records"] == 12  # the workers' counters reach the main process
    st = p.stats()
    assert st["delivered"] == 12 and st["claimed"] == 12  # claimed once each: nobody was handed a record twice
    ledger_balanced(st)


def test_max_records_is_split_over_workers(make_producer: Make) -> None:
    p = make_producer()
    for i in range(9):
        publish(p, f"m-{i}", i)
    ds = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=2.0, max_records=5)
    got = [item["record_id"] for item in loader(ds, "shm")]
    assert len(got) == 5 and len(set(got)) == 5
    assert p.stats()["delivered"] == 5 and p.occupancy() == 4  # the other four are still there for the next


@pytest.mark.parametrize("backend", ["shm"])
def test_export_resume_continues_with_the_rest_exactly_once(backend: str, make_producer: Make) -> None:
    p = make_producer()
    ids = [f"s-{i}" for i in range(10)]
    for i, rid in enumerate(ids):
        publish(p, rid, i)
    first = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=0.5, max_records=8)
    it = iter(first)
    before = [next(it)["record_id"] for _ in range(4)]  # the trainer stops after 4 records
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint is JSON
    it.close()  # the iterator (and its consumer) go away: nothing claimed is left behind
    assert state == {"version": 1, "source": "export", "epoch": 0, "consumed": before}
    assert p.stats()["delivered"] == 4 and p.occupancy() == 6

    second = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=0.5, max_records=8)
    second.load_state_dict(state)
    after = [item["record_id"] for item in second]
    assert len(after) == 4  # max_records counts the consumed four as spent
    third = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=0.5)
    third.load_state_dict(second.state_dict())
    rest = [item["record_id"] for item in third]
    assert before + after + rest == ids  # every record exactly once, in order
    st = p.stats()
    assert st["delivered"] == 10 and st["abandoned"] == 0 and st["expired_claimed"] == 0
    ledger_balanced(st)
    with pytest.raises(DatasetConfigError, match="'export' dataset"):
        HiddenStatesDataset.from_files(".").load_state_dict(state)


def test_a_corrupt_record_on_the_way_is_counted_and_raised_or_skipped(backend: str, make_producer: Make) -> None:
    p = make_producer()
    publish(p, "a", 1)
    publish(p, "bent", 2)
    publish(p, "c", 3)
    lease = p.pool._by_record["bent"]
    p.transport.buffer[lease.offset + 10] ^= 0x10  # one bit flipped after publication
    ds = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=0.5)
    got = []
    with pytest.raises(ChecksumMismatchError, match="bent"):
        for item in ds:
            got.append(item["record_id"])
    assert got == ["a"]
    assert (ds.stats["errors"], ds.stats["checksum_failed"], ds.stats["skipped"]) == (1, 1, 0)
    assert [item["record_id"] for item in ds] == ["c"]  # a new iteration continues after the failed record

    publish(p, "d", 4)
    publish(p, "bent2", 5)
    publish(p, "e", 6)
    p.transport.buffer[p.pool._by_record["bent2"].offset + 3] ^= 0x01
    skip = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=0.5, on_error="skip")
    assert [item["record_id"] for item in skip] == ["d", "e"]
    assert (skip.stats["errors"], skip.stats["checksum_failed"], skip.stats["skipped"]) == (1, 1, 1)
    st = p.stats()
    assert (st["delivered"], st["checksum_failed"]) == (4, 2)
    ledger_balanced(st)


def test_a_ticket_alone_yields_its_own_record(make_producer: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(TOKEN_FILE_ENV, "/nonexistent/hs-no-token")
    p = make_producer()
    publish(p, "other", 1)
    rec = record_of("mine", 2)
    params = p.publish(rec.meta, rec.hidden_states).kv_transfer_params()
    ds = HiddenStatesDataset.from_export(params, wait_s=5.0, layout="planes")
    (item,) = list(ds)
    assert item["record_id"] == "mine" and same(item["hidden_states"], rec.hidden_states)
    wait_until(lambda: p.occupancy() == 1, 5.0, "the ticket's record to be released")  # "other" is untouched


# --- files --------------------------------------------------------------------------------------------------
def write_dir(d: Path, n: int) -> dict[str, CaptureRecord]:
    recs = {f"f-{i:02d}": record_of(f"f-{i:02d}", i) for i in range(n)}
    for rec in recs.values():
        write_record(d, rec)
    return recs


def test_file_records_in_every_layout(tmp_path: Path) -> None:
    recs = write_dir(tmp_path, 3)
    write_failure(tmp_path, "gone", "blocks_unreadable", "the request was preempted")
    for layout in LAYOUTS:
        ds = HiddenStatesDataset.from_files(tmp_path, layout=layout, on_error="skip")
        items = list(ds)
        assert [i["record_id"] for i in items] == list(recs)
        want = to_item(recs["f-00"], layout)
        assert set(items[0]) == set(want)
        for k, v in want.items():
            assert same(items[0][k], v) if isinstance(v, torch.Tensor) else items[0][k] == v
        assert (ds.stats["failed_at_source"], ds.stats["skipped"], ds.stats["records"]) == (1, 1, 3)
    with pytest.raises(RecordFailedError, match="preempted"):
        list(HiddenStatesDataset.from_files(tmp_path))
    one = HiddenStatesDataset.from_files(record_paths(tmp_path, "f-01")[0])  # a single .safetensors path
    assert [i["record_id"] for i in one] == ["f-01"]


def test_file_shards_over_two_workers_and_resume(tmp_path: Path) -> None:
    recs = write_dir(tmp_path, 7)
    ds = HiddenStatesDataset.from_files(tmp_path)
    got = [item["record_id"] for item in loader(ds, "shm")]
    assert sorted(got) == sorted(recs) and len(got) == 7
    assert ds.stats["records"] == 7

    first = HiddenStatesDataset.from_files(tmp_path)
    it = iter(first)
    before = [next(it)["record_id"] for _ in range(3)]
    state = first.state_dict()
    it.close()
    resumed = HiddenStatesDataset.from_files(tmp_path)
    resumed.load_state_dict(state)
    after = [item["record_id"] for item in loader(resumed, "shm")]  # resumed with workers
    assert sorted(before + after) == sorted(recs) and not set(before) & set(after)
    assert resumed.stats["resume_skipped"] == 3
    # with workers the loop reports what it consumed
    resumed.mark_consumed(after)
    assert sorted(resumed.state_dict()["consumed"]) == sorted(recs)
    # a pass that runs to its end starts the next epoch, which reads every record again
    again = HiddenStatesDataset.from_files(tmp_path)
    assert len(list(again)) == 7 and again.epoch == 1 and again.state_dict()["consumed"] == []
    assert len(list(again)) == 7 and again.epoch == 2
    assert len(list(HiddenStatesDataset.from_files(tmp_path, max_records=2))) == 2


def test_corrupt_and_truncated_files_are_counted(tmp_path: Path) -> None:
    write_dir(tmp_path, 4)
    tensors = record_paths(tmp_path, "f-01")[0]
    blob = bytearray(tensors.read_bytes())
    blob[-5] ^= 0x40  # a bit of the hidden states or token ids
    tensors.write_bytes(bytes(blob))
    cut = record_paths(tmp_path, "f-02")[0]
    cut.write_bytes(cut.read_bytes()[:100])
    record_paths(tmp_path, "f-03")[1].write_text("{not json")
    ds = HiddenStatesDataset.from_files(tmp_path, on_error="skip")
    assert [i["record_id"] for i in ds] == ["f-00"]
    st = ds.stats
    assert st["errors"] == 3 and st["skipped"] == 3
    assert st["checksum_failed"] + st["bad_format"] == 3 and st["bad_format"] >= 2
    with pytest.raises(RecordFormatError):
        list(HiddenStatesDataset.from_files(record_paths(tmp_path, "f-02")[1]))


def test_records_holding_nan_or_inf_are_never_items(tmp_path: Path) -> None:
    """Records whose checksums verify (they are of the NaN rows) but whose rows hold NaN or Inf: counted
    ``non_finite`` and raised (or skipped), by the iterable dataset over files and by the map-style one; the
    finite records around them are items.  The convert command notes them failed (``non_finite``) and exits 1."""
    from vllm_hs_compat.cli import main
    from vllm_hs_compat.errors import NonFiniteRecordError
    from vllm_hs_compat.trainer import RecordFileDataset

    for k, value in ((0, None), (1, float("nan")), (2, float("inf")), (3, None)):
        rec = record_of(f"f-{k:02d}", k)
        if value is not None:
            rec.hidden_states[k, 1, 2] = value
        write_record(tmp_path, CaptureRecord(rec.meta, rec.hidden_states))  # checksummed as they are
    ds = HiddenStatesDataset.from_files(tmp_path, on_error="skip")
    assert [i["record_id"] for i in ds] == ["f-00", "f-03"]
    assert (ds.stats["errors"], ds.stats["non_finite"], ds.stats["skipped"]) == (2, 2, 2)
    with pytest.raises(NonFiniteRecordError, match=r"record 'f-01' \(read by the trainer dataset"):
        list(HiddenStatesDataset.from_files(tmp_path))
    mapped = RecordFileDataset(tmp_path)
    assert mapped[0]["hidden_states"].isfinite().all()
    with pytest.raises(NonFiniteRecordError, match="the first at position 2"):
        mapped[2]
    assert main(["convert", str(tmp_path), "--to", "native", "--out", str(tmp_path / "out")]) == 1
    assert sorted(p.name for p in (tmp_path / "out").glob("*.json")) == [
        "f-00.json", "f-01.error.json", "f-02.error.json", "f-03.json", "hs_format.json",
    ]  # fmt: skip
    assert "non_finite" in (tmp_path / "out" / "f-01.error.json").read_text()


def test_collate_padded_batches_items_of_different_lengths(tmp_path: Path) -> None:
    short = record_of("short", 1)
    rows = rows_of(2, tokens=9)
    long_ = CaptureRecord(RecordMeta.for_tensor("long", rows, list(range(9)), LAYERS, pre_norm=True), rows)
    for rec in (short, long_):
        write_record(tmp_path, rec)
    ds = HiddenStatesDataset.from_files(tmp_path, layout="speculators")
    (batch,) = list(DataLoader(ds, batch_size=2, collate_fn=collate_padded))
    assert batch["record_id"] == ["long", "short"]
    assert batch["hidden_states"].shape == (2, 9, 3 * C) and batch["verifier_last_hidden_states"].shape == (2, 9, C)
    assert batch["lengths"].tolist() == [9, T] and batch["attention_mask"].sum(dim=1).tolist() == [9, T]
    assert same(batch["verifier_last_hidden_states"][1, :T], short.hidden_states[:, 3])
    assert batch["verifier_last_hidden_states"][1, T:].abs().sum() == 0 and batch["loss_mask"][1, T:].sum() == 0
    assert batch["input_ids"][1, :T].tolist() == list(short.meta.token_ids)
    with pytest.raises(DatasetConfigError):
        collate_padded([to_item(short, "eagle3"), to_item(short, "dflash")])


# --- at-least-once: redelivered records -------------------------------------------------------------------------
def _slow_first_transfer(monkeypatch: pytest.MonkeyPatch, pause_s: float) -> None:
    """The first read of the stream outlasts its lease (a trainer slower than lease_ttl_s)."""
    from vllm_hs_compat.export.consumer import Reads

    real = Reads._transfer
    calls = [0]

    def slow(self: Any, *a: Any, **kw: Any) -> Any:
        out = real(self, *a, **kw)
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(pause_s)
        return out

    monkeypatch.setattr(Reads, "_transfer", slow)


def test_a_lease_that_expired_under_the_stream_is_skipped_and_the_record_comes_again(
    backend: str, make_producer: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = make_producer(lease_ttl_s=0.3)
    rec = publish(p, "late", 1)
    _slow_first_transfer(monkeypatch, 0.6)  # the release is then past half the TTL: its verdict is waited for
    ds = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=1.0, max_records=1, batch=1)  # on_error="raise"
    got = list(ds)
    assert [g["record_id"] for g in got] == ["late"] and same(got[0]["hidden_states"], rec.hidden_states[:, 3])
    assert (ds.stats["records"], ds.stats["lease_expired"], ds.stats["errors"], ds.stats["duplicates"]) == (1, 1, 0, 0)
    st = p.stats()
    assert (st["delivered"], st["redelivered"], st["stale_releases"], st["expired_claimed"]) == (1, 1, 1, 0)
    ledger_balanced(st)
    # the negative control: a producer without redelivery loses the record (counted at both ends)
    q = make_producer(lease_ttl_s=0.3, max_redeliveries=0)
    publish(q, "lost", 2)
    _slow_first_transfer(monkeypatch, 0.6)
    lost = HiddenStatesDataset.from_export(q.endpoint, q.token, wait_s=1.0, max_records=1)
    assert list(lost) == [] and lost.stats["lease_expired"] == 1
    assert (q.stats()["expired_claimed"], q.stats()["delivered"]) == (1, 0)


@pytest.mark.parametrize("backend", ["shm"])  # a forked worker: not with a NIXL producer in this process
@pytest.mark.parametrize("window", [None, 0], ids=["dedupe", "no-dedupe"])
def test_a_record_handed_out_twice_is_dropped_by_the_dataset(
    backend: str, make_producer: Make, monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    """The duplicate at-least-once allows: the consumer posted its release and handed the record out before the
    producer's verdict (``defer_releases``), the lease had expired meanwhile, the producer requeued the record and
    the same stream claimed it again.  The dataset (here in a DataLoader worker, whose items the resume state
    does not see) yields it once and counts the duplicate; with ``dedupe_window=0`` (the negative control) the
    duplicate reaches the training loop."""
    from vllm_hs_compat.export.consumer import releases as consumer_releases

    p = make_producer(lease_ttl_s=0.3)
    publish(p, "twice", 1)
    publish(p, "other", 2)
    monkeypatch.setattr(consumer_releases, "DEFER_FRACTION", 100.0)  # every release posted, its verdict taken as given
    _slow_first_transfer(monkeypatch, 0.6)  # (both patches reach the forked worker)
    kw = {} if window is None else {"dedupe_window": window}
    ds = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=1.0, **kw)
    got = [g["record_id"] for g in loader(ds, "shm", workers=1)]
    if window is None:
        assert got == ["twice", "other"]
        assert (ds.stats["records"], ds.stats["duplicates"], ds.stats["lease_expired"]) == (2, 1, 0)
    else:
        assert got == ["twice", "other", "twice"] and ds.stats["duplicates"] == 0
    st = p.stats()
    assert (st["delivered"], st["redelivered"], st["stale_releases"]) == (2, 1, 1)  # delivered once at the producer
    ledger_balanced(st)
    with pytest.raises(DatasetConfigError, match="dedupe_window"):
        HiddenStatesDataset.from_export(p.endpoint, p.token, dedupe_window=-1)


def test_the_dedupe_window_is_bounded() -> None:
    from vllm_hs_compat.trainer.dataset import _Recent

    recent = _Recent(3)
    for rid in ("a", "b", "c", "a", "d"):
        recent.add(rid)
    assert len(recent) == 3 and "a" not in recent and {"b", "c", "d"} <= {r for r in "abcd" if r in recent}


@pytest.mark.parametrize("backend", ["shm"])
def test_a_slow_training_loop_does_not_end_the_stream(backend: str, make_producer: Make) -> None:
    """``wait_s`` is time without records while asking the producers: a training loop that spends longer than
    that on each item (the stream suspended at its yield) still gets every record.  (Before, the idle clock ran
    during the yield, and this stream ended after the first record with three still at the producer.)"""
    p = make_producer()
    for i in range(4):
        publish(p, f"slow-{i}", i)
    ds = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=0.2)
    got = []
    for item in ds:
        got.append(item["record_id"])
        time.sleep(0.3)  # a training step longer than wait_s
    assert got == [f"slow-{i}" for i in range(4)] and p.occupancy() == 0
    # wait_s=0: what is there now, then the end (one empty answer)
    publish(p, "now", 9)
    assert [i["record_id"] for i in HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=0)] == ["now"]
