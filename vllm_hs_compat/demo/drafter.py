"""A tiny EAGLE-3-style drafter head, trained on captured records (torch only).

EAGLE-3 fuses the verifier's low, middle and high layers (the auxiliary planes, concatenated: ``[T, (P-1)*C]``)
through one linear layer, adds the embedding of the next token, runs ONE decoder layer and reads tokens through
the verifier's own (frozen) LM head.  Position ``t`` (features of ``x_<=t``, embedding of ``x_{t+1}``) predicts
the verifier's next-token distribution at ``t + 1`` -- computed here from the record's base plane (the last
layer before the final norm) through the verifier's final norm and LM head: distillation, as EAGLE trains.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from vllm_hs_compat.errors import ToolError


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
        e = F.embedding(next_ids, self.get_buffer("embed"))
        x = self.inp(torch.cat([e, self.fc(aux)], dim=-1))
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        x = self.layer(x, src_mask=causal, src_key_padding_mask=pad, is_causal=True)
        return F.linear(self.norm(x), self.get_buffer("head"))


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
    head: Eagle3Head,
    steps: int,
    *,
    batch: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[StepStats], None] | None = None,
) -> list[StepStats]:
    """``steps`` Adam steps over random batches of ``items``; returns every step's loss and top-1 agreement."""
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
            raise ToolError(f"the drafter loss became {stats.loss} at step {step}; lower the learning rate (lr={lr})")
        out.append(stats)
        if on_step is not None:
            on_step(stats)
    return out
