"""Real-vLLM tests: run one nox session per vLLM release (they need ``vllm`` installed).

Without vLLM in the environment the whole directory is skipped at collection.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]
else:
    # Releases >= 0.28 detect the CPU platform from this, and some (0.30, 0.31) freeze platform facts such
    # as PIN_MEMORY while vllm.platforms.cpu loads, before force_cpu_platform() can run.  Earlier releases
    # ignore it for detection and need force_cpu_platform() below.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # No __init__.py here on purpose: a package named tests.vllm would shadow the real ``vllm``.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness

    # Before anything else imports vLLM modules that read the platform: releases before 0.28 resolve it
    # at import time and would pick an unusable platform on this GPU-less machine.
    harness.force_cpu_platform()

    def _describe() -> list[str]:
        import sched_harness

        from vllm_hs_compat import api
        from vllm_hs_compat.errors import HsCompatError

        try:
            adapter = api.get_adapter()
        except HsCompatError as exc:  # a release the package refuses: every test errors with this; say it once
            return [f"vllm: {harness.vllm_version()}  adapter REFUSED: {exc}"]
        return [
            f"vllm: {harness.vllm_version()}  adapter: {adapter.name}  view order: {adapter.view_order.name}",
            f"vllm slot mapping: {harness.slot_mapping_path().name}",
            f"model runners driven: {', '.join(sched_harness.runner_modes())}",
        ]

    def pytest_report_header(config: pytest.Config) -> list[str]:
        return _describe()

    def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
        # Printed even with -q, so the matrix log of every nox session names the release it tested.
        for line in _describe():
            terminalreporter.write_line(f"[vllm-hs-compat] {line}")
        # What the random schedules reached (test_connector_schedules), when they ran.
        for line in getattr(sys.modules.get("sched_harness"), "SUMMARY", []):
            terminalreporter.write_line(f"[vllm-hs-compat] {line}")

    @pytest.fixture(scope="session", autouse=True)
    def _record_release(record_testsuite_property: Callable[[str, object], None]) -> None:
        """The release under test, in the junit report of the session (read by the matrix report)."""
        import sched_harness

        from vllm_hs_compat import api

        record_testsuite_property("vllm_version", harness.vllm_version())
        record_testsuite_property("adapter", api.get_adapter().name)
        record_testsuite_property("slot_mapping_path", harness.slot_mapping_path().name)
        record_testsuite_property("model_runners", ", ".join(sched_harness.runner_modes()))

    def pytest_configure(config: pytest.Config) -> None:
        config.addinivalue_line("markers", "vllm: needs a real vLLM install (run through nox sessions)")
