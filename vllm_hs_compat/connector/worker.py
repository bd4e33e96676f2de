"""The connector's worker half: the capture view, reading held requests' rows, publishing records.

Lives in every worker process (one per TP rank and PP stage).  Only the capture owner (an adapter question:
TP rank 0 of the stage that holds the capture layer) reads and publishes; every rank reports each save
finished exactly once so vLLM's aggregation frees the blocks when the owner is done.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from vllm_hs_compat import api, envs
from vllm_hs_compat.adapters.base import VllmAdapter
from vllm_hs_compat.adapters.reader import Ranks
from vllm_hs_compat.core import finite
from vllm_hs_compat.core.capture import RecordFailure, SaveRequest, SlotCheck, StepPlan
from vllm_hs_compat.core.groups import CaptureGroup
from vllm_hs_compat.core.labels import PlaneLabels
from vllm_hs_compat.core.layout import CaptureView
from vllm_hs_compat.core.pinned import PinnedArena
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.core.slots import batch_slots
from vllm_hs_compat.core.transfer import PendingRows, RowReader, pinned_host_stats
from vllm_hs_compat.core.vocabulary import (
    REASON_BACKLOG,
    REASON_BLOCKS,
    REASON_NON_FINITE,
    REASON_SLOT_CHECK,
    reason_of,
)
from vllm_hs_compat.errors import CaptureConfigError, CaptureGroupError, CaptureViewError, HsCompatError, SlotError

from .config import ConnectorConfig
from .sinks import Sink, make_sink
from .slot_checks import SlotChecks

if TYPE_CHECKING:
    from vllm_hs_compat.adapters.vllm_types import KVCacheConfig, VllmConfig

log = logging.getLogger("vllm.vllm_hs_compat.connector")

#: Host bytes of records read or being read and not yet through the sink beyond which the worker reads no more:
#: further saves wait in the engine's blocks (held, so vLLM schedules around them) until the sink catches up.  A
#: record alone is always read, whatever its size.
MAX_BACKLOG_BYTES = 4 << 30


def _pinned_arena() -> PinnedArena | None:
    """The pinned host slab the owner's step reads take their rows into (``VLLM_HS_COMPAT_PINNED_MIB``, allocated
    now, before the engine's first step); None when set to 0 or when the host refuses it (logged: the reads then
    allocate as they go)."""
    raw = envs.get(envs.PINNED_MIB)
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if mib < 0:
        raise CaptureConfigError(f"{envs.PINNED_MIB}={raw!r}: expected a whole number of MiB (0: no arena)")
    if mib == 0:
        return None
    try:
        arena = PinnedArena(mib << 20)
    except RuntimeError as e:  # the host cannot pin that much: the reads allocate as they go
        log.warning("vllm-hs-compat: no pinned arena of %d MiB (%s); set %s lower or 0", mib, e, envs.PINNED_MIB)
        return None
    log.info("vllm-hs-compat: %d MiB of pinned host memory for the reads, allocated in %.2f s", mib, arena.alloc_s)
    return arena


class _Wait:
    """The backlog is full: the save waits (its blocks held) for a later step."""


WAIT = _Wait()


def _idle(q: queue.Queue[Any]) -> bool:
    return q.unfinished_tasks == 0


#: Worker halves alive in this process (the in-process engine), drained by ``vllm_hs_compat.connector.flush``.
LIVE: weakref.WeakSet[CaptureWorker] = weakref.WeakSet()


@dataclass(frozen=True)
class WorkerFacts:
    """What the worker half needs to know about the engine, resolved once from vLLM's configs by the adapter
    (:meth:`resolve`) -- or written by hand in a test, which then needs no vLLM at all."""

    group: CaptureGroup
    """The capture layer's KV-cache group as the worker sees it."""
    labels: PlaneLabels
    hidden_size: int
    ranks: Ranks
    layout: str | None = None
    """vLLM's KV-cache layout name where the release has one (logged), else None."""

    @classmethod
    def resolve(
        cls, adapter: VllmAdapter, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
    ) -> WorkerFacts:
        return cls(
            group=api.resolve_capture_group(kv_cache_config, view="worker", vllm_config=vllm_config, adapter=adapter),
            labels=api.plane_labels(vllm_config, adapter=adapter),
            hidden_size=adapter.hidden_size(vllm_config),
            ranks=adapter.parallel_ranks(vllm_config),
            layout=adapter.kv_cache_layout(vllm_config, kv_cache_config),
        )


class CaptureWorker:
    """Worker-side state of the capture connector.

    Built from :class:`WorkerFacts` (:meth:`from_vllm` resolves them from a live engine's configs); reading,
    checking and publishing records uses only those facts, the capture tensor vLLM registers and the adapter's
    ``capture_owner``/``layer_slot_mapping`` -- so tests/connector drive it with hand-built facts on CPU."""

    def __init__(
        self, adapter: VllmAdapter, config: ConnectorConfig, facts: WorkerFacts, *, vllm_version: str = ""
    ) -> None:
        self.adapter = adapter
        self.config = config
        self.facts = facts
        self.vllm_version = vllm_version
        self.group = facts.group
        self.labels = facts.labels
        self.hidden_size = facts.hidden_size
        self.layout = facts.layout
        self.owner = False
        self.view: CaptureView | None = None
        self.reader: RowReader | None = None
        self.sink: Sink | None = None
        self._issued_step = -1
        self._checked_step = -1
        self._group_checked = False
        self._report: set[str] = set()
        self._report_lock = threading.Lock()
        self.slot_checks = SlotChecks(self._slot_check_failed)
        # Two threads past the engine's: the copies' completions (a read reported the moment its copy is done, so
        # vLLM frees its blocks whatever the sink is doing), then the publisher (checks, record, the sink's write).
        self._copies: queue.Queue[tuple[SaveRequest, PendingRows, int] | None] = queue.Queue()
        self._queue: queue.Queue[tuple[SaveRequest, PendingRows, int] | None] = queue.Queue()
        self._waiting: list[SaveRequest] = []  # saves not read yet while the backlog is full (engine thread)
        self._counted = 0  # the first this many of _waiting are counted in "saves_waited" (a FIFO: always a prefix)
        self._backlog = 0
        self._backlog_lock = threading.Lock()
        self._made = 0  # records built (the order "self_test": {"corrupt_record": N} counts in)
        self._threads: list[threading.Thread] = []
        self.counters = {
            "saves": 0,
            "saves_waited": 0,
            "records": 0,
            "records_failed": 0,
            "records_non_finite": 0,
            "bytes": 0,
            "slot_checks": 0,
            "slot_checks_failed": 0,
            "slot_checks_unavailable": 0,
        }
        self._counter_lock = threading.Lock()
        # Where the worker's time goes (logged at shutdown): on the engine's thread, issuing the step's reads and
        # the slot checks; on the publisher's, waiting for the copies, the NaN/Inf check, building the record
        # (its checksum) and the sink's write.
        self.seconds = dict.fromkeys(("issue", "slot_check", "copy_wait", "finite", "record", "sink"), 0.0)
        LIVE.add(self)

    @classmethod
    def from_vllm(
        cls,
        adapter: VllmAdapter,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        config: ConnectorConfig,
        *,
        vllm_version: str = "",
    ) -> CaptureWorker:
        """The worker half of a live engine: its facts resolved from vLLM's configs."""
        return cls(
            adapter, config, WorkerFacts.resolve(adapter, vllm_config, kv_cache_config), vllm_version=vllm_version
        )

    def _count(self, key: str, n: int = 1) -> None:
        with self._counter_lock:
            self.counters[key] += n

    def _time(self, **spent: float) -> None:
        with self._counter_lock:
            for key, s in spent.items():
                self.seconds[key] += s

    # --- start-up ---------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Resolve and check the capture view; the owner starts its sink.  Logs once."""
        tensor = kv_caches.get(self.group.layer_name)
        ranks = self.facts.ranks
        self.owner = self.adapter.capture_owner(ranks, tensor is not None)
        if tensor is not None:
            self.view = api.describe_capture_view(
                tensor,
                self.group,
                num_planes=self.labels.num_planes,
                hidden_size=self.hidden_size,
                adapter=self.adapter,
            )
            self.reader = RowReader(tensor, self.view, options=self.config.read)
        if self.owner:
            # where a compact file storage quantizes: on the capture layer's GPU (else on the host)
            device = tensor.device if tensor is not None and tensor.device.type == "cuda" else None
            if device is not None and self.reader is not None:
                self.reader.arena = _pinned_arena()
            self.sink = make_sink(self.config, ranks.dp_rank, device=device)
            self._threads = [
                threading.Thread(target=self._complete_loop, name="hs-compat-copies", daemon=True),
                *(
                    threading.Thread(target=self._publish_loop, name=f"hs-compat-publish-{i}", daemon=True)
                    for i in range(max(1, self.sink.writers))
                ),
            ]
            for thread in self._threads:
                thread.start()
        view = self.view.describe() if self.view is not None else "none (this stage does not hold the capture layer)"
        log.info(
            "vllm-hs-compat worker (%s): vLLM %s, adapter %s; %s; view %s shape=%s layout=%s; planes = layer ids %s "
            "(pre-norm); owner=%s sink=%s %s",
            ranks.describe(),
            self.vllm_version or self.adapter.version,
            self.adapter.name,
            self.group.describe(),
            view,
            list(tensor.shape) if tensor is not None else None,
            self.layout or "shape-defined",
            list(self.labels.layer_ids),
            self.owner,
            self.config.sink if self.owner else "-",
            {k: v for k, v in self.sink.locator().items() if k != "capability_key"} if self.sink is not None else "",
        )
        token_file = getattr(self.sink, "token_file", None)
        if token_file is not None:
            log.info("vllm-hs-compat: export token (the trainer credential) is in %s", token_file)

    def handshake_info(self) -> dict[str, Any] | None:
        """What the scheduler half needs from the capture owner (None on other ranks)."""
        if not self.owner or self.sink is None:
            return None
        return {
            "owner": True,
            "ranks": self.facts.ranks.describe(),
            "group_index": self.group.index,
            "group_block_size": self.group.block_size,
            "sink": self.sink.kind,
            "locator": self.sink.locator(),
        }

    # --- every step -------------------------------------------------------------------------------------
    def _check_group(self, plan: StepPlan) -> None:
        if self._group_checked:
            return
        if (plan.group_index, plan.group_block_size) != (self.group.index, self.group.block_size):
            raise CaptureGroupError(
                f"the scheduler addresses the capture layer as group {plan.group_index} with block size "
                f"{plan.group_block_size}, this worker resolved {self.group.describe()}: the scheduler's block "
                "ids would address other rows. The scheduler and the worker see different KV-cache configs."
            )
        self._group_checked = True

    def on_step(self, plan: StepPlan | None) -> None:
        """Issue the reads of this step's saves (once per step: 0.17 binds the metadata twice) and of saves that
        waited for the backlog: one batched read (one index upload, one gather) for all of them."""
        if plan is not None and plan.step > self._issued_step:
            self._issued_step = plan.step
            self._check_group(plan)
            self.slot_checks.poll()
            for save in plan.saves:
                self._count("saves")
                if not self.owner:
                    self._done(save.req_id)
                    continue
                self._waiting.append(save)
        if not self._waiting:
            return
        batch: list[tuple[SaveRequest, int]] = []
        admitted = 0
        for save in self._waiting:
            got = self._admit(save)
            if isinstance(got, _Wait):  # in order: the saves after it wait as well
                break
            admitted += 1
            if got is not None:
                batch.append((save, got))
        self._waiting = self._waiting[admitted:]
        counted = max(0, self._counted - admitted)
        if len(self._waiting) > counted:
            self._count("saves_waited", len(self._waiting) - counted)
        self._counted = len(self._waiting)
        if batch:
            t = time.perf_counter()
            self._issue(batch)
            self._time(issue=time.perf_counter() - t)

    def _admit(self, save: SaveRequest) -> int | None | _Wait:
        """The save's host bytes, reserved in the backlog; None when it failed here (reported); :data:`WAIT`
        when the backlog is full (its blocks stay held until a later step reads it)."""
        if self.reader is None:
            self._fail(save, REASON_BLOCKS, "the capture owner has no registered capture view")
            self._done(save.req_id)
            return None
        bad = self.slot_checks.take(save.req_id, wait=False)  # a verdict still on the device: the publisher's
        if bad is not None:
            self._fail(save, REASON_SLOT_CHECK, bad)
            self._done(save.req_id)
            return None
        nbytes = save.num_tokens * self.labels.num_planes * self.hidden_size * self.reader.cache.element_size()
        with self._backlog_lock:
            if self._backlog and self._backlog + nbytes > MAX_BACKLOG_BYTES:
                return WAIT
            self._backlog += nbytes
        return nbytes

    def _release(self, nbytes: int) -> None:
        with self._backlog_lock:
            self._backlog -= nbytes

    def _issue(self, batch: list[tuple[SaveRequest, int]]) -> None:
        if self.reader is None:
            raise CaptureViewError("the capture owner has no registered capture view")
        try:
            results = self.reader.read_many([(s.req_id, s.block_ids, s.start, s.num_tokens) for s, _ in batch])
        except HsCompatError as e:
            for save, nbytes in batch:
                self._release(nbytes)
                self._fail(save, REASON_BLOCKS, str(e))
                self._done(save.req_id)
            return
        for (save, nbytes), pending in zip(batch, results, strict=True):
            if isinstance(pending, HsCompatError):
                self._release(nbytes)
                self._fail(save, REASON_BLOCKS, str(pending))
                self._done(save.req_id)
                continue
            if pending.event is None:  # CPU: the copy was synchronous, the blocks may go at once
                self._done(save.req_id)
                self._queue.put((save, pending, nbytes))
            else:
                self._copies.put((save, pending, nbytes))

    def _done(self, req_id: str) -> None:
        with self._report_lock:
            self._report.add(req_id)

    def finished(self) -> set[str]:
        """Held requests whose rows are read (their blocks may be freed): each reported exactly once.  The
        publisher thread marks a CUDA copy done as soon as it completes, so records are published even when vLLM
        steps no more (an idle engine); only the block free waits for the next step."""
        with self._report_lock:
            done, self._report = self._report, set()
        return done

    def on_capture_written(self, layer_name: str, attn_metadata: Any, plan: StepPlan | None) -> None:
        """``save_kv_layer`` of the capture layer: its rows for this step are written.  Queue this step's slot
        checks on the writing stream, then remember the point after them there (side-stream reads wait for it, so
        a record's rows are read after its checks' verdicts reached the host)."""
        if layer_name != self.group.layer_name:
            return
        self._check_slots(layer_name, attn_metadata, plan)
        if self.reader is not None:
            self.reader.mark_written()

    def _check_slots(self, layer_name: str, attn_metadata: Any, plan: StepPlan | None) -> None:
        if not self.owner or plan is None or not plan.checks or plan.step <= self._checked_step or self.view is None:
            return
        self._checked_step = plan.step
        mapping = self.adapter.layer_slot_mapping(layer_name, attn_metadata)
        if mapping is None:
            self._count("slot_checks_unavailable", len(plan.checks))
            return
        t = time.perf_counter()
        self._count("slot_checks", len(plan.checks))
        view = self.view
        # every check's slots at once, as the step's read takes them; a check whose block ids cannot address its
        # positions fails here, the others are queued on the device
        slots, where = batch_slots(
            [(c.req_id, c.block_ids, c.start, c.num_tokens) for c in plan.checks],
            group_block_size=view.group_block_size,
            num_manager_blocks=view.num_manager_blocks,
        )
        queued: list[tuple[SlotCheck, int]] = []
        for check, at in zip(plan.checks, where, strict=True):
            if isinstance(at, SlotError):
                self.slot_checks.fail(check.req_id, str(at))
            else:
                queued.append((check, at))
        self.slot_checks.submit(queued, slots, mapping, num_slots=view.num_manager_blocks * view.group_block_size)
        self._time(slot_check=time.perf_counter() - t)

    def _slot_check_failed(self, req_id: str, message: str) -> None:
        """Count and log a failed slot check (:class:`SlotChecks` keeps it until the record takes it)."""
        self._count("slot_checks_failed")
        log.error("vllm-hs-compat: slot check failed for request %r: %s", req_id, message)

    # --- publishing (background thread) -----------------------------------------------------------------
    def _fail(self, save: SaveRequest, reason: str, message: str) -> None:
        self._count("records_failed")
        log.warning("vllm-hs-compat: record %r failed: %s: %s", save.record_id, reason, message)
        if self.sink is None:
            return
        try:
            self.sink.fail(RecordFailure(save.record_id, save.req_id, reason, message, save.publication))
        except Exception:
            log.exception("vllm-hs-compat: the sink could not record the failure of %r", save.record_id)

    def _record(self, save: SaveRequest, rows: torch.Tensor) -> CaptureRecord:
        with self._counter_lock:
            made, self._made = self._made, self._made + 1
        if made == self.config.corrupt_record:  # "self_test" (ConnectorConfig.corrupt_record): before the checksum
            rows = rows.clone()
            rows[rows.shape[0] // 2, 0].neg_()
            log.warning("self_test: record %r corrupted on purpose (corrupt_record=%d)", save.record_id, made)
        meta = RecordMeta.for_tensor(
            save.record_id,
            rows,
            save.token_ids,
            self.labels.layer_ids,
            pre_norm=self.labels.pre_norm,
            vllm_version=self.vllm_version,
            adapter=self.adapter.name,
            start=save.start,
            num_prompt_tokens=save.num_prompt_tokens,
            sample=save.sample,
        )
        return CaptureRecord(meta, rows)

    def _complete_loop(self) -> None:
        """Report each CUDA read the moment its copy is done (vLLM frees the blocks in its next step), in issue
        order, then hand it to the publisher: a slow sink never holds the engine's blocks."""
        while True:
            item = self._copies.get()
            if item is None:
                for _ in range(len(self._threads) - 1):  # one for each publisher
                    self._queue.put(None)
                self._copies.task_done()
                return
            save, pending, nbytes = item
            copied = False
            try:
                t0 = time.perf_counter()
                pending.wait()
                self._time(copy_wait=time.perf_counter() - t0)
                copied = True
            except Exception as e:
                self._fail(save, reason_of(e), f"{type(e).__name__}: {e}")
                self._release(nbytes)
            self._done(save.req_id)  # exactly once: vLLM frees the blocks of each reported request
            if copied:
                self._queue.put(item)  # before this task is done: a drain never sees the record between queues
            del item, pending  # the publisher's alone now (the step's pinned block goes with its last record)
            self._copies.task_done()

    def _publish_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                self._publish(*item)
            finally:
                # the record's rows go with the call: a view of its step's pinned host block, which torch's
                # allocator reuses only once no record of that step is referenced (none held while waiting here)
                item = None
                self._queue.task_done()

    def _publish(self, save: SaveRequest, pending: PendingRows, nbytes: int) -> None:
        """Check one read record (its slot check, NaN/Inf) and hand it to the sink, or fail it; release its bytes
        from the backlog either way."""
        try:
            rows = pending.rows
            if self.sink is None:
                raise CaptureViewError("no sink")
            t1 = time.perf_counter()
            checked = self.slot_checks.take(save.req_id, wait=True)  # read after the step's write event: ready
            if checked is not None:
                self._fail(save, REASON_SLOT_CHECK, checked)
                return
            # NaN/Inf: flags computed where the rows were read (the direct kernel's own, the staged read's on the
            # device, the CPU gather's); where a read made none, here on the host
            bad = finite.problem(rows, pending.finite, start=save.start, layer_ids=self.labels.layer_ids)
            t2 = time.perf_counter()
            self._time(finite=t2 - t1)
            if bad is not None:
                self._count("records_non_finite")
                self._fail(save, REASON_NON_FINITE, f"{bad} (checked by the connector before the record was made)")
                return
            record = self._record(save, rows)
            t3 = time.perf_counter()
            self.sink.write(record, save.publication)
            self._time(record=t3 - t2, sink=time.perf_counter() - t3)
            self._count("records")
            self._count("bytes", nbytes)
        except Exception as e:
            self._fail(save, reason_of(e), f"{type(e).__name__}: {e}")
        finally:
            self._release(nbytes)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every read record has reached the sink (True) or ``timeout_s`` passed.  Sleeps on the
        queue's condition (what ``Queue.join`` waits on; the publisher's ``task_done`` of the last record wakes
        it), so the wait neither polls nor adds a poll interval to a drain."""
        deadline = time.monotonic() + timeout_s
        for q in (self._copies, self._queue):  # the completions hand every record on before their task is done
            with q.all_tasks_done:
                if not q.all_tasks_done.wait_for(partial(_idle, q), max(0.0, deadline - time.monotonic())):
                    return False
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Publish what is read, stop the publisher, close the sink; log the counters."""
        for save in self._waiting:  # never read: the engine stopped while they waited for the sink (counted)
            self._fail(save, REASON_BACKLOG, "the engine stopped while the record waited for the sink's backlog")
            self._done(save.req_id)
        self._waiting = []
        self._counted = 0
        if self._threads:
            self._copies.put(None)  # the completions pass it on to the publisher
            deadline = time.monotonic() + timeout_s
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            self._threads = []
        if self.sink is not None:
            try:
                self.sink.close()
            finally:
                self.sink = None
        if self.owner:
            log.info("vllm-hs-compat worker seconds: %s", {k: round(v, 3) for k, v in self.seconds.items()})
            log.info("vllm-hs-compat worker: %s", self.counters)
            pinned = pinned_host_stats()
            if pinned is not None:  # the process's pinned host blocks: cudaHostAlloc on the engine thread is slow
                log.info("vllm-hs-compat pinned host memory: %s", {k: round(v, 3) for k, v in pinned.items()})
            arena = self.reader.arena if self.reader is not None else None
            if arena is not None:  # the reads' own pinned slab: pieces handed out, and reads it had no room for
                log.info("vllm-hs-compat pinned arena: %s", {k: round(v, 3) for k, v in arena.describe().items()})
