"""Adoption checks staged records ahead in a few threads and adopts them in order (``batches.CheckAhead``): reading a
record back, its checksum and its NaN/Inf check were most of adoption's time on the GPU host (docs/gpu.md).  The
store's answer must be the same as checking each record when it is adopted, in the same order, and an answer is
used only for the record it was computed for."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from store_driver import RUN_CONFIG, stage  # noqa: E402

from vllm_hs_compat.capture.batches import Batches, Outcome  # noqa: E402
from vllm_hs_compat.capture.staged import record_files  # noqa: E402
from vllm_hs_compat.capture.store import CaptureStore, read_index  # noqa: E402
from vllm_hs_compat.errors import CaptureStoreError  # noqa: E402

MISMATCH = {3}  # a sample whose engine ran other ids: refused by the check, in its place in the order


def _adopt_all(out: Path, threads: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[Any, ...]], set[str]]:
    """Stage 10 records, adopt them through ``Batches.adopt_batch`` with ``threads`` checking threads; the index
    rows in order, and the names of the threads the checks ran in."""
    args = argparse.Namespace(retries=0, max_consecutive_failures=100)
    where: set[str] = set()
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
        )
        outcomes = []
        for i in range(10):
            info, manifest = stage(store.staging_dir(), i, wrong_ids=i in MISMATCH)
            _, manifest, error = record_files(manifest)
            ticket = {"manifest": str(manifest), "error": str(error)}
            outcomes.append(Outcome(sample=info, info=info, ticket=ticket))
        assert work.adopt_batch(outcomes, deadline=0.0, stop=threading.Event()) == []
    rows = [(r["sample_id"], r["status"], r["reason"], r["checksum"]) for r in read_index(out).to_pylist()]
    return rows, where


def test_records_checked_ahead_in_threads_are_adopted_in_order_as_if_checked_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ahead, threads = _adopt_all(tmp_path / "ahead", 3, monkeypatch)
    one_by_one, adopter = _adopt_all(tmp_path / "serial", 1, monkeypatch)
    assert ahead == one_by_one  # the same rows, statuses, reasons and checksums, in the same order
    assert [r[0] for r in ahead] == [f"s{i:04d}" for i in range(10)]
    assert [r[2] for r in ahead if r[1] != "ok"] == ["tokenizer_mismatch"]
    assert any(t.startswith("capture-check") for t in threads), threads  # checked ahead in the pool
    assert adopter == {threading.current_thread().name}  # control: one thread checks each when adopting it


def test_an_answer_is_adopted_only_for_the_record_it_checked(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, run_config=RUN_CONFIG) as store:
        info_a, manifest_a = stage(store.staging_dir(), 1)
        info_b, manifest_b = stage(store.staging_dir(), 2)
        with pytest.raises(CaptureStoreError, match="not the same record"):
            store.adopt(info_b, manifest_b, checked=store.check(info_a, manifest_a))
        # control: the answer for its own record is adopted, and so is the other record checked on adoption
        assert store.adopt(info_a, manifest_a, checked=store.check(info_a, manifest_a)).status == "ok"
        assert store.adopt(info_b, manifest_b).status == "ok"
