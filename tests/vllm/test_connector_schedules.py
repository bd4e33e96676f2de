"""Random schedules through vLLM's OWN ``Scheduler`` with the capture connector on both sides.

vLLM schedules (chunked prefill, prefix caching, preemption under a tiny KV budget, speculative decode of
``extract_hidden_states``), its scheduler creates the scheduler-role connector, the worker-role connector is created
and registered as the worker and runner do, the hooks run in the release runner's order through vLLM's own helpers,
and the capture layer's own forward writes the rows.  Only the model is the test's: hidden states and tokens are
deterministic functions of the token prefix (``sched_harness``), so every record has one right answer.

Properties, per schedule:

* every record the sink receives is exactly (bit for bit) the hidden states of the positions its ticket names,
  paired with the right token ids; records exist exactly for the requests whose ticket says ``pending``;
* aborted requests get a ``failed``/``aborted`` ticket and no record; finished requests get the positions the
  capture mode and window select, or a ``failed``/``skipped`` ticket naming why there are none;
* at every step, every running request's computed positions hold its prefix's hidden states (no contamination);
* every held block is freed: the KV cache manager's free-block count returns to its initial value;
* the generated tokens are the model's greedy continuation, whatever the schedule.

``VLLM_HS_COMPAT_SCHEDULES`` sets the number of schedules per scheduler mode (default 200; ``nox -s vllm_long``
runs 10,000).  ``VLLM_HS_COMPAT_SCHEDULE_SEED`` (an integer) seeds hypothesis: the nox ``vllm``
sessions set it from the commit under test, so every landing draws other schedules and a failure is replayed with
the seed the session printed (``VLLM_HS_COMPAT_SCHEDULE_SEED=<seed> nox -s "vllm(release='0.29.0')"``).  Unset,
the schedules are hypothesis' derandomized ones (the same every run); ``VLLM_HS_COMPAT_SCHEDULE_RANDOM`` draws
fresh ones.  Each model runner the release has is a mode (``sched_harness.runner_modes``, found by feature): V1
(0.17-0.33) with resumed requests handed back as cached ones, V2 (0.29+) with resumed requests handed back as new
requests; 0.29-0.33 run both, 0.34 (Model Runner V1 deleted) V2 alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness as h
import pytest
import sched_harness as sh
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from vllm_hs_compat.core.capture import RecordFailure

pytestmark = pytest.mark.vllm

NUM_SCHEDULES = int(os.environ.get("VLLM_HS_COMPAT_SCHEDULES", "200"))
#: Schedules run per scheduler mode in this session (all verifiers).
SCHEDULES_RUN: Counter[str] = Counter()
#: The runners this release drives the capture with (a fact of the release: V1 where it exists, V2 where it runs
#: extract_hidden_states); a mode a release lacks is not parametrized at all.
MODES = sh.runner_modes()
MAX_MODEL_LEN = h.MAX_MODEL_LEN
REPORTS = Path(__file__).resolve().parents[2] / "reports"
_FRESH = "VLLM_HS_COMPAT_SCHEDULE_RANDOM" in os.environ
_SEED_ENV = os.environ.get("VLLM_HS_COMPAT_SCHEDULE_SEED", "").strip()
#: The hypothesis seed of every schedule test here (None: derandomized, or fresh with VLLM_HS_COMPAT_SCHEDULE_RANDOM).
SCHEDULE_SEED: int | None = int(_SEED_ENV, 0) if _SEED_ENV and not _FRESH else None
DERANDOMIZE = SCHEDULE_SEED is None and not _FRESH


def _seeded(test: Callable[..., None]) -> Callable[..., None]:
    """``test`` (a hypothesis test) under SCHEDULE_SEED when one is set."""
    return seed(SCHEDULE_SEED)(test) if SCHEDULE_SEED is not None else test


def seed_note() -> str:
    if SCHEDULE_SEED is not None:
        return f"schedule seed {SCHEDULE_SEED} (replay: VLLM_HS_COMPAT_SCHEDULE_SEED={SCHEDULE_SEED})"
    return "schedule seed: " + ("derandomized" if DERANDOMIZE else "fresh (VLLM_HS_COMPAT_SCHEDULE_RANDOM)")


def _announce_seed() -> None:
    """The seed, in the test's output and once in the session's terminal summary (before any schedule runs, so
    a failing session names it)."""
    note = seed_note()
    print(f"[vllm-hs-compat] {note}")
    if note not in sh.SUMMARY:
        sh.SUMMARY.insert(0, note)


# --------------------------------------------------------------------------------------------------
# schedules
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    spec: sh.EngineSpec
    plans: tuple[sh.RequestPlan, ...]
    seed: int


windows = st.one_of(
    st.none(),
    st.tuples(st.one_of(st.none(), st.integers(-64, 64)), st.one_of(st.none(), st.integers(-64, 64))).map(list),
)
capture_specs = st.fixed_dictionaries({"capture": st.sampled_from(["prompt", "all", "output"]), "window": windows})
overrides = st.one_of(
    st.none(),
    st.none(),
    st.none(),
    capture_specs,
    st.fixed_dictionaries({"window": windows}),  # over the engine's capture mode
    st.just({"enabled": False}),
    st.just({"capture": "bogus"}),
)


@st.composite
def schedules(draw: st.DrawFn, v2: bool, least: int, verifier: str = "dense") -> Schedule:
    """A KV budget from vLLM's minimum (one max-length request) up, batch limits, requests sharing prefixes
    (some identical, some longer than the token budget), staggered arrivals and abort points.  A third of the
    schedules are "pressure" schedules: several mid-length requests with long outputs arriving together into the
    smallest cache vLLM accepts, which is what makes vLLM preempt.  Budgets are ``least`` (vLLM's own minimum for
    the engine, :func:`floor`) plus a slack."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    pressure = draw(st.sampled_from([False, False, True]))
    num_bases = draw(st.integers(1, 3))
    bases = [[rng.randrange(sh.VOCAB) for _ in range(MAX_MODEL_LEN)] for _ in range(num_bases)]
    mnbt = draw(st.sampled_from([16, 24, 32, 48, 64, 128]))
    seqs = draw(st.sampled_from([3, 4, 6]) if pressure else st.sampled_from([1, 2, 3, 4, 4, 6]))
    capture = draw(capture_specs)
    slack = draw(st.sampled_from([0.0, 0.06]) if pressure else st.sampled_from([0.0, 0.06, 0.12, 0.2, 0.4, 0.9, 2.0]))
    spec = sh.EngineSpec(
        # mostly near vLLM's minimum (one max-length request), so that requests compete for blocks
        num_blocks=least + int(least * slack),
        max_num_batched_tokens=mnbt,
        max_num_seqs=seqs,
        v2=v2,
        extra_config={"capture": capture["capture"], "window": capture["window"]},
        pad_tokens=draw(st.sampled_from([0, 0, 1, 5])),
        reorder=draw(st.booleans()),
        verifier=verifier,
    )
    n = draw(st.sampled_from([3, 4, 5, 6]) if pressure else st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]))
    plans = []
    for i in range(n):
        base = draw(st.integers(0, num_bases - 1))
        shared = draw(st.sampled_from([0, 0, 8, 16, 17, 31, 32, 40, 64, 100]))
        abort = draw(st.sampled_from([*([None] * 12), *sh.ABORT_POINTS]))
        if abort == "prefill":  # more new tokens than a step takes: seen mid-prefill whatever the seed draws
            own = draw(st.integers(mnbt + 1, mnbt + 100))
        else:
            own = draw(st.sampled_from(range(40, 120) if pressure else range(0 if shared else 1, 240)))
        prompt = bases[base][:shared] + [rng.randrange(sh.VOCAB) for _ in range(own)]
        prompt = prompt[: MAX_MODEL_LEN - 1]
        plans.append(
            sh.RequestPlan(
                req_id=f"req-{i}",
                prompt=tuple(prompt),
                max_tokens=draw(st.sampled_from(range(24, 65) if pressure else range(1, 33))),
                arrival=draw(st.sampled_from([0, 0, 1]) if pressure else st.sampled_from([0, 0, 0, 1, 2, 3, 5, 8, 12])),
                abort=abort,
                hs_capture=draw(overrides),
            )
        )
    return Schedule(spec, tuple(plans), seed)


MAX_BATCHED_TOKENS = 128  # the largest token budget schedules() draws
MAX_SEQS = 6


def floor(verifier: str, connector: bool, v2: bool) -> int:
    """vLLM's smallest KV budget for the largest batch limits drawn (the need only grows with the token budget);
    computed outside the strategy, which must not touch global state."""
    return sh.min_num_blocks(verifier, connector, v2, MAX_BATCHED_TOKENS, MAX_SEQS)


# --------------------------------------------------------------------------------------------------
# what the contract (docs/connector.md) says a finished request's record is
# --------------------------------------------------------------------------------------------------
def expected_positions(t: sh.RequestTrace, base: dict[str, Any]) -> tuple[str, Any]:
    """``("queued", (start, stop))`` or ``(status, reason)`` for a finished request, from docs/connector.md:
    rows ``[0, num_computed_tokens)`` exist at finish; ``capture`` picks the prompt, everything, or the generated
    part; ``window`` slices that (Python semantics); a request's own ``hs_capture`` overrides both or opts out."""
    if t.aborted:
        return "failed", "aborted"
    cfg = dict(base)
    if t.plan.hs_capture is not None:
        if t.plan.hs_capture.get("capture", "prompt") not in ("prompt", "all", "output"):
            return "failed", "bad_params"
        if t.plan.hs_capture.get("enabled") is False:
            return "skipped", "disabled"
        cfg.update(t.plan.hs_capture)
    assert t.token_ids_at_finish is not None and t.num_computed_at_finish is not None
    valid = min(t.num_computed_at_finish, len(t.token_ids_at_finish))
    prompt = t.num_prompt_tokens
    mode = cfg.get("capture", "prompt")
    if mode == "prompt":
        if valid < prompt:
            return "failed", "prompt_incomplete"
        lo, hi = 0, prompt
    elif mode == "all":
        lo, hi = 0, valid
    else:
        lo, hi = prompt, max(prompt, valid)
    window = cfg.get("window")
    if window is not None:
        picked = range(lo, hi)[slice(*window)]
        lo, hi = (picked.start, picked.stop) if len(picked) else (lo, lo)
    if hi <= lo:
        return "failed", "empty_selection"
    return "queued", (lo, hi)


def greedy(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    hashes = sh.prefix_hashes(tokens)
    limit = min(max_tokens, MAX_MODEL_LEN - len(tokens))
    for _ in range(limit):
        t = sh.next_token(hashes[-1], tokens[-1])
        tokens.append(t)
        hashes.append(sh.hash_after(hashes[-1], t))
    return tokens


# --------------------------------------------------------------------------------------------------
# one schedule
# --------------------------------------------------------------------------------------------------
def run_and_check(schedule: Schedule, coverage: Counter[str]) -> None:
    sh.take_records()  # nothing left over from an earlier schedule
    engine = sh.build_engine(schedule.spec)
    try:
        trace = sh.run_schedule(engine, list(schedule.plans))
        free_at_end = engine.free_blocks()
        initial = engine.initial_free_blocks
        finished = dict(engine.finished_params)
    finally:
        engine.close()  # the worker connector publishes what it has read and stops its publisher
        counters = engine.connector_counters()
    records = sh.take_records()
    for bad in ("slot_checks_failed", "tracking_mismatch", "records_failed"):
        assert counters.get(bad, 0) == 0, f"the connector's own check counted {bad}: {counters}"
    coverage["connector_slot_checks"] += counters.get("slot_checks", 0)

    assert free_at_end == initial, f"{initial - free_at_end} KV blocks still held after every request left"
    failures = [r for r in records if isinstance(r, RecordFailure)]
    assert not failures, f"the connector failed records: {failures}"
    by_id: dict[str, list[Any]] = {}
    for r in records:
        by_id.setdefault(r.meta.record_id, []).append(r)

    base = schedule.spec.connector_config()
    for rid, t in trace.requests.items():
        ticket_pair = finished.get(rid)
        assert ticket_pair is not None, f"{rid}: request_finished was never called"
        held, params = ticket_pair
        entry = (params or {}).get("hs_record")  # the ticket (docs/connector.md, "What the client gets back")
        assert entry is not None and entry["record_id"] == rid, (rid, params)
        status, detail = expected_positions(t, base)
        got = by_id.pop(rid, [])
        if not t.aborted:
            assert t.output_params == params, f"{rid}: the client's kv_transfer_params differ from the connector's"
            expect_tokens = greedy(t.plan.prompt, t.plan.max_tokens)
            assert t.token_ids_at_finish == expect_tokens, f"{rid}: generated tokens are not the greedy continuation"
        assert entry["status"] == status, (rid, entry, status, detail)
        if status != "queued":
            assert entry["reason"] == detail, (rid, entry, detail)
            assert held is False
            assert not got, f"{rid}: a record exists although the ticket says {entry}"
            coverage[f"no_record_{detail}"] += 1
            continue
        start, stop = detail
        assert held is True
        assert (entry["start"], entry["num_tokens"], entry["num_prompt_tokens"]) == (
            start,
            stop - start,
            t.num_prompt_tokens,
        ), (rid, entry, detail)
        assert len(got) == 1, f"{rid}: {len(got)} records for one request"
        rec = got[0]
        rec.check()  # the record's own consistency (shape, dtype, checksum when it carries one)
        tokens = t.token_ids_at_finish
        assert tokens is not None
        assert rec.meta.token_ids == tuple(tokens[start:stop]), f"{rid}: token ids are not paired with the rows"
        assert (rec.meta.start, rec.meta.num_prompt_tokens) == (start, t.num_prompt_tokens)
        assert rec.meta.layer_ids == tuple(sorted(sh.AUX_LAYER_IDS))
        expect = sh.rows_for(sh.prefix_hashes(tokens[:stop]))[start:]
        rows = rec.hidden_states
        assert rows.shape == expect.shape and rows.dtype == expect.dtype, (rid, rows.shape, expect.shape)
        if not torch.equal(rows.view(torch.int16), expect.view(torch.int16)):
            bad = (rows.view(torch.int16) != expect.view(torch.int16)).flatten(1).any(-1).nonzero().flatten()
            raise AssertionError(f"{rid}: record rows at positions {(bad + start)[:8].tolist()} are not its own")
        coverage["records"] += 1
        coverage["record_rows"] += stop - start
    assert not by_id, f"records for requests that never had one: {sorted(by_id)}"

    coverage["schedules"] += 1
    coverage["capture_group_of_its_own"] += int(len(engine.kv.scheduler.kv_cache_groups) > 1)
    coverage["requests"] += len(trace.requests)
    coverage["steps"] += trace.steps
    coverage["preemptions"] += trace.preemptions
    coverage["resumed_as_new"] += trace.resumed_as_new
    coverage["resumed_cached"] += trace.resumed_cached
    coverage["cache_checks"] += trace.cache_checks
    coverage["held_only_steps"] += trace.held_only_steps
    coverage["stalled_steps"] += trace.stalled_steps
    for name in ("forward_steps", "no_forward_steps", "spec_accepted", "spec_rejected", "pad_rows", "reordered_steps"):
        coverage[name] += getattr(trace.stats, name)
    for t in trace.requests.values():
        if t.aborted:
            coverage[f"aborted_{t.aborted}"] += 1
        if t.prefix_hit_tokens:
            coverage["prefix_hits"] += 1
        if t.times_scheduled and len(t.plan.prompt) > schedule.spec.max_num_batched_tokens:
            coverage["prompts_over_token_budget"] += 1


# --------------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny tensors: torch's thread pool only costs time on the shared 2-core machines."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _write_report(mode: str, coverage: Counter[str]) -> None:
    release = os.environ.get("VLLM_HS_COMPAT_RELEASE")
    if not release:
        return
    REPORTS.mkdir(exist_ok=True)
    path = REPORTS / f"schedules-{release}-{mode}.json"
    path.write_text(json.dumps(dict(sorted(coverage.items())), indent=1) + "\n")


CASES = [(mode, verifier) for verifier in ("dense", "hybrid") for mode in MODES]


@pytest.mark.parametrize(("mode", "verifier"), CASES, ids=[f"{m}-{v}" for m, v in CASES])
def test_random_schedules(mode: str, verifier: str, record_testsuite_property: Callable[[str, object], None]) -> None:
    """Dense verifier: the capture layer shares the verifier's group.  Hybrid verifier (full + sliding-window
    layers): with the connector (SupportsHMA from 0.22) vLLM turns the hybrid KV-cache manager on and the capture
    layer gets a group of its own (smaller block size); before 0.22 vLLM turns HMA off and merges it."""
    coverage: Counter[str] = Counter()
    count = NUM_SCHEDULES if verifier == "dense" else max(20, NUM_SCHEDULES // 6)

    @settings(
        max_examples=count,
        deadline=None,
        derandomize=DERANDOMIZE,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(schedules(v2=mode == "v2", least=floor(verifier, True, mode == "v2"), verifier=verifier))
    def check(schedule: Schedule) -> None:
        run_and_check(schedule, coverage)

    check = _seeded(check)
    _announce_seed()
    t0 = time.perf_counter()
    check()
    elapsed = time.perf_counter() - t0
    _write_report(f"{mode}-{verifier}", coverage)
    SCHEDULES_RUN[mode] += coverage["schedules"]
    # The compatibility report's "schedules" column (the last value written wins: the running totals).
    record_testsuite_property("schedules", ", ".join(f"{m.upper()} {n}" for m, n in sorted(SCHEDULES_RUN.items())))
    record_testsuite_property("schedule_seed", seed_note())
    print(f"[vllm-hs-compat] schedules ({mode}, {verifier}): {dict(sorted(coverage.items()))}")
    c = coverage
    sh.SUMMARY.append(
        f"schedules {mode}/{verifier}: {c['schedules']} in {elapsed:.0f}s; {c['requests']} requests, "
        f"{c['records']} records ({c['record_rows']} rows) bit-exact, {c['preemptions']} preemptions "
        f"(resumed: {c['resumed_cached']} cached, {c['resumed_as_new']} as new), {c['prefix_hits']} prefix hits, "
        f"aborts waiting/prefill/decode/in-step {c['aborted_waiting']}/{c['aborted_prefill']}/"
        f"{c['aborted_decode']}/{c['aborted_in_step']}, {c['no_forward_steps']} no-forward steps "
        f"({c['stalled_steps']} with requests waiting), drafts accepted/rejected {c['spec_accepted']}/"
        f"{c['spec_rejected']}, {c['connector_slot_checks']} connector slot checks"
    )
    assert coverage["schedules"] >= count
    if coverage["preemptions"]:  # V2's scheduler hands resumed requests back as new requests, V1 as cached ones
        resumed, never = ("resumed_as_new", "resumed_cached") if mode == "v2" else ("resumed_cached", "resumed_as_new")
        assert coverage[resumed] > 0 and coverage[never] == 0, dict(coverage)
    # The schedules reached the situations they exist for (asserted from 100 schedules on: fewer may miss some).
    if count < 100:
        return
    musts = ["records", "no_forward_steps", "spec_accepted", "spec_rejected"]
    if verifier == "dense":  # hybrid prefix hits need every group to hit (rare with sliding windows, some releases)
        musts += ["preemptions", "prefix_hits", *(f"aborted_{point}" for point in sh.ABORT_POINTS)]
    for what in musts:
        assert coverage[what] > 0, f"no schedule produced any {what}: {dict(coverage)}"


@pytest.mark.parametrize("mode", MODES)
def test_schedules_without_connector(mode: str) -> None:
    """The harness alone (no kv_transfer_config): vLLM's scheduler, the runner's order and vLLM's writer keep every
    running request's rows equal to its prefix's hidden states, blocks return, tokens are the greedy ones."""
    coverage: Counter[str] = Counter()

    @settings(max_examples=max(20, NUM_SCHEDULES // 10), deadline=None, derandomize=DERANDOMIZE, database=None)
    @given(schedules(v2=mode == "v2", least=floor("dense", False, mode == "v2")))
    def check(schedule: Schedule) -> None:
        spec = sh.EngineSpec(**{**schedule.spec.__dict__, "extra_config": None})
        with sh.engine_for(spec) as engine:
            trace = sh.run_schedule(engine, list(schedule.plans))
            assert engine.free_blocks() == engine.initial_free_blocks
            assert engine.connector is None
        for t in trace.requests.values():
            if not t.aborted:
                assert t.token_ids_at_finish == greedy(t.plan.prompt, t.plan.max_tokens), t.plan.req_id
        coverage["cache_checks"] += trace.cache_checks
        coverage["preemptions"] += trace.preemptions

    _announce_seed()
    _seeded(check)()
    assert coverage["cache_checks"] > 0, dict(coverage)


# --------------------------------------------------------------------------------------------------
# the property can fail: negative controls
# --------------------------------------------------------------------------------------------------
def _fixed_schedule(v2: bool) -> Schedule:
    """Three requests sharing a prefix, one preempted under the smallest cache, capture ``all``."""
    rng = random.Random(7)
    base = [rng.randrange(sh.VOCAB) for _ in range(64)]
    plans = tuple(
        sh.RequestPlan(f"req-{i}", tuple(base[: 16 * (i + 1)] + [rng.randrange(sh.VOCAB) for _ in range(40)]), 40, 0)
        for i in range(3)
    )
    spec = sh.EngineSpec(
        num_blocks=floor("dense", True, v2), max_num_batched_tokens=32, max_num_seqs=3, v2=v2,
        extra_config={"capture": "all", "window": None},
    )  # fmt: skip
    return Schedule(spec, plans, 7)


@pytest.mark.parametrize("mode", MODES)
def test_fixed_schedule_passes(mode: str) -> None:
    coverage: Counter[str] = Counter()
    run_and_check(_fixed_schedule(mode == "v2"), coverage)
    assert coverage["records"] == 3 and coverage["prefix_hits"] >= 1, dict(coverage)


@pytest.mark.parametrize("mode", MODES)
def test_negative_control_wrong_blocks(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that reads a request's blocks in the wrong order is caught (rows of other positions)."""
    from vllm_hs_compat.connector import worker

    original = worker.CaptureWorker._issue

    def rotate(save: Any) -> Any:
        ids = tuple(save.block_ids)
        return dataclasses.replace(save, block_ids=ids[1:] + ids[:1]) if len(ids) > 1 else save

    def rotated(self: Any, batch: list[tuple[Any, int]]) -> None:  # the step's batched read
        original(self, [(rotate(save), nbytes) for save, nbytes in batch])

    monkeypatch.setattr(worker.CaptureWorker, "_issue", rotated)
    with pytest.raises(AssertionError, match="are not its own"):
        run_and_check(_fixed_schedule(mode == "v2"), Counter())


@pytest.mark.parametrize("mode", MODES)
def test_negative_control_blocks_never_freed(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that never reports a held request finished leaks its blocks: caught by the free-block count."""
    from vllm_hs_compat.connector import worker

    monkeypatch.setattr(worker.CaptureWorker, "finished", lambda self: set())
    with pytest.raises(AssertionError, match="no progress|still held"):
        run_and_check(_fixed_schedule(mode == "v2"), Counter())


@pytest.mark.parametrize("mode", MODES)
def test_negative_control_stale_rows(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows overwritten between the step that computed them and the read (another request's values) are caught
    by the per-step cache check."""
    real_write = sh.Runner._write

    def clobbering(self: Any, slots: torch.Tensor, to_cache: torch.Tensor, cycle: Any = None) -> Any:
        out = real_write(self, slots, to_cache, cycle)
        if slots.numel() > 1:
            view = self.engine.view
            junk = torch.full((1, h.NUM_PLANES, h.HIDDEN), 3.0, dtype=h.DTYPE)
            h.write_hidden_states(self.engine.layer, view, junk, slots[:1].clone())
        return out

    monkeypatch.setattr(sh.Runner, "_write", clobbering)
    with pytest.raises(AssertionError, match="differ from the hidden states of its prefix"):
        run_and_check(_fixed_schedule(mode == "v2"), Counter())


@pytest.mark.parametrize("mode", MODES)
def test_an_untested_release_checks_the_slots_of_every_request(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a release newer than the tested range the adapter is ``untested``, and the connector vLLM's scheduler
    creates checks every request's derived slots against the slot mapping vLLM wrote with, whatever
    ``check_requests`` says; every record stays bit-exact.  Control: the same adapter, not untested, checks only the
    first request."""
    from vllm_hs_compat.connector import connector as connector_module

    base = _fixed_schedule(mode == "v2")
    spec = dataclasses.replace(base.spec, extra_config={**(base.spec.extra_config or {}), "check_requests": 1})
    schedule = Schedule(spec, base.plans, base.seed)
    real = connector_module.get_adapter()  # on a release past the matrix (nox -s vllm_newest) untested already
    tested_adapter = type(real)(real.version, untested=False)
    untested_adapter = type(real)(real.version, untested=True)
    tested: Counter[str] = Counter()
    monkeypatch.setattr(connector_module, "get_adapter", lambda: tested_adapter)
    run_and_check(schedule, tested)
    monkeypatch.setattr(connector_module, "get_adapter", lambda: untested_adapter)
    untested: Counter[str] = Counter()
    run_and_check(schedule, untested)
    assert untested["records"] == tested["records"] == 3
    assert tested["connector_slot_checks"] > 0
    assert untested["connector_slot_checks"] > tested["connector_slot_checks"], (tested, untested)
