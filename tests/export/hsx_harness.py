"""Test harness of the export suite: the second process, deadlines, backend parameters."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# UCX reads its environment once, when NIXL is first imported: set it before anything imports nixl.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_hs_compat.export import ExportProducer, nixl_available  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_START_TIMEOUT_S = 60.0

NIXL_REASON = "nixl is not importable here (install: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
BACKENDS = [
    pytest.param("shm", id="shm"),
    pytest.param(
        "nixl",
        id="nixl",
        marks=[pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason=NIXL_REASON)],
    ),
]


class Peer:
    """A second Python process (tests/export/hsx_peer.py) driven by JSON lines; every wait has a deadline."""

    def __init__(self, prefix: list[str] | None = None, env: dict[str, str | None] | None = None) -> None:
        """``prefix``: a command the peer runs under (``unshare --pid --fork ...``); ``env``: overrides (None
        removes a variable)."""
        self._log = tempfile.NamedTemporaryFile(prefix="hsx-peer-", suffix=".log", delete=False)
        penv = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        for k, v in (env or {}).items():
            if v is None:
                penv.pop(k, None)
            else:
                penv[k] = v
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-u", os.path.join(HERE, "hsx_peer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=penv,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self.next_line(PEER_START_TIMEOUT_S)
        if "ready" not in ready:
            raise RuntimeError(f"peer did not start: {ready}")
        self.pid: int = ready["ready"]  # in the peer's own pid namespace

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def next_line(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"peer {self.proc.pid} said nothing for {timeout_s}s; log: {self.log()}") from None
        return dict(json.loads(line))

    def send(self, cmd: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd: str, timeout_s: float = 30.0, **kw: Any) -> dict[str, Any]:
        self.send(cmd, **kw)
        return self.answer(timeout_s)

    def answer(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The answer to the command sent last (progress lines are skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ans = self.next_line(max(0.01, deadline - time.monotonic()))
            if "progress" not in ans:
                return ans

    def ok(self, cmd: str, timeout_s: float = 30.0, **kw: Any) -> dict[str, Any]:
        ans = self.call(cmd, timeout_s, **kw)
        if not ans.get("ok"):
            raise AssertionError(f"peer {cmd} failed: {ans.get('error')}: {ans.get('message')}\n{ans.get('tb')}")
        return ans

    def log(self) -> str:
        try:
            with open(self._log.name) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        os.unlink(self._log.name)


@contextlib.contextmanager
def producer_factory(backend: str) -> Iterator[Callable[..., ExportProducer]]:
    """``make(**kw)`` -> an ExportProducer on ``backend`` (16 slots of 1 MiB unless given), closed at exit."""
    made: list[ExportProducer] = []

    def make(**kw: Any) -> ExportProducer:
        kw.setdefault("num_slots", 16)  # 16 MiB: CI containers often have a 64 MiB /dev/shm
        kw.setdefault("slot_bytes", 1 << 20)
        p = ExportProducer(backend=backend, **kw)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.close()


def run_script(script: str, args: list[str], env: dict[str, str | None], timeout_s: float) -> dict[str, Any]:
    """Run ``tests/export/<script>`` with ``args`` in a Python process of its own (``env``: overrides of this
    process's environment, None removes a variable): the last JSON line it printed.  A process that fails or prints
    none (one UCX aborted) is an AssertionError naming its exit status, with the end of its stderr."""
    penv = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for k, v in env.items():
        if v is None:
            penv.pop(k, None)
        else:
            penv[k] = v
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *args], capture_output=True, text=True, env=penv, timeout=timeout_s
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"{script} {args} ended with status {done.returncode}: {done.stderr[-3000:]}")
    return dict(json.loads(lines[-1]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_memory(pid: int) -> tuple[float, int]:
    """``(resident MiB, threads)`` of a process, from ``/proc/<pid>/status``."""
    rss, threads = 0.0, 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads


def ledger_balanced(st: dict[str, Any]) -> None:
    """The export ledger at a quiescent point: every published record ended exactly once, every offered record
    was published or refused by name."""
    ended = ("delivered", "checksum_failed", "abandoned", "expired_ready", "expired_claimed", "discarded_at_close")
    in_flight = st["leases_ready"] + st["leases_claimed"]
    assert st["published"] == sum(st[k] for k in ended) + in_flight, {k: st[k] for k in (*ended, "published")}
    assert st["unaccounted"] == 0
    refused = ("dropped_full", "too_large", "duplicate", "aborted", "bad_records")
    queued = st.get("queued", 0)  # handed to publish_nowait, not yet taken by the writer
    assert st["offered"] == st["published"] + st["leases_writing"] + queued + sum(st[k] for k in refused), st
    assert st["released"] == st["delivered"] + st["checksum_failed"] + st["abandoned"]


def wait_until(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)
