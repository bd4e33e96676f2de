"""Adoption checks staged records ahead in a few threads and adopts them in order (``batches.CheckAhead``): reading a
record back, its checksum and its NaN/Inf check were most of adoption's time on the GPU host (docs/gpu.md).  The
store's answer must be the same as checking each record when it is adopted, in the same order, and an answer is
used only for the record it was computed for."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from store_driver import RUN_CONFIG, stage  # noqa: E402

from vllm_hs_compat.capture.batches import Batches, CheckAhead, Checkers, Outcome  # noqa: E402
from vllm_hs_compat.capture.staged import record_files  # noqa: E402
from vllm_hs_compat.capture.store import CaptureStore, read_index  # noqa: E402
from vllm_hs_compat.errors import CaptureConfigError, CaptureStoreError  # noqa: E402

MISMATCH = {3}  # a sample whose engine ran other ids: refused by the check, in its place in the order


def _adopt_all(
    out: Path,
    threads: int,
    monkeypatch: pytest.MonkeyPatch,
    check_in: str = "threads",
    before: Callable[[Batches], None] | None = None,
) -> tuple[list[tuple[Any, ...]], set[str], int]:
    """Stage 10 records, adopt them through ``Batches.adopt_batch`` with ``threads`` checking workers (``check_in``:
    threads or processes); the index rows in order, the names of the threads :meth:`CaptureStore.check` ran in (a
    process's checks do not call it), and how many answers the adopter took from the workers."""
    args = argparse.Namespace(retries=0, max_consecutive_failures=100)
    where: set[str] = set()
    taken = 0
    take = CheckAhead.take

    def counted(self: CheckAhead, o: Outcome, path: Path) -> Any:
        nonlocal taken
        answer = take(self, o, path)
        taken += answer is not None
        return answer

    monkeypatch.setattr(CheckAhead, "take", counted)
    with CaptureStore(out, run_config=RUN_CONFIG) as store:
        check = store.check

        def watched(*a: Any, **k: Any) -> Any:
            where.add(threading.current_thread().name)
            return check(*a, **k)

        monkeypatch.setattr(store, "check", watched)
        work = Batches(
            args,
            capture="prompt",
            storage="captured",
            store=store,
            llm=None,
            note_row=lambda row: None,
            check_threads=threads,
            check_in=check_in,
        )
        if before is not None:
            before(work)
        outcomes = []
        for i in range(10):
            info, manifest = stage(store.staging_dir(), i, wrong_ids=i in MISMATCH)
            _, manifest, error = record_files(manifest)
            ticket = {"manifest": str(manifest), "error": str(error)}
            outcomes.append(Outcome(sample=info, info=info, ticket=ticket))
        try:
            assert work.adopt_batch(outcomes, deadline=0.0, stop=threading.Event()) == []
        finally:
            work.close()
    rows = [(r["sample_id"], r["status"], r["reason"], r["checksum"]) for r in read_index(out).to_pylist()]
    return rows, where, taken


def test_records_checked_ahead_in_threads_are_adopted_in_order_as_if_checked_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ahead, threads, _ = _adopt_all(tmp_path / "ahead", 3, monkeypatch)
    one_by_one, adopter, none = _adopt_all(tmp_path / "serial", 1, monkeypatch)
    assert ahead == one_by_one  # the same rows, statuses, reasons and checksums, in the same order
    assert [r[0] for r in ahead] == [f"s{i:04d}" for i in range(10)]
    assert [r[2] for r in ahead if r[1] != "ok"] == ["tokenizer_mismatch"]
    assert any(t.startswith("capture-check") for t in threads), threads  # checked ahead in the pool
    assert adopter == {threading.current_thread().name}  # control: one thread checks each when adopting it
    assert none == 0


def test_records_checked_ahead_in_processes_are_adopted_as_if_checked_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ready: list[int] = []

    def count_ready(work: Batches) -> None:  # read once the run's end closed the workers
        monkeypatch.setattr(work, "close", lambda: (Batches.close(work), ready.append(work.checkers.ready)))

    ahead, threads, taken = _adopt_all(tmp_path / "ahead", 2, monkeypatch, check_in="processes", before=count_ready)
    one_by_one, _, _ = _adopt_all(tmp_path / "serial", 1, monkeypatch)
    assert ahead == one_by_one  # the same rows, statuses, reasons and checksums, in the same order
    assert [r[2] for r in ahead if r[1] != "ok"] == ["tokenizer_mismatch"]
    # every record after the first was checked ahead, by the processes: the store's own check ran only in the
    # adopter's thread, for the first record (nothing is offered before it), in no checking thread of this process
    assert taken == 9 and threads == {threading.current_thread().name}, (taken, threads)
    assert ready == [2]  # both processes came up


def test_a_checking_process_that_died_costs_only_the_check_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def kill_workers(work: Batches) -> None:
        pool: Any = work.checkers._pool
        list(pool.map(abs, range(4)))  # the workers are up
        for proc in list(pool._processes.values()):
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)

    rows, _, taken = _adopt_all(tmp_path / "dead", 2, monkeypatch, check_in="processes", before=kill_workers)
    one_by_one, _, _ = _adopt_all(tmp_path / "serial", 1, monkeypatch)
    assert rows == one_by_one and taken == 0  # every record checked by the adopter itself, none lost


def test_adoption_checks_elsewhere_are_refused() -> None:
    with pytest.raises(CaptureConfigError, match="expected one of threads, processes"):
        Checkers(None, 2, "gpu")


def test_an_answer_is_adopted_only_for_the_record_it_checked(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, run_config=RUN_CONFIG) as store:
        info_a, manifest_a = stage(store.staging_dir(), 1)
        info_b, manifest_b = stage(store.staging_dir(), 2)
        with pytest.raises(CaptureStoreError, match="not the same record"):
            store.adopt(info_b, manifest_b, checked=store.check(info_a, manifest_a))
        # control: the answer for its own record is adopted, and so is the other record checked on adoption
        assert store.adopt(info_a, manifest_a, checked=store.check(info_a, manifest_a)).status == "ok"
        assert store.adopt(info_b, manifest_b).status == "ok"
