"""Record storage side by side: ``captured`` (bf16 as vLLM wrote it) against ``fp8_e4m3`` (one scale per row), on
hidden states of a real forward (the package's tiny Llama, or ``--model`` any local HF causal LM folder), written and
read back through ``export.files`` -- the path the file sink, ``capture`` and the trainer dataset use.

Prints, per storage: bytes per token (files on disk), write and read MB/s of captured-equivalent bytes, the
relative error per row (max, mean) and what a drafter trainer sees: top-1 agreement of the teacher built from the
stored base plane (the verifier's own final norm and LM head) with the teacher built from the exact rows.

    python benchmarks/bench_storage.py                      # tiny model made in a temporary folder
    python benchmarks/bench_storage.py --model DIR --layers 1,3,5 --sequences 64 --tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.export import files


def _hidden_states(model_dir: str, layers: list[int], sequences: int, tokens: int) -> tuple[list[torch.Tensor], object]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    out = []
    with torch.no_grad():
        for _ in range(sequences):
            ids = torch.randint(3, vocab, (1, tokens), generator=g)
            hs = model(ids, output_hidden_states=True).hidden_states
            # planes in vLLM's numbering: layer id k = the input of decoder layer k = HF hidden_states[k];
            # the base plane (the last decoder layer's output, pre-norm) is HF hidden_states[-1] before the norm
            planes = [hs[k][0] for k in layers] + [_pre_norm_last(model, ids)]
            out.append(torch.stack(planes, dim=1).to(torch.bfloat16))
    return out, model


def _pre_norm_last(model: object, ids: torch.Tensor) -> torch.Tensor:
    captured: dict[str, torch.Tensor] = {}
    norm = model.model.norm  # type: ignore[attr-defined]

    def keep(mod: object, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        captured["x"] = args[0][0]

    handle = norm.register_forward_hook(keep)
    try:
        model(ids)  # type: ignore[operator]
    finally:
        handle.remove()
    return captured["x"]


def _teacher(model: object, base: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.lm_head(model.model.norm(base.to(torch.bfloat16)))  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local HF causal LM folder (default: the package's tiny Llama, made here)")
    ap.add_argument("--layers", default="1,2", help="captured layer ids besides the base plane (default 1,2)")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from vllm_hs_compat.reference.models import make_model

            model_dir = make_model(str(Path(tmp) / "tiny"), seed=7).path
        layers = [int(x) for x in args.layers.split(",")]
        rows, model = _hidden_states(model_dir, layers, args.sequences, args.tokens)
        ids = [*layers, int(model.config.num_hidden_layers)]  # type: ignore[attr-defined]  # + the base plane
        exact_top1 = [_teacher(model, r[:, -1]).argmax(-1) for r in rows]
        captured_bytes = sum(r.numel() * r.element_size() for r in rows)
        tokens = sum(r.shape[0] for r in rows)
        print(f"{len(rows)} records x {args.tokens} tokens, planes {layers} + base, hidden {rows[0].shape[-1]}")
        print(f"{'storage':<10} {'bytes/token':>12} {'write MB/s':>11} {'read MB/s':>10} {'rel err max':>12} "
              f"{'rel err mean':>13} {'teacher top-1':>14}")  # fmt: skip
        for storage in files.STORAGES:
            out = Path(tmp) / storage
            out.mkdir()
            recs = [
                CaptureRecord(RecordMeta.for_tensor(f"r{i}", r, list(range(r.shape[0])), ids, pre_norm=True), r)
                for i, r in enumerate(rows)
            ]
            t0 = time.perf_counter()
            manifests = [files.write_record(out, rec, storage=storage) for rec in recs]
            t_write = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = [files.read_record(m) for m in manifests]
            t_read = time.perf_counter() - t0
            disk = sum(p.stat().st_size for p in out.iterdir())
            errors = [files.relative_error(b.hidden_states, r) for b, r in zip(back, rows, strict=True)]
            agree = [
                float((_teacher(model, b.hidden_states[:, -1]).argmax(-1) == e).float().mean())
                for b, e in zip(back, exact_top1, strict=True)
            ]
            print(
                f"{storage:<10} {disk / tokens:>12.0f} {captured_bytes / t_write / 1e6:>11.0f} "
                f"{captured_bytes / t_read / 1e6:>10.0f} {max(e for e, _ in errors):>12.4f} "
                f"{statistics.fmean(m for _, m in errors):>13.4f} {statistics.fmean(agree):>14.4f}"
            )


if __name__ == "__main__":
    main()
