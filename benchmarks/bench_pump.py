"""The producer's pump over TCP, before vs after, side by side in one run (not a test).

    python benchmarks/bench_pump.py [--reps 8] [--before-src DIR] [--configs before,after,...] [--json F]

Over UCX's TCP transport a READ is two-sided: the producer's UCX worker answers it only while something in the
producer process progresses it, and that is :class:`ExportProducer`'s pump thread.  This benchmark runs pairs of
processes (a producer, a consumer; NIXL forced onto TCP over loopback: ``UCX_TLS=tcp``, ``UCX_NET_DEVICES=lo``),
one pair per configuration, and per repetition, configurations rotated, measures on each pair:

* ``lone``: one ``fetch()`` of a 64 KiB record after 1 s without requests (the producer's pump has gone idle);
  "its READ": the consumer's transport READ inside it (the part the producer's pump decides over TCP);
* ``busy``: the median of 20 back-to-back ``fetch()`` calls of 64 KiB records;
* ``stream``: ``iter_batches(max_records=256)`` over 1,000 records of 64 KiB (per record);
* the producer process's CPU time during the busy fetches and the stream (utime + stime from /proc).

After the repetitions every producer sits idle for ``--idle-s`` seconds (its last request more than a second
before) and its CPU use over that window is printed (percent of one core).  The load average is printed before,
during and after: on a shared machine label the run "under load".

Configurations (``--configs``, comma-separated):

* ``before``: the package as it was (``--before-src``: a directory holding its ``vllm_hs_compat``, e.g.
  ``git archive <commit> vllm_hs_compat | tar -x -C DIR``), its defaults;
* ``after``: this tree's package, its defaults;
* ``after-20us`` / ``after-spin``: this tree, ``claimed_poll_interval_s=2e-5`` / ``0`` (the pause between
  polls while claimed; the default is 50 us; ``0``: back to back, a ``sleep(0)`` between polls);
* ``after-cspin``: this tree, the consumer's READ poll never sleeps (its ``nixl_backend.SPIN_S`` patched in the
  benchmark's consumer process only);
* ``before-idle200us``: the old package with ``idle_poll_interval_s=2e-4`` (what a fast pump costs idle);
* ``before-progthread``: the old package with NIXL's own progress thread in the producer's agent
  (``enable_prog_thread=True``, patched in the benchmark's producer process only); NIXL's Python API gives that
  thread a 0 us delay, so it polls UCX without pause;
* ``before-progthread-evt``: the same with the thread's delay set to 100 ms (NIXL's binding patched in the
  benchmark's producer process only): the thread then sleeps in ``poll()`` on the UCX worker's event fd, woken by
  traffic, or after 100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from role_worker import Worker

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20
REC = 64 * KiB
SLOT = REC + 64  # the rows and their 8 token ids, rounded up
STREAM_N, BATCH, BUSY_N = 1000, 256, 20
HIDDEN, PLANES = 1024, 4  # bf16 rows: 8 KiB per token
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}

CONFIGS: dict[str, dict[str, Any]] = {
    "before": {"src": "before"},
    "after": {"src": "after"},
    "after-20us": {"src": "after", "kw": {"claimed_poll_interval_s": 2e-5}},
    "after-spin": {"src": "after", "kw": {"claimed_poll_interval_s": 0.0}},
    "after-cspin": {"src": "after", "env": {"HSX_BENCH_SPIN_S": "1e9"}},
    "before-idle200us": {"src": "before", "kw": {"idle_poll_interval_s": 2e-4}},
    "before-progthread": {"src": "before", "env": {"HSX_BENCH_PROG_THREAD": "1"}},
    "before-progthread-evt": {
        "src": "before",
        "env": {"HSX_BENCH_PROG_THREAD": "1", "HSX_BENCH_PTHR_DELAY_US": "100000"},
    },
}


def _cpu_s() -> float:
    with open(f"/proc/{os.getpid()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve(handlers: dict[str, Callable[..., Any]]) -> None:
    """Answer one JSON command per stdin line on the original stdout (library logs go to stderr)."""
    chan = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            ans = handlers[op](**cmd)
        except Exception as e:  # the orchestrator prints it and stops
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans if ans is not None else {}), file=chan, flush=True)


def role_producer() -> None:
    import torch

    if os.environ.get("HSX_BENCH_PROG_THREAD"):  # diagnostic: NIXL's own progress thread in this process
        from vllm_hs_compat.export import nixl_backend

        delay_us = int(os.environ.get("HSX_BENCH_PTHR_DELAY_US", "0"))

        def _agent(api: Any, name: str) -> Any:
            if delay_us:  # NIXL's Python API sets the thread's delay to 0 (poll without timeout: it spins)
                real = api.nixlBind

                class Config(real.nixlAgentConfig):  # type: ignore[misc, name-defined]
                    def __setattr__(self, key: str, value: Any) -> None:
                        super().__setattr__(key, delay_us if key == "pthrDelay" else value)

                class Bind:
                    nixlAgentConfig = Config

                    def __getattr__(self, key: str) -> Any:
                        return getattr(real, key)

                api.nixlBind = Bind()
            return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"], enable_prog_thread=True))

        nixl_backend._agent = _agent
    from vllm_hs_compat.core.records import RecordMeta
    from vllm_hs_compat.export import ExportProducer

    tokens = REC // (HIDDEN * PLANES * 2)
    rows = torch.randint(0, 256, (REC,), dtype=torch.uint8).view(torch.bfloat16).view(tokens, PLANES, HIDDEN)
    prod: list[ExportProducer] = []

    def start(kw: dict[str, Any]) -> dict[str, Any]:
        p = ExportProducer(
            backend="nixl",
            num_slots=STREAM_N + 64,
            slot_bytes=SLOT,
            lease_ttl_s=60,
            ready_ttl_s=None,
            on_full="wait",
            wait_timeout_s=10.0,
            **kw,
        )
        prod.append(p)
        import vllm_hs_compat

        return {"endpoint": p.endpoint, "token": p.token, "pid": os.getpid(), "src": vllm_hs_compat.__file__}

    def publish(ids: list[str]) -> dict[str, Any]:
        for rid in ids:
            prod[0].publish(RecordMeta.for_tensor(rid, rows, [0] * tokens, [1, 2, 3, 4], True), rows)
        return {}

    def stop() -> None:
        for p in prod:
            p.close()

    _serve({"start": start, "publish": publish, "cpu": lambda: {"s": _cpu_s()}, "stop": stop})


def role_consumer() -> None:
    spin = os.environ.get("HSX_BENCH_SPIN_S")
    if spin:  # diagnostic: how long a READ is polled before the polls pause (patched here only)
        from vllm_hs_compat.export import nixl_backend

        nixl_backend.SPIN_S = float(spin)
    from vllm_hs_compat.export import ExportConsumer

    cons: list[ExportConsumer] = []
    keep: list[Any] = [None]  # the previous record stays alive while the next is fetched, as in a user's loop
    reads: list[float] = []  # seconds of each transport READ (NIXL request to completion) since the last take

    def timed_reads() -> None:
        """Time the consumer's transport READs (the part of a fetch the producer's pump decides over TCP)."""
        tr = cons[0]._landing.transport
        if tr is None or getattr(tr, "_bench_timed", False):
            return
        inner = tr.read

        def read(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                reads.append(time.perf_counter() - t0)

        tr.read = read  # type: ignore[method-assign]
        tr._bench_timed = True  # type: ignore[attr-defined]

    def take_reads() -> list[float]:
        out = list(reads)
        reads.clear()
        return out

    def connect(endpoint: str, token: str) -> None:
        cons.append(ExportConsumer(endpoint, token, landing_bytes=64 * MiB))

    def lone(rid: str, idle_s: float) -> dict[str, Any]:
        timed_reads()
        time.sleep(idle_s)
        take_reads()
        t0 = time.perf_counter()
        keep[0] = cons[0].fetch(rid)
        dt = time.perf_counter() - t0
        return {"s": dt, "read": sum(take_reads())}

    def busy(ids: list[str]) -> dict[str, Any]:
        per = []
        timed_reads()
        take_reads()
        for rid in ids:
            t0 = time.perf_counter()
            keep[0] = cons[0].fetch(rid)
            per.append(time.perf_counter() - t0)
        return {"s": statistics.median(per), "read": statistics.median(take_reads())}

    def stream(n: int) -> dict[str, Any]:
        got = 0
        timed_reads()
        take_reads()
        t0 = time.perf_counter()
        for b in cons[0].iter_batches(max_records=BATCH, wait_s=1.0, idle_timeout_s=2.0):
            got += len(b)
            keep[0] = b
            if got >= n:
                break
        dt = time.perf_counter() - t0
        if got != n:
            raise RuntimeError(f"streamed {got} of {n} records")
        return {"s": dt / n, "read": sum(take_reads()) / n}

    _serve({"connect": connect, "lone": lone, "busy": busy, "stream": stream})


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=8, help="measured repetitions (one more is run first and dropped)")
    ap.add_argument("--configs", default="before,after")
    ap.add_argument("--before-src", default=None, help="directory holding the old package (for before*)")
    ap.add_argument("--idle-before-fetch-s", type=float, default=1.0)
    ap.add_argument("--idle-s", type=float, default=10.0, help="the idle CPU window")
    ap.add_argument("--json", help="also write the raw figures to this file")
    a = ap.parse_args()
    if a.role:
        {"producer": role_producer, "consumer": role_consumer}[a.role]()
        return
    names = a.configs.split(",")
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-pump-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"# bench_pump  {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  {_load()}  cpus {os.cpu_count()}")
    pairs: dict[str, tuple[Worker, Worker, int]] = {}
    workers: list[Worker] = []
    res: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    seq = [0]

    def ids(n: int) -> list[str]:
        seq[0] += 1
        return [f"r{seq[0]}-{i}" for i in range(n)]

    try:
        for n in names:
            cfg = CONFIGS[n]
            if cfg["src"] == "before" and not a.before_src:
                sys.exit(f"{n} needs --before-src")
            src = Path(a.before_src) if cfg["src"] == "before" else ROOT
            env = cfg.get("env", {})
            prod = Worker("producer", __file__, sys.executable, src, {**TCP, **env}, log_dir / f"{n}-producer.log")
            cons = Worker("consumer", __file__, sys.executable, src, {**TCP, **env}, log_dir / f"{n}-consumer.log")
            workers += [prod, cons]
            info = prod("start", kw=cfg.get("kw", {}))
            cons("connect", endpoint=info["endpoint"], token=info["token"])
            pairs[n] = (prod, cons, int(info["pid"]))
            print(f"#   {n}: producer pid {info['pid']}, package {Path(info['src']).parent}", flush=True)
        for rep in range(a.reps + 1):  # repetition 0 wires the connections up: dropped
            k = rep % len(names)
            for n in names[k:] + names[:k]:
                prod, cons, pid = pairs[n]
                r = res[n]
                (rid,) = ids(1)
                prod("publish", ids=[rid])
                lone_r = cons("lone", rid=rid, idle_s=a.idle_before_fetch_s)
                bids = ids(BUSY_N)
                prod("publish", ids=bids)
                c0 = _proc_cpu_s(pid)
                busy_r = cons("busy", ids=bids)
                c_busy = _proc_cpu_s(pid) - c0
                sids = ids(STREAM_N)
                prod("publish", ids=sids)
                c0 = _proc_cpu_s(pid)
                stream_r = cons("stream", n=STREAM_N)
                c_stream = _proc_cpu_s(pid) - c0
                if rep:
                    for key, v in (
                        ("lone_ms", lone_r["s"] * 1e3),
                        ("lone_read_ms", lone_r["read"] * 1e3),
                        ("busy_us", busy_r["s"] * 1e6),
                        ("busy_read_us", busy_r["read"] * 1e6),
                        ("stream_us", stream_r["s"] * 1e6),
                        ("stream_read_us", stream_r["read"] * 1e6),
                        ("busy_cpu_ms", c_busy * 1e3 / BUSY_N),
                        ("stream_cpu_us", c_stream * 1e6 / STREAM_N),
                    ):
                        r.setdefault(key, []).append(v)
            print(f"#   repetition {rep}/{a.reps} done  {_load()}", flush=True)
        time.sleep(1.0)
        idle0 = {n: _proc_cpu_s(pair[2]) for n, pair in pairs.items()}
        t0 = time.monotonic()
        time.sleep(a.idle_s)
        dt = time.monotonic() - t0
        for n, pair in pairs.items():
            res[n]["idle_cpu_pct"] = [(_proc_cpu_s(pair[2]) - idle0[n]) / dt * 100]
        print(f"# end  {_load()}")
    finally:
        for w in reversed(workers):
            w.close()
    print(
        f"\nmedian (min..max) over {a.reps} reps; producer CPU per fetch / per streamed record; "
        f"idle CPU over {a.idle_s:g} s"
    )
    keys = (
        ("lone_ms", "lone 64 KiB fetch after idle (ms)"),
        ("lone_read_ms", "  its READ (ms)"),
        ("busy_us", "busy 64 KiB fetch (us)"),
        ("busy_read_us", "  its READ (us)"),
        ("stream_us", f"stream {STREAM_N} x 64 KiB (us/record)"),
        ("stream_read_us", "  its READs (us/record)"),
        ("busy_cpu_ms", "producer CPU per busy fetch (ms)"),
        ("stream_cpu_us", "producer CPU per streamed record (us)"),
        ("idle_cpu_pct", "producer CPU idle (% of a core)"),
    )
    print(f"{'':44}" + "".join(f"{n:>22}" for n in names))
    for key, label in keys:
        cells = []
        for n in names:
            v = res[n].get(key, [])
            cells.append(f"{statistics.median(v):8.2f} ({min(v):.2f}..{max(v):.2f})" if v else "-")
        print(f"{label:44}" + "".join(f"{c:>22}" for c in cells))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
