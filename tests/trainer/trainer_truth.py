"""Ground truth for the trainer-format tests: a tiny random-weight verifier (vllm_hs_compat.reference.models) whose
every hidden state and logit is known from the transformers forward (vllm_hs_compat.reference.forward), and capture
records built from it exactly as vLLM's convention defines them (layer id i = HF hidden_states[i]; id
num_hidden_layers = the final norm's input).  No vLLM is needed: the records go through the package's own record
and file-sink API."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.reference.forward import convention_plane, hf_planes, load_hf
from vllm_hs_compat.reference.models import make_model

#: vLLM ids of the auxiliary planes on the 4-layer tiny verifier; the base plane is id 4.
AUX = (1, 2, 3)
NUM_LAYERS = 4


@dataclass
class Truth:
    """One sequence: its tokens, HF's hidden states (``num_layers + 1`` of ``[T, C]``; the last after the final
    norm), the final norm's input (pre-norm base) and the verifier's logits ``[T, V]``."""

    record: CaptureRecord
    tokens: list[int]
    hf_hidden: tuple[torch.Tensor, ...]
    pre_norm: torch.Tensor
    logits: torch.Tensor

    @property
    def post_norm(self) -> torch.Tensor:
        return self.hf_hidden[-1]


def make_verifier(folder: Path, *, index: bool = True) -> str:
    """The tiny dense verifier in ``folder`` (4 layers, hidden 64, vocab 512, tied embeddings).  ``index``: also
    write ``model.safetensors.index.json`` (the sharded-checkpoint index some trainers insist on)."""
    from safetensors.torch import load_file, save_file

    tiny = make_model(str(folder), "dense", seed=0)
    # A fresh Llama's final norm weight is all ones: then pre- and post-norm rows differ by a per-row scale only and
    # the LM head's argmax cannot tell them apart.  A random weight makes a wrong norm state visible in the logits.
    weights = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    norm = weights["model.norm.weight"]
    weights["model.norm.weight"] = (torch.randn(norm.shape, generator=gen) + 0.3).to(norm.dtype)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    keys = list(weights)
    if index:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": dict.fromkeys(keys, "model.safetensors")})
        )
    return tiny.path


def sequences(n: int, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(6, 40))] for _ in range(n)]


def truths(
    model_dir: str, n: int = 6, *, dtype: torch.dtype = torch.float32, aux: tuple[int, ...] = AUX, seed: int = 0
) -> list[Truth]:
    """``n`` records of the verifier in ``model_dir`` (planes ``aux + (num_layers,)`` in ``dtype``) with their
    ground truth."""
    model = load_hf(model_dir, dtype=dtype)
    num_layers = int(model.config.num_hidden_layers)
    ids = (*aux, num_layers)
    out = []
    for k, tokens in enumerate(sequences(n, seed)):
        planes = hf_planes(model, tokens)
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0].float()
        rows = torch.stack([convention_plane(planes, i) for i in ids], dim=1).contiguous()
        meta = RecordMeta.for_tensor(
            f"req-{k:03d}", rows, tokens, ids, pre_norm=True, num_prompt_tokens=len(tokens) // 2
        )
        rec = CaptureRecord(meta, rows)
        if planes.pre_norm is None:
            raise AssertionError("the tiny verifier has a final norm")
        out.append(Truth(rec, tokens, planes.hidden_states, planes.pre_norm, logits))
    return out


def top1_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows whose argmax agrees (``[..., V]`` each)."""
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())
