"""The CLI suite: ``inspect`` against file-sink records and real export producers, ``doctor`` without vLLM
(the release-specific doctor cases live in tests/vllm)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import torch

# UCX reads its environment once, when NIXL is first imported: set it before anything imports nixl.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "export"))


AUX_LAYER_IDS = (1, 2, 3)


@pytest.fixture(scope="session")
def drafter_truth(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny local verifier (dense, seed 0) and the drafters' ground truth, made once for test_evaluate and
    test_eagle3: the shipped conversations as transformers templates them (``train``: their ids), training items
    from the verifier's own planes at :data:`AUX_LAYER_IDS` (every row in the loss), the evaluation prompts (the
    demo's setting), the bf16 (``hf``) and fp32 (``f32``) verifiers and the simulation's ``verifier``."""
    from transformers import AutoTokenizer

    from vllm_hs_compat.capture.data import CONVERSATIONS
    from vllm_hs_compat.commands.evaluate import prompts_of
    from vllm_hs_compat.drafter import acceptance as A
    from vllm_hs_compat.drafter.head import make_item
    from vllm_hs_compat.reference import forward as R
    from vllm_hs_compat.reference.models import make_model

    torch.set_num_threads(1)
    model = make_model(str(tmp_path_factory.mktemp("drafters") / "model"), "dense", seed=0)
    tok = AutoTokenizer.from_pretrained(model.path)
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines() if line.strip()]
    templated = [
        list(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]) for r in rows
    ]
    prompts, failed = prompts_of(None, tok, limit=6)
    assert failed == 0
    hf = R.load_hf(model.path)
    items = []
    for ids in templated:
        planes = R.hf_planes(hf, ids)
        rows_ = torch.stack([R.convention_plane(planes, k) for k in (*AUX_LAYER_IDS, 4)], dim=1)
        item = make_item(
            torch.tensor(ids),
            rows_[:, : len(AUX_LAYER_IDS)].reshape(len(ids), -1),
            rows_[:, -1],
            torch.ones(len(ids)),
            R.final_norm(hf),
            hf.get_output_embeddings(),
        )
        assert item is not None
        items.append(item)
    f32 = R.load_hf(model.path, torch.float32)
    return {
        "path": model.path,
        "hf": hf,
        "f32": f32,
        "verifier": A.Verifier(f32, AUX_LAYER_IDS),
        "items": items,
        "train": templated,
        "prompts": prompts,
    }
