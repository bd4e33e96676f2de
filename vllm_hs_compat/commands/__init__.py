"""The ``vllm-hs-compat`` subcommands, one module each.

A command module exposes ``register(subparsers) -> None``, which adds its parser and sets ``func`` (called with
the parsed arguments, returns the exit code).  :mod:`vllm_hs_compat.cli` only dispatches.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

#: Where :func:`progress` writes while :func:`console_to_log` holds the process's stdout/stderr (None: stderr).
_CONSOLE: IO[str] | None = None


@contextlib.contextmanager
def stdout_to_stderr(active: bool) -> Iterator[None]:
    """Send everything written to file descriptor 1 (vLLM and NIXL log to stdout) to stderr while active, so
    ``--json`` prints nothing but the report on stdout."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.__stdout__):
            if stream is not None:
                stream.flush()
        os.dup2(saved, 1)
        os.close(saved)


def progress(message: str) -> None:
    """A progress line on stderr (never stdout: it may carry ``--json``); the console's stderr while
    :func:`console_to_log` sends everything else to a log."""
    print(f"vllm-hs-compat: {message}", file=_CONSOLE or sys.stderr, flush=True)


@contextlib.contextmanager
def console_to_log(
    log_path: str | os.PathLike[str], header: str = "", *, progress_to_console: bool = True
) -> Iterator[IO[str]]:
    """Send file descriptors 1 and 2 (vLLM's logs, C++ and library warnings) to ``log_path`` (appended; a header
    line per use) while active; :func:`progress` keeps writing to the console's stderr (``progress_to_console``
    False: to the log too, e.g. under the demo's own display).  Yields a stream on the console's stdout (the demo's
    display).  Nests: an inner use sends the output to its own log, progress where the outer one sends it."""
    global _CONSOLE
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    display = os.fdopen(os.dup(1), "w", buffering=1)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    previous = _CONSOLE
    with open(path, "a") as log:
        if header:
            log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {header}\n")
            log.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        _CONSOLE = previous or (console if progress_to_console else None)
        try:
            yield display
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            _CONSOLE = previous
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            display.close()
            console.close()
