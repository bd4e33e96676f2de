"""``vllm-hs-compat capture`` against plain ``LLM.generate`` of the same rows (a benchmark, not a test).

One invocation runs both variants, each in a fresh process, interleaved over the repeats so machine load hits them
alike, on the same engine settings (the capture command's: chunked prefill, prefix caching, its batch and context
sizes; on CPU eager with block size 32):

* ``generate`` -- ``vllm.LLM`` without speculative method or connector, ``generate`` of every row's token ids (the
  ids the capture command sends: the same row reader and chat template), one output token each;
* ``capture``  -- the capture command itself (``vllm-hs-compat capture`` on the same file): ``extract_hidden_states``,
  the connector, the file sink, the sharded store and its index, ``--storage`` as given.

Throughput counts the rows' prompt tokens over the time from a ready engine to the end of the work: for
``generate`` the ``generate`` call (the rows were templated before), for ``capture`` until the command shuts its
engine down (templating of all rows after the first batch, the file sink, verification and adoption of every
record included; the index's last part and the summary are written after).  The engine's start-up is printed apart:
it is paid once per process, not per row.  Prints tokens/s and bytes/s (capture: the
records on disk) per run, the medians, and capture / generate (target >= 0.9x).

    python benchmarks/bench_capture.py                    # the tiny Llama, the shipped conversations x 8
    python benchmarks/bench_capture.py --rows 384 --repeats 3 --storage fp8_e4m3
    python benchmarks/bench_capture.py --hidden 512 --num-layers 8      # a model whose forward costs something
"""

from __future__ import annotations

import argparse
import json
import os
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


def _generate(model: str, data: str, out: dict[str, Any]) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_hs_compat.capture.samples import Sample, read_samples
    from vllm_hs_compat.commands import capture as cmd
    from vllm_hs_compat.demo.engine import has_gpu

    tok = AutoTokenizer.from_pretrained(model)
    samples = [s for s in read_samples(data, tok, max_len=cmd._model_len(model, None) - 1) if isinstance(s, Sample)]
    args: dict[str, Any] = dict(
        model=model, tokenizer=model, dtype="bfloat16", seed=0, max_model_len=cmd._model_len(model, None)
    )
    args.update(max_num_seqs=32, enable_chunked_prefill=True, enable_prefix_caching=True, max_num_batched_tokens=128)
    args.update({} if has_gpu() else dict(enforce_eager=True, block_size=32))
    t0 = time.monotonic()
    llm = LLM(**args)
    t_ready = time.monotonic()
    prompts = [{"prompt_token_ids": list(s.input_ids)} for s in samples]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    t_end = time.monotonic()
    out.update(start_s=t_ready - t0, work_s=t_end - t_ready, tokens=sum(len(s.input_ids) for s in samples), bytes=0)


def timed_capture(
    model: str,
    data: str,
    tree: str,
    storage: str,
    layers: str = LAYERS,
    extra_argv: list[str] | tuple[str, ...] = (),
    warmup: Any = None,
) -> dict[str, Any]:
    """Run ``vllm-hs-compat capture`` in this process; the clock runs from a ready engine (after ``warmup(llm)``,
    untimed, if given) until the command shuts its engine down."""
    from vllm_hs_compat.commands import capture as cmd

    marks: dict[str, float] = {}
    engine = cmd._engine

    def timed_engine(*a: Any, **kw: Any) -> Any:  # the benchmark's clock: when the engine is ready
        llm = engine(*a, **kw)
        marks["started"] = time.monotonic()
        if warmup is not None:
            warmup(llm)
        marks["ready"] = time.monotonic()
        return llm

    from vllm_hs_compat.demo import engine as demo_engine

    shutdown = demo_engine.shutdown

    def timed_shutdown(llm: Any) -> None:  # the work ends when the command shuts its engine down
        marks["done"] = time.monotonic()
        shutdown(llm)

    cmd._engine = timed_engine  # type: ignore[assignment]
    demo_engine.shutdown = timed_shutdown  # type: ignore[assignment]
    parser = argparse.ArgumentParser()
    cmd.register(parser.add_subparsers(dest="command"))  # the command's own arguments and defaults
    argv = ["capture", "--model", model, "--layers", layers, "--data", data, "--out", tree, "--storage", storage]
    args = parser.parse_args([*argv, *extra_argv])
    t0 = time.monotonic()
    summary = cmd.capture(args)
    return dict(
        start_s=marks["started"] - t0,
        work_s=marks["done"] - marks["ready"],
        tokens=int(summary["tokens"]),
        bytes=int(summary["bytes"]),
        captured=int(summary["captured"]),
        failed=summary.get("failed"),
        storage=summary.get("storage"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a local model folder (default: the package's tiny Llama, made here)")
    ap.add_argument("--rows", type=int, default=192)
    ap.add_argument("--hidden", type=int, default=None, help="the made model's hidden size (default: the tiny one's)")
    ap.add_argument("--num-layers", type=int, default=None, help="the made model's layers (default: the tiny one's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--storage", default="captured", choices=("captured", "fp8_e4m3"))
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:  # a child: one variant in this fresh process
        out: dict[str, Any] = {}
        if a.variant == "generate":
            _generate(a.model, a.data, out)
        else:
            out.update(timed_capture(a.model, a.data, a.tree, a.storage))
        Path(a.result).write_text(json.dumps(out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from vllm_hs_compat.reference.models import make_model

            shape = {k: v for k, v in (("hidden", a.hidden), ("num_layers", a.num_layers)) if v is not None}
            model = make_model(str(Path(tmp) / "tiny"), seed=7, **shape).path
        data = Path(tmp) / "rows.jsonl"
        _rows(data, a.rows)
        runs: dict[str, list[dict[str, Any]]] = {"generate": [], "capture": []}
        for r in range(a.repeats):
            for variant in ("generate", "capture") if r % 2 == 0 else ("capture", "generate"):
                result = Path(tmp) / f"{variant}-{r}.json"
                tree = str(Path(tmp) / f"tree-{r}")
                cmd = [sys.executable, __file__, "--variant", variant, "--model", model, "--data", str(data),
                       "--tree", tree, "--result", str(result), "--storage", a.storage]  # fmt: skip
                env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"{variant} run {r} failed:\n{proc.stderr[-3000:]}")
                got = json.loads(result.read_text())
                runs[variant].append(got)
                rate = got["tokens"] / got["work_s"]
                extra = f", {got['bytes'] / got['work_s'] / 1e6:.1f} MB/s on disk" if variant == "capture" else ""
                print(f"run {r} {variant:<8}: engine start {got['start_s']:.1f} s, {got['tokens']} tokens in "
                      f"{got['work_s']:.2f} s = {rate:.0f} tokens/s{extra}", flush=True)  # fmt: skip
        med = {v: statistics.median(x["tokens"] / x["work_s"] for x in rs) for v, rs in runs.items()}
        last = runs["capture"][-1]
        print(f"median tokens/s: generate {med['generate']:.0f}, capture {med['capture']:.0f}; "
              f"capture / generate = {med['capture'] / med['generate']:.2f}x (target >= 0.9x)")  # fmt: skip
        print(f"capture: {last['captured']} records, {last['bytes'] / max(1, last['tokens']):.0f} bytes/token on "
              f"disk (storage {a.storage}{', ' + json.dumps(last['storage']) if last.get('storage') else ''}), "
              f"failed {last.get('failed') or {}}")  # fmt: skip


if __name__ == "__main__":
    main()
