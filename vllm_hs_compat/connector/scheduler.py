"""The connector's scheduler half: which records to make, holding their blocks, tickets, slot checks.

Lives in vLLM's scheduler (engine-core) process.  It never touches tensors: at ``request_finished`` it decides
the positions of the record, checks that the request's capture-group blocks cover them, holds the blocks
(returns True) and queues a :class:`~vllm_hs_compat.core.capture.SaveRequest` for the next step's metadata;
the worker half reads and publishes, then reports the request finished so vLLM frees the blocks.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_hs_compat import api
from vllm_hs_compat.adapters.base import VllmAdapter
from vllm_hs_compat.core.capture import (
    BlockTracker,
    CaptureSpec,
    FinishedRequest,
    NoRecord,
    RequestSample,
    SaveRequest,
    SlotCheck,
    StepPlan,
    parse_request,
)
from vllm_hs_compat.core.choices import Choices, Sibling
from vllm_hs_compat.core.groups import CaptureGroup
from vllm_hs_compat.core.labels import PlaneLabels
from vllm_hs_compat.core.vocabulary import (
    REASON_ABORTED,
    REASON_ASYNC_DRAFTS,
    REASON_BAD_PARAMS,
    REASON_BLOCKS,
    REASON_DISABLED,
    REASON_ENGINE_STOPPED,
    REASON_PADDING,
    REQUEST_KEY,
    RESULT_KEY,
    STATUS_FAILED,
    STATUS_QUEUED,
    STATUS_SHARED,
    STATUS_SKIPPED,
)
from vllm_hs_compat.errors import CaptureConfigError
from vllm_hs_compat.export.capabilities import new_publication

from .config import ConnectorConfig
from .sinks import sink_ticket

if TYPE_CHECKING:
    from vllm_hs_compat.adapters.vllm_types import KVCacheConfig, Request, SchedulerOutput, VllmConfig

log = logging.getLogger("vllm.vllm_hs_compat.connector")


#: Scheduler halves alive in this process (the in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
LIVE: weakref.WeakSet[CaptureScheduler] = weakref.WeakSet()


@dataclass(frozen=True)
class SchedulerFacts:
    """What the scheduler half needs to know about the engine, resolved once from vLLM's configs by the adapter
    (:meth:`resolve`) -- or written by hand in a test, which then needs no vLLM at all."""

    group: CaptureGroup
    """The capture layer's KV-cache group as the scheduler sees it (its index and block size)."""
    labels: PlaneLabels
    num_blocks: int
    """Blocks of the KV cache: a block id at or past it is refused (``blocks``)."""
    bytes_per_token: int
    clobbered_slot: int | None = None
    """The manager slot CUDA-graph padding overwrites on this release (``padding_slot``), or None."""
    async_scheduling: bool = False
    """The engine schedules ahead of its outputs (the adapter's ``async_scheduling``): a step that follows one
    with drafts for the request has no start this side can vouch for, and is not checked."""
    misplaced_drafts: str | None = None
    """Why this engine writes generated positions after a step that emitted two tokens at wrong positions (the
    adapter's ``async_drafts_misplace_rows``), or None: a record reaching past such a step fails (``async_drafts``)."""

    @classmethod
    def resolve(
        cls, adapter: VllmAdapter, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
    ) -> SchedulerFacts:
        group = api.resolve_capture_group(kv_cache_config, view="scheduler", vllm_config=vllm_config, adapter=adapter)
        labels = api.plane_labels(vllm_config, adapter=adapter)
        if kv_cache_config is None:  # resolve_capture_group raised already; keep mypy and readers informed
            raise CaptureConfigError("no kv_cache_config")
        num_blocks = adapter.num_blocks(kv_cache_config)
        itemsize = adapter.model_dtype(vllm_config).itemsize
        padding = adapter.cuda_graph_padding(vllm_config)
        return cls(
            group=group,
            labels=labels,
            num_blocks=num_blocks,
            bytes_per_token=labels.num_planes * adapter.hidden_size(vllm_config) * itemsize,
            clobbered_slot=adapter.padding_clobbered_slot(num_blocks, group.block_size) if padding else None,
            async_scheduling=adapter.async_scheduling(vllm_config),
            misplaced_drafts=adapter.async_drafts_misplace_rows(vllm_config),
        )


class CaptureScheduler:
    """Scheduler-side state of the capture connector.

    Built from :class:`SchedulerFacts` (:meth:`from_vllm` resolves them from a live engine's configs); what it
    decides per request and per step reads only those facts, the adapter's ``read_step``/``read_finished``, and
    the package's own core types -- so tests/connector drive it with hand-built facts and requests."""

    def __init__(self, adapter: VllmAdapter, config: ConnectorConfig, facts: SchedulerFacts) -> None:
        self.adapter = adapter
        self.config = config
        self.facts = facts
        self.group = facts.group
        self.labels = facts.labels
        self.num_blocks = facts.num_blocks
        self.bytes_per_token = facts.bytes_per_token
        self._clobbered = facts.clobbered_slot
        self._step = 0
        self._pending: list[SaveRequest] = []
        self._held: set[str] = set()
        self._tracker = BlockTracker(self.group.index)
        # Under async scheduling: the drafts scheduled for each followed request the last time it ran (its next
        # step's start is then uncertain by up to that many positions).
        self._drafts: dict[str, int] = {}
        self._checks_left = config.check_requests
        # A release the matrix has not proven (the adapter says so): every request's slots are checked.
        self._check_every = adapter.check_every_request
        self._locator: dict[str, Any] | None = None
        self._choices = Choices()  # the families of n > 1 requests (see core/choices.py)
        self.counters = {
            "records_scheduled": 0,
            "records_refused": 0,
            "slot_checks_sent": 0,
            "slot_checks_uncertain": 0,
            "tracking_mismatch": 0,
            "records_lost_at_shutdown": 0,
        }
        LIVE.add(self)
        log.info(
            "vllm-hs-compat scheduler: %s; %d planes %s; %d blocks; capture=%s window=%s sink=%s; slot checks: %s",
            self.group.describe(),
            self.labels.num_planes,
            list(self.labels.layer_ids),
            self.num_blocks,
            config.capture.mode,
            list(config.capture.window) if config.capture.window else None,
            config.sink,
            "every request (untested release)" if self._check_every else f"first {config.check_requests} requests",
        )
        if facts.misplaced_drafts is not None:
            log.warning(
                "vllm-hs-compat: %s. Records that reach past such a step (capture 'all' or 'output'; this engine's "
                "default is %r, a request may override it) fail with reason %r; prompt records are not affected. "
                "To keep them: --no-async-scheduling (vllm serve), async_scheduling=False (vllm.LLM).",
                facts.misplaced_drafts,
                config.capture.mode,
                REASON_ASYNC_DRAFTS,
            )

    @classmethod
    def from_vllm(
        cls,
        adapter: VllmAdapter,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        config: ConnectorConfig,
    ) -> CaptureScheduler:
        """The scheduler half of a live engine: its facts resolved from vLLM's configs."""
        return cls(adapter, config, SchedulerFacts.resolve(adapter, vllm_config, kv_cache_config))

    # --- start-up ---------------------------------------------------------------------------------------
    def on_handshake(self, infos: Sequence[Mapping[str, Any]]) -> None:
        """The capture owner's sink locator, sent by the workers once their caches are registered."""
        owners = [i for i in infos if i.get("owner")]
        if len(owners) != 1:
            log.warning("vllm-hs-compat: expected one capture owner in the worker handshake, got %d", len(owners))
        if owners:
            info = owners[0]
            if (info.get("group_index"), info.get("group_block_size")) != (self.group.index, self.group.block_size):
                raise CaptureConfigError(
                    f"the worker resolved the capture group as index {info.get('group_index')} block size "
                    f"{info.get('group_block_size')}, the scheduler as {self.group.describe()}: block ids from "
                    "the scheduler would address the wrong cache rows"
                )
            self._locator = dict(info.get("locator") or {})
            shown = {k: v for k, v in self._locator.items() if k != "capability_key"}  # a secret: never logged
            log.info("vllm-hs-compat scheduler: capture owner %s, sink %s", info.get("ranks"), shown)

    # --- every step -------------------------------------------------------------------------------------
    def build_plan(self, scheduler_output: SchedulerOutput) -> StepPlan:
        """This step's metadata payload: the saves queued since the last step, and slot checks."""
        plan = StepPlan(self._step, self.group.index, self.group.block_size, self._pending)
        self._pending = []
        self._step += 1
        if self._check_every or self._checks_left or len(self._tracker):
            # Only while some of the first `check_requests` requests are alive (every request on an untested
            # release): afterwards a step costs O(saves).
            step = self.adapter.read_step(scheduler_output)
            for new in step.new:
                if (self._check_every or self._checks_left) and new.req_id not in self._tracker:
                    self._tracker.watch(new)
                    self._checks_left = max(0, self._checks_left - 1)
            self._tracker.apply(step)
            starts = {r.req_id: r.num_computed_tokens for r in step.new}
            starts.update({r.req_id: r.num_computed_tokens for r in step.cached})
            for rid, start in starts.items():
                n = step.num_scheduled_tokens.get(rid, 0)
                if rid not in self._tracker or n <= 0:
                    continue
                if self.facts.async_scheduling:
                    # The start counts the drafts of the request's last step as accepted; the worker moves it
                    # back by the rejected ones, which this side learns only later: no check it could vouch for.
                    uncertain = self._drafts.pop(rid, 0) > 0
                    if step.spec_tokens.get(rid):
                        self._drafts[rid] = step.spec_tokens[rid]
                    if uncertain:
                        self.counters["slot_checks_uncertain"] += 1
                        continue
                plan.checks.append(SlotCheck(rid, self._tracker.blocks(rid), start, n))
            if self._drafts:
                for rid in step.finished | step.preempted:
                    self._drafts.pop(rid, None)
            self.counters["slot_checks_sent"] += len(plan.checks)
        return plan

    # --- request end ------------------------------------------------------------------------------------
    def _spec_for(self, fr: FinishedRequest) -> tuple[CaptureSpec, RequestSample | None]:
        """The request's capture settings and ``sample`` entry (its ``hs_capture`` over the config's)."""
        override = (fr.params or {}).get(REQUEST_KEY)
        if override is None:
            return self.config.capture, None
        return parse_request(override, base=self.config.capture, what=f"request {fr.req_id!r} {REQUEST_KEY}")

    def _params(self, fr: FinishedRequest, status: str, **fields: Any) -> dict[str, Any]:
        entry = {"v": 1, "record_id": fr.req_id, "status": status, "sink": self.config.sink, **fields}
        return {RESULT_KEY: entry}

    def _refuse(self, fr: FinishedRequest, reason: str, message: str) -> tuple[bool, dict[str, Any]]:
        self.counters["records_refused"] += 1
        status = STATUS_SKIPPED if reason == REASON_DISABLED else STATUS_FAILED
        if status == STATUS_FAILED and reason != REASON_ABORTED:
            log.warning("vllm-hs-compat: no record for request %r: %s: %s", fr.req_id, reason, message)
        return False, self._params(fr, status, reason=reason, message=message)

    def request_finished(self, request: Request, block_ids: Sequence[Any]) -> tuple[bool, dict[str, Any] | None]:
        """Decide the request's record; hold its blocks (True) when one will be made.

        ``block_ids``: the capture group's list (vLLM without HMA passes its only group) or one list per group
        (``request_finished_all_groups``).  A child of an ``n > 1`` request also reports its siblings finished
        so far (``hs_choices``, see :mod:`vllm_hs_compat.core.choices`)."""
        return self.finished(self.adapter.read_finished(request), block_ids)

    def finished(self, fr: FinishedRequest, block_ids: Sequence[Any]) -> tuple[bool, dict[str, Any]]:
        """:meth:`request_finished` of a request already read into the core type."""
        sib = self._choices.join(
            self.adapter.parallel_sampling_child(fr.req_id), fr.arrival_time, fr.token_ids, fr.num_prompt_tokens
        )
        hold, params = self._decide(fr, block_ids, sib)
        if sib is not None:
            params = self._choices.finish(sib, params)
        return hold, params

    def _decide(
        self, fr: FinishedRequest, block_ids: Sequence[Any], sib: Sibling | None
    ) -> tuple[bool, dict[str, Any]]:
        watched = self._tracker.blocks(fr.req_id) if fr.req_id in self._tracker else None
        self._tracker.forget(fr.req_id)
        if fr.aborted:
            return self._refuse(fr, REASON_ABORTED, f"the request did not finish normally ({fr.status})")
        try:
            spec, sample = self._spec_for(fr)
        except CaptureConfigError as e:
            return self._refuse(fr, REASON_BAD_PARAMS, str(e))
        try:
            start, stop = spec.positions(num_prompt_tokens=fr.num_prompt_tokens, num_valid=fr.num_valid)
        except NoRecord as e:
            return self._refuse(fr, e.reason, e.message)
        repeat = fr.first_generated_repeat if self.facts.misplaced_drafts is not None else None
        if repeat is not None and stop > repeat:
            return self._refuse(
                fr,
                REASON_ASYNC_DRAFTS,
                f"the record reaches position {stop - 1}, at or past position {repeat}, where a generated token "
                f"repeats the one before it (a step that emitted two tokens); {self.facts.misplaced_drafts}. Run with "
                "--no-async-scheduling (vllm serve) or async_scheduling=False (vllm.LLM), or capture 'prompt'",
            )
        try:
            what = f"request {fr.req_id!r} {REQUEST_KEY}.sample"
            record_sample = None if sample is None else sample.for_record(start, stop, len(fr.token_ids), what=what)
        except CaptureConfigError as e:
            return self._refuse(fr, REASON_BAD_PARAMS, str(e))
        in_prompt = sib is not None and stop <= fr.num_prompt_tokens
        if sib is not None and in_prompt:
            shared = self._choices.shared_record(sib, start, stop)
            if shared is not None:  # a sibling stores these prompt rows already: point at its record
                self._choices.counters["choices_shared"] += 1
                entry = dict(shared[RESULT_KEY])
                same_as = entry["record_id"]
                entry.update(record_id=fr.req_id, status=STATUS_SHARED, same_as=same_as)
                return False, {**shared, RESULT_KEY: entry}
        try:
            blocks = _group_blocks(block_ids, self.group.index)
        except CaptureConfigError as e:
            return self._refuse(fr, REASON_BLOCKS, str(e))
        bs = self.group.block_size
        need = -(-stop // bs)
        if len(blocks) < need:
            return self._refuse(
                fr,
                REASON_BLOCKS,
                f"{len(blocks)} capture-group blocks of {bs} tokens cannot hold positions up to {stop}",
            )
        used = blocks[:need]
        if any(b < 0 or b >= self.num_blocks for b in used[start // bs :]):
            return self._refuse(fr, REASON_BLOCKS, f"block ids {used} run outside the cache [0, {self.num_blocks})")
        if watched is not None and tuple(watched[:need]) != used:
            self.counters["tracking_mismatch"] += 1
            log.warning(
                "vllm-hs-compat: request %r: blocks followed through the steps %s differ from the blocks at finish "
                "%s; using the latter",
                fr.req_id,
                list(watched[:need]),
                list(used),
            )
        if self._clobbered is not None:
            block, offset = divmod(self._clobbered, bs)
            hit = [p * bs + offset for p, b in enumerate(used) if b == block and start <= p * bs + offset < stop]
            if hit:
                return self._refuse(
                    fr,
                    REASON_PADDING,
                    f"position {hit[0]} lives in the last slot of the last block, which padded CUDA-graph tokens "
                    f"overwrite on vLLM {self.adapter.version} (fixed in 0.25.0); run with --enforce-eager or upgrade",
                )
        publication = new_publication()  # binds the ticket's capability to this record, not to its id alone
        save = SaveRequest(
            record_id=fr.req_id,
            req_id=fr.req_id,
            block_ids=used,
            start=start,
            stop=stop,
            token_ids=fr.token_ids[start:stop],
            num_prompt_tokens=fr.num_prompt_tokens,
            publication=publication,
            sample=record_sample,
        )
        self._pending.append(save)
        self._held.add(fr.req_id)
        self.counters["records_scheduled"] += 1
        # "queued", not a promise: the pool that may still drop it lives in the capture owner's worker process,
        # which this step cannot ask (docs/connector.md says why, and what a client must expect).
        params = self._params(
            fr, STATUS_QUEUED, start=start, num_tokens=stop - start, num_prompt_tokens=fr.num_prompt_tokens
        )
        nbytes = (stop - start) * self.bytes_per_token
        params.update(sink_ticket(self.config.sink, self._locator, fr.req_id, nbytes, publication))
        if sib is not None and in_prompt:
            self._choices.remember_prompt_record(sib, start, stop, params)
        return True, params

    def on_finished_sending(self, req_ids: set[str]) -> None:
        """The workers reported these held requests done (vLLM frees their blocks)."""
        self._held.difference_update(req_ids)

    def holds(self, record_ids: Collection[str]) -> int:
        """How many of ``record_ids`` are held for a record not read yet (a record's id is its request's)."""
        return sum(1 for r in record_ids if r in self._held)

    @property
    def held(self) -> int:
        """Requests whose blocks are held for a record not read yet (queued or sent to the workers)."""
        return len(self._held)

    def shutdown(self) -> None:
        """Count and name the records the engine stopped before reading.  Saves never sent to the workers are
        lost for sure: with the file sink each leaves ``<record>.error.json``."""
        lost = list(self._pending)
        self._pending = []
        if self._held:
            self.counters["records_lost_at_shutdown"] += len(lost)
            log.error(
                "vllm-hs-compat: the engine stopped with %d record(s) not read (%d never sent to the workers: lost). "
                "With the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) the records of an offline "
                "LLM.generate are read in the engine's next steps: call vllm_hs_compat.connector.flush(llm) "
                "before shutting it down.",
                len(self._held),
                len(lost),
            )
        if lost and self.config.sink == "file" and self.config.file_path is not None:
            from vllm_hs_compat.export import files

            for save in lost:
                files.write_failure(
                    self.config.file_path,
                    save.record_id,
                    REASON_ENGINE_STOPPED,
                    "the engine stopped before the record was read",
                )
        self._held.clear()
        LIVE.discard(self)


def _group_blocks(block_ids: Sequence[Any], group_index: int) -> tuple[int, ...]:
    """The capture group's block ids from what ``request_finished[_all_groups]`` received."""
    if block_ids and not isinstance(block_ids[0], int):
        if group_index >= len(block_ids):
            raise CaptureConfigError(
                f"request_finished received block ids of {len(block_ids)} group(s); the capture layer is in "
                f"group {group_index}"
            )
        return tuple(int(b) for b in block_ids[group_index])
    if group_index != 0:
        raise CaptureConfigError(
            f"request_finished received one block list, but the capture layer is in group {group_index}: vLLM "
            "called the non-HMA path with the hybrid KV-cache manager on"
        )
    return tuple(int(b) for b in block_ids)
