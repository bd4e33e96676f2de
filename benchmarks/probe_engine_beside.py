"""What `capture`'s own threads cost the engine's thread beside them (docs/gpu.md, twelfth session: the ~1B shape).

    python benchmarks/probe_engine_beside.py [--records 48] [--tokens 1300] [--hidden 2048] [--seconds 3]

On a GPU, vLLM's engine thread spends each step in many short host calls -- torch ops and CUDA launches, each of
which releases the interpreter and takes it back -- and with the connector and `capture` in the same process, the
connector's publishers (the file sink) and adoption's threads (read back, checksum, NaN/Inf check, move, index) run
beside it.  A thread that gives the interpreter up a few hundred times a step pays, at each return, whatever the
other threads hold it for; on a host with cores to spare that, not CPU, is what they cost it.

This probe runs a stand-in for that thread -- a loop of "steps" of short torch ops on small CPU tensors and a little
pure Python -- alone, then beside each of: the connector's file sink writing ~1B-shaped records in its default
writers (``files.write_record``, 4 threads as on CUDA), adoption of such records through the capture's own
``Batches.adopt_batch`` with its default check-ahead threads, and both.  The same loop also runs in a *separate
process* at the same time, which shares the cores but not the interpreter: its slowdown is the CPU's share, the
in-process loop's beyond it the interpreter's.  Printed: steps/s of each loop in each stage and the ratio to alone.
A benchmark, not a test: it checks only that every record was written and adopted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch


def _step(xs: list[torch.Tensor], ops: int) -> None:
    """One stand-in engine step: ``ops`` short torch ops (each gives the interpreter up) and some pure Python."""
    acc = 0
    for i in range(ops):
        x = xs[i % len(xs)]
        x.add_(1)
        acc += len({"k": i, "v": [i, i + 1]})
    if acc < 0:
        raise RuntimeError("unreachable")


def _loop(stop: Any, counter: Any, ops: int) -> None:
    torch.set_num_threads(1)
    xs = [torch.zeros(16) for _ in range(8)]
    while not stop.is_set():
        _step(xs, ops)
        with counter.get_lock():
            counter.value += 1


def _child(stop: Any, counter: Any, ops: int) -> None:  # the same loop in its own process (own interpreter)
    _loop(stop, counter, ops)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=1300)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--planes", type=int, default=4)
    ap.add_argument("--writers", type=int, default=4, help="the sink's writer threads (4: its default on CUDA)")
    ap.add_argument("--ops", type=int, default=200, help="torch ops per stand-in step")
    ap.add_argument("--seconds", type=float, default=3.0, help="the 'alone' stage's length")
    ap.add_argument("--dir", default=None, help="where records go (default: a temporary folder on /dev/shm or /tmp)")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for this process")
    a = ap.parse_args()
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)

    from vllm_hs_compat.capture import batches
    from vllm_hs_compat.capture.rows import SampleInfo
    from vllm_hs_compat.capture.staged import record_files
    from vllm_hs_compat.capture.store import CaptureStore
    from vllm_hs_compat.core.checksums import compute_checksum
    from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
    from vllm_hs_compat.export import files

    rows = torch.randn(a.tokens, a.planes, a.hidden).to(torch.bfloat16)
    ids = list(range(3, 3 + a.tokens))
    base = RecordMeta.for_tensor("r", rows, ids, list(range(1, a.planes + 1)), pre_norm=True)
    base = base.with_checksum(compute_checksum(rows.view(torch.uint8).reshape(-1), base.checksum_algorithm))
    mb = rows.numel() * rows.element_size() / 2**20
    root = Path(a.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
    work = root / f"probe-beside-{os.getpid()}"

    def write(folder: Path, i: int) -> Path:
        meta = RecordMeta.from_dict({**base.to_dict(), "request_id": f"r{i}", "sample_id": f"r{i}"})
        return files.write_record(folder, CaptureRecord(meta, rows))

    def sink(folder: Path) -> None:
        """The sink: every record written by ``writers`` threads, then deleted (no page cache carried over)."""
        folder.mkdir(parents=True, exist_ok=True)
        todo = list(range(a.records))
        lock = threading.Lock()

        def writer() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                m = write(folder, i)
                m.with_suffix(".safetensors").unlink()
                m.unlink()

        threads = [threading.Thread(target=writer) for _ in range(a.writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def staged(n: int) -> tuple[Any, list[Any]]:
        store = CaptureStore(work / f"tree-{n}", run_config={"probe": 1})
        stage = store.staging_dir()
        stage.mkdir(parents=True, exist_ok=True)
        outcomes = []
        for i in range(a.records):
            _, manifest, error = record_files(write(stage, i))
            info = SampleInfo(f"r{i}", "probe", a.tokens, input_ids=tuple(ids))
            outcomes.append(batches.Outcome(info, info, {"manifest": str(manifest), "error": str(error)}))
        return store, outcomes

    def adoption(store: Any, check_in: str) -> Any:
        """The capture's own adoption (its checking workers started: a run starts them with the engine)."""
        b = batches.Batches(
            argparse.Namespace(retries=0, max_consecutive_failures=a.records + 1),
            capture="prompt",
            storage="captured",
            store=store,
            llm=None,
            note_row=lambda row: None,
            check_threads=batches.CHECK_THREADS,
            check_in=check_in,
        )
        if b.checkers.active:
            b.checkers.submit(*_first(store)).result()  # type: ignore[union-attr]  # the workers are up
        return b

    def _first(store: Any) -> tuple[Any, Path]:
        m = write(work / "warm", 0)
        return SampleInfo("w", "probe", a.tokens, input_ids=tuple(ids)), record_files(m)[1]

    def adopt(b: Any, outcomes: list[Any]) -> None:
        b.adopt_batch(outcomes, time.monotonic() + 600, threading.Event())
        if b.store.run_summary().captured != a.records:
            raise SystemExit(f"{b.store.run_summary().captured} of {a.records} records adopted")

    ctx = mp.get_context("spawn")
    stop_child, child_count = ctx.Event(), ctx.Value("q", 0)
    child = ctx.Process(target=_child, args=(stop_child, child_count, a.ops), daemon=True)
    stop_here, here_count = threading.Event(), mp.Value("q", 0)
    here = threading.Thread(target=_loop, args=(stop_here, here_count, a.ops), daemon=True)
    results: dict[str, dict[str, float]] = {}
    try:
        work.mkdir(parents=True)
        child.start()
        time.sleep(3.0)  # the child imports torch
        here.start()
        time.sleep(0.5)

        def stage(name: str, run: Any) -> None:
            c0, h0, t0 = child_count.value, here_count.value, time.perf_counter()
            run()
            dt = time.perf_counter() - t0
            results[name] = {
                "s": dt,
                "here": (here_count.value - h0) / dt,
                "other_process": (child_count.value - c0) / dt,
            }

        stage("alone", lambda: time.sleep(a.seconds))
        stage("sink", lambda: sink(work / "sink"))
        (work / "warm").mkdir()
        s1, o1 = staged(1)
        b1 = adoption(s1, "threads")
        stage("adoption", lambda: adopt(b1, o1))
        b1.close()
        s2, o2 = staged(2)
        b2 = adoption(s2, "threads")

        def both() -> None:
            side = threading.Thread(target=sink, args=(work / "sink2",))
            side.start()
            adopt(b2, o2)
            side.join()

        stage("sink + adoption", both)
        b2.close()
        s3, o3 = staged(3)
        b3 = adoption(s3, "processes")
        stage("adoption, checks in processes", lambda: adopt(b3, o3))
        b3.close()
        stage("alone again", lambda: time.sleep(a.seconds))
    finally:
        stop_here.set()
        stop_child.set()
        here.join(5)
        child.join(10)
        shutil.rmtree(work, ignore_errors=True)
    alone = {k: (results["alone"][k] + results["alone again"][k]) / 2 for k in ("here", "other_process")}
    print(
        f"{a.records} records of {mb:.1f} MiB ({a.tokens} x {a.planes} x {a.hidden} bf16), {a.writers} sink writers, "
        f"{batches.CHECK_THREADS} check-ahead threads, {os.cpu_count()} cores, switch interval "
        f"{sys.getswitchinterval() * 1e3:.1f} ms; stand-in steps/s (x alone):"
    )
    for name, r in results.items():
        print(
            f"  {name:30s} {r['s']:6.2f} s   this process {r['here']:8.1f} ({r['here'] / alone['here']:.2f}x)"
            f"   another process {r['other_process']:8.1f} ({r['other_process'] / alone['other_process']:.2f}x)"
        )
    print(json.dumps({"alone": alone, "stages": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
