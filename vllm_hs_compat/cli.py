"""Command line: ``vllm-hs-compat doctor | demo | verify | serve-args``.  Each command lives in its own module
under :mod:`vllm_hs_compat.commands`; this module only dispatches."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence

from vllm_hs_compat import __version__
from vllm_hs_compat.errors import HsCompatError, VllmNotInstalledError


def _select_cpu_platform_if_needed() -> None:
    """The doctor only reads vLLM's modules: without an accelerator it selects vLLM's CPU platform."""
    from vllm_hs_compat.adapters.base import ensure_platform

    try:
        ensure_platform()
    except Exception as exc:  # the probes below report what this breaks
        print(f"note: could not select a vLLM platform ({type(exc).__name__}: {exc})", file=sys.stderr)


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """Send everything written to file descriptor 1 (vLLM logs to stdout) to stderr, so ``--json`` prints
    nothing but the report on stdout."""
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


def doctor(as_json: bool = False) -> int:
    with _stdout_to_stderr(as_json):
        report, lines, code = _doctor()
    _emit(report, lines, as_json)
    return code


def _doctor() -> tuple[dict[str, object], list[str], int]:
    from vllm_hs_compat.adapters import (
        ADAPTERS,
        OVERRIDE_ENV,
        SUPPORTED_VLLM,
        TESTED_RELEASES,
        choose_adapter,
        installed_vllm_version,
    )

    report: dict[str, object] = {"vllm_hs_compat": __version__, "supported_vllm": str(SUPPORTED_VLLM)}
    lines = [
        f"vllm-hs-compat {__version__}",
        f"supported vLLM: {SUPPORTED_VLLM} (tested: {', '.join(TESTED_RELEASES)})",
    ]
    try:
        raw = installed_vllm_version()
    except VllmNotInstalledError as exc:
        report.update(vllm=None, ok=False, error=str(exc))
        lines += [
            "vLLM: not installed",
            f"  {exc}",
            "adapters: " + ", ".join(f"{a.name} {a.versions}" for a in ADAPTERS),
        ]
        return report, lines, 2
    report["vllm"] = raw
    lines.append(f"vLLM: {raw}")
    override = os.environ.get(OVERRIDE_ENV) or None
    try:
        adapter = choose_adapter(raw, override)
    except HsCompatError as exc:
        report.update(ok=False, error=str(exc))
        lines += [f"adapter: none -- {exc}"]
        return report, lines, 1
    _select_cpu_platform_if_needed()
    lines.append(f"adapter: {adapter.describe()}" + (f" [{OVERRIDE_ENV}={override}]" if override else ""))
    results = adapter.run_probes()
    bad = [r for r in results if not r.ok]
    lines.append("probes:")
    for r in results:
        mark = "ok  " if r.ok else "FAIL"
        lines.append(f"  [{mark}] {r.name}: {r.observed!r}" + ("" if r.ok else f" (expected {r.expected!r})"))
        lines.append(f"         {r.question}")
    facts = {
        "view_order": adapter.view_order.value,
        "capture_spec_types": sorted(adapter.capture_spec_types),
        "hma_with_connector": adapter.hma_with_connector,
        "default_runner": adapter.default_runner,
        "padding_slots_write": adapter.padding_slots_write,
        "required_kvcache_layout": adapter.required_kvcache_layout,
        "connector_module_path_wins": adapter.connector_module_path_wins,
        "requires_kv_delivery": adapter.requires_kv_delivery,
    }
    lines.append("facts:")
    lines += [f"  {k}: {v}" for k, v in facts.items()]
    report.update(
        adapter=adapter.name,
        override=override,
        probes=[{"name": r.name, "ok": r.ok, "expected": r.expected, "observed": r.observed} for r in results],
        facts=facts,
        ok=not bad,
    )
    if bad:
        choices = "|".join(a.name for a in ADAPTERS)
        fix = (
            f"unset {OVERRIDE_ENV} or choose another adapter"
            if override
            else f"reinstall a released vLLM, or for a fork/nightly set {OVERRIDE_ENV}=<{choices}>"
        )
        lines.append(f"RESULT: {len(bad)} probe(s) contradict adapter {adapter.name}: {fix}")
    else:
        lines.append(f"RESULT: ok -- adapter {adapter.name} confirmed by {len(results)} probes")
    return report, lines, 1 if bad else 0


def _emit(report: dict[str, object], lines: list[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hs-compat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_doc = sub.add_parser("doctor", help="report the installed vLLM, the adapter chosen and every probe")
    p_doc.add_argument("--json", action="store_true", help="machine-readable output")
    from vllm_hs_compat.commands import demo, serve_args, verify

    for command in (demo, verify, serve_args):
        command.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(as_json=args.json)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
