"""``vllm-hs-compat demo``: the whole path on this machine, in a few minutes (docs/demo.md).

Default (a dataset to a trained drafter):

1. writes a tiny random-weight Llama (no model hub) whose tokenizer carries the package's chat template (with
   ``{% generation %}`` markers);
2. captures the package's conversation set (:data:`vllm_hs_compat.capture.data.CONVERSATIONS`) through the very
   code of ``vllm-hs-compat capture`` (one in-process vLLM engine with ``extract_hidden_states`` and the connector,
   file sink) into a sharded, indexed tree;
3. a trainer in ANOTHER process reads the tree, verifies every record against transformers (token ids and loss
   mask equal to transformers' own ``apply_chat_template`` of the row, every plane equal to a forward of the same
   weights), measures an untrained drafter's acceptance length, trains a tiny EAGLE-3-style drafter on the records
   with their loss masks, measures it again and saves it (``<out>/drafter``, for ``vllm-hs-compat evaluate``);
4. prints a summary and writes ``summary.json`` and ``loss.png``; exits 1 if any record failed verification.

``--serve``: the live-serving path instead: the engine's connector exports each served prompt's record and the
trainer process streams them over NIXL or shared memory while the engine serves the next batch.

``--corrupt-record N`` negates one row of the N-th record in the engine's process, before the sink checksums it
(file or export alike): the record arrives intact, and only the comparison with transformers can catch it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from vllm_hs_compat.commands import console_to_log
from vllm_hs_compat.errors import HsCompatError, ToolError

#: Capture ids of the demo's 4-layer verifier: EAGLE-3's low / middle / high auxiliary layers and the base
#: plane (layer id num_hidden_layers: the last layer's output before the final norm).
LAYER_IDS = (1, 2, 3, 4)
BATCH = 8
#: Records per shard folder of the demo's capture tree (24 conversations: three shards).
RECORDS_PER_SHARD = 8
#: The trainer's whole run (model load, stream, verification, training) must end within this.
TRAINER_TIMEOUT_S = 900.0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="conversations -> capture tree -> verify -> train a drafter -> acceptance length, on a tiny local model "
        "(a few minutes)",
    )
    p.add_argument(
        "--out", default="vllm-hs-compat-demo", help="output folder (model, tree, drafter, logs, summary, plot)"
    )
    p.add_argument(
        "--records",
        type=int,
        default=24,
        help="conversations captured (default 24: the whole shipped set), or with --serve prompts served",
    )
    p.add_argument("--steps", type=int, default=60, help="drafter training steps (default 60)")
    p.add_argument(
        "--serve",
        action="store_true",
        help="the live-serving path instead of the capture: records streamed from the export to the trainer",
    )
    p.add_argument(
        "--transport", choices=("auto", "nixl", "shm"), default="auto", help="--serve: the export's transport"
    )
    p.add_argument("--k", type=int, default=3, help="acceptance length: tokens drafted per step (default 3)")
    p.add_argument(
        "--eval-tokens", type=int, default=32, help="acceptance length: tokens generated per prompt (default 32)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--corrupt-record",
        type=int,
        default=None,
        metavar="N",
        help="self-test: corrupt record N in the engine's process (before its checksum); the demo must fail",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")
    p.set_defaults(func=run)


# --- output ------------------------------------------------------------------------------------------------
def _prompts(model_dir: str, n: int, seed: int) -> list[list[int]]:
    """``n`` distinct prompts of 24-200 tokens; every third one continues the one before it (a shared prefix,
    so vLLM's prefix cache hits), several are longer than one scheduler step (chunked prefill)."""
    from transformers import AutoTokenizer

    from vllm_hs_compat.reference.models import corpus

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
    for stale_dir in ("tree", "drafter"):  # a fresh capture each run (the same --out would otherwise resume)
        shutil.rmtree(out / stale_dir, ignore_errors=True)
    t_start = time.monotonic()
    try:
        with console_to_log(out / "engine.log", progress_to_console=False) as display:
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


class _Display:
    """The demo's progress bars and the trainer's events they follow."""

    def __init__(self, progress: Any, steps: int, records: int) -> None:
        self.progress = progress
        self.recv = progress.add_task("trainer: records read + verified against transformers", total=records)
        self.before = progress.add_task("trainer: acceptance length, untrained drafter", total=1)
        self.steps = progress.add_task("trainer: drafter training steps", total=steps)
        self.after = progress.add_task("trainer: acceptance length, trained drafter", total=1)
        self.trainer: _Trainer | None = None
        self.done: dict[str, Any] | None = None
        self.times: dict[str, float] = {}

    def pump(self, block_s: float = 0.0) -> None:
        if self.trainer is None:
            return
        deadline = time.monotonic() + block_s
        progress = self.progress
        while True:
            try:
                ev = self.trainer.events.get(timeout=max(0.0, deadline - time.monotonic()) if block_s else 0.0)
            except queue.Empty:
                return
            kind = ev.get("event")
            if kind == "start":
                self.times["trainer_pid"] = ev["pid"]
            elif kind == "record":
                progress.advance(self.recv)
            elif kind == "acceptance":
                task = self.before if ev["phase"] == "before" else self.after
                progress.advance(task)
                progress.update(task, description=progress.tasks[task].description + f" ({ev['mean_length']:.3f})")
            elif kind == "step":
                progress.advance(self.steps)
                progress.update(self.steps, description=f"trainer: drafter training (loss {ev['loss']:.3f})")
            elif kind == "done":
                self.done = ev
            elif kind == "exit":
                return

    def finish(self, out: Path) -> int:
        """Wait for the trainer's result; returns its exit status."""
        trainer = self.trainer
        if trainer is None:
            raise ToolError("the trainer process was never started")
        deadline = time.monotonic() + TRAINER_TIMEOUT_S
        while self.done is None and trainer.proc.poll() is None and time.monotonic() < deadline:
            self.pump(0.5)
        self.pump()
        if self.done is None and trainer.proc.poll() is None:
            trainer.proc.kill()
        rc = trainer.wait(timeout_s=60.0)
        if self.done is None:
            tail = (out / "trainer.log").read_text(errors="replace")[-2000:]
            raise ToolError(f"the trainer process exited ({rc}) without a result; its log ends:\n{tail}")
        return rc


def _run(args: argparse.Namespace, out: Path, display: IO[str]) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from vllm_hs_compat.reference.models import make_model

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
    for flag in ("k", "eval_tokens"):
        if getattr(args, flag) < 1:
            raise ToolError(f"--{flag.replace('_', '-')} must be at least 1, found {getattr(args, flag)}")
    times: dict[str, float] = {}
    with Progress(*columns, console=console, transient=False) as progress:
        t = time.monotonic()
        task = progress.add_task("tiny model (random weights, local)", total=1)
        model = make_model(str(out / "model"), "dense", seed=args.seed)
        progress.advance(task)
        times["model_s"] = time.monotonic() - t
        if args.serve:
            return _run_serve(args, out, model.path, progress, times)
        return _run_capture(args, out, model.path, progress, times)


# --- default: a dataset -> capture tree -> verify -> train -> acceptance --------------------------------------
def _conversations(n: int) -> list[dict[str, Any]]:
    from vllm_hs_compat.capture.data import CONVERSATIONS

    rows = [json.loads(line) for line in CONVERSATIONS.read_text(encoding="utf-8").splitlines() if line.strip()]
    if n > len(rows):
        raise ToolError(f"--records {n}: the shipped conversation set has {len(rows)} rows")
    return rows[:n]


def _templated(model: str, rows: list[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """Each row's ids and assistant mask as transformers itself templates it (independent of the package's
    templating code): what every record must carry."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out: dict[str, dict[str, list[int]]] = {}
    for row in rows:
        got = tok.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        out[str(row["id"])] = {
            "input_ids": [int(x) for x in got["input_ids"]],
            "loss_mask": [int(x) for x in got["assistant_masks"]],
        }
    return out


def _eval_prompts(model: str, n: int) -> list[list[int]]:
    """The acceptance measurement's prompts: the shipped conversations up to their last assistant turn (the same
    prompts ``vllm-hs-compat evaluate`` takes by default)."""
    from transformers import AutoTokenizer

    from vllm_hs_compat.commands.evaluate import prompts_of

    prompts, failed = prompts_of(None, AutoTokenizer.from_pretrained(model), limit=n)
    if failed or not prompts:
        raise ToolError(f"{failed} shipped conversation(s) gave no prompt to measure the acceptance length on")
    return prompts


def _capture_args(model: str, tree: Path, n: int) -> argparse.Namespace:
    """``vllm-hs-compat capture`` arguments, parsed by the capture command's own parser."""
    from vllm_hs_compat.capture.data import CONVERSATIONS
    from vllm_hs_compat.commands import capture as capture_cmd

    parser = argparse.ArgumentParser(prog="vllm-hs-compat")
    capture_cmd.register(parser.add_subparsers(dest="command", required=True))
    words = [
        "capture",
        "--model",
        model,
        "--layers",
        ",".join(str(k) for k in LAYER_IDS),
        "--data",
        str(CONVERSATIONS),
        "--out",
        str(tree),
        "--limit",
        str(n),
        "--batch-size",
        str(BATCH),
        "--records-per-shard",
        str(RECORDS_PER_SHARD),
        "--max-model-len",
        "2048",
        "--log",  # vLLM's output with the demo's own (engine.log), off the screen
        str(tree.parent / "engine.log"),
    ]
    return parser.parse_args(words)


def _run_capture(
    args: argparse.Namespace, out: Path, model: str, progress: Any, times: dict[str, float]
) -> dict[str, Any]:
    from vllm_hs_compat.commands import capture as capture_cmd

    n = args.records
    rows = _conversations(n)
    expected = _templated(model, rows)
    tree = out / "tree"
    t = time.monotonic()
    task = progress.add_task(f"capture {n} conversations -> {tree.name}/ (vLLM engine + connector)", total=n)
    cap_args = _capture_args(model, tree, n)
    cap_args.self_test = _self_test(args)
    summary = capture_cmd.capture(cap_args)
    progress.update(task, completed=int(summary.get("captured", 0)))
    times["capture_s"] = time.monotonic() - t
    view = _Display(progress, args.steps, n)
    t = time.monotonic()
    view.trainer = _launch_trainer(
        args, out, model, tree=str(tree), expected=expected, eval_prompts=_eval_prompts(model, 8)
    )
    rc = view.finish(out)
    times["trainer_s"] = time.monotonic() - t
    times.update(view.times)
    done = view.done
    if done is None:  # finish() raised already
        raise ToolError("the trainer gave no result")
    from vllm_hs_compat.capture.index import read_index

    index = read_index(tree).to_pylist()
    shards = sorted({str(r["record"]).split("/")[0] for r in index if r["status"] == "ok" and r["record"]})
    capture_info = {
        "tree": str(tree),
        "rows_read": summary.get("rows_read"),
        "captured": summary.get("captured"),
        "failed": summary.get("failed") or {},
        "shards": shards,
        "index_rows": len(index),
        "tokens": summary.get("tokens"),
        "loss_tokens": summary.get("loss_tokens"),
        "tokens_per_s": summary.get("tokens_per_s"),
    }
    return _summarise(done, [], len(expected), args, times, out, trainer_rc=rc, capture=capture_info)


# --- --serve: live serving, records streamed from the export ---------------------------------------------------
def _run_serve(
    args: argparse.Namespace, out: Path, model: str, progress: Any, times: dict[str, float]
) -> dict[str, Any]:
    n = args.records
    prompts = _prompts(model, n, args.seed)
    t = time.monotonic()
    task = progress.add_task("vLLM engine start (extract_hidden_states + connector)", total=1)
    llm = _engine(model, out, args.transport, num_records=n, self_test=_self_test(args))
    progress.advance(task)
    times["engine_start_s"] = time.monotonic() - t
    serve = progress.add_task("serving prompts (vLLM)", total=n)
    view = _Display(progress, args.steps, n)
    tickets: list[dict[str, Any]] = []
    t = time.monotonic()
    eval_prompts = _eval_prompts(model, 8)

    from vllm_hs_compat.connector import flush

    for b in range(0, n, BATCH):
        tickets += _serve(llm, prompts[b : b + BATCH])
        flush(llm, timeout_s=120.0)
        progress.advance(serve, len(prompts[b : b + BATCH]))
        if view.trainer is None:
            view.trainer = _start_trainer(args, out, model, prompts, tickets, eval_prompts)
        view.pump()
    times["serve_s"] = time.monotonic() - t
    if view.trainer is None:
        raise ToolError("no request was served")
    try:
        rc = view.finish(out)
    finally:
        from vllm_hs_compat.demo.engine import shutdown

        shutdown(llm)
    times["trainer_s"] = time.monotonic() - t
    times.update(view.times)
    if view.done is None:
        raise ToolError("the trainer gave no result")
    return _summarise(view.done, tickets, len(prompts), args, times, out, trainer_rc=rc)


def _self_test(args: argparse.Namespace) -> dict[str, int] | None:
    """``--corrupt-record N`` as the connector's explicit fault hook (``"self_test"`` in its config)."""
    return None if args.corrupt_record is None else {"corrupt_record": int(args.corrupt_record)}


def _engine(model: str, out: Path, transport: str, num_records: int, self_test: dict[str, int] | None = None) -> Any:
    from vllm_hs_compat.demo.engine import build_llm

    # One 256 KiB slot holds the largest record (200 tokens x 4 planes x 64 x 2 B = 100 KiB); a slot per record,
    # so a trainer that falls behind never makes the pool drop one.
    export = {"backend": transport, "num_slots": max(64, num_records), "slot_bytes": 256 << 10}
    extra: dict[str, Any] = {
        "capture": "prompt",
        "sink": "export",
        "export": {**export, "token_file": str(out / "export.token")},
    }
    if self_test:
        extra["self_test"] = self_test
    return build_llm(model, LAYER_IDS, extra)


def _serve(llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    from vllm_hs_compat.adapters.engine_api import sampling_params

    params = sampling_params(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [dict(o.kv_transfer_params or {}) for o in outs]


def _launch_trainer(args: argparse.Namespace, out: Path, model: str, **fields: Any) -> _Trainer:
    from vllm_hs_compat.demo.trainer_proc import TrainerArgs

    targs = TrainerArgs(
        endpoint=str(fields.pop("endpoint", "")),
        token_file=str(out / "export.token"),
        model=model,
        prompts=fields.pop("prompts", []),
        steps=args.steps,
        out_dir=str(out),
        backend=args.transport,
        seed=args.seed,
        eval_k=args.k,
        eval_new_tokens=args.eval_tokens,
        **fields,
    )
    targs.save(out / "trainer_args.json")
    return _Trainer(out / "trainer_args.json", out / "trainer.log")


def _start_trainer(
    args: argparse.Namespace,
    out: Path,
    model: str,
    prompts: list[list[int]],
    tickets: list[dict[str, Any]],
    eval_prompts: list[list[int]],
) -> _Trainer:
    entry = next((t["hs_export"] for t in tickets if "hs_export" in t), None)
    if entry is None:
        raise ToolError(f"the first requests carry no export ticket: {tickets[:1]} (see {out / 'engine.log'})")
    return _launch_trainer(args, out, model, endpoint=entry["endpoint"], prompts=prompts, eval_prompts=eval_prompts)


def _summarise(
    done: dict[str, Any],
    tickets: list[dict[str, Any]],
    expected: int,
    args: argparse.Namespace,
    times: dict[str, float],
    out: Path,
    trainer_rc: int,
    capture: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from vllm_hs_compat.demo.plot import loss_png

    records = done["records"]
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    not_queued = [t.get("hs_record", {}) for t in tickets if t.get("hs_record", {}).get("status") != "queued"]
    nbytes = sum(r["nbytes"] for r in records)
    pull_s = sum(r["pull_s"] for r in records)
    losses, accs = done["losses"], done["accuracies"]
    acceptance = done.get("acceptance") or {}
    if losses:
        where = "captured" if capture is not None else "streamed"
        loss_png(out / "loss.png", losses, accs, title=f"EAGLE-3-style drafter on {len(ok)} {where} records")
    problems = []
    if failed:
        problems.append(f"{len(failed)} record(s) failed verification")
    if len(records) != expected:
        problems.append(f"{len(records)} records arrived for {expected} {'rows' if capture else 'prompts'}")
    if not_queued:
        problems.append(f"{len(not_queued)} request(s) were not exported: {not_queued[:2]}")
    if capture is not None and capture["failed"]:
        problems.append(f"the capture failed rows: {capture['failed']}")
    if trainer_rc != 0:
        problems.append(f"the trainer exited with {trainer_rc}")
    if not losses and args.steps > 0:
        problems.append("no training step ran")
    return {
        "ok": not problems,
        "problems": problems,
        "mode": "capture" if capture is not None else "serve",
        "capture": capture,
        "records": len(records),
        "records_ok": len(ok),
        "records_failed": failed,
        "expected": expected,
        "tokens": sum(r["tokens"] for r in records),
        "loss_tokens": sum(r.get("loss_tokens", 0) for r in records),
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
        "acceptance": acceptance,
        "drafter": done.get("drafter"),
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

    from vllm_hs_compat.reference.forward import ROW_TOL

    console = Console(width=None if sys.stdout.isatty() else 110)
    capture = s.get("capture")
    per = Table(title="records (each checked against transformers, same weights)")
    first = ("sample", "tokens", "loss tok") if capture else ("record", "tokens", "bytes")
    for col in ("#", *first, *(f"rel err L{k}" for k in s["layer_ids"]), "result"):
        per.add_column(col, justify="left" if col in ("record", "sample", "result") else "right")
    for i, r in enumerate(s["per_record"]):
        errs = r["max_rel"] or [None] * len(s["layer_ids"])
        cells = [f"{e:.4f}" if e is not None else "-" for e in errs]
        result = "[green]ok[/green]" if r["ok"] else f"[red]FAIL[/red] {r['reason']}"
        lead = (
            [r["sample_id"], str(r["tokens"]), str(r["loss_tokens"])]
            if capture
            else [r["record_id"][-16:], str(r["tokens"]), f"{r['nbytes']:,}"]
        )
        per.add_row(str(i), *lead, *cells, result)
    console.print(per)
    t = Table(title="vllm-hs-compat demo", show_header=False)
    t.add_column("what")
    t.add_column("value")
    verdict = "[green]all verified[/green]" if s["ok"] else "[red]FAILED[/red]: " + "; ".join(s["problems"])
    if capture:
        failed = capture["failed"]
        t.add_row(
            "capture",
            f"{capture['captured']} of {capture['rows_read']} conversations captured"
            + (f", failed {failed}" if failed else "")
            + f" ({capture['tokens_per_s'] or 0:.0f} tokens/s) into {len(capture['shards'])} shards "
            f"({', '.join(capture['shards'])}) + index ({capture['index_rows']} rows) in {capture['tree']}",
        )
    t.add_row(
        "records", f"{s['records']} of {s['expected']} ({s['records_ok']} verified, {len(s['records_failed'])} failed)"
    )
    t.add_row("tokens", f"{s['tokens']:,}" + (f" ({s['loss_tokens']:,} in assistant loss masks)" if capture else ""))
    t.add_row("bytes", f"{s['bytes']:,} (layers {s['layer_ids']}, bf16)")
    if capture:
        t.add_row("read by", f"trainer pid {s['trainer_pid']} (engine pid {s['engine_pid']}), {s['transport']}")
    else:
        thr = f"{s['throughput_mb_s']:.1f} MB/s" if s["throughput_mb_s"] else "-"
        rate = s["pull_median_mb_s"]
        t.add_row(
            "transport",
            f"{s['transport']}, trainer pid {s['trainer_pid']} / engine pid {s['engine_pid']}: median "
            f"{1e3 * s['pull_median_s']:.1f} ms and {rate:.0f} MB/s per record (claim + read + release, one record "
            f"per round trip: small records are latency-bound); {s['pull_s']:.2f} s of pulls in all ({thr} incl. "
            "the waits for the engine)",
        )
    if s["max_rel_err"] is not None:
        what = "token ids and loss masks = transformers' chat template; " if capture else ""
        t.add_row("verification", f"{what}max relative error {s['max_rel_err']:.4f} (tolerance {ROW_TOL})")
    if s["losses"]:
        a0, a1 = s["accuracies"][0], s["accuracies"][-1]
        t.add_row(
            "drafter",
            f"{len(s['losses'])} steps on {s['trained_on']} records: loss {s['losses'][0]:.3f} -> "
            f"{s['losses'][-1]:.3f}, top-1 agreement {a0:.2f} -> {a1:.2f}; saved in {s['drafter']}",
        )
    acc = s.get("acceptance") or {}
    if "before" in acc and "after" in acc:
        b, a = acc["before"], acc["after"]
        t.add_row(
            "acceptance",
            f"mean acceptance length {b['mean_length']:.3f} -> {a['mean_length']:.3f} (k={a['k']}: 1 = no draft "
            f"accepted, {a['k'] + 1} = all; {a['prompts']} prompts x {args_tokens(a)} tokens, greedy verification "
            f"over the transformers forward); first draft accepted {b['per_position'][0]:.2f} -> "
            f"{a['per_position'][0]:.2f}",
        )
    if s["losses"]:
        t.add_row("plot", str(s["plot"]))
    tm = s["times"]
    if capture:
        phases = f"capture (engine start + capture) {tm.get('capture_s', 0):.1f} s, verify+train+acceptance "
        phases += f"{tm.get('trainer_s', 0):.1f} s"
    else:
        phases = f"engine start {tm.get('engine_start_s', 0):.1f} s, serve {tm.get('serve_s', 0):.1f} s, "
        phases += f"serve+stream+train {tm.get('trainer_s', 0):.1f} s"
    t.add_row("time", f"model {tm.get('model_s', 0):.1f} s, {phases}, total {s['wall_s']:.1f} s")
    t.add_row("result", verdict)
    console.print(t)
    console.print(f"logs and summary.json in {out}")


def args_tokens(a: dict[str, Any]) -> int:
    """Tokens generated per prompt in an acceptance result."""
    return int(round(a["generated"] / a["prompts"])) if a.get("prompts") else 0
