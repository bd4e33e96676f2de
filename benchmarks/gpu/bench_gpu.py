"""Capture throughput at the GPU's limit (a benchmark, not a test; docs/gpu.md).

Random-weight Llamas of real shapes (``load_format="dummy"``: vLLM fills the weights, only ``config.json`` and a
tokenizer are written): ``1b`` (Llama-3.2-1B: hidden 2048, 16 layers) and ``8b`` (Llama-3.1-8B: hidden 4096, 32
layers), 4 captured layers each, rows of 512-2,048 random token ids.  Each variant is a fresh process with one
in-process engine on the same settings -- vLLM's own defaults for the platform (on an H100/H200 16,384 tokens and
1,024 sequences a step, 0.9 of the memory, CUDA graphs and torch.compile), chunked prefill and prefix caching on,
``TRITON_ATTN`` -- and one untimed warm-up batch before the clock starts:

* ``generate``     -- plain ``LLM.generate`` of the rows (no speculative method, no connector), one output token;
* ``extract``      -- ``extract_hidden_states`` writing the capture cache, no connector reading it (vLLM's own cost);
* ``capture``      -- ``vllm-hs-compat capture`` on the rows (the connector, the file sink, the sharded store, every
  record verified and indexed), ``--storage captured`` (bf16);
* ``capture_fp8``  -- the same with ``--storage fp8_e4m3``;
* ``capture_serial`` -- ``capture`` with ``--adoption serial`` (each batch adopted before the next reaches the
  engine; the command overlaps them on a GPU by default): what the overlap buys, side by side (not in the default
  list; ``--variants generate,capture,capture_serial``);
* ``capture_procs`` -- ``capture`` with ``--adoption-checks processes`` (adoption's checks ahead in processes of
  their own instead of threads beside the engine's: docs/capture.md; not in the default list);
* ``capture@N`` (any capture variant) -- the same with ``--batch-size N``: what the size of the batches the command
  gives the engine costs, side by side (``--variants capture,capture@256``);
* ``example``      -- vLLM's in-tree ``ExampleHiddenStatesConnector`` writing the same layers (one safetensors file
  per request; ``use_synchronization_lock=False``), until every file is on disk;
* ``export``       -- the serving path: the connector's export sink (shared memory) and a trainer in ANOTHER process
  streaming every record while the engine runs; records/s and tokens/s as the trainer receives them.

Prefill tokens/s = the rows' prompt tokens over the time from the first request to the end of the work (records on
disk, or in the trainer).  Prints a table (ratios against ``generate``; under each capture variant, where its time
went: the engine, adoption, their overlap, the engine's wait) and writes ``bench.json``.

    python benchmarks/gpu/bench_gpu.py --out /tmp/bench                    # 8b and 1b, every variant
    python benchmarks/gpu/bench_gpu.py --models 8b --variants generate,capture --rows 256
    python benchmarks/gpu/bench_gpu.py --models small --rows 24 --variants generate,capture   # CPU check
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

#: name: (hidden, layers, heads, kv heads, intermediate, vocab, captured layer ids)
SHAPES: dict[str, tuple[int, int, int, int, int, int, tuple[int, ...]]] = {
    "1b": (2048, 16, 32, 8, 8192, 128256, (2, 8, 14, 16)),
    "8b": (4096, 32, 32, 8, 14336, 128256, (2, 16, 29, 32)),
    "small": (256, 4, 4, 2, 512, 4096, (1, 2, 3, 4)),  # a CPU check of the benchmark itself
}
VARIANTS = (
    "generate",
    "capture",
    "capture_serial",
    "capture_procs",
    "example",
    "export",
    "extract",
    "capture_fp8",
)  # the order they run in
#: What runs unless ``--variants`` says otherwise (``capture_serial`` and ``capture_procs`` are comparisons, asked for).
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v not in ("capture_serial", "capture_procs"))
FIRST_TOKEN, LAST_TOKEN = 3, 500  # inside the tiny tokenizer's vocabulary (512): capture checks ids against it


def make_model(path: Path, shape: str) -> list[int]:
    """``config.json`` of the shape and the package's tiny tokenizer; returns the captured layer ids."""
    from vllm_hs_compat.reference.models import make_tokenizer

    hidden, layers, heads, kv_heads, inter, vocab, capture = SHAPES[shape]
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": shape != "8b",
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    make_tokenizer(str(path))
    return list(capture)


def make_rows(path: Path, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` rows of ``lo``-``hi`` random token ids (no two share a prefix: every record is read out)."""
    rng = random.Random(seed)
    rows = [[rng.randrange(FIRST_TOKEN, LAST_TOKEN) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    with path.open("w") as f:
        for i, ids in enumerate(rows):
            f.write(json.dumps({"id": f"r{i}", "input_ids": ids}) + "\n")
    return rows


# --- the variants (each in its own process) -----------------------------------------------------------------------
def _engine_args(model: str, layers: list[int], spec: bool, extra: dict[str, Any]) -> dict[str, Any]:
    from vllm_hs_compat.demo.engine import engine_args, has_gpu

    args = engine_args(model, layers, gpu=has_gpu(), max_model_len=4096, **extra)
    if not spec:
        args.pop("speculative_config")
    return args


def _warmup(llm: Any, params: Any = None) -> None:
    """One untimed batch of about 31,000 tokens (more than a step of vLLM's default budget, so that chunks with
    context run too): kernels compiled for the shapes, first-step allocations made."""
    from vllm_hs_compat.adapters.engine_api import sampling_params

    warm = [{"prompt_token_ids": [FIRST_TOKEN + (i * 7 + j) % 400 for j in range(600 + 60 * i)]} for i in range(24)]
    llm.generate(warm, params or sampling_params(max_tokens=1, temperature=0.0), use_tqdm=False)


def _memory(out: dict[str, Any]) -> None:
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        out["gpu"] = {
            "name": torch.cuda.get_device_name(),
            "total_bytes": total,
            "free_bytes_after": free,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        }


def _prompts(rows: list[list[int]]) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": r} for r in rows]


class PySpy:
    """``--pyspy``: py-spy attached to this variant's process for its timed part only (the engine's start and
    warm-up are most of the process's life), writing its raw samples to ``path`` when stopped."""

    def __init__(self, exe: str | None, path: Path) -> None:
        self.exe, self.path = exe, path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.exe is None:
            return
        self.path.unlink(missing_ok=True)
        cmd = [self.exe, "record", "--pid", str(os.getpid()), "--native", "--idle", "--threads", "--subprocesses",
               "--format", "raw", "--rate", "50", "--output", str(self.path)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # attached before the clock starts

    def stop(self, out: dict[str, Any]) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        try:
            _, err = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        out["pyspy"] = {"path": self.path.name, "rc": self.proc.returncode, "written": self.path.is_file()}
        if not self.path.is_file():
            out["pyspy"]["stderr"] = err.decode(errors="replace")[-800:]


def run_generate(a: argparse.Namespace, rows: list[list[int]], out: dict[str, Any], spec: bool) -> None:
    from vllm import LLM

    from vllm_hs_compat.adapters.engine_api import sampling_params

    t0 = time.monotonic()
    llm = LLM(**_engine_args(a.model, a.layers, spec, a.engine_args))  # as the capture engine: stats logging off
    out["start_s"] = time.monotonic() - t0
    _warmup(llm)
    spy = PySpy(a.pyspy, Path(a.out) / f"{a.shape}-{a.variant_name}.pyspy.txt")
    spy.start()
    t = time.monotonic()
    llm.generate(_prompts(rows), sampling_params(max_tokens=1, temperature=0.0), use_tqdm=False)
    out["work_s"] = time.monotonic() - t
    spy.stop(out)
    out["bytes"] = 0
    _memory(out)
    _config(llm, out)


def _config(llm: Any, out: dict[str, Any]) -> None:
    c = llm.llm_engine.vllm_config
    out["engine"] = {
        "max_num_batched_tokens": int(c.scheduler_config.max_num_batched_tokens),
        "max_num_seqs": int(c.scheduler_config.max_num_seqs),
        "block_size": int(c.cache_config.block_size),
        "gpu_memory_utilization": float(c.cache_config.gpu_memory_utilization),
        "enforce_eager": bool(c.model_config.enforce_eager),
        "cudagraph_mode": str(getattr(c.compilation_config, "cudagraph_mode", None)),
    }


def run_capture(a: argparse.Namespace, rows: list[list[int]], out: dict[str, Any], storage: str) -> None:
    from bench_capture import timed_capture
    from thread_clock import ThreadClock

    from vllm_hs_compat.adapters.engine_api import sampling_params

    optout = sampling_params(
        max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {"hs_capture": {"enabled": False}}}
    )
    argv = ["--loss-mask", "all", "--engine-args", json.dumps(a.engine_args)]
    if a.variant == "capture_serial":
        argv += ["--adoption", "serial"]
    if a.variant == "capture_procs":
        argv += ["--adoption-checks", "processes"]
    if a.batch_size is not None:
        argv += ["--batch-size", str(a.batch_size)]
    tree = Path(a.work) / f"tree-{storage}"
    shutil.rmtree(tree, ignore_errors=True)
    # BENCH_THREADS=1: CPU seconds per thread and the interpreter's wake lateness (its sampler and probe hold the
    # interpreter too -- the ~1B engine's one run beside them was 1.55x slower than the session before: the headline
    # rows run without them)
    clock = ThreadClock() if os.environ.get("BENCH_THREADS") == "1" else None
    spy = PySpy(a.pyspy, Path(a.out) / f"{a.shape}-{a.variant_name}.pyspy.txt")

    def warmup(llm: Any) -> None:  # the clock runs from the warmed engine to the command's return (its shutdown too)
        _warmup(llm, optout)
        if clock is not None:
            clock.__enter__()
        spy.start()

    got = timed_capture(a.model, a.data, str(tree), storage, ",".join(map(str, a.layers)), argv, warmup=warmup)
    spy.stop(out)
    out.update(got)
    if clock is not None:
        clock.__exit__(None, None, None)
        out["threads"] = clock.report()
    _memory(out)


def run_example(a: argparse.Namespace, rows: list[list[int]], out: dict[str, Any]) -> None:
    from vllm_hs_compat.adapters.engine_api import sampling_params
    from vllm_hs_compat.demo.engine import speculative_config

    sink = Path(a.work) / "example_sink"
    shutil.rmtree(sink, ignore_errors=True)
    args = _engine_args(a.model, a.layers, True, a.engine_args)
    args["speculative_config"] = speculative_config(a.layers)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # use_synchronization_lock=False: with the lock the example deadlocked in an in-process engine.
    extra = {"shared_storage_path": str(sink), "use_synchronization_lock": False}
    where: dict[str, str] = {"kv_connector": "ExampleHiddenStatesConnector"}
    import torch

    if not torch.cuda.is_available():  # the benchmark's CPU check: the test suite's CPU stand-ins for its copies
        sys.path.insert(0, str(ROOT / "tests" / "e2e"))
        where = {"kv_connector": "CpuExampleHiddenStatesConnector", "kv_connector_module_path": "e2e_example_cpu"}
    kv = KVTransferConfig(**where, kv_role="kv_producer", kv_connector_extra_config=extra)
    t0 = time.monotonic()
    llm = LLM(**args, kv_transfer_config=kv)
    out["start_s"] = time.monotonic() - t0
    _warmup(llm)
    _drain(llm, [])
    t = time.monotonic()
    outs = llm.generate(_prompts(rows), sampling_params(max_tokens=1, temperature=0.0), use_tqdm=False)
    files = [Path((o.kv_transfer_params or {}).get("hidden_states_path", "")) for o in outs]
    missing = _drain(llm, files)
    out["work_s"] = time.monotonic() - t
    out["missing"] = missing
    out["bytes"] = sum(f.stat().st_size for f in files if f.is_file())
    out["records"] = sum(1 for f in files if f.is_file())
    _memory(out)
    _config(llm, out)


def _drain(llm: Any, files: list[Path], timeout_s: float = 300.0) -> int:
    """Step the in-process engine while it holds requests, then wait for ``files``; returns how many are missing."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if core.scheduler.has_requests():
            llm.llm_engine.step()
        elif all(f.is_file() for f in files):
            break
        else:
            time.sleep(0.005)
    return sum(1 for f in files if not f.is_file())


def run_export(a: argparse.Namespace, rows: list[list[int]], out: dict[str, Any]) -> None:
    from vllm_hs_compat.adapters.engine_api import sampling_params
    from vllm_hs_compat.connector import flush
    from vllm_hs_compat.demo.engine import build_llm

    hidden = SHAPES[a.shape][0]
    record = max(len(r) for r in rows) * len(a.layers) * hidden * 2
    token_file = Path(a.work) / "export.token"
    extra = {
        "capture": "prompt",
        "sink": "export",
        "export": {
            "backend": "shm",
            "num_slots": a.slots,
            "slot_bytes": 1 << (record - 1).bit_length(),
            "token_file": str(token_file),
        },
    }
    t0 = time.monotonic()
    llm = build_llm(a.model, a.layers, extra, max_model_len=4096, **a.engine_args)
    out["start_s"] = time.monotonic() - t0
    params = sampling_params(max_tokens=1, temperature=0.0)
    optout = sampling_params(
        max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {"hs_capture": {"enabled": False}}}
    )
    first = llm.generate([{"prompt_token_ids": rows[0][:600]}], params, use_tqdm=False)[0]  # its ticket: the endpoint
    flush(llm)
    _warmup(llm, optout)  # no records: the trainer gets the first one, then the timed ones
    flush(llm)
    entry = (first.kv_transfer_params or {})["hs_export"]
    report = Path(a.work) / "trainer.json"
    report.unlink(missing_ok=True)
    report.with_suffix(".ready").unlink(missing_ok=True)
    trainer = subprocess.Popen(
        [sys.executable, __file__, "--trainer", entry["endpoint"], "--token-file", str(token_file),
         "--expect", str(len(rows) + 1), "--result", str(report)],
        env=os.environ.copy(),
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not report.with_suffix(".ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the trainer is connected and has the first record before the clock starts
    t, t_wall = time.monotonic(), time.time()
    llm.generate(_prompts(rows), params, use_tqdm=False)
    flush(llm, timeout_s=300.0)
    engine_done = time.monotonic()
    rc = trainer.wait(timeout=600)
    got = json.loads(report.read_text()) if report.exists() else {}
    out.update(
        trainer_rc=rc,
        records=got.get("records", 0) - 1,
        trainer_tokens=got.get("tokens", 0) - got.get("first_tokens", 0),
        failed=got.get("failed"),
        engine_s=engine_done - t,
        work_s=got.get("last_wall", time.time()) - t_wall,
        bytes=got.get("bytes", 0) - got.get("first_bytes", 0),
    )
    _memory(out)
    _config(llm, out)


def trainer(endpoint: str, token_file: str, expect: int, result: str) -> int:
    """The trainer process of ``export``: stream records until ``expect`` arrived (or 120 s without one)."""
    from vllm_hs_compat.export import ExportConsumer
    from vllm_hs_compat.export.control import read_token

    n = tokens = nbytes = failed = 0
    first: dict[str, int] = {}
    last = time.time()
    with ExportConsumer(endpoint, read_token(token_file), backend="shm", timeout_s=30.0) as c:
        for rec in c.iter_records(wait_s=1.0, idle_timeout_s=120.0):
            if isinstance(rec, Exception):
                failed += 1
            else:
                n += 1
                tokens += int(rec.hidden_states.shape[0])
                nbytes += rec.hidden_states.numel() * rec.hidden_states.element_size()
            last = time.time()
            if n + failed == 1:  # the record made before the clock: the benchmark waits for it
                first = {"first_tokens": tokens, "first_bytes": nbytes}
                Path(result).with_suffix(".ready").write_text("")
            if n + failed >= expect:
                break
    Path(result).write_text(json.dumps({"records": n, "tokens": tokens, "bytes": nbytes, "failed": failed,
                                        "last_wall": last, **first}))  # fmt: skip
    return 0 if failed == 0 and n == expect else 1


def split_variant(name: str) -> tuple[str, int | None] | None:
    """``capture@256`` -> (``capture``, 256): a capture variant with its own ``--batch-size``; ``generate`` ->
    (``generate``, None); None for a name that is neither."""
    base, at, size = name.partition("@")
    if base not in VARIANTS or (at and not (base.startswith("capture") and size.isdigit())):
        return None
    return base, int(size) if at else None


def child(a: argparse.Namespace) -> int:
    switch = os.environ.get("BENCH_SWITCH_INTERVAL")
    if switch:  # the interpreter's switch interval in this variant's process (an experiment: default 0.005 s)
        sys.setswitchinterval(float(switch))
    rows = [json.loads(line)["input_ids"] for line in Path(a.data).read_text().splitlines()]
    out: dict[str, Any] = {"variant": a.variant, "shape": a.shape, "rows": len(rows), "tokens": sum(map(len, rows))}
    known = split_variant(a.variant)
    if known is None:
        raise SystemExit(f"unknown variant {a.variant!r}")
    a.variant_name = a.variant  # as asked (capture@256), for file names
    a.variant, size = known
    if size is not None:
        a.batch_size = size
        out["batch_size"] = size
    if a.variant in ("generate", "extract"):
        run_generate(a, rows, out, spec=a.variant == "extract")
    elif a.variant in ("capture", "capture_serial", "capture_procs", "capture_fp8"):
        run_capture(a, rows, out, "fp8_e4m3" if a.variant == "capture_fp8" else "captured")
    elif a.variant == "example":
        run_example(a, rows, out)
    else:
        run_export(a, rows, out)
    Path(a.result).write_text(json.dumps(out, indent=1))
    return 0


# --- the driver -------------------------------------------------------------------------------------------------------
def logged(engine_log: Path, head: str) -> dict[str, float] | None:
    """The dict the connector's worker logs at shutdown after ``head`` (its last such line; None when none):
    ``vllm-hs-compat worker seconds: `` (its seconds per stage), ``vllm-hs-compat pinned host memory: `` (torch's
    pinned host allocator in the engine's process: blocks created, milliseconds in ``cudaHostAlloc``)."""
    found = None
    for line in engine_log.read_text(errors="replace").splitlines():
        at = line.find(head)
        if at >= 0:
            found = ast.literal_eval(line[at + len(head) :].strip())
    return found


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'shape':<6} {'variant':<18} {'tok/s':>9} {'x gen':>6} {'rows/s':>7} {'B/token':>8} {'start s':>8} "
        f"{'work s':>7} {'peak GiB':>8}"
    ]
    base = {r["shape"]: r["tokens"] / r["work_s"] for r in results if r["variant"] == "generate" and r.get("work_s")}
    for r in results:
        if not r.get("work_s"):
            lines.append(f"{r['shape']:<6} {r['variant']:<18} FAILED: {r.get('error', '?')[-200:]}")
            continue
        rate = r["tokens"] / r["work_s"]
        ratio = f"{rate / base[r['shape']]:.2f}" if r["shape"] in base else "-"
        bpt = r.get("bytes", 0) / max(1, r["tokens"])
        peak = r.get("gpu", {}).get("peak_reserved_bytes", 0) / 2**30
        lines.append(
            f"{r['shape']:<6} {r['variant']:<18} {rate:>9.0f} {ratio:>6} {r['rows'] / r['work_s']:>7.1f} "
            f"{bpt:>8.0f} {r.get('start_s', 0):>8.1f} {r['work_s']:>7.2f} {peak:>8.1f}"
        )
        w = r.get("where")
        if w:  # the capture command's own summary: which side bounded the run
            lines.append(
                f"{'':<6}   engine {w['engine_s']:.2f} s, adoption {w['adopt_s']:.2f} s ({w['overlap_s']:.2f} s beside "
                f"the engine), the engine waiting on adoption {w['adopt_wait_s']:.2f} s"
                + (  # a tree whose adopter follows the engine says its tail (earlier trees: not measured)
                    f", the tail after the engine's last batch {w['adopt_tail_s']:.2f} s, "
                    f"{w['adopted_while_running']:.0f} records adopted while their batch ran"
                    if "adopt_tail_s" in w
                    else ""
                )
            )
        c = r.get("connector_s")
        if c:  # the connector's worker: its engine-thread stages, then its publisher's
            lines.append(f"{'':<6}   connector s: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))
        th = r.get("threads")
        if th:  # CPU seconds per thread group in the capture's process, and how late the interpreter came back
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(th["cpu_s"].items())[:8])
            g = th["gil_wake_ms"]
            lines.append(f"{'':<6}   thread cpu s (of {th['wall_s']:.2f} s): {top}")
            late = f"mean {g['mean']:.2f}, p90 {g['p90']:.2f}, p99 {g['p99']:.2f}"
            lines.append(f"{'':<6}   interpreter wake late ms: {late}")
        ar = r.get("arena")
        if ar:  # the connector's own pinned slab, allocated at start
            lines.append(f"{'':<6}   pinned arena: " + ", ".join(f"{k} {v:.2f}" for k, v in ar.items()))
        h = r.get("pinned")
        if h:  # torch's pinned host allocator in the engine's process (cudaHostAlloc runs on the engine thread)
            lines.append(f"{'':<6}   pinned host: " + ", ".join(f"{k} {v:.1f}" for k, v in h.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-gpu", help="bench.json and the table land here")
    ap.add_argument("--work", default=None, help="models, rows, capture trees, example files (default OUT/work)")
    ap.add_argument("--models", default="8b,1b", help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, of {list(VARIANTS)}; a capture variant may name its batch size: capture@256",
    )
    ap.add_argument("--rows", default="8b:256,1b:512,small:24", help="rows per shape, e.g. 8b:256,1b:512")
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument(
        "--batch-size", type=int, default=None, help="capture: rows given to the engine at once (the command's default)"
    )
    ap.add_argument("--slots", type=int, default=32, help="export: the pool's slots (of the longest record's size)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per variant process")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run: later variants skip")
    ap.add_argument(
        "--engine-args", default='{"load_format": "dummy"}', help="vllm.LLM arguments of every variant (JSON)"
    )
    ap.add_argument(
        "--pyspy",
        default=None,
        help="a py-spy binary: record the timed part of each generate or capture variant with it (native frames, "
        "idle threads, the processes it starts; 50 samples/s) into OUT/SHAPE-VARIANT.pyspy.txt -- "
        "benchmarks/gpu/pyspy_threads.py reads it",
    )
    # a child (one variant) or the export's trainer
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--trainer", help=argparse.SUPPRESS)
    ap.add_argument("--token-file", help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.engine_args = json.loads(a.engine_args)
    if a.trainer:
        return trainer(a.trainer, a.token_file, a.expect, a.result)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or out / "work")
    work.mkdir(parents=True, exist_ok=True)
    if a.variant:
        a.layers = [int(x) for x in json.loads((Path(a.model) / "layers.json").read_text())]
        a.work = str(work)
        return child(a)
    import torch

    if torch.cuda.is_available():
        a.engine_args.setdefault("attention_backend", "TRITON_ATTN")
    t_start = time.monotonic()
    per_shape = dict(x.split(":") for x in a.rows.split(","))
    results: list[dict[str, Any]] = []
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    if not torch.cuda.is_available():
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    variants = a.variants.split(",")
    unknown = sorted(v for v in variants if split_variant(v) is None)
    if unknown:  # a misspelt variant would otherwise fall through to the last branch of child()
        ap.error(f"--variants: unknown {unknown}; expected some of {list(VARIANTS)}")
    for shape in a.models.split(","):
        model = work / f"model-{shape}"
        layers = make_model(model, shape)
        (model / "layers.json").write_text(json.dumps(layers))
        data = work / f"rows-{shape}.jsonl"
        make_rows(data, int(per_shape[shape]), a.min_len, a.max_len)
        for variant in variants:
            left = None if a.deadline is None else a.deadline - (time.monotonic() - t_start)
            if left is not None and left < 60:
                print(f"{shape} {variant}: skipped, {left:.0f} s of --deadline left", flush=True)
                continue
            result = work / f"{shape}-{variant}.json"
            result.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--variant", variant, "--shape", shape, "--model", str(model),
                   "--data", str(data), "--result", str(result), "--out", str(out), "--work", str(work),
                   "--slots", str(a.slots), "--engine-args", json.dumps(a.engine_args)]  # fmt: skip
            if a.batch_size is not None:
                cmd += ["--batch-size", str(a.batch_size)]
            if a.pyspy:  # where each thread's time goes (it slows the process it samples: not for the ratios)
                cmd += ["--pyspy", a.pyspy]
            t = time.monotonic()
            log = out / f"{shape}-{variant}.log"
            timeout = a.timeout if left is None else min(a.timeout, left)
            with log.open("w") as f:
                try:
                    rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = -9
            got = json.loads(result.read_text()) if result.exists() else {}
            got.setdefault("variant", variant)
            got.setdefault("shape", shape)
            got.setdefault("rows", int(per_shape[shape]))
            got.setdefault("tokens", 0)
            got["rc"], got["wall_s"] = rc, time.monotonic() - t
            if rc != 0:
                got["error"] = f"rc {rc}: " + log.read_text(errors="replace")[-1500:]
            for stale in (work / "tree-captured", work / "tree-fp8_e4m3", work / "example_sink"):
                # vLLM's log of the capture engine stays, and the connector's stage seconds from its end
                for engine_log in sorted(stale.glob("logs/*.log")):
                    kept = out / f"{shape}-{variant}-engine-{engine_log.name}"
                    shutil.copyfile(engine_log, kept)
                    got.setdefault("connector_s", logged(kept, "vllm-hs-compat worker seconds: "))
                    got.setdefault("pinned", logged(kept, "vllm-hs-compat pinned host memory: "))
                    got.setdefault("arena", logged(kept, "vllm-hs-compat pinned arena: "))
                shutil.rmtree(stale, ignore_errors=True)  # the disk holds one variant's records at a time
            results.append(got)
            mine = [r for r in results if r["shape"] == shape]
            print("\n".join(table(mine)[len(table(mine[:-1])) :]), flush=True)  # this variant's lines
            (out / "bench.json").write_text(json.dumps(results, indent=1))
    print("\n".join(table(results)), flush=True)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
