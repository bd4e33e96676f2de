"""Real vLLM engines (CPU build) with ``extract_hidden_states`` and ``HiddenStatesCaptureConnector``: every record,
delivered through the export (a consumer in another process, over shared memory) or the file sink, is paired with
the transformers forward of the same weights.  Each case is its own engine process.

Model Runner V2 cases run when ``HS_E2E_V2=1`` and the TP=2 case when ``HS_E2E_TP=1`` (the nox sessions choose
per release; they are slow on 2 cores).

``HS_E2E_JOBS=N`` (the nox sessions: 2) runs up to N engine processes at a time, each bound to a CPU of its own
(``VLLM_CPU_OMP_THREADS_BIND``): an engine's start-up is mostly one busy core, so on 2 cores two cases take about
the time of one.  Each case is still its own fresh engine process with its own settings; the runs this session's
selected tests need are started in test order, at most N ahead, and a TP=2 case runs alone.  Unset or 1: one at a
time, on demand.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import e2e_cases as C
import e2e_models
import e2e_pairing
import e2e_reference
import e2e_report
import pytest
import torch
import vllm

pytestmark = pytest.mark.e2e

ALL_CASES: dict[str, C.Case] = {**C.cases(), **C.v2_cases(), **C.tp_cases(), **C.defaults_cases()}


def _enabled(case: C.Case) -> str | None:
    if not case.v2 and not C.has_v1_runner():
        return "a Model Runner V1 case: this vLLM has no V1 (deleted in 0.34); its V2 cases run with HS_E2E_V2=1"
    if case.name in C.defaults_cases() and not (C.on_gpu() or os.environ.get("HS_E2E_DEFAULTS") == "1"):
        return "vLLM's own batch defaults run on a GPU, or with HS_E2E_DEFAULTS=1 (docs/gpu.md)"
    if case.v2 and os.environ.get("HS_E2E_V2") != "1":
        return "Model Runner V2 cases run with HS_E2E_V2=1 (nox: the e2e session of 0.32.0)"
    if case.engine.get("tensor_parallel_size", 1) > 1 and os.environ.get("HS_E2E_TP") != "1":
        return "TP=2 runs with HS_E2E_TP=1 (nox: the e2e session of 0.29.0)"
    return None


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    out = {kind: e2e_models.make_model(str(root / kind), kind, seed=7).path for kind in e2e_models.KINDS}
    # The hybrid reference (HF Ministral over the Llama weights) is only sound if it equals HF Llama inside the
    # sliding window and differs beyond it.
    facts = e2e_reference.check_hybrid_equivalence(out["hybrid"], e2e_models.SLIDING_WINDOW)
    e2e_report.add(f"hybrid reference: HF Ministral == HF Llama inside the window; {facts}")
    return out


Key = tuple[str, str]  # (case name, connector)


def _exclusive(key: Key) -> bool:
    """A TP=2 engine binds both CPUs itself: it runs with no other engine beside it."""
    return bool(ALL_CASES[key[0]].engine.get("tensor_parallel_size", 1) > 1)


def planned_runs(items: list[pytest.Item]) -> list[Key]:
    """The runs the selected, enabled tests of this module will ask for, in test order (a test not listed here
    still gets its run, on demand)."""
    keys: list[Key] = []
    for item in items:
        if getattr(item, "module", None) is not sys.modules[__name__]:
            continue
        spec = getattr(item, "callspec", None)
        params = spec.params if spec is not None else {}
        test = getattr(item, "originalname", item.name)
        if test == "test_case" and _enabled(ALL_CASES[params["name"]]) is None:
            key = (params["name"], "ours")
        elif test == "test_pairing_catches_misattribution":
            key = ("dense", "ours")
        elif test == "test_in_tree_example_connector_agrees":
            key = ("dense", "example")
        elif test == "test_minimal_example_connector":
            key = (params["name"], "minimal")
        else:
            continue
        if key not in keys:
            keys.append(key)
    return keys


class Runs:
    """Runs each (case, connector) once per session; tests that need the same run share it.  With ``jobs`` > 1 the
    planned runs are started ahead (at most ``jobs`` engines at a time, each bound to one CPU)."""

    def __init__(self, models: dict[str, str], root: Path, jobs: int = 1, plan: list[Key] | None = None) -> None:
        self.models = models
        self.root = root
        self.cache: dict[Key, C.CaseRun] = {}
        self.plan = list(plan or [])
        self.pending: dict[Key, Future[C.CaseRun]] = {}
        cpus = sorted(os.sched_getaffinity(0))
        self.jobs = max(1, min(jobs, len(cpus)))
        self.pool = ThreadPoolExecutor(self.jobs, thread_name_prefix="e2e-engine") if self.jobs > 1 else None
        self.cpus: queue.Queue[int] = queue.Queue()
        for cpu in cpus[: self.jobs]:
            self.cpus.put(cpu)

    def _run(self, key: Key, cpu: int | None = None) -> C.CaseRun:
        name, connector = key
        case = ALL_CASES[name]
        env = None
        if cpu is not None:  # the engine's OpenMP threads (and the processes it starts) on this CPU alone
            env = {**C.base_env([str(C.TRITON_CPU_SHIM)] if case.v2 else None), "VLLM_CPU_OMP_THREADS_BIND": str(cpu)}
        return C.run_case(case, self.models[case.model_kind], self.root / f"{name}-{connector}", connector, env=env)

    def _run_bound(self, key: Key) -> C.CaseRun:
        cpu = self.cpus.get()
        try:
            return self._run(key, cpu)
        finally:
            self.cpus.put(cpu)

    def _top_up(self, key: Key) -> None:
        """Start ``key`` (if not started) and the planned runs after it, up to ``jobs`` engines in flight; stop at an
        exclusive run (it starts alone, when asked for)."""
        assert self.pool is not None
        if key not in self.cache and key not in self.pending:  # asked for: started now (it queues for a CPU)
            self.pending[key] = self.pool.submit(self._run_bound, key)
        start = self.plan.index(key) if key in self.plan else len(self.plan)
        for k in self.plan[start + 1 :]:
            if len(self.pending) >= self.jobs or _exclusive(k):
                break
            if k not in self.cache and k not in self.pending:
                self.pending[k] = self.pool.submit(self._run_bound, k)

    def get(self, name: str, connector: str = "ours") -> C.CaseRun:
        key = (name, connector)
        if key not in self.cache:
            if self.pool is None:
                self.cache[key] = self._run(key)
            elif _exclusive(key):
                for k in list(self.pending):  # nothing runs beside it
                    self.cache[k] = self.pending.pop(k).result()
                self.cache[key] = self._run(key)
            else:
                self._top_up(key)
                self.cache[key] = self.pending.pop(key).result()
                nxt = self.plan.index(key) + 1 if key in self.plan else len(self.plan)
                if nxt < len(self.plan) and not _exclusive(self.plan[nxt]):
                    self._top_up(self.plan[nxt])
        return self.cache[key]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def runs(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    """Each run's directory (spec, engine log, result, records) lives under ``$HS_E2E_WORK`` when set (the nox
    sessions keep them in ``reports/`` for inspection), else in pytest's temporary directory."""
    work = os.environ.get("HS_E2E_WORK")
    if work:
        root = Path(work)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    else:
        root = tmp_path_factory.mktemp("runs")
    jobs = int(os.environ.get("HS_E2E_JOBS") or "1")
    r = Runs(models, root, jobs, planned_runs(list(request.session.items)))
    yield r
    r.close()


def _engine_ok(run: C.CaseRun) -> dict[str, Any]:
    tail = "\n".join(run.log.splitlines()[-60:])
    assert run.rc == 0, f"engine process failed (rc {run.rc}) after {run.seconds:.0f} s:\n{tail}"
    assert run.result is not None, f"no result.json:\n{tail}"
    assert run.result["drained"], f"the engine still held requests or files were missing: {run.result}"
    return run.result


def _title(name: str, connector: str) -> str:
    return f"vllm {vllm.__version__} | {name} | {connector}"


def _checked(run: C.CaseRun, name: str, connector: str) -> C.CheckResult:
    res = C.check(run, _title(name, connector))
    r = run.result or {}
    e2e_report.add(
        f"{res.text}\n  engine: {run.seconds:.1f} s wall (init {r.get('init_s', 0):.1f} s, generate "
        f"{r.get('generate_s', 0):.2f} s); preemptions {r.get('num_preemptions')}; prefix-cache hits "
        f"{r.get('prefix_cache_hits')} of {r.get('prefix_cache_queries')} tokens"
    )
    assert res.pairing is not None, res.text
    assert res.pairing.ok, res.text
    return res


def _assert_connector_facts(case: C.Case, run: C.CaseRun, checked: C.CheckResult) -> C.LogFacts:
    result = run.result or {}
    facts = C.log_facts(run.log, result)
    n = checked.expected_status.count("queued")
    for r, expected in zip(result["requests"], checked.expected_status, strict=True):
        cap = (r["kv_transfer_params"] or {}).get(C.RESULT_KEY) or {}
        assert cap.get("status") == expected, f"request {r['index']}: {cap}"
        assert cap.get("sink") == case.sink
    tp = case.engine.get("tensor_parallel_size", 1)
    assert len(facts.workers) == tp, f"expected {tp} worker start-up lines, got {facts.workers}"
    owners = [w for w in facts.workers if w.owner]
    assert len(owners) == 1 and owners[0].tp_rank == 0, f"the capture owner must be TP rank 0: {facts.workers}"
    assert len(facts.scheduler) == 1, facts.scheduler
    # Only the owner logs its counters at shutdown: every save read, published, none failed, slot checks clean.
    assert len(facts.counters) == 1, facts.counters
    k = facts.counters[0]
    assert k["saves"] == n and k["records"] == n and k["records_failed"] == 0, k
    assert k["slot_checks"] > 0 and k["slot_checks_failed"] == 0, k
    assert facts.chunked_prefill
    assert facts.v2_runner == case.v2, "Model Runner V2 " + ("expected" if case.v2 else "not expected")
    if result.get("model_runner") and C.has_v1_runner():  # two sources agree where the release still logs the line
        assert ("Using V2 Model Runner" in run.log) is facts.v2_runner, result["model_runner"]
    if case.sink == "export":
        assert result.get("consumer_rc") == 0, (run.out / "consumer.log").read_text()[-3000:]
        summary = C.json.loads((run.out / "export_records" / "summary.json").read_text())
        assert len(summary["fetched"]) == n
        assert summary["extra"] == [], f"records beyond one per request: {summary['extra']}"
    if case.sink == "export" and n:  # no transport when every request failed by name (async_drafts on a GPU)
        producer_pids = {t["pid"] for t in summary["transports"]}
        assert {t["kind"] for t in summary["transports"]} == {"shm"}
        assert len(producer_pids) == 1
        producer_pid = producer_pids.pop()
        owner_pid = owners[0].pid if owners[0].pid is not None else result["pid"]
        if tp == 1:
            owner_pid = result["pid"]  # the in-process engine: the worker is the runner process
        assert producer_pid == owner_pid, f"records served by pid {producer_pid}, the owner is {owner_pid}"
        assert summary["pid"] not in (producer_pid, result["pid"]), "the consumer must be another process"
    return facts


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_case(name: str, runs: Runs) -> None:
    case = ALL_CASES[name]
    why = _enabled(case)
    if why:
        pytest.skip(why)
    run = runs.get(name)
    result = _engine_ok(run)
    checked = _checked(run, name, "ours")
    facts = _assert_connector_facts(case, run, checked)
    config = result["engine_config"]
    limit = config["max_num_batched_tokens"]
    if run.spec.max_num_batched_tokens is None:  # vLLM's own step budget: the batch must span several steps
        assert sum(len(p) for p in case.prompts) > 2 * limit, f"the prompts fit in one step of {limit} tokens"
    else:
        assert any(len(p) > limit for p in case.prompts), "some prompt must be chunked"
    if C.on_gpu():  # vLLM's GPU defaults: CUDA graphs (and torch.compile) on
        assert not config["enforce_eager"] and "NONE" not in config["cudagraph_mode"], config
        assert config["device"].startswith("cuda"), config
    if case.expect_preemptions:
        assert result["num_preemptions"], f"no preemption happened: {result['num_preemptions']}"
    if case.expect_prefix_hits:
        assert result["prefix_cache_hits"], "no prefix-cache hit"
    if name == "concurrent":
        assert len(case.prompts) >= 16 and len({len(p) for p in case.prompts}) == len(case.prompts)
    if case.expect_own_capture_group:
        # vLLM's own grouping (the engine's KV-cache config) and the connector's start-up log agree.
        groups = result["kv_cache_groups"]["worker"]
        cap = [g for g in groups if any(x.startswith("cache_only_layers.") for x in g["layers"])]
        assert len(cap) == 1 and len(cap[0]["layers"]) == 1 and len(groups) > 1, groups
        assert "a group of its own" in facts.workers[0].text, facts.workers[0].text
        assert "a group of its own" in facts.scheduler[0], facts.scheduler[0]
    elif case.model_kind == "dense":
        assert "merged with the verifier layers" in facts.workers[0].text, facts.workers[0].text
    if case.engine.get("tensor_parallel_size", 1) == 2:
        procs = {w.tp_rank: w for w in facts.workers}
        assert procs[1].proc is not None and procs[0].pid != procs[1].pid, facts.workers


def test_in_tree_example_connector_agrees(runs: Runs) -> None:
    """Control: vLLM's own ExampleHiddenStatesConnector (under the CPU stand-ins) passes the same pairing on the
    dense case -- the reference and the pairing are not tuned to our connector."""
    run = runs.get("dense", "example")
    _engine_ok(run)
    _checked(run, "dense", "example")


@pytest.mark.parametrize("name", ["dense", "hybrid_preempt"])
def test_minimal_example_connector(name: str, runs: Runs) -> None:
    """examples/minimal_connector.py (the README's connector for authors, built on the public API) passes the same
    pairing: dense (capture layer merged into the verifier's group) and hybrid under preemption (own group)."""
    run = runs.get(name, "minimal")
    _engine_ok(run)
    _checked(run, name, "minimal")


def test_pairing_catches_misattribution(runs: Runs) -> None:
    """Negative controls on real records: the pairing must fail for swapped records, an off-by-one row shift,
    one corrupted row, and planes read in the configured instead of the recorded layer order."""
    run = runs.get("dense")
    _engine_ok(run)
    recs, _ = C.records_of(run)
    assert all(r is not None for r in recs)
    good: list[e2e_pairing.Record] = [r for r in recs if r is not None]
    reqs = (run.result or {})["requests"]
    layer_ids = sorted(run.spec.layer_ids)
    refs = [e2e_reference.reference(run.spec.model, r["prompt"], layer_ids) for r in reqs]
    toks = [r["prompt"] for r in reqs]
    assert e2e_pairing.pair(good, refs, toks, layer_ids).ok

    rotated = good[1:] + good[:1]
    p = e2e_pairing.pair(rotated, refs, toks, layer_ids)
    assert not p.ok and all(p.matrix[i][i] == 0.0 for i in range(len(good))), p.render("rotated")

    longest = max(range(len(good)), key=lambda i: good[i].hidden_states.shape[0])
    shifted = list(good)
    g = good[longest]
    shifted[longest] = dataclasses.replace(g, hidden_states=torch.cat([g.hidden_states[1:], g.hidden_states[-1:]]))
    assert not e2e_pairing.pair(shifted, refs, toks, layer_ids).ok

    corrupted = list(good)
    hs = g.hidden_states.clone()
    row = hs.shape[0] // 2
    hs[row] = (
        hs[row]
        + 3 * e2e_pairing.ROW_TOL * hs[row].float().norm(dim=-1, keepdim=True).to(hs.dtype) / hs.shape[-1] ** 0.5
    )
    corrupted[longest] = dataclasses.replace(g, hidden_states=hs)
    p = e2e_pairing.pair(corrupted, refs, toks, layer_ids)
    assert not p.ok and not p.full_match[longest]

    configured = list(e2e_models.CAPTURE_LAYER_IDS)
    assert configured != layer_ids
    misread = [dataclasses.replace(r, layer_ids=configured) for r in good]
    assert not e2e_pairing.pair(misread, refs, toks, layer_ids).ok

    # Every plane one layer off (layer id k read from k + 1; the last from k - 1): each record must fail its own
    # reference although its labels are right.
    top = e2e_models.NUM_LAYERS
    neighbours = [k + 1 if k < top else k - 1 for k in layer_ids]
    off_by_layer = [e2e_reference.reference(run.spec.model, r["prompt"], neighbours) for r in reqs]
    layer_shifted = [dataclasses.replace(r, hidden_states=ref) for r, ref in zip(good, off_by_layer, strict=True)]
    p = e2e_pairing.pair(layer_shifted, refs, toks, layer_ids)
    assert not p.ok and not any(p.full_match), p.render("planes one layer off")
