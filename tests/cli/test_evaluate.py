"""The acceptance length (``vllm-hs-compat evaluate``, the demo's before/after figure) on a tiny local verifier.

Greedy verification over the verifier's transformers forward (:mod:`vllm_hs_compat.drafter.acceptance`):

* controls that pin the scale: a drafter that proposes the verifier's own greedy continuation is accepted every
  time (exactly ``k + 1``), a random one almost never (``1.0`` here);
* a drafter trained on the verifier's planes beats the same drafter untrained (ordering, the demo's claim);
* the generated text is the verifier's greedy continuation whatever the drafter proposes;
* the command reads a saved drafter, gives the same figure as the library call, and refuses a drafter made for
  another verifier and a folder that holds none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_hs_compat.cli import main
from vllm_hs_compat.drafter import acceptance as A
from vllm_hs_compat.drafter.head import Eagle3Head, load_drafter, save_drafter, train
from vllm_hs_compat.errors import DrafterError

AUX = (1, 2, 3)
K = 3


@pytest.fixture(scope="module")
def tiny(drafter_truth: dict[str, Any]) -> dict[str, Any]:
    """The session's tiny verifier (conftest ``drafter_truth``): trained on the shipped conversations as
    transformers templates them, evaluated on their prompts (the demo's setting)."""
    return drafter_truth


def _head(hf: Any, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    return Eagle3Head(64, len(AUX), hf.get_input_embeddings().weight, hf.get_output_embeddings().weight)


@pytest.fixture(scope="module")
def trained(tiny: dict[str, Any]) -> Eagle3Head:
    """The drafter trained 60 steps on the verifier's planes of the shipped conversations (as the demo does)."""
    hf = tiny["hf"]
    head = _head(hf)
    train(tiny["items"], head, 60)
    return head


def test_controls_pin_the_scale(tiny: dict[str, Any]) -> None:
    v, prompts = tiny["verifier"], tiny["prompts"]
    oracle = A.measure(v, A.OracleProposer(v), prompts, k=K, new_tokens=16)
    assert oracle.mean_length == K + 1 and oracle.per_position == [1.0] * K
    rnd = A.measure(v, A.RandomProposer(512, seed=1), prompts, k=K, new_tokens=16)
    assert rnd.mean_length < 1.05, rnd
    assert rnd.generated >= 16 * len(prompts) and rnd.steps >= rnd.generated / (K + 1)


def test_trained_drafter_beats_untrained(tiny: dict[str, Any], trained: Eagle3Head) -> None:
    v, prompts = tiny["verifier"], tiny["prompts"]
    untrained = _head(tiny["hf"])
    before = A.measure(v, A.DrafterProposer(untrained), prompts, k=K, new_tokens=24)
    after = A.measure(v, A.DrafterProposer(trained), prompts, k=K, new_tokens=24)
    assert after.mean_length > before.mean_length + 0.3, (before.mean_length, after.mean_length)
    assert 1.0 <= before.mean_length and after.mean_length < K + 1


def test_generated_text_is_the_verifiers_greedy_continuation(tiny: dict[str, Any]) -> None:
    """Whatever is drafted, the tokens kept are the verifier's own greedy ones (speculative decoding is exact)."""
    v = tiny["verifier"]
    prompt = tiny["prompts"][0]

    class Recorder:
        def __init__(self, inner: A.Proposer) -> None:
            self.inner = inner
            self.last: list[int] = []

        def propose(self, ids: Any, aux: Any, next_id: int, k: int) -> list[int]:
            self.last = [*ids, next_id]
            return self.inner.propose(ids, aux, next_id, k)

    greedy = list(prompt)
    for _ in range(12):
        greedy.append(int(v(greedy)[1][-1]))
    for inner in (A.RandomProposer(512), A.OracleProposer(v)):
        rec = Recorder(inner)
        A.measure(v, rec, [prompt], k=K, new_tokens=12)
        n = min(len(rec.last), len(greedy))
        assert rec.last[:n] == greedy[:n] and n > len(prompt)


def test_evaluate_command_reads_a_saved_drafter(
    tiny: dict[str, Any], trained: Eagle3Head, tmp_path: Path, capsys: Any
) -> None:
    head = trained
    folder = save_drafter(head, tmp_path / "drafter", verifier=tiny["path"], aux_layer_ids=list(AUX))
    again, cfg = load_drafter(folder)
    assert cfg["aux_layer_ids"] == list(AUX) and cfg["hidden"] == 64
    rc = main(["evaluate", "--model", tiny["path"], "--drafter", str(folder), "--limit", "3", "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    direct = A.measure(tiny["verifier"], A.DrafterProposer(head), tiny["prompts"][:3], k=K, new_tokens=32)
    assert got["prompts"] == 3 and got["mean_length"] == pytest.approx(direct.mean_length)
    assert got["mean_length"] > 1.0

    # a drafter made for another verifier (hidden size), and a folder with no drafter, are refused by name
    cfg_path = folder / "drafter.json"
    cfg_path.write_text(json.dumps({**cfg, "vocab": 1024}))
    assert main(["evaluate", "--model", tiny["path"], "--drafter", str(folder)]) == 2
    assert "vocabulary 1024" in capsys.readouterr().err
    with pytest.raises(DrafterError, match="not a saved drafter"):
        load_drafter(tmp_path / "empty")


def test_first_draft_is_what_training_optimised(tiny: dict[str, Any], trained: Eagle3Head) -> None:
    """The proposer feeds the drafter exactly what training fed it (planes at 0..n, tokens at 1..n+1): its first
    draft is the argmax of the training forward at the last position, for every prompt."""
    v, head = tiny["verifier"], trained
    for ids in tiny["prompts"]:
        aux, greedy = v(ids)
        next_id = int(greedy[-1])
        (draft,) = A.DrafterProposer(head).propose(ids, aux, next_id, 1)
        with torch.no_grad():
            logits = head(aux[None], torch.tensor([[*ids[1:], next_id]]), torch.zeros(1, len(ids), dtype=torch.bool))
        assert draft == int(logits[0, -1].argmax())
