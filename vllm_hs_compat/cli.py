"""Command line: ``vllm-hs-compat doctor | inspect | demo | verify | serve-args | serve | convert | capture |
evaluate`` (see ``--help`` of each).

A thin dispatcher: each command lives in its own module under :mod:`vllm_hs_compat.commands` and registers its
parser there.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: Command modules, in ``--help`` order; each has ``register(subparsers)``.
COMMANDS = ("doctor", "inspect", "demo", "verify", "serve_args", "serve", "convert", "capture", "evaluate")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns its exit code."""
    parser = argparse.ArgumentParser(prog="vllm-hs-compat", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"vllm_hs_compat.commands.{name}").register(sub)
    words = list(sys.argv[1:] if argv is None else argv)
    tail: list[str] | None = None
    if "--" in words:  # `serve ... -- VLLM FLAGS`: everything after the first -- belongs to vLLM, unparsed
        i = words.index("--")
        words, tail = words[:i], words[i + 1 :]
    args = parser.parse_args(words)
    args.argv = words[1:]  # the command's own words, for a command that hands them on (capture --ray to its ranks)
    if tail is not None:
        if not hasattr(args, "vllm_args"):
            parser.error(f"arguments after -- are passed to vLLM by `serve` only; {args.command} takes none")
        args.vllm_args = tail
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
