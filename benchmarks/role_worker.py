"""A benchmark's second process: the benchmark script itself run with ``--role ROLE``, driven by one JSON command a
line on stdin, one JSON answer a line on stdout (its stderr goes to a log file).  Shared by bench_pump.py and
bench_vs_mooncake.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any


class Worker:
    """``script --role ROLE`` under ``python`` in ``cwd`` (``cwd`` also leads ``PYTHONPATH``); ``env`` is applied on
    top of this process's environment less its ``UCX_*`` variables."""

    def __init__(self, role: str, script: str, python: str, cwd: Path, env: dict[str, str], log: Path) -> None:
        full = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        full.update(env)
        full["PYTHONPATH"] = str(cwd) + os.pathsep + full.get("PYTHONPATH", "")
        self.role = role
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [python, script, "--role", role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=full,
            cwd=cwd,
        )

    def __call__(self, op: str, **kw: Any) -> dict[str, Any]:
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError(f"{self.role} has no pipes")
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.role} died (log: {self.log.name})")
        ans = dict(json.loads(line))
        if "error" in ans:
            raise RuntimeError(f"{self.role} {op}: {ans['error']} (log: {self.log.name})")
        return ans

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(20)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()
