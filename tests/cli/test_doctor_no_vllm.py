"""``vllm-hs-compat doctor`` on a host without vLLM (a trainer host): exit 2, transports and CUDA reported,
``--json`` alone on stdout."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from vllm_hs_compat.export import nixl_available

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here (tests/vllm covers this case)"
)


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_hs_compat.cli", "doctor", *args], capture_output=True, text=True, timeout=120
    )


def test_doctor_without_vllm_exits_2_and_reports_the_transports() -> None:
    proc = doctor("--json")
    assert proc.returncode == 2, proc.stderr
    rep = json.loads(proc.stdout)  # nothing but the report on stdout (NIXL logs to fd 1: sent to stderr)
    assert rep["vllm"] is None and rep["exit_code"] == 2 and "not installed" in rep["error"]
    assert rep["nixl"]["importable"] is nixl_available()
    if nixl_available():
        assert rep["nixl"]["ucx_agent"] is True and "UCX" in rep["nixl"]["plugins"], rep["nixl"]
        assert rep["nixl"]["ucx_env"].get("UCX_NET_DEVICES") == "lo"  # the suite's environment, reported
    assert rep["shm"]["writable"] is True
    assert rep["cuda"]["available"] is False and rep["cuda"]["pinned_memory"] is None  # CPU-only torch here
    assert "checking NIXL/UCX" in proc.stderr

    text = doctor()
    assert text.returncode == 2
    assert "vLLM: not installed" in text.stdout and "RESULT: exit 2 (vLLM not installed)" in text.stdout
    assert ("nixl agent with UCX: ok" in text.stdout) is nixl_available()
    assert "pinned memory n/a" in text.stdout
    assert "NIXL INFO" not in text.stdout  # library log lines go to stderr in text mode too


def test_doctor_help_documents_the_exit_codes() -> None:
    proc = doctor("--help")
    assert proc.returncode == 0
    for line in ("0  supported vLLM", "1  unsupported vLLM release", "2  vLLM is not installed"):
        assert line in proc.stdout
