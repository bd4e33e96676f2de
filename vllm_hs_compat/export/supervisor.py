"""The producer's side of the gate: it starts the gate process, reads its reports and restarts it when it dies.

The gate (:mod:`vllm_hs_compat.export.gate`, a child process run as ``python -P gate.py``) holds the control
plane's public socket so that no peer can grow or abort the producer's process.  :class:`GateSupervisor` is the one
owner of that child: it starts it bound to a port (the configuration, secret key included, on its stdin), takes its
counters from the JSON lines it writes (events at once, requests every 50 ms), notices its end (EOF on its stdout)
and restarts it on the same port with the same keys -- at once, or after 0.05 s doubling to 1 s while gates keep
dying within ``GATE_STABLE_S`` of starting.  The serving thread (:class:`~vllm_hs_compat.export.server.ControlServer`)
calls it: it polls the gate's stdout with its own descriptors and asks :meth:`GateSupervisor.due` each turn.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from vllm_hs_compat import errors as E
from vllm_hs_compat.export.credentials import TOKEN_ENV
from vllm_hs_compat.export.gate import COUNTERS as GATE_COUNTERS

log = logging.getLogger("vllm_hs_compat.export.control")

#: The gate script (run as a file: ``-m`` would import the package, and the package imports torch).
GATE_SCRIPT: Final = str(Path(__file__).with_name("gate.py"))
#: Smallest address-space limit the gate starts under (measured ~120 MiB of mappings at start; see docs).
GATE_MIN_MEMORY: Final = 96 << 20
#: How long a gate may take to start and bind (a busy host starts Python slowly).
GATE_START_S: Final = 30.0
#: A gate that dies sooner than this after starting is restarted after a growing delay (0.05 s doubling to 1 s),
#: so a gate that cannot run does not spin; one that served a while is restarted at once.
GATE_STABLE_S: Final = 0.25
#: The supervisor's own counters (the gate's come from its reports).
OWN_COUNTERS: Final = ("gate_restarts", "gate_exits_signal", "gate_exits_code", "gate_start_failures")


class GateSupervisor:
    """The running gate (``proc``; None between a death and its restart) and how to make the next one.

    ``cfg``: the gate's configuration but its port (see :mod:`~vllm_hs_compat.export.gate`); ``watch`` /
    ``unwatch``: register the gate's stdout with the serving thread's poller, and forget it."""

    def __init__(self, cfg: dict[str, Any], watch: Callable[[int, int], None], unwatch: Callable[[int], None]) -> None:
        self._cfg = cfg
        self._watch = watch
        self._unwatch = unwatch
        self.proc: subprocess.Popen[bytes] | None = None
        #: the port the gates bind (the first gate's choice when asked for 0)
        self.port = 0
        #: why the last gate ended ("" while none has): ``exit N`` or ``signal SIGNAME``
        self.last_exit = ""
        #: when a dead gate is to be restarted (``time.monotonic()``)
        self.retry_at = 0.0
        self.counters: dict[str, int] = dict.fromkeys(OWN_COUNTERS, 0)
        self._now: dict[str, int] = {}  # the running gate's last report
        self._done: dict[str, int] = {}  # the sum of the final reports of gates that have ended
        self._out = b""
        self._started = 0.0
        self._fast_deaths = 0
        self._generation = 0

    @property
    def pid(self) -> int:
        """The running gate's pid (0 while none runs)."""
        proc = self.proc
        return proc.pid if proc is not None else 0

    def fd(self) -> int | None:
        """The running gate's stdout (its reports; EOF when it ends), or None."""
        proc = self.proc
        return proc.stdout.fileno() if proc is not None and proc.stdout is not None else None

    def due(self, now: float) -> bool:
        """Whether no gate runs and its restart is due."""
        return self.proc is None and now >= self.retry_at

    def reported(self) -> dict[str, int]:
        """Every gate's counters (zero for those none reported yet), summed over every gate run so far, and the
        supervisor's own."""
        out = dict(self.counters)
        for k in (*GATE_COUNTERS, "forwarded"):
            out.setdefault(k, 0)
        for part in (self._done, self._now):
            for k, v in part.items():
                out[k] = out.get(k, 0) + v
        return out

    def start(self, port: int) -> None:
        """Start a gate bound to ``port`` (0: any) and wait for it to report the port it bound."""
        self._generation += 1
        cfg = {**self._cfg, "port": port, "generation": self._generation}
        # one malloc arena: a predictable address space; the gate needs no credential but its key (sent below)
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        env["MALLOC_ARENA_MAX"] = "1"
        proc = subprocess.Popen(
            # -P: the script's directory (this package's modules) is not put on sys.path; PYTHONPATH is kept, so
            # the gate imports the same pyzmq as this process
            [sys.executable, "-P", GATE_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        if proc.stdin is None or proc.stdout is None:  # pragma: no cover - both are pipes
            raise E.GateError("the control gate was started without its pipes")
        out_fd = proc.stdout.fileno()
        os.set_blocking(out_fd, False)
        self.proc = proc
        self._out = b""
        self._started = time.monotonic()
        self._now = {}
        try:
            proc.stdin.write(json.dumps(cfg).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # it died at once: reported below
        deadline = time.monotonic() + GATE_START_S
        line = b""
        waiter = select.poll()  # not select.select: a serving process may hold descriptors past FD_SETSIZE
        waiter.register(out_fd, select.POLLIN)
        while b"\n" not in line:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop(kill=True)
                raise E.GateError(f"the control gate did not start within {GATE_START_S:.0f}s (host overloaded?)")
            if not waiter.poll(int(min(left, 1.0) * 1000) + 1):
                continue
            try:
                chunk = os.read(out_fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                rc = proc.wait()
                self.proc = None
                raise E.GateError(f"the control gate exited at start ({_exit_reason(rc)}); its stderr says why")
            line += chunk
        first, _, rest = line.partition(b"\n")
        self._out = rest
        info = json.loads(first)
        if "error" in info:
            self.stop(kill=True)
            host = self._cfg["host"]
            raise E.ExportConfigError(
                f"control plane cannot bind {host}:{port}: {info['error']}; pass port=0 for an ephemeral port, or "
                "another bind address"
            )
        self.port = int(info["port"])
        self._watch(out_fd, select.POLLIN)

    def stop(self, kill: bool = False) -> int | None:
        """End the running gate (EOF on its stdin; SIGKILL after 2 s or with ``kill``); its exit status."""
        proc = self.proc
        if proc is None:
            return None
        self.proc = None
        if proc.stdout is not None:
            try:
                self._unwatch(proc.stdout.fileno())
            except (KeyError, ValueError):
                pass
        if kill:
            proc.kill()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            rc = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if proc.stdout is not None:
            try:
                self._read_lines(proc.stdout.read() or b"")  # its final report
            except OSError:
                pass
            proc.stdout.close()
        done = dict(self._done)  # a new dict, assigned whole: stats() may be iterating the old one
        for k, v in self._now.items():
            done[k] = done.get(k, 0) + v
        self._done, self._now = done, {}
        return rc

    def _read_lines(self, data: bytes) -> None:
        buf = self._out + data
        *lines, self._out = buf.split(b"\n")
        for line in lines:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            counters = msg.get("c") if isinstance(msg, dict) else None
            if isinstance(counters, dict):
                self._now = {str(k): int(v) for k, v in counters.items() if isinstance(v, int)}

    def readable(self) -> None:
        """Read the gate's reports; at EOF it has died: count why and schedule its restart."""
        proc = self.proc
        if proc is None or proc.stdout is None:
            return
        try:
            data = os.read(proc.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        if data:
            self._read_lines(data)
            return
        lived = time.monotonic() - self._started
        rc = self.stop()
        reason = _exit_reason(rc if rc is not None else 0)
        self.last_exit = reason
        self.counters["gate_exits_signal" if rc is not None and rc < 0 else "gate_exits_code"] += 1
        self._fast_deaths = self._fast_deaths + 1 if lived < GATE_STABLE_S else 0
        delay = 0.0 if self._fast_deaths == 0 else min(1.0, 0.05 * 2 ** (self._fast_deaths - 1))
        self.retry_at = time.monotonic() + delay
        log.warning(
            "export control gate (pid %d) ended after %.1fs: %s; restarting it on port %d in %.2fs",
            proc.pid,
            lived,
            reason,
            self.port,
            delay,
        )

    def restart(self) -> None:
        try:
            self.start(self.port)
        except (E.GateError, E.ExportConfigError) as e:
            self.counters["gate_start_failures"] += 1
            self._fast_deaths += 1
            delay = min(2.0, 0.05 * 2 ** min(self._fast_deaths, 6))
            self.retry_at = time.monotonic() + delay
            log.error("export control gate could not be restarted (%s); trying again in %.2fs", e, delay)
            return
        self.counters["gate_restarts"] += 1


def _exit_reason(rc: int) -> str:
    """``exit N`` or ``signal SIGNAME`` of a child's return code."""
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"
