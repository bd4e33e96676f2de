"""``vllm-hs-compat demo``: the whole path on this machine, in a few minutes (docs/demo.md).

1. writes a tiny random-weight Llama (no model hub);
2. starts a real vLLM engine in this process with ``extract_hidden_states`` and the capture connector (sink
   ``export``);
3. serves prompts; every finished request's hidden states become a record in the export's pool;
4. a trainer in ANOTHER process streams the records over the default transport (NIXL if installed, else shared
   memory), verifies each against a transformers forward of the same weights, and trains a tiny EAGLE-3-style
   drafter head on them;
5. prints a summary (records, tokens, bytes, transport and throughput, verification per record, loss first ->
   last), writes ``summary.json`` and ``loss.png``; exits 1 if any record failed verification.

``--corrupt-record N`` flips the sign of one row of the N-th record in the serving process, before the export
checksums it: the transport delivers it intact, and only the comparison with transformers can catch it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from vllm_hs_compat.errors import HsCompatError, ToolError

#: Capture ids of the demo's 4-layer verifier: EAGLE-3's low / middle / high auxiliary layers and the base
#: plane (layer id num_hidden_layers: the last layer's output before the final norm).
LAYER_IDS = (1, 2, 3, 4)
BATCH = 8
#: The trainer's whole run (model load, stream, verification, training) must end within this.
TRAINER_TIMEOUT_S = 900.0


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="capture -> stream -> verify -> train, on a tiny local model (a few minutes)")
    p.add_argument("--out", default="vllm-hs-compat-demo", help="output folder (model, logs, summary, plot)")
    p.add_argument("--records", type=int, default=24, help="prompts served, one record each (default 24)")
    p.add_argument("--steps", type=int, default=60, help="drafter training steps (default 60)")
    p.add_argument("--transport", choices=("auto", "nixl", "shm"), default="auto", help="export transport")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--corrupt-record",
        type=int,
        default=None,
        metavar="N",
        help="self-test: corrupt record N in the serving process (before its checksum); the demo must fail",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")
    p.set_defaults(func=run)


# --- output ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_fds(log_path: Path) -> Iterator[IO[str]]:
    """Send file descriptors 1 and 2 (vLLM's logs, C++ warnings) to ``log_path``; yields a stream on the
    original stdout for the demo's own display."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    display = os.fdopen(os.dup(1), "w", buffering=1)
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield display
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            display.flush()
            display.close()


def _prompts(model_dir: str, n: int, seed: int) -> list[list[int]]:
    """``n`` distinct prompts of 24-200 tokens; every third one continues the one before it (a shared prefix,
    so vLLM's prefix cache hits), several are longer than one scheduler step (chunked prefill)."""
    from transformers import AutoTokenizer

    from vllm_hs_compat.demo.models import corpus

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    text = corpus(seed + 1, lines=4 * n + 50)
    stream: list[int] = []
    for line in text:
        stream += tok(line + "\n")["input_ids"]
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    pos = 0
    while len(out) < n:
        length = rng.randint(24, 200)
        if out and len(out) % 3 == 2:
            p = out[-1][: rng.randint(16, len(out[-1]) - 1)] + stream[pos : pos + length // 2]
            pos += length // 2
        else:
            p = stream[pos : pos + length]
            pos += length
        if pos >= len(stream):
            pos = rng.randint(0, len(stream) // 2)
            continue
        if tuple(p) not in seen:
            seen.add(tuple(p))
            out.append(p)
    return out


def _install_fault(index: int) -> None:
    """Corrupt the ``index``-th record this process publishes: one row of its first plane negated, BEFORE the
    producer copies and checksums it (so the checksum is of the corrupted rows)."""
    from vllm_hs_compat.export import ExportProducer

    original = ExportProducer.publish
    count = {"n": 0}

    def publish(self: ExportProducer, meta: Any, rows: Any, publication: str | None = None) -> Any:
        n = count["n"]
        count["n"] += 1
        if n == index:
            rows = rows.clone()
            rows[rows.shape[0] // 2, 0].neg_()
        return original(self, meta, rows, publication)

    ExportProducer.publish = publish  # type: ignore[method-assign,assignment]


# --- the run ---------------------------------------------------------------------------------------------------
class _Trainer:
    """The trainer process and a thread reading its JSON-lines events."""

    def __init__(self, args_path: Path, log_path: Path) -> None:
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_hs_compat.demo.trainer_proc", str(args_path)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        stdout = self.proc.stdout
        if stdout is None:
            return
        for line in stdout:
            line = line.strip()
            if line.startswith("{"):
                try:
                    self.events.put(json.loads(line))
                except json.JSONDecodeError:
                    continue
        self.events.put({"event": "exit"})

    def wait(self, timeout_s: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._thread.join(timeout=5)
        self._log.close()
        return rc


def run(args: argparse.Namespace) -> int:
    from vllm_hs_compat.demo.engine import prepare_env

    prepare_env()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "loss.png", "engine.log", "trainer.log"):
        (out / stale).unlink(missing_ok=True)
    t_start = time.monotonic()
    try:
        with _quiet_fds(out / "engine.log") as display:
            summary = _run(args, out, display)
    except HsCompatError as exc:
        print(f"demo failed: {exc}\n(logs: {out / 'engine.log'}, {out / 'trainer.log'})", file=sys.stderr)
        return 2
    summary["wall_s"] = time.monotonic() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_summary(summary, out)
    return 0 if summary["ok"] else 1


def _run(args: argparse.Namespace, out: Path, display: IO[str]) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from vllm_hs_compat.demo.models import make_model

    console = Console(file=display, width=None if display.isatty() else 110)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    n = args.records
    if n < 2:
        raise ToolError(f"--records must be at least 2, found {n}")
    times: dict[str, float] = {}
    with Progress(*columns, console=console, transient=False) as progress:
        t = time.monotonic()
        task = progress.add_task("tiny model (random weights, local)", total=2)
        model = make_model(str(out / "model"), "dense", seed=args.seed)
        progress.advance(task)
        prompts = _prompts(model.path, n, args.seed)
        progress.advance(task)
        times["model_s"] = time.monotonic() - t

        if args.corrupt_record is not None:
            _install_fault(args.corrupt_record)
        t = time.monotonic()
        task = progress.add_task("vLLM engine start (extract_hidden_states + connector)", total=1)
        llm = _engine(model.path, out, args.transport, num_records=n)
        progress.advance(task)
        times["engine_start_s"] = time.monotonic() - t

        serve = progress.add_task("serving prompts (vLLM)", total=n)
        recv = progress.add_task("trainer: records streamed + verified", total=n)
        steps = progress.add_task("trainer: drafter training steps", total=args.steps)
        trainer: _Trainer | None = None
        done: dict[str, Any] | None = None
        tickets: list[dict[str, Any]] = []
        t = time.monotonic()

        def pump(block_s: float = 0.0) -> None:
            nonlocal done
            if trainer is None:
                return
            deadline = time.monotonic() + block_s
            while True:
                try:
                    ev = trainer.events.get(timeout=max(0.0, deadline - time.monotonic()) if block_s else 0.0)
                except queue.Empty:
                    return
                kind = ev.get("event")
                if kind == "start":
                    times["trainer_pid"] = ev["pid"]
                elif kind == "record":
                    progress.advance(recv)
                elif kind == "step":
                    progress.advance(steps)
                    progress.update(steps, description=f"trainer: drafter training (loss {ev['loss']:.3f})")
                elif kind == "done":
                    done = ev
                elif kind == "exit":
                    return

        from vllm_hs_compat.connector import flush

        for b in range(0, n, BATCH):
            tickets += _serve(llm, prompts[b : b + BATCH])
            flush(llm, timeout_s=120.0)
            progress.advance(serve, len(prompts[b : b + BATCH]))
            if trainer is None:
                trainer = _start_trainer(args, out, model.path, prompts, tickets)
            pump()
        times["serve_s"] = time.monotonic() - t
        if trainer is None:
            raise ToolError("no request was served")
        deadline = time.monotonic() + TRAINER_TIMEOUT_S
        while done is None and trainer.proc.poll() is None and time.monotonic() < deadline:
            pump(0.5)
        pump()
        if done is None and trainer.proc.poll() is None:
            trainer.proc.kill()
        rc = trainer.wait(timeout_s=60.0)
        times["trainer_s"] = time.monotonic() - t
        from vllm_hs_compat.demo.engine import shutdown

        shutdown(llm)
    if done is None:
        tail = (out / "trainer.log").read_text(errors="replace")[-2000:]
        raise ToolError(f"the trainer process exited ({rc}) without a result; its log ends:\n{tail}")
    return _summarise(done, tickets, prompts, args, times, out, trainer_rc=rc)


def _engine(model: str, out: Path, transport: str, num_records: int) -> Any:
    from vllm_hs_compat.demo.engine import build_llm

    # One 256 KiB slot holds the largest record (200 tokens x 4 planes x 64 x 2 B = 100 KiB); a slot per record,
    # so a trainer that falls behind never makes the pool drop one.
    export = {"backend": transport, "num_slots": max(64, num_records), "slot_bytes": 256 << 10}
    extra = {"capture": "prompt", "sink": "export", "export": {**export, "token_file": str(out / "export.token")}}
    return build_llm(model, LAYER_IDS, extra)


def _serve(llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    from vllm_hs_compat.adapters.engine_api import sampling_params

    params = sampling_params(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [dict(o.kv_transfer_params or {}) for o in outs]


def _start_trainer(
    args: argparse.Namespace, out: Path, model: str, prompts: list[list[int]], tickets: list[dict[str, Any]]
) -> _Trainer:
    from vllm_hs_compat.demo.trainer_proc import TrainerArgs

    entry = next((t["hs_export"] for t in tickets if "hs_export" in t), None)
    if entry is None:
        raise ToolError(f"the first requests carry no export ticket: {tickets[:1]} (see {out / 'engine.log'})")
    targs = TrainerArgs(
        endpoint=entry["endpoint"],
        token_file=str(out / "export.token"),
        model=model,
        prompts=prompts,
        steps=args.steps,
        out_dir=str(out),
        backend=args.transport,
        seed=args.seed,
    )
    targs.save(out / "trainer_args.json")
    return _Trainer(out / "trainer_args.json", out / "trainer.log")


def _summarise(
    done: dict[str, Any],
    tickets: list[dict[str, Any]],
    prompts: list[list[int]],
    args: argparse.Namespace,
    times: dict[str, float],
    out: Path,
    trainer_rc: int,
) -> dict[str, Any]:
    from vllm_hs_compat.demo.plot import loss_png

    records = done["records"]
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    not_queued = [t.get("hs_record", {}) for t in tickets if t.get("hs_record", {}).get("status") != "queued"]
    nbytes = sum(r["nbytes"] for r in records)
    pull_s = sum(r["pull_s"] for r in records)
    losses, accs = done["losses"], done["accuracies"]
    if losses:
        loss_png(out / "loss.png", losses, accs, title=f"EAGLE-3-style drafter on {len(ok)} streamed records")
    problems = []
    if failed:
        problems.append(f"{len(failed)} record(s) failed verification")
    if len(records) != len(prompts):
        problems.append(f"{len(records)} records arrived for {len(prompts)} prompts")
    if not_queued:
        problems.append(f"{len(not_queued)} request(s) were not exported: {not_queued[:2]}")
    if trainer_rc != 0:
        problems.append(f"the trainer exited with {trainer_rc}")
    if not losses and args.steps > 0:
        problems.append("no training step ran")
    return {
        "ok": not problems,
        "problems": problems,
        "records": len(records),
        "records_ok": len(ok),
        "records_failed": failed,
        "expected": len(prompts),
        "tokens": sum(r["tokens"] for r in records),
        "bytes": nbytes,
        "layer_ids": list(LAYER_IDS),
        "transport": done["transport"],
        "pull_s": pull_s,
        "pull_median_s": statistics.median(r["pull_s"] for r in records) if records else 0.0,
        "pull_median_mb_s": statistics.median(r["nbytes"] / r["pull_s"] / 1e6 for r in records if r["pull_s"] > 0)
        if any(r["pull_s"] > 0 for r in records)
        else 0.0,
        "throughput_mb_s": (nbytes / pull_s / 1e6) if pull_s > 0 else None,
        "max_rel_err": max((max(r["max_rel"]) for r in ok), default=None),
        "per_record": records,
        "losses": losses,
        "accuracies": accs,
        "trained_on": done["trained_on"],
        "ledger": done["ledger"],
        "times": {k: v for k, v in times.items() if k.endswith("_s")},
        "engine_pid": os.getpid(),
        "trainer_pid": times.get("trainer_pid"),
        "plot": str(out / "loss.png") if losses else None,
        "out": str(out),
    }


def _print_summary(s: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from vllm_hs_compat.demo.reference import ROW_TOL

    console = Console(width=None if sys.stdout.isatty() else 110)
    per = Table(title="records (each checked against transformers, same weights)")
    for col in ("#", "record", "tokens", "bytes", *(f"rel err L{k}" for k in s["layer_ids"]), "result"):
        per.add_column(col, justify="right" if col not in ("record", "result") else "left")
    for i, r in enumerate(s["per_record"]):
        errs = r["max_rel"] or [None] * len(s["layer_ids"])
        cells = [f"{e:.4f}" if e is not None else "-" for e in errs]
        result = "[green]ok[/green]" if r["ok"] else f"[red]FAIL[/red] {r['reason']}"
        per.add_row(str(i), r["record_id"][-16:], str(r["tokens"]), f"{r['nbytes']:,}", *cells, result)
    console.print(per)
    t = Table(title="vllm-hs-compat demo", show_header=False)
    t.add_column("what")
    t.add_column("value")
    verdict = "[green]all verified[/green]" if s["ok"] else "[red]FAILED[/red]: " + "; ".join(s["problems"])
    t.add_row(
        "records", f"{s['records']} of {s['expected']} ({s['records_ok']} verified, {len(s['records_failed'])} failed)"
    )
    t.add_row("tokens", f"{s['tokens']:,}")
    t.add_row("bytes", f"{s['bytes']:,} (layers {s['layer_ids']}, bf16)")
    thr = f"{s['throughput_mb_s']:.1f} MB/s" if s["throughput_mb_s"] else "-"
    rate = s["pull_median_mb_s"]
    t.add_row(
        "transport",
        f"{s['transport']}, trainer pid {s['trainer_pid']} / engine pid {s['engine_pid']}: median "
        f"{1e3 * s['pull_median_s']:.1f} ms and {rate:.0f} MB/s per record (claim + read + release, one record per "
        f"round trip: small records are latency-bound); {s['pull_s']:.2f} s of pulls in all ({thr} incl. the "
        "waits for the engine)",
    )
    if s["max_rel_err"] is not None:
        t.add_row("verification", f"max relative error {s['max_rel_err']:.4f} (tolerance {ROW_TOL})")
    if s["losses"]:
        a0, a1 = s["accuracies"][0], s["accuracies"][-1]
        t.add_row(
            "drafter",
            f"{len(s['losses'])} steps on {s['trained_on']} records: loss {s['losses'][0]:.3f} -> "
            f"{s['losses'][-1]:.3f}, top-1 agreement {a0:.2f} -> {a1:.2f}",
        )
        t.add_row("plot", str(s["plot"]))
    tm = s["times"]
    t.add_row(
        "time",
        f"model {tm.get('model_s', 0):.1f} s, engine start {tm.get('engine_start_s', 0):.1f} s, "
        f"serve {tm.get('serve_s', 0):.1f} s, serve+stream+train {tm.get('trainer_s', 0):.1f} s, "
        f"total {s['wall_s']:.1f} s",
    )
    t.add_row("result", verdict)
    console.print(t)
    console.print(f"logs and summary.json in {out}")
