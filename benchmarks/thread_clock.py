"""Where a process's CPU time goes, by thread, while a benchmark runs (Linux; a benchmark aid, not package code).

:class:`ThreadClock` samples ``/proc/self/task/<tid>/stat`` (user + system time of every OS thread of the process)
20 times a second (a thread that ends between two samples loses up to 50 ms) and names each Python thread's by its
``threading`` name (digits dropped, so a pool's threads add up: ``capture-check_0..3`` -> ``capture-check_``);
threads Python did not start (CUDA, OpenMP, the allocator's) add up as ``native``.  Beside it a probe thread
sleeps 5 ms at a time and keeps how late each wake was: a thread that needs the interpreter waits for it there, so
the lateness is the wait an engine thread sees each time it comes back from a call that released it (the switch
interval, ``sys.getswitchinterval()``, bounds it while another thread runs Python).

    with ThreadClock() as clock:
        run()
    clock.report()  # {"cpu_s": {"MainThread": 4.1, "hs-compat-publish-": 2.0, ...}, "gil_wake_ms": {...}}
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(tid: int) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15 of stat)


def _tids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


class ThreadClock:
    """CPU seconds per thread group and the interpreter's wake lateness while the ``with`` block runs."""

    def __init__(self, every_s: float = 0.05, probe_s: float = 0.005) -> None:
        self.every_s, self.probe_s = every_s, probe_s
        self._first: dict[int, float] = {}
        self._entered = False
        self._last: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._late: list[float] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _sample(self) -> None:
        for t in threading.enumerate():
            if t.native_id is not None:
                self._names[t.native_id] = re.sub(r"\d+$", "", t.name)
        for tid in _tids():
            cpu = _cpu_s(tid)
            if cpu is not None:
                self._first.setdefault(tid, 0.0 if self._entered else cpu)  # born in the block: from its start
                self._last[tid] = cpu

    def _sampler(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _probe(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(self.probe_s)
            self._late.append(time.perf_counter() - t - self.probe_s)

    def __enter__(self) -> ThreadClock:
        self._sample()
        self._entered = True  # threads alive now count from here; later ones from their start
        self._threads = [
            threading.Thread(target=self._sampler, name="bench-clock", daemon=True),
            threading.Thread(target=self._probe, name="bench-gil-probe", daemon=True),
        ]
        for th in self._threads:
            th.start()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sample()
        self.wall_s = time.monotonic() - self.t0
        self._stop.set()
        for th in self._threads:
            th.join()

    def report(self) -> dict[str, Any]:
        """``cpu_s``: seconds per thread group, largest first (threads that started before the block count from its
        start); ``wall_s``; ``gil_wake_ms``: the probe's lateness (mean, p50, p90, p99, max) and its count."""
        groups: dict[str, float] = {}
        for tid, last in self._last.items():
            name = self._names.get(tid, "native")
            groups[name] = groups.get(name, 0.0) + last - self._first.get(tid, last)
        late = sorted(self._late)

        def q(p: float) -> float:
            return 1e3 * late[min(len(late) - 1, int(p * len(late)))] if late else 0.0

        return {
            "wall_s": round(self.wall_s, 3),
            "cpu_s": {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v > 0.005},
            "gil_wake_ms": {
                "mean": round(1e3 * sum(late) / max(1, len(late)), 3),
                "p50": round(q(0.5), 3),
                "p90": round(q(0.9), 3),
                "p99": round(q(0.99), 3),
                "max": round(q(1.0), 3),
                "n": len(late),
            },
        }
