"""The ``vllm-hs-compat`` subcommands, one module each.

A command module exposes ``register(subparsers) -> None``, which adds its parser and sets ``func`` (called with
the parsed arguments, returns the exit code).  :mod:`vllm_hs_compat.cli` only dispatches.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


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
    """A progress line on stderr (never stdout: it may carry ``--json``)."""
    print(f"vllm-hs-compat: {message}", file=sys.stderr, flush=True)
