"""A drafter's mean acceptance length against its verifier: greedy verification simulated over the verifier's
transformers forward (``vllm-hs-compat evaluate``, the demo's before/after figure; docs/demo.md).

Speculative decoding with greedy verification, one request at a time, as vLLM's EAGLE-3 path does at temperature 0:

1. the verifier runs over the prompt ``x_0..x_n``: its planes at the drafter's auxiliary layer ids for positions
   ``0..n`` and its greedy next token ``x_{n+1}``;
2. the drafter proposes ``k`` tokens ``d_1..d_k`` from those planes and the tokens ``x_1..x_{n+1}``
   (:meth:`~vllm_hs_compat.drafter.head.Eagle3Head.draft`);
3. the verifier runs over ``x_0..x_{n+1}, d_1..d_k``; the drafts are accepted while each equals the verifier's
   greedy token at its position, and the verifier's greedy token after the last accepted one is the bonus token;
4. the accepted drafts and the bonus token join the sequence (``accepted + 1`` tokens for this verification
   step) and the loop goes on until at least ``new_tokens`` tokens were generated.

The acceptance length of a step is ``accepted + 1`` (between 1: nothing accepted, and ``k + 1``: every draft
accepted) and the figure is its mean over every step of every prompt -- vLLM's ``1 + accepted / drafts``.  Every
verifier forward is a full forward without a KV cache (the tiny models make that cheap); the greedy tokens are
the argmax of the verifier's own logits, so the generated text is exactly the verifier's greedy continuation, with
or without a drafter (checked: :func:`measure` raises when a step would change it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from vllm_hs_compat.errors import DrafterError
from vllm_hs_compat.reference.forward import convention_plane, hf_planes


class Verifier:
    """The verifier's forward (transformers, same weights as the engine's): the planes of ``aux_layer_ids``
    (concatenated per position, ``[T, len(aux_layer_ids) * C]``, the ``eagle3`` layout's ``aux_hidden_states``)
    and the greedy next token at every position (``[T]``)."""

    def __init__(self, model: Any, aux_layer_ids: Sequence[int]) -> None:
        self.model = model
        self.aux_layer_ids = [int(k) for k in aux_layer_ids]
        self.forwards = 0

    def __call__(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        planes = hf_planes(self.model, ids)
        self.forwards += 1
        aux = torch.cat([convention_plane(planes, k) for k in self.aux_layer_ids], dim=-1).float()
        with torch.no_grad():
            # HF's last hidden state is after the final norm: its LM head gives the model's own logits
            logits = self.model.get_output_embeddings()(planes.hidden_states[-1])
        return aux, logits.argmax(-1)


class Proposer(Protocol):
    """Proposes ``k`` tokens after the context ``ids`` (``x_0..x_n``) and ``next_id`` (``x_{n+1}``), given the
    verifier's auxiliary planes ``aux`` ``[n+1, A]`` at positions ``0..n``."""

    def propose(self, ids: Sequence[int], aux: torch.Tensor, next_id: int, k: int) -> list[int]: ...


class DrafterProposer:
    """An :class:`~vllm_hs_compat.drafter.head.Eagle3Head`'s own drafts."""

    def __init__(self, head: Any) -> None:
        self.head = head

    def propose(self, ids: Sequence[int], aux: torch.Tensor, next_id: int, k: int) -> list[int]:
        next_ids = torch.tensor([*ids[1:], next_id], dtype=torch.long)
        return list(self.head.draft(aux, next_ids, k))


class OracleProposer:
    """Control: the verifier's own greedy continuation (every draft is accepted: acceptance length ``k + 1``)."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier

    def propose(self, ids: Sequence[int], aux: torch.Tensor, next_id: int, k: int) -> list[int]:
        seq = [*ids, next_id]
        out: list[int] = []
        for _ in range(k):
            _, greedy = self.verifier(seq)
            tok = int(greedy[-1])
            out.append(tok)
            seq.append(tok)
        return out


class RandomProposer:
    """Control: uniformly random tokens (about ``1 + k / vocab``: almost nothing accepted)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, ids: Sequence[int], aux: torch.Tensor, next_id: int, k: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(k)]


@dataclass
class Acceptance:
    """What :func:`measure` found.  ``mean_length``: mean tokens per verification step (``1 + accepted /
    steps``); ``per_position[j]``: the share of steps whose draft ``j + 1`` was accepted."""

    k: int
    prompts: int
    steps: int
    accepted: int
    generated: int
    per_position: list[float]
    per_prompt: list[float] = field(default_factory=list)
    method: str = "greedy verification simulated over the verifier's transformers forward"
    #: the generated tokens of each prompt (the verifier's greedy continuation; not in :meth:`to_dict`)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def mean_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {**asdict(self), "mean_length": self.mean_length}
        out.pop("outputs")
        return out


def measure(
    verifier: Verifier,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    *,
    k: int = 3,
    new_tokens: int = 32,
    max_len: int | None = None,
) -> Acceptance:
    """The mean acceptance length of ``proposer`` with ``k`` drafts per step over ``prompts``, generating at
    least ``new_tokens`` tokens after each (the last step may add up to ``k`` more; fewer when a step would pass
    ``max_len`` tokens in all)."""
    if k < 1 or new_tokens < 1:
        raise DrafterError(f"k and new_tokens must be at least 1, found k={k}, new_tokens={new_tokens}")
    if not prompts:
        raise DrafterError("no prompt to evaluate the drafter on")
    steps = accepted = generated = 0
    hits = [0] * k
    per_prompt: list[float] = []
    outputs: list[list[int]] = []
    for prompt in prompts:
        ids = [int(t) for t in prompt]
        if not ids:
            raise DrafterError("an empty prompt: the verifier needs at least one token")
        aux, greedy = verifier(ids)
        next_id = int(greedy[-1])
        p_steps = p_acc = 0
        # until new_tokens are generated (the last step may add up to k more), or a step would pass max_len
        while len(ids) + 1 - len(prompt) < new_tokens and (max_len is None or len(ids) + 1 + k <= max_len):
            n = len(ids)
            drafts = [int(t) for t in proposer.propose(ids, aux, next_id, k)]
            if len(drafts) != k:
                raise DrafterError(f"the proposer gave {len(drafts)} drafts, {k} were asked for")
            aux2, greedy2 = verifier([*ids, next_id, *drafts])
            if int(greedy2[n - 1]) != next_id:  # the verifier's own continuation must not depend on the drafts
                raise DrafterError(
                    f"the verifier's greedy token at position {n} changed from {next_id} to {int(greedy2[n - 1])} "
                    "when drafts were appended: its forward is not causal, or not deterministic"
                )
            a = 0
            while a < len(drafts) and drafts[a] == int(greedy2[n + a]):
                hits[a] += 1
                a += 1
            ids = [*ids, next_id, *drafts[:a]]
            next_id = int(greedy2[n + a])
            aux = aux2[: len(ids)]
            p_steps += 1
            p_acc += a
        steps += p_steps
        accepted += p_acc
        generated += len(ids) + 1 - len(prompt)
        per_prompt.append((p_acc + p_steps) / p_steps if p_steps else 0.0)
        outputs.append([*ids[len(prompt) :], next_id])
    return Acceptance(
        k=k,
        prompts=len(prompts),
        steps=steps,
        accepted=accepted,
        generated=generated,
        per_position=[h / steps if steps else 0.0 for h in hits],
        per_prompt=per_prompt,
        outputs=outputs,
    )
