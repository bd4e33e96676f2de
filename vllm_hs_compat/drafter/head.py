"""A tiny EAGLE-3-style drafter head, trained on captured records (torch only).

EAGLE-3 fuses the verifier's low, middle and high layers (the auxiliary planes, concatenated: ``[T, (P-1)*C]``)
through one linear layer, adds the embedding of the next token, runs ONE decoder layer and reads tokens through
the verifier's own (frozen) LM head.  Position ``t`` (features of ``x_<=t``, embedding of ``x_{t+1}``) predicts
the verifier's next-token distribution at ``t + 1`` -- computed here from the record's base plane (the last
layer before the final norm) through the verifier's final norm and LM head: distillation, as EAGLE trains.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vllm_hs_compat.errors import DrafterError, ToolError


@dataclass
class TrainItem:
    """One record, ready for the drafter: ``aux`` ``[T-1, (P-1)*C]`` at positions ``0..T-2``, ``next_ids``
    ``[T-1]`` (the token at ``t + 1``), ``teacher`` ``[T-1, V]`` (the verifier's probabilities at ``t + 1``) and
    ``mask`` ``[T-1]`` (the record's loss mask at ``t + 1``)."""

    aux: torch.Tensor
    next_ids: torch.Tensor
    teacher: torch.Tensor
    mask: torch.Tensor


def teacher_probs(base: torch.Tensor, norm: nn.Module, lm_head: nn.Module) -> torch.Tensor:
    """The verifier's next-token probabilities from its pre-norm last hidden states ``[T, C]``."""
    with torch.no_grad():
        logits = lm_head(norm(base.to(next(lm_head.parameters()).dtype)))
    return torch.softmax(logits.float(), dim=-1)


def make_item(
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    base: torch.Tensor,
    mask: torch.Tensor,
    norm: nn.Module,
    lm_head: nn.Module,
) -> TrainItem | None:
    """A :class:`TrainItem` from one record in the ``eagle3`` layout (None when it has fewer than 2 tokens)."""
    if input_ids.shape[0] < 2:
        return None
    probs = teacher_probs(base, norm, lm_head)
    return TrainItem(
        aux=aux[:-1].float(),
        next_ids=input_ids[1:].long(),
        teacher=probs[1:],
        mask=mask[1:].float(),
    )


class Eagle3Head(nn.Module):
    """fc(aux) + embed(next token) -> one pre-norm decoder layer (causal) -> norm -> the verifier's LM head."""

    def __init__(self, hidden: int, num_aux: int, embed: torch.Tensor, lm_head: torch.Tensor, heads: int = 2) -> None:
        super().__init__()
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.inp = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = nn.TransformerEncoderLayer(
            hidden, heads, dim_feedforward=2 * hidden, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.RMSNorm(hidden)
        self.register_buffer("embed", embed.detach().float().clone())
        self.register_buffer("head", lm_head.detach().float().clone())

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """``aux`` ``[B, T, A]``, ``next_ids`` ``[B, T]``, ``pad`` ``[B, T]`` (True = padding) -> logits
        ``[B, T, V]``."""
        return self.logits(self.hidden(self.fc(aux), next_ids, pad))

    def hidden(self, features: torch.Tensor, next_ids: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        """The decoder layer's output ``[B, T, C]`` (before the norm) from fused features ``[B, T, C]`` (``fc`` of
        the verifier's planes, or the drafter's own earlier output) and the next tokens ``[B, T]``."""
        e = F.embedding(next_ids, self.get_buffer("embed"))
        x = self.inp(torch.cat([e, features], dim=-1))
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        out: torch.Tensor = self.layer(x, src_mask=causal, src_key_padding_mask=pad, is_causal=True)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token logits through the norm and the verifier's frozen LM head."""
        return F.linear(self.norm(hidden), self.get_buffer("head"))

    def draft(self, aux: torch.Tensor, next_ids: torch.Tensor, k: int) -> list[int]:
        """Propose ``k`` tokens greedily, as EAGLE-3 drafts at inference.

        ``aux`` ``[n+1, A]``: the verifier's auxiliary planes at positions ``0..n`` of the context; ``next_ids``
        ``[n+1]``: the tokens at ``1..n+1`` (the last one is the verifier's own next token, whose planes the
        verifier has not computed yet).  Draft ``j`` is read at the last position; for the draft after it the
        drafter's own output at that position stands in for the verifier's fused planes (which do not exist for
        drafted tokens), with the drafted token appended."""
        if aux.shape[0] != next_ids.shape[0] or aux.shape[0] < 1:
            raise ToolError(
                f"draft needs one plane row per next token: found {aux.shape[0]} rows, {next_ids.shape[0]} tokens"
            )
        out: list[int] = []
        with torch.no_grad():
            features = self.fc(aux.float())[None]
            ids = next_ids.long()[None]
            for _ in range(k):
                h = self.hidden(features, ids, None)
                tok = int(self.logits(h[0, -1]).argmax())
                out.append(tok)
                features = torch.cat([features, h[:, -1:]], dim=1)
                ids = torch.cat([ids, torch.tensor([[tok]], dtype=torch.long)], dim=1)
        return out

    def config(self) -> dict[str, int]:
        """What :func:`load_drafter` needs to build this head again."""
        return {
            "hidden": int(self.norm.weight.shape[0]),
            "num_aux": int(self.fc.in_features) // int(self.norm.weight.shape[0]),
            "heads": int(self.layer.self_attn.num_heads),
            "vocab": int(self.get_buffer("head").shape[0]),
        }


#: Files of a saved drafter (:func:`save_drafter`): the weights (safetensors) and what they were made for (JSON).
DRAFTER_WEIGHTS = "drafter.safetensors"
DRAFTER_CONFIG = "drafter.json"


def save_drafter(head: Eagle3Head, path: str | os.PathLike[str], **meta: Any) -> Path:
    """Write ``head`` into the folder ``path`` (``drafter.safetensors`` + ``drafter.json`` with its geometry and
    ``meta``: e.g. the verifier and the auxiliary layer ids it was trained on); returns the folder."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in head.state_dict().items()}
    save_file(state, str(out / DRAFTER_WEIGHTS))
    (out / DRAFTER_CONFIG).write_text(json.dumps({"kind": "vllm-hs-compat-eagle3-demo", **head.config(), **meta}))
    return out


def load_drafter(path: str | os.PathLike[str]) -> tuple[Eagle3Head, dict[str, Any]]:
    """A head written by :func:`save_drafter`, in eval mode, and its ``drafter.json``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from vllm_hs_compat.errors import DrafterError

    folder = Path(path)
    cfg_path, weights = folder / DRAFTER_CONFIG, folder / DRAFTER_WEIGHTS
    if not cfg_path.is_file() or not weights.is_file():
        raise DrafterError(
            f"{folder} is not a saved drafter: expected {DRAFTER_CONFIG} and {DRAFTER_WEIGHTS} in it (the demo "
            "writes one into <out>/drafter)"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
        state = load_file(str(weights))
        hidden, num_aux, heads = int(cfg["hidden"]), int(cfg["num_aux"]), int(cfg["heads"])
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise DrafterError(f"cannot read the drafter in {folder}: {type(exc).__name__}: {exc}") from None
    if "embed" not in state or "head" not in state:
        raise DrafterError(f"{weights} lacks the embedding or LM head buffers: found {sorted(state)[:8]}")
    head = Eagle3Head(hidden, num_aux, state["embed"], state["head"], heads=heads)
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:
        raise DrafterError(f"{weights} does not fit the geometry in {cfg_path}: {exc}") from None
    return head.eval(), cfg


def _batch(items: Sequence[TrainItem]) -> tuple[torch.Tensor, ...]:
    t = max(i.aux.shape[0] for i in items)
    b = len(items)
    a, v = items[0].aux.shape[1], items[0].teacher.shape[1]
    aux = torch.zeros(b, t, a)
    ids = torch.zeros(b, t, dtype=torch.long)
    teacher = torch.zeros(b, t, v)
    mask = torch.zeros(b, t)
    for k, it in enumerate(items):
        n = it.aux.shape[0]
        aux[k, :n], ids[k, :n], teacher[k, :n], mask[k, :n] = it.aux, it.next_ids, it.teacher, it.mask
    return aux, ids, teacher, mask


@dataclass
class StepStats:
    step: int
    loss: float  # KL(verifier || drafter), nats per token
    accuracy: float  # drafter top-1 == verifier top-1, over the batch's masked positions


def train(
    items: Sequence[TrainItem],
    head: nn.Module,
    steps: int,
    *,
    batch: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[StepStats], None] | None = None,
) -> list[StepStats]:
    """``steps`` Adam steps over random batches of ``items``; returns every step's loss and top-1 agreement.

    ``head``: any drafter whose ``forward(aux, ids, pad)`` gives ``[B, T, vocab]`` logits (:class:`Eagle3Head`,
    :class:`~vllm_hs_compat.drafter.eagle3.Eagle3Drafter`)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    out: list[StepStats] = []
    for step in range(steps):
        chosen = rng.sample(list(items), min(batch, len(items)))
        aux, ids, teacher, mask = _batch(chosen)
        logits = head(aux, ids, mask == 0)
        logp = F.log_softmax(logits, dim=-1)
        # KL(teacher || drafter) per token: the soft cross-entropy minus the teacher's own entropy (same gradient;
        # reads 0 when the drafter reproduces the verifier's distribution).
        per_tok = (teacher * (torch.log(teacher.clamp_min(1e-30)) - logp)).sum(-1)
        denom = mask.sum().clamp_min(1.0)
        loss = (per_tok * mask).sum() / denom
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        agree = ((logits.argmax(-1) == teacher.argmax(-1)).float() * mask).sum() / denom
        stats = StepStats(step, float(loss.detach()), float(agree))
        if not math.isfinite(stats.loss):
            raise DrafterError(
                f"the drafter loss became {stats.loss} at step {step}; lower the learning rate (lr={lr})"
            )
        out.append(stats)
        if on_step is not None:
            on_step(stats)
    return out
