"""The capture's output tree (vllm_hs_compat/capture/store.py) on real files and real processes.

Records are the package's own files (export/files.py) of random tensors, staged as the connector's file sink
writes them.  Killed runs are real processes (forked from a forkserver that imported torch once, so a child costs
milliseconds, not the seconds of a fresh interpreter) killed with SIGKILL, by the store's own test hook at a named
point or from outside at a random time.  Every check has a negative control that must fail: the same kills with
the store's safety turned off (``capture/durable.py``'s ``_UNSAFE``: parts and manifests written in place, no
recovery) must leave a duplicate or a half record the check finds."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import store_driver  # noqa: E402
from store_driver import RUN_CONFIG, run, sample_id, stage, token_ids  # noqa: E402

from vllm_hs_compat.capture.store import (  # noqa: E402
    Breaker,
    CaptureStore,
    CaptureStoreError,
    CircuitOpenError,
    Retry,
    RunConfigMismatchError,
    SampleInfo,
    read_index,
    read_summary,
)
from vllm_hs_compat.core.records import CaptureRecord  # noqa: E402
from vllm_hs_compat.export import files  # noqa: E402

_CTX = multiprocessing.get_context("forkserver")
# The forkserver does not take this process's sys.path (3.11), so it preloads what store_driver imports, by names
# importable everywhere; the child then imports store_driver itself in a few milliseconds.
_CTX.set_forkserver_preload(
    [
        "pytest",
        "torch",
        "safetensors.torch",
        "pyarrow.parquet",
        "vllm_hs_compat.export.files",
        "vllm_hs_compat.capture.store",
    ]
)

N = 20
MISMATCH = frozenset({3})
KILLED = -signal.SIGKILL


def child(out: Path, **kw: object) -> multiprocessing.Process:
    p = _CTX.Process(target=store_driver.run, args=(str(out),), kwargs=kw)
    p.start()
    return p


def run_child(out: Path, **kw: object) -> int | None:
    p = child(out, **kw)
    p.join(120)
    return p.exitcode


def check_tree(out: Path, samples: int = N, mismatch: frozenset[int] = MISMATCH) -> list[str]:
    """Everything that is wrong with the tree at ``out`` after a finished run (empty: exactly one verified record
    per sample, the index consistent with the folders, nothing left over).  Reads the parts with pyarrow itself."""
    problems: list[str] = []
    try:
        index = read_index(out)
    except Exception as e:  # a damaged part is a finding
        return [f"read_index: {type(e).__name__}: {e}"]
    raw_ok: dict[str, int] = {}
    for part in sorted((out / "index").glob("rank-*-part-*.parquet")):
        t = pq.read_table(part)
        for sid, st in zip(t.column("sample_id").to_pylist(), t.column("status").to_pylist(), strict=True):
            if st == "ok":
                raw_ok[sid] = raw_ok.get(sid, 0) + 1
    problems += [f"{sid}: {n} ok rows in the parts" for sid, n in raw_ok.items() if n != 1]
    rows = index.to_pylist()
    ok = {r["sample_id"]: r for r in rows if r["status"] == "ok"}
    failed = {r["sample_id"]: r for r in rows if r["status"] == "failed"}
    want = {sample_id(i) for i in range(samples) if i not in mismatch}
    if set(ok) != want:
        problems.append(f"ok samples: missing {sorted(want - set(ok))}, extra {sorted(set(ok) - want)}")
    for i in mismatch:
        if failed.get(sample_id(i), {}).get("reason") != "tokenizer_mismatch":
            problems.append(f"{sample_id(i)}: expected a tokenizer_mismatch row, found {failed.get(sample_id(i))}")
    named: set[Path] = set()
    for sid, r in ok.items():
        manifest = out / r["record"]
        try:
            rec = files.read_record(manifest)
        except Exception as e:
            problems.append(f"{sid}: record {r['record']} does not verify: {e}")
            continue
        if rec.meta.checksum != r["checksum"] or rec.meta.token_ids != token_ids(int(sid[1:])):
            problems.append(f"{sid}: record {r['record']} is not this sample's")
        named |= {manifest, manifest.with_name(json.loads(manifest.read_text())["tensors"])}
    on_disk = {p for p in out.glob("shard-*/*") if p.is_file()}
    if on_disk != named:
        problems.append(f"files no index row names: {sorted(str(p.relative_to(out)) for p in on_disk - named)}")
    leftovers = [p for p in out.rglob("*") if p.is_file() and (p.name.endswith(".tmp") or ".staging" in p.parts)]
    leftovers += list((out / "index").glob("*.journal"))
    if leftovers:
        problems.append(f"left over: {sorted(str(p.relative_to(out)) for p in leftovers)}")
    return problems


# --- kill and resume --------------------------------------------------------------------------------------------
# (hook point, n-th time, what the killed tree must show: proof the kill hit the window it names)
KILLS = {
    # mid-shard: 7 adopted with 5 per shard = shard 1 holds two journaled records no part names
    "mid-shard": (("adopt.after_journal", 7), lambda out: len(list(out.glob("index/*.journal"))) == 1),
    # mid-index-write: the second part's temporary file half written
    "mid-index-write": (("index.mid_write", 2), lambda out: len(list(out.glob("index/.rank-0-part-00001*"))) == 1),
    # the second part complete under its temporary name, not renamed
    "before-index-rename": (("index.before_rename", 2), lambda out: len(list(out.glob("index/*.parquet"))) == 1),
    # between moving the tensors and writing the manifest: tensors in the shard, no manifest beside them
    "between-tensors-and-manifest": (
        ("adopt.after_tensors", 4),
        lambda out: len(list(out.glob("shard-*/*.safetensors"))) == len(list(out.glob("shard-*/*.json"))) + 1,
    ),
    # record complete in the shard, no journal line for it yet
    "before-journal": (("adopt.after_manifest", 3), lambda out: len(list(out.glob("shard-*/*.json"))) == 3),
}


@pytest.mark.parametrize("where", sorted(KILLS))
def test_kill_and_resume(tmp_path: Path, where: str) -> None:
    kill, shows = KILLS[where]
    assert run_child(tmp_path, samples=N, kill=kill, mismatch=MISMATCH) == KILLED
    assert shows(tmp_path), f"the kill at {kill} did not leave the state it names"
    assert check_tree(tmp_path), "the killed tree already passes: the check cannot tell"
    summary = run(str(tmp_path), samples=N, mismatch=MISMATCH)
    assert check_tree(tmp_path) == []
    assert summary.tree_records == N - len(MISMATCH)
    assert summary.captured + summary.skipped == N - len(MISMATCH)  # each sample captured once or skipped


@pytest.mark.parametrize("where", ["mid-shard", "mid-index-write", "between-tensors-and-manifest"])
def test_kill_and_resume_negative_control_unsafe(tmp_path: Path, where: str) -> None:
    """The same kills with the safety off: the check must find a duplicate or a half or damaged record."""
    kill, shows = KILLS[where]
    assert run_child(tmp_path, samples=N, kill=kill, mismatch=MISMATCH, unsafe=True) == KILLED
    try:
        run(str(tmp_path), samples=N, mismatch=MISMATCH, unsafe=True)
    except CaptureStoreError:
        pass  # a half-written part refuses the resume: found, too
    finally:
        from vllm_hs_compat.capture import durable

        durable._UNSAFE = False
    assert check_tree(tmp_path) != []


def test_kill_again_during_resume_then_finish(tmp_path: Path) -> None:
    """Killed mid-shard, then the resume killed mid-index-write, then between tensors and manifest: the last run
    still ends with exactly one verified record per sample."""
    assert run_child(tmp_path, samples=N, kill=("adopt.after_journal", 7), mismatch=MISMATCH) == KILLED
    assert run_child(tmp_path, samples=N, kill=("index.mid_write", 1), mismatch=MISMATCH) == KILLED
    assert run_child(tmp_path, samples=N, kill=("adopt.after_tensors", 2), mismatch=MISMATCH) == KILLED
    run(str(tmp_path), samples=N, mismatch=MISMATCH)
    assert check_tree(tmp_path) == []


def test_kill_at_random_times(tmp_path: Path) -> None:
    """SIGKILL from outside at random times (seeded) while a run adopts, three times, then a run to the end.  The
    killed runs go through the driver's command line (``store_driver.main``)."""
    rng = random.Random(19)
    kills = 0
    argv = ["--out", str(tmp_path), "--samples", str(N), "--per-shard", "3", "--delay", "0.01", "--mismatch", "3"]
    for _ in range(3):
        p = _CTX.Process(target=store_driver.main, args=(argv,))
        p.start()
        time.sleep(rng.uniform(0.02, 0.2))
        if p.is_alive():
            os.kill(p.pid or 0, signal.SIGKILL)
            kills += 1
        p.join(60)
    assert kills >= 1, "no run was killed: raise the delays"
    run(str(tmp_path), samples=N, mismatch=MISMATCH, per_shard=3)
    assert check_tree(tmp_path) == []


# --- ranks ------------------------------------------------------------------------------------------------------
def _records(out: Path) -> dict[str, tuple[int, tuple[int, ...]]]:
    """sample id -> (checksum of the record's bytes, token ids), read back from the files."""
    got = {}
    for r in read_index(out).to_pylist():
        if r["status"] == "ok":
            rec = files.read_record(out / r["record"])
            got[r["sample_id"]] = (rec.meta.checksum, rec.meta.token_ids)
    return got


def test_two_ranks_in_two_processes_equal_one_rank(tmp_path: Path) -> None:
    two, one, half = tmp_path / "two", tmp_path / "one", tmp_path / "half"
    n = 40
    ranks = [child(two, samples=n, rank=r, world_size=2, mismatch=MISMATCH) for r in (0, 1)]
    run(str(one), samples=n, mismatch=MISMATCH)
    for p in ranks:
        p.join(120)
        assert p.exitcode == 0
    assert check_tree(two, samples=n) == [] and check_tree(one, samples=n) == []
    by_rank = {r["sample_id"]: r["rank"] for r in read_index(two).to_pylist()}
    assert set(by_rank.values()) == {0, 1}
    assert _records(two) == _records(one)
    s = read_summary(two)
    assert (s.ranks, s.captured, s.tree_records, s.closed) == ([0, 1], n - 1, n - 1, True)
    assert s.failed == {"tokenizer_mismatch": 1} and s.rows_read == 2 * n
    # negative control: one rank of two alone is not the whole set
    run(str(half), samples=n, rank=0, world_size=2, mismatch=MISMATCH)
    assert _records(half) != _records(one)


def test_world_size_change_recovers_the_gone_ranks_leftovers(tmp_path: Path) -> None:
    """Rank 1 of 2 killed mid-shard; the tree is then finished by one rank: it recovers rank 1's journal."""
    assert (
        run_child(tmp_path, samples=N, rank=1, world_size=2, kill=("adopt.after_journal", 2), mismatch=MISMATCH)
        == KILLED
    )
    assert list(tmp_path.glob("index/rank-1.journal"))
    run(str(tmp_path), samples=N, mismatch=MISMATCH)
    assert check_tree(tmp_path) == []
    assert {r["rank"] for r in read_index(tmp_path).to_pylist() if r["status"] == "ok"} == {0, 1}


def test_owns_is_a_deterministic_partition(tmp_path: Path) -> None:
    stores = [CaptureStore(tmp_path, run_config=RUN_CONFIG, rank=r, world_size=3) for r in range(3)]
    try:
        ids = [f"id-{i}" for i in range(300)]
        owners = [[s.owns(i) for s in stores].count(True) for i in ids]
        assert owners == [1] * len(ids)
        shares = [sum(s.owns(i) for i in ids) for s in stores]
        assert min(shares) > 60, shares  # xxh3 spreads ids; a constant split would put all on one rank
    finally:
        for s in stores:
            s.close()
    with pytest.raises(CaptureStoreError, match="rank 3 is outside world size 3"):
        CaptureStore(tmp_path, run_config=RUN_CONFIG, rank=3, world_size=3)


def test_one_process_per_rank(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, run_config=RUN_CONFIG, rank=0, world_size=2):
        with pytest.raises(CaptureStoreError, match="held by another running process"):
            CaptureStore(tmp_path, run_config=RUN_CONFIG, rank=0, world_size=2)
        CaptureStore(tmp_path, run_config=RUN_CONFIG, rank=1, world_size=2).close()  # control: another rank opens
    CaptureStore(tmp_path, run_config=RUN_CONFIG, rank=0, world_size=2).close()  # released at close


# --- resume rules ---------------------------------------------------------------------------------------------
def test_resume_with_other_run_config_is_refused(tmp_path: Path) -> None:
    run(str(tmp_path), samples=4, mismatch=frozenset())
    other = {**RUN_CONFIG, "layers": [1, 3], "extra": True}
    with pytest.raises(RunConfigMismatchError) as e:
        CaptureStore(tmp_path, run_config=other)
    msg = str(e.value)
    assert "layers: tree has [1, 2], this run has [1, 3]" in msg and "extra" in msg and "model" not in msg
    assert "another --out" in msg
    # control: the same settings resume, everything done is skipped
    s = run(str(tmp_path), samples=4, mismatch=frozenset())
    assert (s.captured, s.skipped, s.tree_records) == (0, 4, 4)


def test_token_id_mismatch_is_a_failure_not_an_adoption(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, run_config=RUN_CONFIG) as store:
        info, manifest = stage(store.staging_dir(), 5, wrong_ids=True)
        row = store.adopt(info, manifest)
        assert (row.status, row.reason, row.record) == ("failed", "tokenizer_mismatch", None)
        assert "differ from the sample's" in (row.message or "") and not store.done(info.sample_id)
        assert "at position 0" in (row.message or "")  # the first position that differs is named
        assert list(store.staging_dir().iterdir()) == []  # the wrong record is gone, not adopted
        # control: the right ids are adopted
        info2, manifest2 = stage(store.staging_dir(), 6)
        assert store.adopt(info2, manifest2).status == "ok" and store.done(info2.sample_id)
        # a record of a longer prompt that begins like the sample's is not the sample's either
        longer = SampleInfo(**{**_fields(info2), "sample_id": "s0099", "input_ids": token_ids(6)[:-1]})
        _, manifest3 = stage(store.staging_dir(), 6)
        assert store.adopt(longer, manifest3).reason == "tokenizer_mismatch"
    assert list(tmp_path.glob("shard-*/*.json")) == [tmp_path / "shard-0-00000" / "s0006.json"]
    # failed rows are retried by a later run: the sample is not done
    with CaptureStore(tmp_path, run_config=RUN_CONFIG) as store:
        assert not store.done(sample_id(5)) and store.done(sample_id(6))
        info, manifest = stage(store.staging_dir(), 5)
        assert store.adopt(info, manifest).status == "ok"
    index = {r["sample_id"]: r for r in read_index(tmp_path).to_pylist()}
    assert index[sample_id(5)]["status"] == "ok"  # "ok" wins over the earlier failed row
    assert index["s0099"]["status"] == "failed"


def _fields(info: SampleInfo) -> dict[str, object]:
    return {k: getattr(info, k) for k in info.__dataclass_fields__}


def test_damaged_or_failed_records_are_failures(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, run_config=RUN_CONFIG) as store:
        info, manifest = stage(store.staging_dir(), 1)
        tensors = manifest.with_suffix(".safetensors")
        stored = load_file(tensors)
        stored["hidden_states"][0, 0, 0] += 1  # one value of the hidden states changed after the checksum
        save_file(stored, tensors)
        row = store.adopt(info, manifest)
        assert (row.status, row.reason) == ("failed", "bad_record") and "checksum" in (row.message or "")
        # the connector's own failure file
        info2, _ = stage(store.staging_dir(), 2)
        error = files.write_failure(store.staging_dir(), "req-x", "pool_full", "no free slots")
        row2 = store.adopt(info2, error.with_name("req-x.json"))
        assert (row2.reason, row2.message) == ("pool_full", "no free slots")
        row3 = store.adopt(SampleInfo(**{**_fields(info2), "sample_id": "s0077"}), tmp_path / "nothing.json")
        assert row3.reason == "missing_record"
        with pytest.raises(CaptureStoreError, match="already has a verified record"):
            info4, m4 = stage(store.staging_dir(), 4)
            store.adopt(info4, m4)
            store.adopt(info4, m4)
        with pytest.raises(CaptureStoreError, match="needs SampleInfo.input_ids"):
            store.adopt(SampleInfo("s0100", "x:1", 3), m4)
    s = read_summary(tmp_path)
    assert s.failed == {"bad_record": 1, "missing_record": 1, "pool_full": 1} and s.captured == 1


@pytest.mark.parametrize("storage", ["captured", "fp8_e4m3"])
def test_a_record_holding_nan_or_inf_is_never_adopted(tmp_path: Path, storage: str) -> None:
    """A staged record whose rows hold NaN (or Inf) and whose checksum is of exactly those rows (the connector
    checksums whatever it captured) is not adopted: a failed row ``non_finite`` naming the position and layer id,
    its files deleted.  Stored as fp8 the check reads the stored bytes and scales (not the decoded rows).  Control:
    the same record without the planted value is adopted."""
    with CaptureStore(tmp_path, run_config=RUN_CONFIG) as store:
        for i, value in ((1, float("nan")), (2, float("-inf"))):
            info, manifest = stage(store.staging_dir(), i)
            rec = files.read_record(manifest)
            rows = rec.hidden_states.clone()
            rows[-1, 1, 3] = value
            meta = msgspec.structs.replace(rec.meta, checksum=None)  # the file sink checksums what it is given
            files.write_record(store.staging_dir(), CaptureRecord(meta, rows), storage=storage)
            assert not files.read_record(manifest).hidden_states.isfinite().all()  # and its checksum verifies
            assert files.verify_record(manifest).non_finite is not None
            row = store.adopt(info, manifest)
            assert (row.status, row.reason, row.record) == ("failed", "non_finite", None), row
            assert f"the first at position {rows.shape[0] - 1}" in (row.message or "") and "layer ids [" in (
                row.message or ""
            )
            assert list(store.staging_dir().iterdir()) == [] and not store.done(info.sample_id)
        info3, manifest3 = stage(store.staging_dir(), 3)  # control
        rec3 = files.read_record(manifest3)
        files.write_record(store.staging_dir(), rec3, storage=storage)
        assert files.verify_record(manifest3).non_finite is None
        assert store.adopt(info3, manifest3).status == "ok"
    assert read_summary(tmp_path).failed == {"non_finite": 2}


def test_a_run_counts_samples_not_attempts_and_its_rate_over_the_capture(tmp_path: Path) -> None:
    """A sample whose first attempt failed and whose second was adopted in the same run is captured, not also
    failed (captured + failed = the samples run); tokens/s is over the capture time the command notes, not over
    the run's wall time (engine start-up)."""
    with CaptureStore(tmp_path, run_config=RUN_CONFIG) as store:
        info, _ = stage(store.staging_dir(), 1)
        assert store.adopt(info, tmp_path / "nothing.json").reason == "missing_record"  # attempt 1
        info, manifest = stage(store.staging_dir(), 1)
        assert store.adopt(info, manifest).status == "ok"  # attempt 2
        store.fail(SampleInfo(sample_id(2), "x:2", 3), "empty", "nothing")
        store.note_times(engine_start_s=20.0, capture_s=0.5)
        run = store.run_summary()
    assert (run.captured, run.failed) == (1, {"empty": 1})
    assert run.tokens_per_s == run.tokens / 0.5 and run.engine_start_s == 20.0
    merged = read_summary(tmp_path)
    assert merged.tokens_per_s == merged.tokens / 0.5 and merged.tree_failed == {"empty": 1}


def test_not_owned_sample_is_refused(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, run_config=RUN_CONFIG, rank=0, world_size=2) as store:
        theirs = next(sample_id(i) for i in range(N) if not store.owns(sample_id(i)))
        with pytest.raises(CaptureStoreError, match="belongs to rank 1 of 2"):
            store.fail(SampleInfo(theirs, "x:1", 3), "empty", "nothing")


# --- retry and breaker ------------------------------------------------------------------------------------------
def test_breaker_trips_after_consecutive_failures() -> None:
    b = Breaker(3)
    b.failure("pool_full", "a")
    b.failure("timeout", "b")
    b.success()  # control: a success resets the count
    b.failure("timeout", "c")
    b.failure("timeout", "d")
    with pytest.raises(
        CircuitOpenError, match=r"3 consecutive failures \(timeout x2, pool_full x1\); last: pool_full: e"
    ):
        b.failure("pool_full", "e")
    with pytest.raises(CaptureStoreError):
        Breaker(0)


def test_retry_bounds_attempts_and_skips_permanent_reasons() -> None:
    r = Retry(3)
    assert [r.allow("a", "timeout") for _ in range(3)] == [True, True, False]
    assert r.allow("b", "tokenizer_mismatch") is False  # trying again gives the same answer
    only = Retry(2, retry_on={"pool_full"})
    assert only.allow("c", "pool_full") and not only.allow("d", "timeout")
    with pytest.raises(CaptureStoreError):
        Retry(0)


def test_summary_counts_runs_and_the_tree(tmp_path: Path) -> None:
    first = run(str(tmp_path), samples=6, per_shard=4, mismatch=MISMATCH)
    assert (first.rows_read, first.captured, first.skipped, first.failed) == (6, 5, 0, {"tokenizer_mismatch": 1})
    assert first.closed and first.tree_records == 5 and first.tree_tokens == first.tokens > 0
    assert first.tree_bytes == first.bytes == sum(p.stat().st_size for p in tmp_path.glob("shard-*/*"))
    again = run(str(tmp_path), samples=6, per_shard=4, mismatch=MISMATCH)
    assert (again.captured, again.skipped, again.failed, again.tree_records) == (0, 5, {"tokenizer_mismatch": 1}, 5)
    assert json.loads((tmp_path / "summary.json").read_text()) == read_summary(tmp_path).to_dict() | {
        "elapsed_s": again.elapsed_s,
        "tokens_per_s": again.tokens_per_s,
    }
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-0-00000", "shard-0-00001"]  # 4 + 1


def test_a_foreign_folder_is_not_taken_over(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CaptureStoreError, match="is not empty"):
        CaptureStore(tmp_path, run_config=RUN_CONFIG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    CaptureStore(tmp_path / "new", run_config=RUN_CONFIG).close()  # control: a new folder is made a tree


def test_a_record_made_for_another_sample_is_not_adopted(tmp_path: Path) -> None:
    """Records of schema 2 name their sample; one that names another sample is a failure (wrong_sample)."""
    import msgspec

    from vllm_hs_compat.core.records import CaptureRecord, RecordMeta

    if "sample_id" not in RecordMeta.__struct_fields__:
        pytest.skip("records of this build do not carry a sample id (schema 1)")
    with CaptureStore(tmp_path, run_config=RUN_CONFIG) as store:
        for named, expect in (("s0009", "wrong_sample"), ("s0008", "ok")):  # the second is the control
            info, manifest = stage(store.staging_dir(), 8)
            rec = files.read_record(manifest)
            manifest.unlink()
            meta = msgspec.structs.replace(rec.meta, sample_id=named)
            manifest = files.write_record(store.staging_dir(), CaptureRecord(meta, rec.hidden_states))
            row = store.adopt(info, manifest)
            assert (row.reason or row.status) == expect, row


@pytest.mark.skipif(
    not os.environ.get("VLLM_HS_COMPAT_STORE_KILLS"), reason="opt-in: VLLM_HS_COMPAT_STORE_KILLS=<rounds>"
)
def test_many_random_kills_of_two_ranks(tmp_path: Path) -> None:
    """Opt-in soak: two ranks writing one tree, each killed at random times, round after round; then both run to
    the end.  The tree must equal one rank's."""
    rounds = int(os.environ["VLLM_HS_COMPAT_STORE_KILLS"])
    rng = random.Random(rounds)
    n = 60
    tree, one = tmp_path / "tree", tmp_path / "one"
    for _ in range(rounds):
        ps = [child(tree, samples=n, rank=r, world_size=2, mismatch=MISMATCH, per_shard=4) for r in (0, 1)]
        time.sleep(rng.uniform(0.0, 0.4))
        for p in ps:
            if rng.random() < 0.8 and p.is_alive():
                os.kill(p.pid or 0, signal.SIGKILL)
            time.sleep(rng.uniform(0.0, 0.05))
        for p in ps:
            p.join(60)
    for r in (0, 1):
        run(str(tree), samples=n, rank=r, world_size=2, mismatch=MISMATCH, per_shard=4)
    assert check_tree(tree, samples=n) == []
    run(str(one), samples=n, mismatch=MISMATCH)
    assert _records(tree) == _records(one)


def test_a_row_without_an_id_is_keyed_by_its_source(tmp_path: Path) -> None:
    """A malformed line has no sample id: its failed row is keyed by ``"@" + source``, owned by one rank, and a
    re-run that fails it again leaves one row for it, not two."""
    bad = SampleInfo(sample_id="", source="data.jsonl:7", num_tokens=0)
    for _ in range(2):
        stores = [CaptureStore(tmp_path, run_config=RUN_CONFIG, rank=r, world_size=2) for r in (0, 1)]
        owners = [s for s in stores if s.owns("@data.jsonl:7")]
        assert len(owners) == 1
        owners[0].fail(bad, "malformed", "line 8 is not JSON")
        for s in stores:
            s.close()
    rows = read_index(tmp_path).to_pylist()
    assert [(r["sample_id"], r["source"], r["reason"]) for r in rows] == [("", "data.jsonl:7", "malformed")]
    assert read_summary(tmp_path).tree_failed == {"malformed": 1}
    parts = [pq.read_table(p).num_rows for p in (tmp_path / "index").glob("*.parquet")]
    assert sum(parts) == 2  # control: both runs wrote a row; the merge keeps one
