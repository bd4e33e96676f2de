"""The demo trainer's check of a captured record (``verify_item``), without an engine: a record built from a
transformers forward over exactly the templated ids of a shipped conversation passes; the same record with its
ids, its loss mask, its sample id or one plane row changed fails, each with its own reason (the negative
controls of what the e2e demo run relies on)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from vllm_hs_compat.capture.data import CONVERSATIONS
from vllm_hs_compat.demo.trainer_proc import verify_item
from vllm_hs_compat.reference import forward as R
from vllm_hs_compat.reference.models import make_model

LAYERS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    model = make_model(str(tmp_path_factory.mktemp("demo-verify") / "model"), "dense", seed=2)
    tok = AutoTokenizer.from_pretrained(model.path)
    row = json.loads(CONVERSATIONS.read_text().splitlines()[1])
    got = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = [int(x) for x in got["input_ids"]], [int(x) for x in got["assistant_masks"]]
    rows = R.reference(model.path, ids, LAYERS)  # [T, P, C], what vLLM's record must equal
    t, c = rows.shape[0], rows.shape[2]
    item = {
        "record_id": "r-1",
        "sample_id": row["id"],
        "input_ids": torch.tensor(ids),
        "loss_mask": torch.tensor(mask),
        "layer_ids": torch.tensor(LAYERS),
        "hidden_states": rows[:, -1].clone(),
        "aux_hidden_states": rows[:, :-1].reshape(t, 3 * c).clone(),
    }
    return {"model": model.path, "item": item, "expected": {row["id"]: {"input_ids": ids, "loss_mask": mask}}}


def _check(setup: dict[str, Any], **change: Any) -> Any:
    item = {**setup["item"], **change}
    return verify_item(item, setup["model"], {}, setup["expected"])


def test_the_templated_record_passes(setup: dict[str, Any]) -> None:
    res = _check(setup)
    assert res.ok, res.reason
    assert res.loss_tokens == sum(setup["expected"][res.sample_id]["loss_mask"]) > 0


def test_each_difference_fails_with_its_reason(setup: dict[str, Any]) -> None:
    item = setup["item"]
    ids = item["input_ids"].clone()
    ids[5] = (ids[5] + 1) % 512
    assert "token ids differ" in _check(setup, input_ids=ids).reason
    mask = item["loss_mask"].clone()
    mask[-1] = 1 - mask[-1]
    assert "loss mask differs" in _check(setup, loss_mask=mask).reason
    assert "none of the rows" in _check(setup, sample_id="conv-999").reason
    aux = item["aux_hidden_states"].clone()
    aux[len(aux) // 2, :64].neg_()
    res = _check(setup, aux_hidden_states=aux)
    assert not res.ok and "differs from transformers" in res.reason and res.max_rel[0] > 1.0
