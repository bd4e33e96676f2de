"""The EAGLE-3 drafter in vLLM's checkpoint layout (:mod:`vllm_hs_compat.drafter.eagle3`), without vLLM.

* the folder holds exactly the weights and config vLLM's ``llama_eagle3`` loads (names, shapes, architecture,
  auxiliary layer ids; no embedding, no draft-vocabulary maps) and reads back to the same drafts;
* the forward is causal and its first draft is what training optimised (the training forward's last row);
* trained on the verifier's planes it beats the same drafter untrained in the greedy-verification simulation,
  and an untrained one is accepted almost never (the scale's floor);
* ``evaluate --backend simulate`` reads the folder; ``--backend vllm`` refuses the demo's own head by name, and
  auxiliary layer ids out of ascending order are refused (vLLM concatenates planes in ascending order).

vLLM's own measurement of the same folder: tests/e2e/test_demo_tools.py (``HS_E2E_DEMO``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from vllm_hs_compat.cli import main
from vllm_hs_compat.drafter import acceptance as A
from vllm_hs_compat.drafter import eagle3 as E
from vllm_hs_compat.drafter.head import Eagle3Head, save_drafter
from vllm_hs_compat.errors import DrafterError
from vllm_hs_compat.reference import forward as R

AUX = (1, 2, 3)
K = 3


@pytest.fixture(scope="module")
def tiny(drafter_truth: dict[str, Any]) -> dict[str, Any]:
    """The session's tiny verifier and training items (conftest ``drafter_truth``), with this drafter's geometry."""
    return {
        **drafter_truth,
        "train_ids": [tuple(t) for t in drafter_truth["train"]],
        "geometry": E.geometry_for(drafter_truth["f32"].config.to_dict(), AUX),
    }


def _drafter(tiny: dict[str, Any], seed: int = 0) -> E.Eagle3Drafter:
    torch.manual_seed(seed)
    f32 = tiny["f32"]
    return E.Eagle3Drafter(
        tiny["geometry"], f32.get_input_embeddings().weight, f32.get_output_embeddings().weight
    ).eval()


@pytest.fixture(scope="module")
def trained(tiny: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = _drafter(tiny)
    hist = E.train_eagle3(tiny["items"], d, 80)
    folder = E.save_eagle3(d, tmp_path_factory.mktemp("eagle3") / "drafter", verifier=tiny["path"])
    loaded, cfg = E.load_eagle3(folder, tiny["f32"].get_input_embeddings().weight)
    return {"drafter": loaded, "folder": folder, "cfg": cfg, "hist": hist}


def test_folder_is_vllms_eagle3_layout(tiny: dict[str, Any], trained: dict[str, Any]) -> None:
    folder, cfg = trained["folder"], trained["cfg"]
    state = load_file(str(folder / E.WEIGHTS_FILE))
    c, i, hd = 64, 128, 32
    want = {
        "fc.weight": (c, 3 * c),
        "midlayer.input_layernorm.weight": (c,),
        "midlayer.hidden_norm.weight": (c,),
        "midlayer.self_attn.q_proj.weight": (2 * hd, 2 * c),
        "midlayer.self_attn.k_proj.weight": (1 * hd, 2 * c),
        "midlayer.self_attn.v_proj.weight": (1 * hd, 2 * c),
        "midlayer.self_attn.o_proj.weight": (c, 2 * hd),
        "midlayer.post_attention_layernorm.weight": (c,),
        "midlayer.mlp.gate_proj.weight": (i, c),
        "midlayer.mlp.up_proj.weight": (i, c),
        "midlayer.mlp.down_proj.weight": (c, i),
        "norm.weight": (c,),
        "lm_head.weight": (512, c),
    }
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    # the LM head is the verifier's own (vLLM then shares it); no embedding: vLLM shares the verifier's
    assert torch.equal(state["lm_head.weight"], tiny["hf"].get_output_embeddings().weight.detach())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert cfg["target_hidden_size"] == 64 and cfg["draft_vocab_size"] == cfg["vocab_size"] == 512
    assert E.is_eagle3_folder(folder)
    # the loaded drafter computes with the saved (bf16) weights: a second save is bit-identical
    again = E.save_eagle3(trained["drafter"], folder.parent / "again")
    state2 = load_file(str(again / E.WEIGHTS_FILE))
    assert all(torch.equal(state[k], state2[k]) for k in state)


def test_forward_is_causal_and_first_draft_is_the_training_row(tiny: dict[str, Any], trained: dict[str, Any]) -> None:
    d, v = trained["drafter"], tiny["verifier"]
    for ids in tiny["prompts"][:3]:
        aux, greedy = v(ids)
        next_ids = torch.tensor([*ids[1:], int(greedy[-1])])
        (draft,) = d.draft(aux, next_ids, 1)
        with torch.no_grad():
            logits = d(aux[None], next_ids[None])
            # causal: changing the last row's token and planes leaves every earlier row unchanged
            aux2, ids2 = aux.clone(), next_ids.clone()
            aux2[-1] += 1.0
            ids2[-1] = (ids2[-1] + 1) % 512
            logits2 = d(aux2[None], ids2[None])
        assert draft == int(logits[0, -1].argmax())
        assert torch.allclose(logits[0, :-1], logits2[0, :-1]) and not torch.allclose(logits[0, -1], logits2[0, -1])


def test_trained_beats_untrained_and_random_is_the_floor(tiny: dict[str, Any], trained: dict[str, Any]) -> None:
    v, prompts = tiny["verifier"], tiny["prompts"]
    hist = trained["hist"]
    assert hist[-1].loss < hist[0].loss * 0.7, (hist[0], hist[-1])
    before = A.measure(v, E.Eagle3Proposer(_drafter(tiny)), prompts, k=K, new_tokens=24)
    after = A.measure(v, E.Eagle3Proposer(trained["drafter"]), prompts, k=K, new_tokens=24)
    assert before.mean_length < 1.1, before
    assert after.mean_length > before.mean_length + 0.3, (before.mean_length, after.mean_length)


def test_evaluate_command_simulates_an_eagle3_folder(
    tiny: dict[str, Any], trained: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    folder = trained["folder"]
    rc = main(["evaluate", "--model", tiny["path"], "--drafter", str(folder), "--limit", "3", "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    direct = A.measure(tiny["verifier"], E.Eagle3Proposer(trained["drafter"]), tiny["prompts"][:3], k=K, new_tokens=32)
    assert got["backend"] == "simulate" and got["mean_length"] == pytest.approx(direct.mean_length)
    assert got["aux_layer_ids"] == list(AUX)

    # the demo's own head is not in vLLM's layout: --backend vllm refuses it by name, before any engine
    head = Eagle3Head(64, 3, tiny["hf"].get_input_embeddings().weight, tiny["hf"].get_output_embeddings().weight)
    demo = save_drafter(head, tmp_path / "demo", verifier=tiny["path"], aux_layer_ids=list(AUX))
    assert main(["evaluate", "--model", tiny["path"], "--drafter", str(demo), "--backend", "vllm"]) == 2
    assert "not one" in capsys.readouterr().err
    # a drafter made for another verifier is refused by name
    cfg = json.loads((folder / E.CONFIG_FILE).read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / E.WEIGHTS_FILE).write_bytes((folder / E.WEIGHTS_FILE).read_bytes())
    (bad / E.CONFIG_FILE).write_text(json.dumps({**cfg, "target_hidden_size": 128}))
    assert main(["evaluate", "--model", tiny["path"], "--drafter", str(bad)]) == 2
    assert "hidden size 128" in capsys.readouterr().err
    with pytest.raises(DrafterError, match="ascending order"):
        E.geometry_for(tiny["f32"].config.to_dict(), (3, 1, 2))


def test_trains_from_a_capture_tree(tiny: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    """``python -m vllm_hs_compat.drafter.eagle3`` over a capture tree (records of the verifier's own planes at
    layer ids 1-4, staged and indexed as the capture command does): the records are read through the index, the
    auxiliary ids are every captured id but the base plane's, and the drafter it writes beats an untrained one."""
    from vllm_hs_compat.capture.store import CaptureStore, SampleInfo
    from vllm_hs_compat.core.records import CaptureRecord, RecordMeta, RecordSample
    from vllm_hs_compat.export import files

    hf, tree = tiny["hf"], tmp_path / "tree"
    run_config = {"model": tiny["path"], "layers": [*AUX, 4], "mode": "prompt", "template": "t"}
    with CaptureStore(tree, run_config=run_config, records_per_shard=4) as store:
        for i, ids in enumerate(tiny["train_ids"][:8]):
            planes = R.hf_planes(hf, ids)
            rows = torch.stack([R.convention_plane(planes, k) for k in (*AUX, 4)], dim=1).to(torch.bfloat16)
            meta = RecordMeta.for_tensor(
                f"req-{i}",
                rows,
                ids,
                (*AUX, 4),
                pre_norm=True,
                num_prompt_tokens=len(ids),
                sample=RecordSample(sample_id=f"s{i}", source=f"rows:{i}", loss_mask_spans=((1, len(ids)),)),
            )
            manifest = files.write_record(store.staging_dir(), CaptureRecord(meta, rows))
            assert store.adopt(SampleInfo(f"s{i}", f"rows:{i}", len(ids), None, input_ids=ids), manifest).status == "ok"
    out = tmp_path / "drafter"
    assert E.main(["--model", tiny["path"], "--tree", str(tree), "--out", str(out), "--steps", "60"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records"] == 8 and summary["records_failed"] == 0 and summary["aux_layer_ids"] == list(AUX)
    assert summary["loss_last"] < summary["loss_first"]
    drafter, _ = E.load_eagle3(out, tiny["f32"].get_input_embeddings().weight)
    v, prompts = tiny["verifier"], tiny["prompts"][:4]
    before = A.measure(v, E.Eagle3Proposer(_drafter(tiny)), prompts, k=K, new_tokens=16)
    after = A.measure(v, E.Eagle3Proposer(drafter), prompts, k=K, new_tokens=16)
    assert after.mean_length > before.mean_length + 0.2, (before.mean_length, after.mean_length)
    # not a tree: refused by name, exit 2
    assert E.main(["--model", tiny["path"], "--tree", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "indexes no captured record" in capsys.readouterr().err
