"""``vllm-hs-compat doctor``: the installed vLLM, the adapter chosen, every probe (expected and observed), the
export transports (NIXL/UCX, shared memory) and CUDA (pinned memory).

Exit codes (also in ``--help``):

* 0: the installed vLLM is supported and every probe agrees with the adapter chosen for it -- also for a release
  newer than the tested range, which then runs with a warning (printed);
* 1: the release is unsupported, or a probe contradicts the adapter (a fork, a nightly, a wrong
  ``VLLM_HS_COMPAT_ADAPTER``, a newer release that changed what the package relies on);
* 2: vLLM is not installed (a trainer host: the transport and CUDA sections are still reported).  argparse also
  exits 2 on a usage error.

The NIXL and CUDA sections are informational: they never change the exit code (the export falls back to the
``/dev/shm`` ring without NIXL; pinned memory matters only on a CUDA host).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from vllm_hs_compat import __version__
from vllm_hs_compat.commands import progress, stdout_to_stderr
from vllm_hs_compat.errors import HsCompatError, VllmNotInstalledError

EXIT_OK = 0
EXIT_UNSUPPORTED = 1
EXIT_NO_VLLM = 2

EPILOG = """exit codes:
  0  supported vLLM, every probe agrees with the adapter (a release newer than the tested range: with a warning)
  1  unsupported vLLM release, or a probe contradicts the adapter (fork, nightly, wrong VLLM_HS_COMPAT_ADAPTER,
     a newer release that changed what the package relies on)
  2  vLLM is not installed (transport and CUDA sections are still reported; a usage error also exits 2)
The NIXL/UCX and CUDA sections never change the exit code. Progress goes to stderr; --json prints only the
report on stdout."""


def register(sub: Any) -> None:
    """Add ``doctor`` to the ``vllm-hs-compat`` subparsers."""
    p = sub.add_parser(
        "doctor",
        help="report the installed vLLM, the adapter, every probe, NIXL/UCX and CUDA",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout (nothing else there)")
    p.add_argument("--no-nixl-agent", action="store_true", help="do not start a NIXL agent (only check the install)")
    p.set_defaults(func=lambda args: doctor(as_json=args.json, nixl_agent=not args.no_nixl_agent))


def doctor(as_json: bool = False, nixl_agent: bool = True) -> int:
    """Run the doctor; print the report (text, or JSON with ``as_json``); return the exit code."""
    with stdout_to_stderr(True):  # vLLM and NIXL log to stdout: the report alone goes there
        report, lines, code = _doctor(nixl_agent)
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print("\n".join(lines))
    return code


def _select_cpu_platform_if_needed() -> None:
    """The doctor only reads vLLM's modules: without an accelerator it selects vLLM's CPU platform."""
    from vllm_hs_compat.adapters.base import ensure_platform

    try:
        ensure_platform()
    except Exception as exc:  # the probes below report what this breaks
        print(f"note: could not select a vLLM platform ({type(exc).__name__}: {exc})", file=sys.stderr)


def probe_line(name: str, ok: bool, expected: object, observed: object) -> str:
    """``ok    name  expected X, observed Y`` (``FAIL`` when they differ): a probe reading ``False`` is not a
    failure, a disagreement is."""
    return f"  {'ok  ' if ok else 'FAIL'}  {name}  expected {expected!r}, observed {observed!r}"


def _vllm_section(report: dict[str, Any], lines: list[str]) -> int:
    from vllm_hs_compat.adapters import (
        ADAPTERS,
        OVERRIDE_ENV,
        SUPPORTED_VLLM,
        TESTED_RELEASES,
        choose_adapter,
        installed_vllm_distribution,
        installed_vllm_version,
        openai_server_command,
        untested_warning,
    )

    report["supported_vllm"] = str(SUPPORTED_VLLM)
    lines.append(f"supported vLLM: {SUPPORTED_VLLM} (tested: {', '.join(TESTED_RELEASES)})")
    try:
        raw = installed_vllm_version()
    except VllmNotInstalledError as exc:
        report.update(vllm=None, ok=False, error=str(exc))
        lines += [
            "vLLM: not installed",
            f"  {exc}",
            "adapters: " + ", ".join(f"{a.name} {a.versions}" for a in ADAPTERS),
        ]
        return EXIT_NO_VLLM
    report["vllm"] = raw
    dist = installed_vllm_distribution()
    server = openai_server_command("python", "MODEL")
    report["vllm_distribution"] = dist
    report["openai_server"] = server
    lines.append(f"vLLM: {raw} (distribution {dist}; OpenAI server: {' '.join(server)} ..., which serve starts)")
    override = os.environ.get(OVERRIDE_ENV) or None
    try:
        adapter = choose_adapter(raw, override)
    except HsCompatError as exc:
        report.update(ok=False, error=str(exc))
        lines.append(f"adapter: none -- {exc}")
        return EXIT_UNSUPPORTED
    progress(f"importing vLLM {raw} and running the probes of adapter {adapter.name} (takes a few seconds) ...")
    _select_cpu_platform_if_needed()
    lines.append(f"adapter: {adapter.describe()}" + (f" [{OVERRIDE_ENV}={override}]" if override else ""))
    results = adapter.run_probes()
    bad = [r for r in results if not r.ok]
    lines.append(f"probes ({len(results)}; each observed value must equal the adapter's expected one):")
    for r in results:
        lines.append(probe_line(r.name, r.ok, r.expected, r.observed))
        lines.append(f"        {r.question}")
    facts = {
        "view_order": adapter.view_order.label,
        "capture_spec_types": sorted(adapter.capture_spec_types),
        "hma_with_connector": adapter.hma_with_connector,
        "default_runner": adapter.default_runner,
        "model_runners": ", ".join(adapter.model_runners) + ("" if adapter.v1_runner else " (Model Runner V1 deleted)"),
        "padding_slots_write": adapter.padding_slots_write,
        "required_kvcache_layout": adapter.required_kvcache_layout,
        "connector_module_path_wins": adapter.connector_module_path_wins,
        "requires_kv_delivery": adapter.requires_kv_delivery,
        # tokens Model Runner V1's extract_hidden_states proposer counts for a step that emitted two (vLLM's own
        # method, run here): 1 -> under async scheduling generated records past a repeat fail (`async_drafts`)
        "v1_draft_feedback": adapter.v1_draft_feedback_observed(),
    }
    lines.append("facts:")
    lines += [f"  {k}: {v}" for k, v in facts.items()]
    report.update(
        adapter=adapter.name,
        override=override,
        untested=adapter.untested,
        probes=[
            {"name": r.name, "ok": r.ok, "expected": r.expected, "observed": r.observed, "question": r.question}
            for r in results
        ],
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
        if adapter.untested and not override:
            names = ", ".join(r.name for r in bad)
            fix = f"this release changed what the package relies on ({names}): refused; install a tested release"
        report["error"] = f"{len(bad)} probe(s) contradict adapter {adapter.name}"
        lines.append(f"vLLM RESULT: {len(bad)} probe(s) contradict adapter {adapter.name}: {fix}")
        return EXIT_UNSUPPORTED
    if adapter.untested:
        warning = untested_warning(adapter, raw, len(results))
        report["warning"] = warning
        lines.append(f"WARNING: {warning}")
    lines.append(f"vLLM RESULT: ok -- adapter {adapter.name} confirmed by {len(results)} probes")
    return EXIT_OK


def _transport_section(report: dict[str, Any], lines: list[str], nixl_agent: bool) -> None:
    from vllm_hs_compat.export.nixl_backend import describe_nixl
    from vllm_hs_compat.export.shm import DEFAULT_SHM_DIR

    progress("checking NIXL/UCX" + (" (starting one agent)" if nixl_agent else "") + " ...")
    nixl = describe_nixl(create_agent=nixl_agent)
    report["nixl"] = nixl
    lines.append("export transports:")
    if not nixl["importable"]:
        lines.append(f"  nixl: not installed -- {nixl['error']} (the /dev/shm ring serves one host)")
    else:
        pkgs = ", ".join(f"{k} {v}" for k, v in nixl["packages"].items()) or "?"
        lines.append(f"  nixl: importable as {nixl['module']} ({pkgs})")
        if nixl_agent:
            if nixl["ucx_agent"]:
                lines.append(f"  nixl agent with UCX: ok (backends {nixl.get('backends')})")
            else:
                lines.append(f"  nixl agent with UCX: FAILED -- {nixl['error']}")
            lines.append(f"  nixl plugins: {', '.join(nixl['plugins']) or 'none found'}")
        ucx_env = nixl["ucx_env"]
        lines.append("  UCX environment: " + (", ".join(f"{k}={v}" for k, v in ucx_env.items()) or "UCX defaults"))
    shm: dict[str, Any] = {"dir": DEFAULT_SHM_DIR, "writable": os.access(DEFAULT_SHM_DIR, os.W_OK)}
    try:
        shm["free_bytes"] = shutil.disk_usage(DEFAULT_SHM_DIR).free
    except OSError as exc:
        shm["error"] = str(exc)
    report["shm"] = shm
    free = f", {shm['free_bytes'] / (1 << 20):.0f} MiB free" if "free_bytes" in shm else f" ({shm.get('error')})"
    lines.append(f"  shm ring: {DEFAULT_SHM_DIR} {'writable' if shm['writable'] else 'NOT writable'}{free}")


def _cuda_section(report: dict[str, Any], lines: list[str]) -> None:
    import torch

    cuda: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "available": bool(torch.cuda.is_available()),
        "devices": [],
        "pinned_memory": None,
    }
    if cuda["available"]:
        cuda["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            buf = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
            cuda["pinned_memory"] = bool(buf.is_pinned())
        except RuntimeError as exc:
            cuda["pinned_memory"] = False
            cuda["pinned_error"] = str(exc)
    report["cuda"] = cuda
    lines.append(f"torch: {cuda['torch']} (CUDA build: {cuda['torch_cuda'] or 'none'})")
    if not cuda["available"]:
        lines.append("  CUDA: not available (CPU-only: records are copied from host memory; pinned memory n/a)")
        return
    lines.append(f"  CUDA: {len(cuda['devices'])} device(s): {', '.join(cuda['devices'])}")
    if cuda["pinned_memory"]:
        lines.append("  pinned host memory: ok (1 MiB pinned and checked)")
    else:
        lines.append(f"  pinned host memory: FAILED -- {cuda.get('pinned_error', 'the buffer is not pinned')}")


def _doctor(nixl_agent: bool = True) -> tuple[dict[str, Any], list[str], int]:
    report: dict[str, Any] = {"vllm_hs_compat": __version__}
    lines = [f"vllm-hs-compat {__version__}"]
    code = _vllm_section(report, lines)
    _transport_section(report, lines, nixl_agent)
    _cuda_section(report, lines)
    report["exit_code"] = code
    meaning = {
        EXIT_OK: "ok",
        EXIT_UNSUPPORTED: "unsupported or contradictory vLLM install",
        EXIT_NO_VLLM: "vLLM not installed",
    }
    lines.append(f"RESULT: exit {code} ({meaning[code]})")
    return report, lines, code
