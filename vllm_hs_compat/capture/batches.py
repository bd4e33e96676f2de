"""The capture command's batches: the engine's part of each (:meth:`Batches.engine_batch`), its adoption into the
store in the batch's order (:meth:`Batches.adopt_batch`), retries and the circuit breaker, and :func:`drive`, which
runs the two side by side through a :class:`~vllm_hs_compat.capture.pipeline.Pipeline` (the engine on batch k+1
while the adopter adopts batch k, then follows the engine into batch k+1 record by record: :class:`OutcomeStream`).
Used by ``vllm-hs-compat capture`` (:mod:`vllm_hs_compat.commands.capture`); imports vLLM only through the package's
connector and adapters, when a batch runs."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hs_compat.errors import CaptureConfigError, CaptureFeedError

from .feed import EngineFeed, Submitted
from .pipeline import Pipeline

#: Seconds to wait for a record's files after the engine stepped past its request (the file sink writes them from
#: the connector's publisher thread).
RECORD_WAIT_S = 120.0
#: Failure reason of a row whose request vLLM refused before running it (e.g. longer than the context); not retried.
ENGINE_REFUSED = "engine_refused"


def request_params(sample: Any, args: argparse.Namespace, capture: str) -> Any:
    """The sampling parameters of ``sample``'s request: its sample entry for the connector, and the tokens to
    generate (one for a prompt capture; ``--max-new-tokens`` with ``--on-policy``)."""
    from vllm_hs_compat.adapters.engine_api import sampling_params
    from vllm_hs_compat.core.capture import sample_entry
    from vllm_hs_compat.core.vocabulary import REQUEST_KEY

    # on-policy: the prompt's mask (all zeros) plus the generated part, through the record's last position
    generated = args.on_policy and sample.loss_mask is not None
    entry = sample_entry(
        sample_id=sample.sample_id,
        source=str(sample.source),
        loss_mask=sample.loss_mask,
        generated=generated,
        metadata=dict(sample.metadata) if sample.metadata else None,
    )
    kv = {"kv_transfer_params": {REQUEST_KEY: {"capture": capture, "sample": entry}}}
    if args.on_policy:
        return sampling_params(
            max_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, extra_args=kv
        )
    # prompt capture: one generated token is the least a request can ask for; it is not part of the record
    return sampling_params(max_tokens=1, temperature=0.0, extra_args=kv)


def files_ready(ticket: Mapping[str, Any]) -> Path | None:
    """The record's manifest (or its error file) if the file sink wrote it already, else None."""
    manifest, error = Path(ticket["manifest"]), Path(ticket["error"])
    if manifest.exists():
        return manifest
    if error.exists():
        return error
    return None


def wait_files(ticket: Mapping[str, Any], deadline: float) -> Path | None:
    """The record's manifest (or its error file) once the file sink wrote it; None past ``deadline``."""
    while True:
        path = files_ready(ticket)
        if path is not None:
            return path
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


#: Threads that check staged records ahead of their adoption (reading a record back, its checksum and its NaN/Inf
#: check are most of adoption's time, and release the interpreter); 1: each record is checked when adopted.
CHECK_THREADS = min(4, os.cpu_count() or 1)
#: Where adoption's checks ahead run (``capture --adoption-checks``): threads of this process, or processes of
#: their own, which leave the interpreter to the engine's thread beside them (docs/capture.md).
CHECK_IN = ("threads", "processes")
#: Seconds a run's end waits for checking processes still starting (importing torch), to say whether they came up.
READY_WAIT_S = 60.0


def _ready() -> bool:
    """A checking process's first task: import what a check needs, before the first record waits on it."""
    import vllm_hs_compat.capture.staged  # noqa: F401

    return True


class Checkers:
    """The run's workers that check staged records ahead of adoption (:class:`CheckAhead` offers them records):
    ``count`` threads of this process, or ``count`` processes (``spawn``; they only read the records' files and
    return the store's answer).  Started once for the run, closed at its end (:meth:`close`).  A check that fails
    in a worker (a process that died included) costs only the check ahead: the adopter checks that record itself
    (``fallbacks`` counts them; ``checked_ahead`` the answers the adopter took)."""

    def __init__(self, store: Any, count: int, where: str = "threads") -> None:
        if where not in CHECK_IN:
            raise CaptureConfigError(f"adoption checks in {where!r}: expected one of {', '.join(CHECK_IN)}")
        self.store, self.count, self.where = store, count, where
        self.checked_ahead = 0
        """Answers the adopter took from the workers."""
        self.fallbacks = 0
        self.ready = 0
        """Workers that were up by :meth:`close` (a process: it started and imported the checks)."""
        self._pool: ThreadPoolExecutor | ProcessPoolExecutor | None = None
        self._started: list[Future[bool]] = []
        if count > 1 and where == "threads":
            self._pool = ThreadPoolExecutor(count, thread_name_prefix="capture-check")
            self.ready = count
        elif count > 1:
            import multiprocessing

            self._pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"))
            self._started = [self._pool.submit(_ready) for _ in range(count)]

    @property
    def active(self) -> bool:
        return self._pool is not None

    def submit(self, sample: Any, path: Path) -> Future[Any] | None:
        """Start checking ``sample``'s record at ``path``; None where it cannot be checked ahead (no workers, no
        input ids to check against -- the adopter's own check says why -- or a pool that broke)."""
        if self._pool is None or sample.input_ids is None:
            return None
        try:
            if isinstance(self._pool, ProcessPoolExecutor):  # the store's own check, as a function of its module
                from vllm_hs_compat.capture.staged import check_sample

                return self._pool.submit(check_sample, sample, path)
            return self._pool.submit(self.store.check, sample, path)
        except BrokenExecutor:
            return None

    def answer(self, future: Future[Any]) -> Any:
        """The store's answer from ``future`` (waiting for it), or None when the worker failed (the adopter checks)."""
        try:
            answer = future.result()
        except Exception:  # a worker's error or death: the adopter's own check gives the answer or the error
            self.fallbacks += 1
            return None
        self.checked_ahead += 1
        return answer

    def close(self) -> None:
        """Stop the workers (checks not started are dropped; the ones in progress only read)."""
        if self._started:  # long done in a run of any length; a short one waits for its processes' start
            done, _ = wait(self._started, timeout=READY_WAIT_S)
            self.ready = sum(1 for f in done if f.exception() is None and f.result())
            self._started = []
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class CheckAhead:
    """Staged records checked by the run's :class:`Checkers` ahead of their adoption, which stays in order in the
    adopter: only records whose files the sink finished are offered (a worker never waits for a file), and an answer
    is used only for the very file it checked."""

    def __init__(self, checkers: Checkers) -> None:
        self.checkers = checkers
        self.window = 2 * checkers.count if checkers.active else 0
        """How many outcomes past the one being adopted are offered to the workers."""
        self._pending: dict[int, tuple[Path, Future[Any]]] = {}

    def offer(self, outcomes: list[Outcome]) -> None:
        """Start checking those of ``outcomes`` whose files are ready."""
        if not self.checkers.active:
            return
        for o in outcomes:
            if o.ticket is None or not o.counted or id(o) in self._pending:
                continue
            path = files_ready(o.ticket)
            if path is not None:
                future = self.checkers.submit(o.info, path)
                if future is not None:
                    self._pending[id(o)] = (path, future)

    def take(self, o: Outcome, path: Path) -> Any:
        """The answer for ``o``'s file at ``path`` if it was checked ahead (waiting for it), else None."""
        pending = self._pending.pop(id(o), None)
        if pending is None or pending[0] != path:
            return None
        return self.checkers.answer(pending[1])

    def close(self) -> None:
        """Drop what is not taken: checks not started are cancelled, the ones in progress waited for (they only
        read, but the files they read may go once the batch ends)."""
        futures = [f for _, f in self._pending.values()]
        self._pending.clear()
        for f in futures:
            f.cancel()
        wait(futures)


@dataclass
class Outcome:
    """What the engine made of one sample: a record's files to adopt (``ticket``) or a failure (``reason``,
    ``message``; ``counted``: False for a row error found before the engine, which the breaker never counts)."""

    sample: Any
    info: Any
    ticket: Mapping[str, Any] | None = None
    reason: str = ""
    message: str = ""
    counted: bool = True


class OutcomeStream:
    """One batch's outcomes, handed from the engine's thread to the adopter as the engine finishes each request: the
    adopter takes them in the batch's order (:meth:`get`), each as soon as it is known, while the engine steps on.
    The engine's thread puts them (:meth:`put`) and closes the stream (:meth:`close`) when its part of the batch
    returns or fails (an outcome never put is then never taken, its row not run).  Counts what the adopter took
    while the engine still ran the batch (``early``) and how long it waited for the engine (``waited_s``: not
    adoption)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: list[Outcome | None] = [None] * size
        self._closed = False
        self._cond = threading.Condition()
        self.early = 0
        self.waited_s = 0.0

    def idle(self) -> float:
        """Seconds the adopter waited for the engine to know an outcome (not adoption: the pipeline's timings)."""
        return self.waited_s

    def put(self, i: int, outcome: Outcome) -> None:
        """The outcome of the batch's ``i``-th sample (the engine's thread)."""
        with self._cond:
            self._items[i] = outcome
            self._cond.notify_all()

    def close(self) -> None:
        """The engine's part of the batch returned (or failed): nothing more is put."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def ready(self, lo: int, hi: int) -> list[Outcome]:
        """The outcomes already known among the ``lo``-th to the ``hi``-th (not waiting), in order."""
        with self._cond:
            return [o for o in self._items[lo:hi] if o is not None]

    def get(self, i: int, stop: threading.Event) -> Outcome | None:
        """The ``i``-th outcome once the engine knows it; None if the stream closed without it or ``stop`` is set."""
        t0 = time.monotonic()
        with self._cond:
            try:
                while self._items[i] is None and not self._closed and not stop.is_set():
                    self._cond.wait(0.05)
                if self._items[i] is not None and not self._closed:
                    self.early += 1
                return self._items[i]
            finally:
                self.waited_s += time.monotonic() - t0


@dataclass
class _Queued:
    """A batch whose requests are in the engine: the outcomes known before it (by the sample's index), the index of
    each sample sent, and the feed's handle of their requests."""

    samples: list[Any]
    early: dict[int, Outcome]
    sent: list[int]
    sub: Submitted


def _info(sample: Any) -> Any:
    from vllm_hs_compat.capture.rows import SampleInfo

    return SampleInfo.of(sample)


def _outcome(sample: Any, out: Any) -> Outcome:
    """What a finished request's output says of its sample: a record's files to adopt, or why there is none."""
    from vllm_hs_compat.core.vocabulary import RESULT_KEY
    from vllm_hs_compat.export.files import PARAMS_KEY as FILE_KEY

    kv = dict(out.kv_transfer_params or {})
    result = kv.get(RESULT_KEY) or {}
    ticket = kv.get(FILE_KEY)
    if ticket is None or result.get("status") in ("failed", "skipped"):
        reason = str(result.get("reason") or "not_captured")
        message = str(result.get("message") or f"the engine returned no record for it ({result or kv})")
        return Outcome(sample, _info(sample), reason=reason, message=message)
    return Outcome(sample, _info(sample), ticket=ticket)


class Batches:
    """A run's batches against one engine and one store: the retry policy, the circuit breaker and the compact
    storage's figures are this object's.  ``capture``: the record's span (``prompt`` or ``all``); ``storage``:
    ``--storage``; ``note_row``: called with each index row written that is not an adopted record (the command's
    console shows failed rows)."""

    def __init__(
        self,
        args: argparse.Namespace,
        *,
        capture: str,
        storage: str,
        store: Any,
        llm: Any,
        note_row: Callable[[Any], Any],
        check_threads: int = CHECK_THREADS,
        check_in: str = "threads",
    ) -> None:
        from vllm_hs_compat.capture.policy import Breaker, Retry

        self.args, self.capture, self.storage, self.store, self.llm = args, capture, storage, store, llm
        self.feed = EngineFeed(llm)
        self._queued: _Queued | None = None  # the next batch, queued in the engine behind the running one
        self.note_row = note_row
        #: adoption's checking workers (:class:`CheckAhead`), for the whole run: :meth:`close` stops them
        self.checkers = Checkers(store, check_threads, check_in)
        self.retry = Retry(args.retries + 1)
        #: Counts records that failed in the engine, the connector or adoption, never rows the reader refused: those
        #: cost no engine time, are indexed with their reason and say nothing of the next row (docs/capture.md).
        self.breaker = Breaker(args.max_consecutive_failures)
        #: records whose adoption began while the engine still ran their batch (the adopter following the engine)
        self.adopted_early = 0
        #: this run's compact records: (relative error max, mean, tokens, bytes) of each (``--storage``)
        self.stored: list[tuple[float, float, int, int]] = []

    def close(self) -> None:
        """Stop adoption's checking workers (at the run's end, after the last adoption)."""
        self.checkers.close()

    def note_storage(self, row: Any) -> None:
        """Keep the error a compact storage measured for an adopted record (its manifest's ``storage`` entry)."""
        if self.storage == "captured" or row.record is None:
            return
        entry = json.loads((Path(self.args.out) / row.record).read_text()).get("storage") or {}
        self.stored.append((float(entry["rel_error_max"]), float(entry["rel_error_mean"]), row.tokens, row.bytes))

    def storage_summary(self) -> dict[str, Any] | None:
        """The compact storage's figures for this run (None with ``--storage captured``)."""
        if not self.stored:
            return None
        tokens = sum(t for _, _, t, _ in self.stored)
        return {
            "kind": self.storage,
            "records": len(self.stored),
            "rel_error_max": max(e for e, _, _, _ in self.stored),
            "rel_error_mean": sum(m * t for _, m, t, _ in self.stored) / max(1, tokens),
            "bytes_per_token": sum(b for _, _, _, b in self.stored) / max(1, tokens),
        }

    def _submit(self, samples: list[Any]) -> _Queued:
        """Queue ``samples``' requests in the engine (not run yet); a row whose parameters cannot be built is an
        outcome already (``bad_field``, never sent)."""
        from vllm_hs_compat.capture.rows import SampleInfo

        early: dict[int, Outcome] = {}
        ready: list[tuple[int, Any, Any]] = []
        for i, s in enumerate(samples):
            try:
                ready.append((i, s, request_params(s, self.args, self.capture)))
            except CaptureConfigError as exc:  # e.g. metadata over the record's bound once made canonical: a row
                early[i] = Outcome(s, SampleInfo.of(s), reason="bad_field", message=str(exc), counted=False)
        sub = self.feed.submit([{"prompt_token_ids": list(s.input_ids)} for _, s, _ in ready], [p for *_, p in ready])
        return _Queued(samples, early, [i for i, _, _ in ready], sub)

    def engine_batch(
        self, samples: list[Any], ahead: list[Any] | None = None, stream: OutcomeStream | None = None
    ) -> tuple[list[Outcome], float]:
        """The engine's part of a batch: run ``samples`` until their records are read (their files follow from the
        connector's publisher).  ``ahead``: the next batch, queued behind this one now so that the engine steps
        finishing this batch run its tokens too (its own ``engine_batch`` call finds it queued).  ``stream``: each
        sample's outcome is put there as soon as it is known (a request the engine finished, before its record is
        read), and the stream is closed when this returns or fails.  Returns what became of each sample, in order
        (nothing written to the store yet: :meth:`adopt_batch` does, in this order), and the deadline for their
        files."""
        try:
            return self._engine_batch(samples, ahead, stream)
        finally:
            if stream is not None:
                stream.close()

    def _engine_batch(
        self, samples: list[Any], ahead: list[Any] | None, stream: OutcomeStream | None
    ) -> tuple[list[Outcome], float]:
        queued, self._queued = self._queued, None
        if queued is None:
            queued = self._submit(samples)
        elif queued.samples is not samples:  # its requests would run with no one to take their outputs
            raise CaptureFeedError(
                f"engine_batch: {len(queued.samples)} rows are queued in the engine ahead, but a batch of "
                f"{len(samples)} other rows was given to run next; run the queued batch first"
            )
        outcomes: dict[int, Outcome] = dict(queued.early)
        for j, i in enumerate(queued.sent):
            if queued.sub.request_ids[j] is None:  # vLLM refused the request before running it (too long, ...)
                message = queued.sub.refused[j]
                outcomes[i] = Outcome(samples[i], _info(samples[i]), reason=ENGINE_REFUSED, message=message)
        if stream is not None:
            for i, o in outcomes.items():
                stream.put(i, o)
        if ahead:
            self._queued = self._submit(ahead)

        def done(j: int, out: Any) -> None:
            i = queued.sent[j]
            outcomes[i] = _outcome(samples[i], out)
            if stream is not None:
                stream.put(i, outcomes[i])

        self.feed.finish(queued.sub, on_done=done)
        return [outcomes[i] for i in range(len(samples))], time.monotonic() + RECORD_WAIT_S

    def may_open_breaker(self, outcomes: list[Outcome]) -> bool:
        """True when the failures the engine already reported could open the breaker during these outcomes'
        adoption, counted as if none were retried: requests without a record, and records whose connector left an
        error file in their place (``non_finite``, ...; written before the batch's flush returned).  Such a batch
        is adopted before the next one is submitted, so the run stops where a serial run stops."""
        failures = sum(1 for o in outcomes if o.counted and (o.ticket is None or Path(o.ticket["error"]).exists()))
        return failures > 0 and self.breaker.consecutive + failures >= self.breaker.max_consecutive

    def adopt_batch(
        self, outcomes: list[Outcome] | OutcomeStream, deadline: float | None, stop: threading.Event
    ) -> list[Any]:
        """Index each outcome in order: adopt its record (waiting for its files until ``deadline``; None: until
        :data:`RECORD_WAIT_S` after the outcome was known) or fail it; returns the samples to try again.
        ``outcomes``: a batch the engine finished, or the :class:`OutcomeStream` of one it runs (each outcome taken
        as the engine knows it; the batch ends early, its rest not run, if the stream closes without one).
        ``stop``: set when the run is abandoned; the rest stay not run."""
        again: list[Any] = []
        ahead = CheckAhead(self.checkers)
        stream = outcomes if isinstance(outcomes, OutcomeStream) else None
        listed = outcomes if not isinstance(outcomes, OutcomeStream) else []
        size = stream.size if stream is not None else len(listed)
        try:
            for i in range(size):
                if stop.is_set():
                    break
                o = stream.get(i, stop) if stream is not None else listed[i]
                if o is None:  # the engine's part of the batch failed before it knew this outcome
                    break
                until = deadline if deadline is not None else time.monotonic() + RECORD_WAIT_S
                if not o.counted:  # a row error found before the engine: indexed, never retried nor counted
                    self.note_row(self.store.fail(o.info, o.reason, o.message))
                    continue
                if o.ticket is None:
                    self.failed(o.sample, o.info, o.reason, o.message, again)
                    continue
                path = wait_files(o.ticket, until)
                if path is None:
                    why = f"no record file within {RECORD_WAIT_S:.0f} s"
                    self.failed(o.sample, o.info, "missing_record", why, again)
                    continue
                nxt = slice(i + 1, i + 1 + ahead.window)
                ahead.offer(stream.ready(nxt.start, nxt.stop) if stream is not None else listed[nxt])
                row = self.store.adopt(o.info, path, checked=ahead.take(o, path))
                if row.status == "ok":
                    self.note_storage(row)
                    self.retry.forget(o.sample.sample_id)
                    self.breaker.success()
                else:
                    self.failed(o.sample, o.info, row.reason, row.message, again, recorded=row)
        finally:
            ahead.close()
            if stream is not None:
                self.adopted_early += stream.early
        return again

    def failed(
        self, sample: Any, info: Any, reason: str, message: str, again: list[Any], *, recorded: Any = None
    ) -> None:
        """A record that failed: tried again while :class:`Retry` allows, else indexed (``recorded``: the row
        adopt already wrote), shown, and counted by the breaker (which raises when it opens)."""
        if reason != ENGINE_REFUSED and self.retry.allow(sample.sample_id, reason):
            again.append(sample)  # its failed row (if adopt wrote one) gives way to the next attempt's
            return
        self.note_row(recorded if recorded is not None else self.store.fail(info, reason, message))
        self.breaker.failure(reason, message)


def drive(
    work: Batches,
    first: list[Any],
    rows: Iterator[Any],
    size: int,
    pipe: Pipeline[list[Any]],
    progress: Callable[[str], None],
) -> None:
    """Batches through the engine, each adopted in order by ``pipe``'s adopter: handed over before the engine runs it,
    the adopter takes its records as the engine finishes their requests (:class:`OutcomeStream`), once it adopted the
    batch before.  At most two batches held by the adopter (the one it adopts, the one it follows the engine into),
    one in the engine and, when overlapping, the one after it queued in the engine behind it: the engine's steps that
    finish a batch are filled with the next one's tokens.  A batch's retries go into the next batch read after its
    adoption.  A batch whose engine-reported failures could open the breaker is adopted to its end before more rows
    are read; an adoption's error (the open breaker's included) is raised here before more work is submitted.
    Serial (``pipe.overlap`` False): nothing is queued ahead, each batch is adopted before the next one reaches the
    engine."""
    done, t0 = 0, time.monotonic()
    retry: list[Any] = []
    holding: deque[int] = deque()  # rows of each batch the adopter holds, oldest first

    def adopted(rows_in: int, again: list[Any]) -> None:
        nonlocal done
        done += rows_in - len(again)
        retry.extend(again)
        progress(f"captured or failed {done} rows ({time.monotonic() - t0:.1f} s)")

    def take() -> list[Any]:  # the next batch: retries first, then new rows; ``size`` rows at most
        batch = retry[:size]
        del retry[:size]
        return batch + list(itertools.islice(rows, size - len(batch)))

    batch = first
    ahead: list[Any] = take() if pipe.overlap else []  # queued in the engine behind ``batch``
    while batch or holding:
        if not batch:  # the engine has nothing: the adopter's batches end, their retries make the next batch
            adopted(holding.popleft(), pipe.wait())
            batch, ahead = take(), []
            continue
        if not pipe.overlap:
            outcomes, deadline = pipe.engine(functools.partial(work.engine_batch, batch, ahead))
            adopted(len(batch), pipe.adopt_now(functools.partial(work.adopt_batch, outcomes, deadline, pipe.stopping)))
            batch, ahead = take(), []
            continue
        stream = OutcomeStream(len(batch))
        pipe.adopt_later(functools.partial(work.adopt_batch, stream, None, pipe.stopping), idle=stream.idle)
        holding.append(len(batch))
        outcomes, _ = pipe.engine(functools.partial(work.engine_batch, batch, ahead, stream))
        if len(holding) > 1:  # the batch before, adopted while the engine ran this one
            adopted(holding.popleft(), pipe.wait())
        if work.may_open_breaker(outcomes):  # this batch to its end before more rows are read
            adopted(holding.popleft(), pipe.wait())
        nxt = take()  # the reader indexes the rows it refuses (the store takes one writer at a time)
        batch, ahead = (ahead, nxt) if ahead else (nxt, [])
