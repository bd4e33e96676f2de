"""``vllm-hs-compat capture`` against plain ``LLM.generate`` of the same rows (a benchmark, not a test).

One invocation runs both variants, each in a fresh process, interleaved over the repeats so machine load hits them
alike, on the same engine settings: both engines are built by the capture command's own ``build_llm`` (chunked
prefill, prefix caching, its batch and context sizes; on CPU eager with block size 32 and the KV cache space
``prepare_env`` sets), the plain one less the speculative method and the connector.  The settings each child used
are compared and printed; the run stops if they differ.

* ``generate`` -- ``vllm.LLM`` without speculative method or connector, ``generate`` of every row's token ids (the
  ids the capture command sends: the same row reader and chat template), one output token each;
* ``capture``  -- the capture command itself (``vllm-hs-compat capture`` on the same file): ``extract_hidden_states``,
  the connector, the file sink, the sharded store and its index, ``--storage`` as given.

Throughput counts the rows' prompt tokens over the time from a ready engine to the end of the work: for
``generate`` the ``generate`` call (the rows were templated before), for ``capture`` the command's own ``capture_s``
(templating of all rows after the first batch, the file sink, verification and adoption of every record included;
the index's last part and the summary are written after), with where it went (the summary's ``engine_s``,
``adopt_s``, ``overlap_s``, ``adopt_wait_s``).  The engine's start-up is printed apart: it is paid once
per process, not per row.  Prints tokens/s and bytes/s (capture: the records on disk) per run, the medians, and
capture / generate (target >= 0.9x).  A child that fails is reported with its exit code or the signal that killed
it, and the end of its output.

    python benchmarks/bench_capture.py                    # the tiny Llama, the shipped conversations x 8
    python benchmarks/bench_capture.py --rows 384 --repeats 3 --storage fp8_e4m3
    python benchmarks/bench_capture.py --hidden 512 --num-layers 8      # a model whose forward costs something
    python benchmarks/bench_capture.py --model DIR --data rows.jsonl [--loss-mask all] [--layers 2,16,29,32]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAYERS = "1,2"


def _rows(path: Path, n: int) -> None:
    """``n`` rows: the package's conversations under new ids, each made unique by a number in its first message (a
    dataset's rows differ: repeated prompts would be served from vLLM's prefix cache by ``generate``, while every
    record still has to be read out and written)."""
    from vllm_hs_compat.capture.data import CONVERSATIONS

    base = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines() if line.strip()]
    with path.open("w") as f:
        for i in range(n):
            row = json.loads(json.dumps(base[i % len(base)]))
            row["id"] = f"{row.get('id', 'row')}-{i}"
            row["messages"][0]["content"] = f"({i}) {row['messages'][0]['content']}"
            f.write(json.dumps(row) + "\n")


def _engine_settings(model: str, layers: list[int], max_model_len: int) -> tuple[Any, dict[str, Any]]:
    """The capture command's engine, less its speculative method and connector: built by the same ``build_llm``
    (whose arguments then are exactly the capture's), handed to a plain ``vllm.LLM``."""
    from vllm_hs_compat.adapters import engine_api
    from vllm_hs_compat.demo.engine import build_llm, prepare_env

    prepare_env()
    used: dict[str, Any] = {}

    def plain(args: Any, kv_transfer_config: Any) -> Any:
        from vllm import LLM

        used.update({k: v for k, v in args.items() if k != "speculative_config"})
        return LLM(**used)

    engine_api.offline_llm = plain  # type: ignore[assignment]  # build_llm imports it at call time
    return build_llm(model, layers, {}, max_model_len=max_model_len), used


def _record_settings() -> dict[str, Any]:
    """Wrap ``offline_llm`` so the capture child reports the arguments its engine got."""
    from vllm_hs_compat.adapters import engine_api

    used: dict[str, Any] = {}
    original = engine_api.offline_llm

    def recorded(args: Any, kv_transfer_config: Any) -> Any:
        used.update({k: v for k, v in args.items() if k != "speculative_config"})
        return original(args, kv_transfer_config)

    engine_api.offline_llm = recorded  # type: ignore[assignment]
    return used


def _generate(model: str, data: str, layers: str, loss_mask: str, out: dict[str, Any]) -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_hs_compat.capture.samples import Sample, read_samples
    from vllm_hs_compat.commands import capture as cmd

    tok = AutoTokenizer.from_pretrained(model)
    context = cmd._model_len(model, None)
    samples = [s for s in read_samples(data, tok, loss_mask=loss_mask, max_len=context - 1) if isinstance(s, Sample)]
    t0 = time.monotonic()
    llm, used = _engine_settings(model, sorted(int(x) for x in layers.split(",")), context)
    t_ready = time.monotonic()
    prompts = [{"prompt_token_ids": list(s.input_ids)} for s in samples]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    t_end = time.monotonic()
    out.update(start_s=t_ready - t0, work_s=t_end - t_ready, tokens=sum(len(s.input_ids) for s in samples), bytes=0)
    out["settings"] = {**used, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}


def timed_capture(
    model: str,
    data: str,
    tree: str,
    storage: str,
    layers: str = LAYERS,
    extra_argv: list[str] | tuple[str, ...] = (),
    warmup: Any = None,
) -> dict[str, Any]:
    """Run ``vllm-hs-compat capture`` in this process (its own arguments and defaults, ``extra_argv`` added); the
    clock is the command's own: from a ready engine (after ``warmup(llm)``, untimed, if given) to the last record
    adopted (``capture_s``).  Returns the figures and the engine settings the command used."""
    from vllm_hs_compat.commands import capture as cmd

    used = _record_settings()
    warm: dict[str, float] = {"s": 0.0}
    if warmup is not None:
        engine = cmd._engine

        def warmed(*a: Any, **kw: Any) -> Any:  # capture() reads its clock when the engine is handed back
            llm = engine(*a, **kw)
            t = time.monotonic()
            warmup(llm)
            warm["s"] = time.monotonic() - t
            return llm

        cmd._engine = warmed  # type: ignore[assignment]
    parser = argparse.ArgumentParser()
    cmd.register(parser.add_subparsers(dest="command"))  # the command's own arguments and defaults
    argv = ["capture", "--model", model, "--layers", layers, "--data", data, "--out", tree, "--storage", storage]
    summary = cmd.capture(parser.parse_args([*argv, *extra_argv]))
    return dict(
        start_s=float(summary["engine_start_s"]) - warm["s"],
        work_s=float(summary["capture_s"]),
        tokens=int(summary["tokens"]),
        bytes=int(summary["bytes"]),
        captured=int(summary["captured"]),
        failed=summary.get("failed"),
        storage=summary.get("storage"),
        tokens_per_s=float(summary["tokens_per_s"]),
        where={
            k: float(summary.get(k, 0.0))
            for k in ("engine_s", "adopt_s", "adopt_wait_s", "overlap_s", "adopt_tail_s", "adopted_while_running")
        },
        settings={**used, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")},
    )


def _failure(proc: subprocess.CompletedProcess[str]) -> str:
    """How a child ended: its exit code, or the signal that killed it (an OOM kill is SIGKILL)."""
    rc = proc.returncode
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"killed by {name}" + (" (out of memory?)" if -rc == signal.SIGKILL else "")
    return f"exit code {rc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a local model folder (default: the package's tiny Llama, made here)")
    ap.add_argument("--data", help="your own rows (any source capture reads); default: the shipped conversations")
    ap.add_argument("--rows", type=int, default=192, help="rows made from the shipped conversations (no --data)")
    ap.add_argument("--layers", default=LAYERS, help=f"layer ids captured (default {LAYERS})")
    ap.add_argument("--loss-mask", default="assistant", choices=("assistant", "all", "none"))
    ap.add_argument("--hidden", type=int, default=None, help="the made model's hidden size (default: the tiny one's)")
    ap.add_argument("--num-layers", type=int, default=None, help="the made model's layers (default: the tiny one's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--storage", default="captured", choices=("captured", "fp8_e4m3"))
    ap.add_argument("--json", help="write the runs and medians to this file")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:  # a child: one variant in this fresh process
        out: dict[str, Any] = {}
        if a.variant == "generate":
            _generate(a.model, a.data, a.layers, a.loss_mask, out)
        else:
            out.update(timed_capture(a.model, a.data, a.tree, a.storage, a.layers, ["--loss-mask", a.loss_mask]))
        Path(a.result).write_text(json.dumps(out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from vllm_hs_compat.reference.models import make_model

            shape = {k: v for k, v in (("hidden", a.hidden), ("num_layers", a.num_layers)) if v is not None}
            model = make_model(str(Path(tmp) / "tiny"), seed=7, **shape).path
        if a.data:
            data = Path(a.data).resolve()
        else:
            data = Path(tmp) / "rows.jsonl"
            _rows(data, a.rows)
        runs: dict[str, list[dict[str, Any]]] = {"generate": [], "capture": []}
        for r in range(a.repeats):
            for variant in ("generate", "capture") if r % 2 == 0 else ("capture", "generate"):
                result = Path(tmp) / f"{variant}-{r}.json"
                tree = str(Path(tmp) / f"tree-{r}")
                cmd = [sys.executable, __file__, "--variant", variant, "--model", model, "--data", str(data),
                       "--tree", tree, "--result", str(result), "--storage", a.storage, "--layers", a.layers,
                       "--loss-mask", a.loss_mask]  # fmt: skip
                env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode != 0 or not result.exists():
                    sys.exit(f"{variant} run {r} failed ({_failure(proc)}); its output ends:\n{proc.stderr[-3000:]}")
                got = json.loads(result.read_text())
                runs[variant].append(got)
                rate = got["tokens"] / got["work_s"]
                extra = ""
                if variant == "capture":
                    w = got.get("where") or {}
                    extra = (f", {got['bytes'] / got['work_s'] / 1e6:.1f} MB/s on disk; "
                             f"engine {w.get('engine_s', 0):.2f} s, adoption {w.get('adopt_s', 0):.2f} s "
                             f"({w.get('overlap_s', 0):.2f} s beside the engine, "
                             f"the engine waiting {w.get('adopt_wait_s', 0):.2f} s)")  # fmt: skip
                print(f"run {r} {variant:<8}: engine start {got['start_s']:.1f} s, {got['tokens']} tokens in "
                      f"{got['work_s']:.2f} s = {rate:.0f} tokens/s{extra}", flush=True)  # fmt: skip
        settings = {v: [json.dumps(x["settings"], sort_keys=True) for x in rs] for v, rs in runs.items()}
        if len(set(settings["generate"] + settings["capture"])) != 1:
            sys.exit(f"the variants ran on different engine settings: {settings}")
        print(f"engine settings (both variants): {runs['capture'][0]['settings']}")
        med = {v: statistics.median(x["tokens"] / x["work_s"] for x in rs) for v, rs in runs.items()}
        last = runs["capture"][-1]
        print(f"median tokens/s: generate {med['generate']:.0f}, capture {med['capture']:.0f}; "
              f"capture / generate = {med['capture'] / med['generate']:.2f}x (target >= 0.9x)")  # fmt: skip
        print(f"capture: {last['captured']} records, {last['bytes'] / max(1, last['tokens']):.0f} bytes/token on "
              f"disk (storage {a.storage}{', ' + json.dumps(last['storage']) if last.get('storage') else ''}), "
              f"failed {last.get('failed') or {}}")  # fmt: skip
        if a.json:
            Path(a.json).write_text(json.dumps({"runs": runs, "median_tokens_per_s": med}, indent=1))


if __name__ == "__main__":
    main()
