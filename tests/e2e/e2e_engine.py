"""Run ONE real vLLM engine for one end-to-end case, in its own process, and write what it produced.

    python e2e_engine.py SPEC.json

``SPEC.json`` (:class:`EngineSpec`) names the model, the prompts, the engine settings and the connector:

* ``ours``    -- ``HiddenStatesCaptureConnector`` from ``vllm_hs_compat.connector`` (export or file sink);
* ``example`` -- vLLM's in-tree ``ExampleHiddenStatesConnector`` under the CPU stand-ins of ``e2e_example_cpu``;
* ``minimal`` -- ``examples/minimal_connector.py``, the README's connector for authors (one safetensors file per
  request, in the example's file format);
* ``none``    -- no connector (and, with ``extract`` false, no ``extract_hidden_states`` either): the benchmark's
  baseline.

Into ``out_dir`` it writes ``result.json`` (each request's prompt, output tokens and ``kv_transfer_params``, the
engine's preemption counter, timings, pids) and, for the export sink, the records a consumer in ANOTHER process
(``e2e_consumer.py``) fetched over the export's shared-memory transport.  The comparison against transformers is
the caller's (``e2e_check.py``), from these files only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass
class EngineSpec:
    model: str
    out_dir: str
    prompts: list[list[int]]
    max_tokens: list[int]
    layer_ids: list[int]
    connector: str = "ours"  # ours | example | minimal | none
    extract: bool = True  # extract_hidden_states speculative method on
    sink: str = "export"  # ours: export | file
    capture: str = "prompt"  # ours: prompt | all | output; example: prompt | all (include_output_tokens)
    window: list[int | None] | None = None
    max_model_len: int = 2048
    # None: vLLM's own default (on a GPU: a share of the card, block size 16, 16,384 tokens and 1,024 sequences a
    # step on an H100/H200); the CPU cases set all three (e2e_cases.engine_profile).
    max_num_seqs: int | None = 32
    max_num_batched_tokens: int | None = 128
    block_size: int | None = 32
    num_gpu_blocks_override: int | None = None
    # False: CUDA graphs and torch.compile, vLLM's default on a GPU (the CPU build runs eager).
    enforce_eager: bool = True
    attention_backend: str | None = None
    gpu_memory_utilization: float | None = None
    # Set: the KV cache gets exactly this many bytes, no memory profiling (GPU engines sharing one card).
    kv_cache_memory_bytes: int | None = None
    # More vllm.LLM arguments, applied last (benchmarks: load_format "dummy").
    llm_args: dict[str, Any] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    drain_timeout_s: float = 120.0
    extra_config: dict[str, Any] = field(default_factory=dict)
    per_request_params: list[dict[str, Any] | None] | None = None
    # Benchmark only: time the scheduler-side connector hooks per engine step (in-process engines).
    time_scheduler_hooks: bool = False
    # Benchmark only: one untimed batch first (first-step allocations, lazy imports), drained before timing.
    warmup: bool = False
    # Benchmark only: submit the same batch this many more times after the checked one, each drained and timed.
    extra_passes: int = 0
    consume_export: bool = True

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> EngineSpec:
        return cls(**json.loads(Path(path).read_text()))

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(asdict(self)))


def _kv_transfer_config(spec: EngineSpec, out: Path) -> Any:
    from vllm.config import KVTransferConfig

    if spec.connector == "ours":
        extra: dict[str, Any] = {"capture": spec.capture, "sink": spec.sink}
        if spec.window is not None:
            extra["window"] = spec.window
        if spec.sink == "file":
            extra["file"] = {"path": str(out / "file_sink")}
        elif spec.sink == "export":
            extra["export"] = {
                "backend": "shm",
                "num_slots": 64,
                "slot_bytes": 1 << 20,
                "token_file": str(out / "export.token"),
            }
        extra.update(spec.extra_config)
        return KVTransferConfig(
            kv_connector="HiddenStatesCaptureConnector",
            kv_connector_module_path="vllm_hs_compat.connector",
            kv_role="kv_producer",
            kv_connector_extra_config=extra,
        )
    if spec.connector == "example":
        # use_synchronization_lock=False: with the lock the example deadlocked in an in-process engine.
        extra = {"shared_storage_path": str(out / "example_sink"), "use_synchronization_lock": False}
        extra.update(spec.extra_config)
        if _cuda():  # vLLM's own connector, as it ships
            return KVTransferConfig(
                kv_connector="ExampleHiddenStatesConnector", kv_role="kv_producer", kv_connector_extra_config=extra
            )
        return KVTransferConfig(
            kv_connector="CpuExampleHiddenStatesConnector",
            kv_connector_module_path="e2e_example_cpu",
            kv_role="kv_producer",
            kv_connector_extra_config=extra,
        )
    if spec.connector == "minimal":
        return KVTransferConfig(
            kv_connector="MinimalCaptureConnector",
            kv_connector_module_path="minimal_connector",
            kv_role="kv_producer",
            kv_connector_extra_config={"path": str(out / "minimal_sink"), **spec.extra_config},
        )
    if spec.connector == "none":
        return None
    raise ValueError(f"unknown connector {spec.connector!r}")


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def build_llm(spec: EngineSpec, out: Path) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec.model,
        tokenizer=spec.model,
        dtype="bfloat16",
        seed=0,
        max_model_len=spec.max_model_len,
        enable_chunked_prefill=spec.enable_chunked_prefill,
        enable_prefix_caching=spec.enable_prefix_caching,
        enforce_eager=spec.enforce_eager,
        tensor_parallel_size=spec.tensor_parallel_size,
        disable_log_stats=False,
    )
    for key in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "num_gpu_blocks_override",
        "attention_backend",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
    ):
        if getattr(spec, key) is not None:  # None: vLLM's own default
            kwargs[key] = getattr(spec, key)
    kwargs.update(spec.llm_args)
    # a diagnostic lever for a GPU host (e.g. '{"async_scheduling": false}'): the case's LLM arguments, overridden
    kwargs.update(json.loads(os.environ.get("HS_E2E_LLM_ARGS") or "{}"))
    if spec.extract:
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(spec.layer_ids)}},
        }
    kv = _kv_transfer_config(spec, out)
    if kv is not None:
        kwargs["kv_transfer_config"] = kv
    return LLM(**kwargs)


def _sampling_params(spec: EngineSpec) -> list[Any]:
    from vllm import SamplingParams

    params = []
    for i, n in enumerate(spec.max_tokens):
        kv: dict[str, Any] | None = None
        if spec.per_request_params is not None and spec.per_request_params[i] is not None:
            kv = dict(spec.per_request_params[i] or {})
        elif spec.connector == "example" and spec.capture == "all":
            kv = {"include_output_tokens": True}
        extra = {"kv_transfer_params": kv} if kv is not None else None
        params.append(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, extra_args=extra))
    return params


def _inproc_core(llm: Any) -> Any | None:
    """The EngineCore when it runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), else None."""
    client = getattr(llm.llm_engine, "engine_core", None)
    return getattr(client, "engine_core", None)


def _expected_files(spec: EngineSpec, out: Path, requests: list[dict[str, Any]]) -> list[Path]:
    files: list[Path] = []
    for r in requests:
        params = r["kv_transfer_params"] or {}
        if spec.connector in ("example", "minimal"):
            if "hidden_states_path" in params:
                files.append(Path(params["hidden_states_path"]))
        elif spec.connector == "ours" and spec.sink == "file":
            entry = params.get("hs_file") or {}
            if entry.get("manifest"):
                # The manifest is renamed into place last: once it exists the record is complete.
                files.append(Path(entry["manifest"]))
    return files


def drain(llm: Any, spec: EngineSpec, out: Path, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Let the connector read every held request and wait for every file the sink promised.

    An in-process engine only steps when asked: for our connector the package's own ``flush(llm)`` steps it
    until the records reached their sink (after which the engine must hold no finished request); the in-tree
    example connector and the minimal one are stepped while vLLM's scheduler has requests.  A multiprocess
    engine core keeps stepping by itself while a connector holds blocks."""
    from vllm_hs_compat.connector import flush

    core = _inproc_core(llm)
    deadline = time.monotonic() + spec.drain_timeout_s
    files = _expected_files(spec, out, requests)
    busy_after_flush = None
    steps = 0
    if core is not None and spec.connector == "ours":
        from vllm_hs_compat.connector.scheduler import LIVE

        flush(llm, timeout_s=spec.drain_timeout_s)
        # No request left, and no finished one whose blocks the connector still holds.  vLLM's list of requests
        # finished in the last step (sent to the workers with the next one) may remain: under async scheduling
        # ``generate`` returns before that step, and flush steps the engine only while a record is unread.
        busy_after_flush = bool(core.scheduler.has_unfinished_requests()) or any(s.held for s in LIVE)
    while time.monotonic() < deadline:
        if core is not None and core.scheduler.has_requests():
            llm.llm_engine.step()
            steps += 1
            continue
        if all(f.exists() for f in files):
            break
        time.sleep(0.05)
    busy = core is not None and core.scheduler.has_requests()
    return {
        "drain_steps": steps,
        "busy_after_flush": busy_after_flush,
        "drained": all(f.exists() for f in files) and not busy and not busy_after_flush,
        "missing_files": [str(f) for f in files if not f.exists()],
        "scheduler_busy": busy,
    }


COUNTERS = {
    "num_preemptions": "vllm:num_preemptions",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
}


def engine_counters(llm: Any) -> dict[str, int | None]:
    """The engine's own Prometheus counters (``disable_log_stats=False``)."""
    out: dict[str, int | None] = {k: None for k in COUNTERS}
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # noqa: BLE001 - reported; the test decides what a missing counter means
        print(f"[e2e] get_metrics failed: {e!r}", file=sys.stderr)
        return out
    for key, name in COUNTERS.items():
        for m in metrics:
            if m.name == name:
                out[key] = (out[key] or 0) + int(getattr(m, "value", 0))
    return out


def _groups(kv_cache_config: Any) -> list[dict[str, Any]]:
    return [
        {
            "spec": type(g.kv_cache_spec).__name__,
            "block_size": int(g.kv_cache_spec.block_size),
            "layers": list(g.layer_names),
        }
        for g in kv_cache_config.kv_cache_groups
    ]


def kv_cache_groups(llm: Any) -> dict[str, Any]:
    """How the engine grouped the layers, scheduler and worker side (in-process engines only)."""
    core = _inproc_core(llm)
    if core is None:
        return {}
    facts: dict[str, Any] = {}
    try:
        facts["scheduler"] = _groups(core.scheduler.kv_cache_config)
    except AttributeError as e:
        facts["scheduler_error"] = repr(e)
    try:
        worker = core.model_executor.driver_worker.worker
        facts["worker"] = _groups(worker.model_runner.kv_cache_config)
    except AttributeError as e:
        facts["worker_error"] = repr(e)
    return facts


def model_runner_classes(llm: Any) -> list[str]:
    """The in-process worker's model runner class and its bases (``module.qualname``, most derived first): which
    runner the engine really built (Model Runner V2's classes live in ``vllm.v1.worker.gpu.model_runner``, the CPU
    one subclasses it); empty when the engine runs in other processes."""
    core = _inproc_core(llm)
    try:
        runner = core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return []
    return [f"{c.__module__}.{c.__qualname__}" for c in type(runner).__mro__]


def engine_config(llm: Any) -> dict[str, Any]:
    """The settings vLLM resolved (its defaults where the spec left them out)."""
    from vllm_hs_compat import api

    config = llm.llm_engine.vllm_config
    sched, cache, comp = config.scheduler_config, config.cache_config, config.compilation_config
    return {
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "max_num_seqs": int(sched.max_num_seqs),
        "block_size": int(cache.block_size),
        "gpu_memory_utilization": float(cache.gpu_memory_utilization),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
        "device": str(config.device_config.device),
        "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
        # vLLM's own proposer, run by the adapter (tests/vllm/test_async_drafts.py checks it per release)
        "misplaced_drafts": api.get_adapter().async_drafts_misplace_rows(config),
    }


def run_consumer(spec: EngineSpec, out: Path, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Fetch every exported record from a consumer in another process (the trainer's side)."""
    tickets = []
    for r in requests:
        params = r["kv_transfer_params"] or {}
        if "hs_export" in params:
            tickets.append(params)
    args = {
        "tickets": tickets,
        "token_file": str(out / "export.token"),
        "out_dir": str(out / "export_records"),
        "producer_pid": os.getpid() if spec.tensor_parallel_size == 1 else None,
    }
    (out / "consumer_args.json").write_text(json.dumps(args))
    t0 = time.monotonic()
    with open(out / "consumer.log", "w") as log:
        proc = subprocess.run(
            [sys.executable, str(HERE / "e2e_consumer.py"), str(out / "consumer_args.json")],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=180,
            check=False,
        )
    return {"consumer_rc": proc.returncode, "consumer_s": time.monotonic() - t0}


SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
)


class FinishWitness:
    """What vLLM itself says about each request when it hands it to the connector at finish (in-process
    engines): ``num_computed_tokens`` -- the positions whose hidden states exist -- and the token count.  Read
    from vLLM's ``Request`` as vLLM passes it; the connector's answer is not consulted."""

    def __init__(self, core: Any) -> None:
        self.seen: dict[str, dict[str, Any]] = {}
        conn = core.scheduler.connector
        if conn is None:
            return
        for name in ("request_finished", "request_finished_all_groups"):
            fn = getattr(conn, name, None)
            if fn is not None:
                setattr(conn, name, self._wrap(fn))

    def _wrap(self, fn: Any) -> Any:
        def wrapped(request: Any, *a: Any, **k: Any) -> Any:
            self.seen.setdefault(
                request.request_id,
                {
                    "num_computed_tokens": int(request.num_computed_tokens),
                    "num_tokens": int(request.num_tokens),
                    "num_output_placeholders": int(getattr(request, "num_output_placeholders", 0) or 0),
                    "prompt": list(request.prompt_token_ids or []),
                },
            )
            return fn(request, *a, **k)

        return wrapped

    def by_prompt(self) -> dict[tuple[int, ...], dict[str, Any]]:
        out: dict[tuple[int, ...], dict[str, Any]] = {}
        for rid, d in self.seen.items():
            out[tuple(d["prompt"])] = {"engine_request_id": rid, **{k: v for k, v in d.items() if k != "prompt"}}
        return out


WORKER_HOOKS = (
    "bind_connector_metadata",
    "clear_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
)


class HookTimer:
    """Wraps the connector's hooks (scheduler side, and worker side when the worker is in this process) and the
    engine step; one sample per step: (running requests, seconds in scheduler hooks, seconds in worker hooks,
    seconds in the whole step).  Wall time inside vLLM's calls into the connector, nothing else."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.acc = {"scheduler": 0.0, "worker": 0.0}
        self.samples: list[tuple[int, float, float, float]] = []
        conn = core.scheduler.connector
        if conn is not None:
            for name in SCHEDULER_HOOKS:
                fn = getattr(conn, name, None)
                if fn is not None:
                    setattr(conn, name, self._wrap(fn, "scheduler"))
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

            worker_conn = get_kv_transfer_group() if has_kv_transfer_group() else None
        except ImportError:
            worker_conn = None
        if worker_conn is not None and worker_conn is not conn:
            for name in WORKER_HOOKS:
                fn = getattr(worker_conn, name, None)
                if fn is not None:
                    setattr(worker_conn, name, self._wrap(fn, "worker"))
        step = core.step_fn

        def timed_step(*a: Any, **k: Any) -> Any:
            running = len(core.scheduler.running)
            s0, w0 = self.acc["scheduler"], self.acc["worker"]
            t = time.perf_counter()
            try:
                return step(*a, **k)
            finally:
                self.samples.append(
                    (running, self.acc["scheduler"] - s0, self.acc["worker"] - w0, time.perf_counter() - t)
                )

        core.step_fn = timed_step

    def _wrap(self, fn: Any, side: str) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.acc[side] += time.perf_counter() - t

        return wrapped

    def summary(self) -> dict[str, Any]:
        return {"samples": self.samples, **{f"{k}_hooks_s": v for k, v in self.acc.items()}}


def main(spec_path: str) -> int:
    spec = EngineSpec.load(spec_path)
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    import vllm

    result: dict[str, Any] = {"vllm_version": vllm.__version__, "pid": os.getpid(), "connector": spec.connector}
    t0 = time.monotonic()
    llm = build_llm(spec, out)
    result["init_s"] = time.monotonic() - t0
    result["kv_cache_groups"] = kv_cache_groups(llm)
    result["model_runner"] = model_runner_classes(llm)
    result["engine_config"] = engine_config(llm)
    core = _inproc_core(llm)
    witness = FinishWitness(core) if core is not None else None
    timer = None
    if spec.time_scheduler_hooks:
        core = _inproc_core(llm)
        if core is None:
            raise SystemExit("time_scheduler_hooks needs the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        timer = HookTimer(core)
    prompts = [{"prompt_token_ids": p} for p in spec.prompts]
    if spec.warmup:
        warm = [{"prompt_token_ids": [3 + (i * 7 + j) % 400 for j in range(64)]} for i in range(8)]
        llm.generate(warm, _sampling_params(spec)[: len(warm)], use_tqdm=False)
        if _inproc_core(llm) is not None:
            from vllm_hs_compat.connector import flush

            flush(llm)
        result["warmup_s"] = time.monotonic() - t0 - result["init_s"]
    t1, c1 = time.monotonic(), time.process_time()
    outputs = llm.generate(prompts, _sampling_params(spec), use_tqdm=False)
    result["generate_s"] = time.monotonic() - t1
    result["generate_cpu_s"] = time.process_time() - c1
    requests = []
    finish = witness.by_prompt() if witness is not None else {}
    for i, o in enumerate(outputs):
        assert list(o.prompt_token_ids) == spec.prompts[i], f"output {i} is not prompt {i}"
        requests.append(
            {
                "index": i,
                "request_id": o.request_id,
                "prompt": list(o.prompt_token_ids),
                "output": list(o.outputs[0].token_ids),
                "kv_transfer_params": o.kv_transfer_params,
                "at_finish": finish.get(tuple(spec.prompts[i])),
            }
        )
    result["requests"] = requests
    result["generated_tokens"] = sum(len(r["output"]) for r in requests)
    result["prompt_tokens"] = sum(len(r["prompt"]) for r in requests)
    t2, c2 = time.monotonic(), time.process_time()
    result.update(drain(llm, spec, out, requests))
    result["drain_s"] = time.monotonic() - t2
    # CPU seconds of this process (every thread: scheduler, worker, connector publisher) -- less sensitive to
    # other load on the machine than wall time.
    result["drain_cpu_s"] = time.process_time() - c2
    passes = []
    for _ in range(spec.extra_passes):
        t, c = time.monotonic(), time.process_time()
        more = llm.generate(prompts, _sampling_params(spec), use_tqdm=False)
        gen_s = time.monotonic() - t
        more_reqs = [{"kv_transfer_params": o.kv_transfer_params} for o in more]
        drained = drain(llm, spec, out, more_reqs)["drained"]
        passes.append(
            {"generate_s": gen_s, "total_s": time.monotonic() - t, "cpu_s": time.process_time() - c, "drained": drained}
        )
    result["extra_passes"] = passes
    result.update(engine_counters(llm))
    if timer is not None:
        result["hook_timing"] = timer.summary()
    if spec.connector == "ours" and spec.sink == "export" and spec.consume_export:
        result.update(run_consumer(spec, out, requests))
    # Shut the engine down explicitly (the connector logs its counters then); some releases skip it at exit.
    t3 = time.monotonic()
    llm.llm_engine.engine_core.shutdown()
    result["shutdown_s"] = time.monotonic() - t3
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"[e2e] done: {json.dumps({k: v for k, v in result.items() if k != 'requests'})}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
