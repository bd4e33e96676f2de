"""The demo trainer's check of a captured record (``verify_item``), without an engine: a record built from a
transformers forward over exactly the templated ids of a shipped conversation passes; the same record with its
ids, its loss mask, its sample id or one plane row changed fails, each with its own reason (the negative
controls of what the e2e demo run relies on).  The mistakes the check exists to catch -- a post-norm base plane,
planes off by one layer, NaN rows -- fail it, on every row (the tiny model's final norm is not the identity)."""

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


def _row_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)


def test_a_post_norm_or_off_by_one_capture_fails_on_every_row(setup: dict[str, Any]) -> None:
    """A base plane captured after the final norm, or every plane one layer off (either way), fails the demo's
    check, and not only through a few outlier rows: every row of it is farther than the tolerance from the right
    one, so even a one-token record of it fails.  Negative control: with a final norm of weight 1 (the tiny model
    before its norm was made non-trivial), rows whose RMS is near 1 stay within the tolerance after the norm."""
    item = setup["item"]
    ids = [int(x) for x in item["input_ids"]]
    hf = R.load_hf(setup["model"])
    planes = R.hf_planes(hf, ids)
    n = planes.num_layers
    pre, post = R.convention_plane(planes, n), planes.hidden_states[n]
    res = _check(setup, hidden_states=post.clone())
    assert not res.ok and "layer 4:" in res.reason and "layer 1:" not in res.reason
    assert float(_row_errors(post, pre).min()) > R.ROW_TOL
    t, c = pre.shape
    for shift in (1, -1):  # id n + 1 would be the last layer's output after the norm
        got = [post if k + shift == n + 1 else R.convention_plane(planes, k + shift) for k in LAYERS]
        res = _check(setup, hidden_states=got[-1].clone(), aux_hidden_states=torch.cat(got[:-1], dim=-1).clone())
        assert not res.ok and all(f"layer {k}:" in res.reason for k in LAYERS), (shift, res.reason)
        for k, g in zip(LAYERS, got, strict=True):
            assert float(_row_errors(g, R.convention_plane(planes, k)).min()) > R.ROW_TOL, (shift, k)
    # negative control: a weight-1 final norm leaves rows of the pre-norm plane within the tolerance
    eps = float(hf.config.rms_norm_eps)
    unit = (pre.float() * torch.rsqrt(pre.float().pow(2).mean(-1, keepdim=True) + eps)).to(pre.dtype)
    assert float(_row_errors(unit, pre).min()) < R.ROW_TOL
    assert t == len(ids) and c == hf.config.hidden_size


def test_nan_rows_fail_the_check_and_verify_names_them(setup: dict[str, Any]) -> None:
    """One NaN value in one row of one plane: the demo's check fails on that plane (never a small error), and
    ``verify``'s analysis calls the plane NON-FINITE."""
    from vllm_hs_compat.commands.verify import analyse

    aux = setup["item"]["aux_hidden_states"].clone()
    aux[3, 70] = float("nan")  # plane 2 (layer id 2), row 3
    res = _check(setup, aux_hidden_states=aux)
    assert not res.ok and "layer 2: rel inf" in res.reason and "layer 1:" not in res.reason
    item = setup["item"]
    t, c = item["hidden_states"].shape
    rows = torch.cat([aux.reshape(t, 3, c), item["hidden_states"][:, None]], dim=1)
    reports = {r.layer_id: r for r in analyse([(item["input_ids"].tolist(), LAYERS, rows)], R.load_hf(setup["model"]))}
    assert not reports[2].ok and reports[2].note.startswith("NON-FINITE: 1 NaN/Inf")
    assert reports[1].ok and reports[3].ok and reports[4].ok
