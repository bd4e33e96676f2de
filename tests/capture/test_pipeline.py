"""The capture's :class:`~vllm_hs_compat.capture.pipeline.Pipeline`: engine work in the calling thread, adoption in
one adopter thread (two batches held at most, adopted one after the other); its timings, an adoption's wait for the
engine not counted as adoption; an adopter's exception raised in the waiting thread.

The real engine's side is tests/e2e/test_capture.py (``--adoption overlap`` against the CPU default, serial)."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_hs_compat.capture.pipeline import Pipeline
from vllm_hs_compat.errors import CaptureStoreError, CircuitOpenError


def test_adoption_runs_beside_the_engine_and_the_timings_say_so() -> None:
    pipe: Pipeline[str] = Pipeline()
    adopting = threading.Event()
    threads: list[str] = []

    def adopt() -> str:
        threads.append(threading.current_thread().name)
        adopting.set()
        time.sleep(0.2)
        return "batch 0 adopted"

    pipe.engine(lambda: time.sleep(0.05))
    pipe.adopt_later(adopt)
    assert adopting.wait(5)  # the adopter started; the engine's next batch runs meanwhile
    pipe.engine(lambda: time.sleep(0.1))
    assert pipe.wait() == "batch 0 adopted"
    pipe.close()
    t = pipe.timings
    assert threads[0].startswith("capture-adopter") and threads[0] != threading.current_thread().name
    assert t.engine_s == pytest.approx(0.15, abs=0.05) and t.adopt_s == pytest.approx(0.2, abs=0.05)
    assert t.overlap_s == pytest.approx(0.1, abs=0.05)  # the second engine batch, inside the adoption
    assert t.adopt_wait_s == pytest.approx(0.1, abs=0.05)  # the rest of the adoption, the engine idle
    assert pipe.tail_s == pytest.approx(0.1, abs=0.05)  # from the engine's last batch to the adoption's end


def test_serial_pipeline_adopts_in_the_calling_thread_with_no_overlap() -> None:
    pipe: Pipeline[int] = Pipeline(overlap=False)
    pipe.engine(lambda: time.sleep(0.05))
    assert pipe.adopt_now(lambda: int(threading.current_thread() is threading.main_thread())) == 1
    with pytest.raises(CaptureStoreError, match="no adopter thread"):
        pipe.adopt_later(lambda: 2)
    pipe.close()
    assert pipe.timings.overlap_s == 0 and pipe.timings.adopt_wait_s == pipe.timings.adopt_s


def test_two_batches_held_at_most_adopted_one_after_the_other_in_order() -> None:
    pipe: Pipeline[int] = Pipeline()
    release = threading.Event()
    order: list[int] = []

    def adopt(k: int) -> int:
        order.append(k)
        release.wait(5)
        return k

    pipe.adopt_later(lambda: adopt(1))
    pipe.adopt_later(lambda: adopt(2))  # the batch the adopter follows the engine into
    assert pipe.held == 2
    with pytest.raises(CaptureStoreError, match="still holds 2 batches"):
        pipe.adopt_later(lambda: 3)
    with pytest.raises(CaptureStoreError, match="still holds a batch"):
        pipe.adopt_now(lambda: 3)
    time.sleep(0.1)
    assert order == [1]  # one adoption at a time: the second waits for the first
    release.set()
    assert (pipe.wait(), pipe.wait()) == (1, 2) and order == [1, 2]
    with pytest.raises(CaptureStoreError, match="holds no batch"):
        pipe.wait()
    pipe.close()


def test_an_adoptions_wait_for_the_engine_is_neither_adoption_nor_overlap() -> None:
    pipe: Pipeline[str] = Pipeline()
    known = threading.Event()
    waited: list[float] = []

    def follow() -> str:  # waits for the engine to finish its records (0.2 s), then adopts them (0.1 s)
        t0 = time.monotonic()
        known.wait(5)
        waited.append(time.monotonic() - t0)
        time.sleep(0.1)
        return "followed"

    pipe.adopt_later(follow, idle=lambda: waited[0])
    pipe.engine(lambda: (time.sleep(0.2), known.set()))
    assert pipe.wait() == "followed"
    pipe.close()
    t = pipe.timings
    assert t.adopt_s == pytest.approx(0.1, abs=0.05)  # control: the span was 0.3 s, 0.2 of it the engine's
    assert t.overlap_s == pytest.approx(0.0, abs=0.05) and t.adopt_wait_s == pytest.approx(0.1, abs=0.05)
    assert pipe.tail_s == pytest.approx(0.1, abs=0.05)  # only what was left after the engine's work


def test_an_adopters_exception_is_raised_in_the_waiting_thread_itself() -> None:
    pipe: Pipeline[int] = Pipeline()
    breaker = CircuitOpenError("stopped after 3 consecutive failures (non_finite x3)")

    def adopt() -> int:
        raise breaker

    pipe.adopt_later(adopt)
    with pytest.raises(CircuitOpenError) as got:
        pipe.wait()
    assert got.value is breaker  # its own exception and message, not a wrapper
    assert not pipe.busy and pipe.timings.adopt_s >= 0
    pipe.adopt_later(lambda: 7)  # the adopter takes the next batch
    assert pipe.wait() == 7
    assert pipe.close() is None


def test_close_abandons_a_held_batch_between_records_and_hands_back_its_error() -> None:
    pipe: Pipeline[int] = Pipeline()
    started = threading.Event()
    done: list[int] = []

    def adopt() -> int:
        started.set()
        for i in range(100):
            if pipe.stopping.is_set():
                raise OSError(f"stopped at record {i}")
            done.append(i)
            time.sleep(0.01)
        return len(done)

    pipe.adopt_later(adopt)
    assert started.wait(5)
    error = pipe.close(abandon=True)  # the caller is on its way out with an error of its own
    assert isinstance(error, OSError) and "stopped at record" in str(error)
    assert 0 < len(done) < 100
    assert pipe.close() is None  # idempotent
