"""Stage the trainer runs (on a CPU machine): a tiny random-weight verifier, its capture records written through the
package, and those records converted by ``vllm-hs-compat convert`` into speculators' and SpecForge's own on-disk
contracts.  ``run_trainers_h200.sh`` then trains each trainer's drafter on them with the trainer's own command.

The verifier and its ground-truth records are tests/trainer/trainer_truth.py's (4 layers, hidden 64, vocab 512, a
random final-norm weight so that a wrong norm state shows in the logits).  Records go through ``FileSink`` (the
server's native file sink) and then through the ``convert`` command exactly as a user runs it; its JSON summary (layer
ids, norm state, the train command it prints) is kept beside the data, with what was written (records, tokens, loss
tokens), so the run can check that the trainer loaded exactly this data.

    PYTHONPATH=. python benchmarks/gpu_trainers/prepare.py --out .gpurun/data [--sequences 256]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "trainer"))

import torch  # noqa: E402
from trainer_truth import make_verifier, truths  # noqa: E402

from vllm_hs_compat.connector.sinks import FileSink  # noqa: E402


def convert(native: Path, out: Path, fmt: str, model: str, *extra: str) -> dict:
    """``vllm-hs-compat convert NATIVE --to FMT --out OUT --verifier MODEL --loss-mask generated --json [EXTRA]``."""
    cmd = [
        sys.executable,
        "-c",
        "import sys; from vllm_hs_compat.cli import main; sys.exit(main())",
        "convert",
        str(native),
        "--to",
        fmt,
        "--out",
        str(out),
    ]
    cmd += ["--verifier", model, "--loss-mask", "generated", "--json", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"convert --to {fmt} failed ({done.returncode}): {done.stderr}")
    summary: dict = json.loads(done.stdout)
    summary["argv"] = ["vllm-hs-compat", *cmd[3:]]
    return summary


def draft_config(out: Path, model: str) -> Path:
    """SpecForge's EAGLE-3 draft config for the tiny verifier, as SpecForge derives one from a target
    (training/model_loading.py: the target's architecture fields, one llama layer, untied) but with
    ``draft_vocab_size`` = the verifier's 512: the derived default, 32000, exceeds this vocabulary.  It also names
    the aux layer ids in SpecForge's numbering, which ``convert --drafter-config`` checks against the records."""
    target = json.loads((Path(model) / "config.json").read_text())
    keep = (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "hidden_act",
        "initializer_range",
        "attention_bias",
        "attention_dropout",
        "head_dim",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    cfg = {k: target[k] for k in keep if target.get(k) is not None}
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        use_cache=True,
        rope_theta=float(target.get("rope_parameters", {}).get("rope_theta", 10000.0)),
        draft_vocab_size=target["vocab_size"],
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    )
    path = out / "specforge_draft.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the records' dtype")
    args = ap.parse_args()
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    model = make_verifier(out / "verifier")
    # bf16, as a bf16 server captures them (SpecForge's target head runs in model.torch_dtype, bf16 by default,
    # and refuses fp32 hidden states: "expected mat1 and mat2 to have the same dtype")
    records = truths(model, args.sequences, dtype=getattr(torch, args.dtype))
    native = out / "native"
    sink = FileSink(str(native))
    for t in records:
        sink.write(t.record)
    sink.close()

    written = {
        "records": len(records),
        "tokens": sum(len(t.tokens) for t in records),
        # the "generated" mask: rows at or after the prompt
        "loss_tokens": sum(len(t.tokens) - t.record.meta.num_prompt_tokens for t in records),
        "lengths": [len(t.tokens) for t in records],
        "vllm_layer_ids": list(records[0].record.meta.layer_ids),
    }
    summaries = {
        "speculators": convert(native, out / "speculators", "speculators", model),
        "specforge-eagle3": convert(
            native, out / "specforge", "specforge-eagle3", model, "--drafter-config", str(draft_config(out, model))
        ),
    }
    shutil.rmtree(native)  # only the trainer formats travel
    (out / "written.json").write_text(json.dumps({"written": written, "convert": summaries}, indent=1))
    for fmt, s in summaries.items():
        print(f"{fmt}: {s['records']} records, layer ids {s['layer_ids_line']}; check: {s['check']['verdict']}")
        print(f"  train with: {s['command']}")
        if "drafter_config" in s:
            print(f"  drafter config: {s['drafter_config']}")
    print(f"written: {written['records']} records, {written['tokens']} tokens, {written['loss_tokens']} loss tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
