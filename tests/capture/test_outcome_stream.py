"""The adopter follows the engine into the batch it runs (``batches.OutcomeStream``): each record is adopted as soon as
the engine knows its outcome, in the batch's order, with the same index rows as adopting the finished batch; a
stream the engine's side closes early ends the batch there (its rest not run), and an abandoned run stops the
adopter while it waits.  The real engine's side is tests/e2e/test_capture.py (``adopted_while_running``)."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from store_driver import RUN_CONFIG, stage  # noqa: E402

from vllm_hs_compat.capture.batches import Batches, Outcome, OutcomeStream  # noqa: E402
from vllm_hs_compat.capture.staged import record_files  # noqa: E402
from vllm_hs_compat.capture.store import CaptureStore, read_index  # noqa: E402

N = 8


def _batches(store: CaptureStore) -> Batches:
    args = argparse.Namespace(retries=0, max_consecutive_failures=100)
    return Batches(args, capture="prompt", storage="captured", store=store, llm=None, note_row=lambda row: None)


def _outcomes(store: CaptureStore) -> list[Outcome]:
    outcomes = []
    for i in range(N):
        info, manifest = stage(store.staging_dir(), i, wrong_ids=i == 5)
        _, manifest, error = record_files(manifest)
        outcomes.append(Outcome(sample=info, info=info, ticket={"manifest": str(manifest), "error": str(error)}))
    return outcomes


def _rows(out: Path) -> list[tuple[Any, ...]]:
    return [(r["sample_id"], r["status"], r["reason"], r["checksum"]) for r in read_index(out).to_pylist()]


def test_records_are_adopted_as_the_engine_knows_them_in_order_as_from_the_finished_batch(tmp_path: Path) -> None:
    with CaptureStore(tmp_path / "after", run_config=RUN_CONFIG) as store:  # control: the finished batch
        assert _batches(store).adopt_batch(_outcomes(store), None, threading.Event()) == []
    with CaptureStore(tmp_path / "following", run_config=RUN_CONFIG) as store:
        work, outcomes = _batches(store), _outcomes(store)
        stream = OutcomeStream(N)
        adopted: list[str] = []
        real_adopt = store.adopt

        def adopt(info: Any, *a: Any, **k: Any) -> Any:
            adopted.append(info.sample_id)
            return real_adopt(info, *a, **k)

        store.adopt = adopt  # type: ignore[method-assign]
        got: list[Any] = []
        adopter = threading.Thread(
            target=lambda: got.append(work.adopt_batch(stream, None, threading.Event())), daemon=True
        )
        adopter.start()
        # the engine finishes the requests out of order, a few per step; the adopter keeps the batch's order
        for step, upto in (([1, 0], 2), ([2, 4], 3), ([3], 5), ([6, 5], 7), ([7], 8)):
            for i in step:
                stream.put(i, outcomes[i])
            time.sleep(0.2)
            assert adopted == [f"s{i:04d}" for i in range(upto)], (step, adopted)  # the known prefix, in order
        seen_before_close = len(adopted)
        stream.close()
        adopter.join(10)
        assert got == [[]] and not adopter.is_alive()
    assert seen_before_close == N  # every record adopted while the engine's side still ran the batch
    assert stream.early == N and stream.waited_s > 0.3  # it waited for the engine between steps, not counted adoption
    assert _rows(tmp_path / "following") == _rows(tmp_path / "after")  # the same rows, reasons, checksums, order
    assert [r[2] for r in _rows(tmp_path / "following") if r[1] != "ok"] == ["tokenizer_mismatch"]


def test_a_stream_closed_early_ends_the_batch_there_and_a_stop_wakes_a_waiting_adopter(tmp_path: Path) -> None:
    with CaptureStore(tmp_path / "closed", run_config=RUN_CONFIG) as store:
        work, outcomes = _batches(store), _outcomes(store)
        stream = OutcomeStream(N)
        for i in (0, 1, 3):  # the engine failed after finishing these; 2 never known
            stream.put(i, outcomes[i])
        stream.close()
        assert work.adopt_batch(stream, None, threading.Event()) == []
    assert [r[0] for r in _rows(tmp_path / "closed")] == ["s0000", "s0001"]  # 3 not adopted out of order
    with CaptureStore(tmp_path / "stopped", run_config=RUN_CONFIG) as store:
        work, outcomes = _batches(store), _outcomes(store)
        stream, stop = OutcomeStream(N), threading.Event()
        stream.put(0, outcomes[0])
        adopter = threading.Thread(target=work.adopt_batch, args=(stream, None, stop), daemon=True)
        adopter.start()
        time.sleep(0.2)
        assert adopter.is_alive()  # control: waiting for the engine's next outcome
        t0 = time.monotonic()
        stop.set()
        adopter.join(5)
        assert not adopter.is_alive() and time.monotonic() - t0 < 1.0
    assert [r[0] for r in _rows(tmp_path / "stopped")] == ["s0000"]
