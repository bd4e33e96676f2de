"""The real trainers from PyPI read the package's trainer formats: their own readers, collate functions and teacher
targets, against the ground truth of a tiny verifier whose every hidden state and logit is known (trainer_truth).

Opt-in: each trainer's nox session (``nox -s "trainer(name='speculators')"``, ...) installs that trainer
``--no-deps`` with the modules it imports, and sets ``HS_TRAINER`` so a missing trainer fails instead of skipping.
Elsewhere (``nox -s tests``) these tests skip.

Every check has its negative control: the planes at the ids shifted by one differ from what the trainer reads, and a
base plane in the other norm state than its format declares (what the issue found: SpecForge/ModelOpt teachers
agreeing with the verifier 30 % of the time) is caught by ``check_output`` and visibly breaks the teacher.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from trainer_truth import Truth, make_verifier, top1_agreement, truths

from vllm_hs_compat.connector.sinks import FileSink
from vllm_hs_compat.errors import FormatError
from vllm_hs_compat.trainer.formats import FORMAT_FILE, check_output

TRAINER = os.environ.get("HS_TRAINER", "")
if not TRAINER and not any(importlib.util.find_spec(m) for m in ("speculators", "specforge", "modelopt")):
    pytest.skip("no drafter trainer installed (opt-in: nox -s trainer)", allow_module_level=True)


def need(module: str, trainer: str) -> ModuleType:
    """Import a trainer module: required in that trainer's session, else skip."""
    if TRAINER == trainer:
        return importlib.import_module(module)
    return pytest.importorskip(module)


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = make_verifier(root / "verifier")
        self.truths: list[Truth] = truths(self.model, 6)
        self.by_id = {t.record.meta.record_id: t for t in self.truths}
        self.by_tokens = {tuple(t.tokens): t for t in self.truths}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("trainers"))


def write(world: World, fmt: str, out: Path, **options: Any) -> dict[str, Any]:
    """Write every record through the package's file sink in ``fmt``; the summary it saved."""
    sink = FileSink(str(out), format=fmt, verifier=world.model, loss_mask="generated", **options)
    for t in world.truths:
        sink.write(t.record)
    sink.close()
    summary: dict[str, Any] = json.loads((out / FORMAT_FILE).read_text())
    return summary


def generated_mask(t: Truth) -> torch.Tensor:
    return (torch.arange(len(t.tokens)) >= t.record.meta.num_prompt_tokens).to(torch.int64)


def aux_truth(t: Truth, ids: list[int], shift: int) -> torch.Tensor:
    """The aux planes a drafter configured with ``ids`` (trainer numbering, trainer id = HF index - shift) expects:
    HF ``hidden_states[id + shift]`` concatenated; the last layer's output is taken before the final norm (HF's last
    entry is after it; SGLang's capture and vLLM's take the residual stream)."""
    planes = (*t.hf_hidden[:-1], t.pre_norm)
    return torch.cat([planes[i + shift] for i in ids], dim=-1)


# --- speculators ----------------------------------------------------------------------------------------------------
def test_speculators_reads_exact_records_and_builds_exact_teacher(world: World, tmp_path: Path) -> None:
    data = need("speculators.train.data", "speculators")
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader
    from transformers import AutoConfig

    out = tmp_path / "speculators"
    summary = write(world, "speculators", out)
    ids = summary["trainer_layer_ids"]
    assert ids == [1, 2, 3] and summary["base_plane_norm"] == "pre"
    ds = data.ArrowDataset(max_len=512, datapath=str(out), on_missing="raise", hidden_states_dtype=torch.float32)
    assert len(ds) == len(world.truths)
    for i in range(len(ds)):
        t = world.by_id[ds.data[i]["record_id"]]
        item = ds[i]
        assert torch.equal(item["input_ids"], torch.tensor(t.tokens))
        assert torch.equal(item["hidden_states"], aux_truth(t, ids, 0))  # speculators numbering = vLLM's
        assert not torch.allclose(item["hidden_states"], aux_truth(t, ids, 1))  # negative: ids shifted by one
        assert torch.equal(item["verifier_last_hidden_states"], t.pre_norm)
        assert torch.equal(item["loss_mask"], generated_mask(t))

    # Its packing sampler, CollateFn(preprocess=shift_batch) and a real forward/backward of its EAGLE-3 draft model:
    # the teacher logits its verifier_lm_head(verifier_norm(.)) computes, caught by a forward hook.
    loader = _setup_dataloader(
        ds, 512, 64, num_workers=0, num_target_layers=3, prefetch_factor=None, preprocess=shift_batch
    )
    cfg = AutoConfig.from_pretrained(world.model)
    cfg.num_hidden_layers = 1
    model = Eagle3DraftModel.from_training_args(
        verifier_config=cfg,
        verifier_name_or_path=world.model,
        target_layer_ids=ids,
        draft_vocab_size=int(cfg.vocab_size),
        norm_before_residual=False,
        ttt_steps=1,
        draft_attn_impl="eager",
    ).float()
    targets: list[torch.Tensor] = []
    model.verifier_lm_head.register_forward_hook(lambda _m, _i, o: targets.append(o.detach()))
    seen = 0
    agree: list[float] = []
    for batch in loader:
        _, loss, _ = model(
            hidden_states=batch["hidden_states"],
            input_ids=batch["input_ids"],
            document_ids=batch["document_ids"],
            loss_mask=batch["loss_mask"],
            position_ids=batch["position_ids"],
            verifier_last_hidden_states=batch["verifier_last_hidden_states"],
            ttt_steps=1,
            loss_config=resolve_loss_config("kl_div", "eager"),
        )
        loss.backward()
        docs = batch["document_ids"][0]
        for d in range(int(docs.max()) + 1):
            rows = docs == d
            shifted_ids = batch["input_ids"][0, rows].tolist()  # shift_batch dropped the first token
            t = next(x for x in world.truths if x.tokens[1:] == shifted_ids)
            got = targets[-1][0, rows]
            want = t.logits[1:]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            agree.append(top1_agreement(got, want))
            seen += 1
    assert seen == len(world.truths)  # every record in a packed batch, none dropped
    assert min(agree) == 1.0

    # Negative control: a base plane written post-norm while the format says pre-norm is caught by check_output,
    # and speculators' teacher (norm applied twice) no longer equals the verifier's.
    assert check_output(out, world.model)["files_checked"] == len(world.truths)
    from safetensors.torch import load_file, save_file

    bad = out / "hidden_states" / "hs_0.safetensors"
    tensors = load_file(str(bad))
    t0 = world.by_id[ds.data[0]["record_id"]]
    tensors["hidden_states"][:, -1] = t0.post_norm
    save_file(tensors, str(bad))
    with pytest.raises(FormatError, match="post-norm .* declares it pre-norm"):
        check_output(out, world.model)
    wrong = model.verifier_lm_head(model.verifier_norm(ds[0]["verifier_last_hidden_states"])).detach()
    assert top1_agreement(wrong, t0.logits) < 0.9


def test_speculators_packing_sampler_over_the_map_style_dataset(world: World, tmp_path: Path) -> None:
    """speculators' own packing sampler over two ranks and its CollateFn take RecordFileDataset's tensor-only items
    (native records, layout "speculators") as they are: every record exactly once, equal batch counts."""
    need("speculators.train.distributed_batch_sampler", "speculators")
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from torch.utils.data import DataLoader

    from vllm_hs_compat.trainer import RecordFileDataset

    sink = FileSink(str(tmp_path / "native"))
    for t in world.truths:
        sink.write(t.record)
    ds = RecordFileDataset(tmp_path / "native", layout="speculators", loss_mask="generated")
    seen: list[str] = []
    batches = []
    for rank in range(2):
        sampler = MultipackDistributedBatchSamplerV2(batch_max_length=64, lengths=ds.lengths, num_replicas=2, rank=rank)
        collate = CollateFn(64, 64, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch)
        loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate)
        batches.append(0)
        for batch in loader:
            batches[-1] += 1
            docs = batch["document_ids"][0]
            for d in range(int(docs.max()) + 1):
                rows = docs == d
                t = next(x for x in world.truths if x.tokens[1:] == batch["input_ids"][0, rows].tolist())
                assert torch.equal(batch["hidden_states"][0, rows], aux_truth(t, [1, 2, 3], 0)[:-1])
                assert torch.equal(batch["verifier_last_hidden_states"][0, rows], t.pre_norm[1:])
                assert torch.equal(batch["loss_mask"][0, rows], generated_mask(t)[1:])
                seen.append(t.record.meta.record_id)
    assert sorted(seen) == sorted(world.by_id) and batches[0] == batches[1]


# --- SpecForge ------------------------------------------------------------------------------------------------------
def _specforge_batch(out: Path) -> tuple[list[Any], list[dict[str, torch.Tensor]], dict[str, Any]]:
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer, build_offline_reader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    refs = build_offline_reader(str(out), run_id="t", ttt_length=1, max_len=512).read()
    store = LocalFeatureStore()
    normalize = build_offline_normalizer(512)
    items = []
    for ref in refs:
        raw, _handle = store.get(ref)
        items.append(normalize(raw))
    return refs, items, build_offline_collator()(items)


def _specforge_teacher(world: World, refs: list[Any], batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    from specforge.modeling.target.target_head import TargetHead
    from specforge.training.strategies.base import _prepare_eagle_target

    head = TargetHead(world.model)
    head.load_weights(world.model, lm_head_key="model.embed_tokens.weight")  # tied embeddings
    head.freeze_weights()
    input_ids, logits, _mask = _prepare_eagle_target(
        target_head=head.eval(),
        target_repr=refs[0].metadata["target_repr"],
        input_ids=batch["input_ids"],
        target=batch["target"],
        loss_mask=batch["loss_mask"],
        device=torch.device("cpu"),
    )
    return input_ids, logits.detach()


def test_specforge_eagle3_reads_exact_records_and_builds_exact_teacher(world: World, tmp_path: Path) -> None:
    need("specforge.runtime.data_plane.offline_reader", "specforge")
    out = tmp_path / "specforge"
    summary = write(world, "specforge-eagle3", out)
    ids = summary["trainer_layer_ids"]
    assert ids == [0, 1, 2] and summary["base_plane_norm"] == "post"
    refs, items, batch = _specforge_batch(out)
    assert len(refs) == len(world.truths)
    for item in items:
        t = world.by_tokens[tuple(item["input_ids"][0].tolist())]
        assert torch.equal(item["hidden_state"][0], aux_truth(t, ids, 1))  # SGLang numbering: layer j's output
        assert not torch.allclose(item["hidden_state"][0], aux_truth(t, ids, 0))  # negative: unshifted ids
        torch.testing.assert_close(item["target"][0], t.post_norm, rtol=0, atol=1e-6)
        mask = generated_mask(t)
        mask[-1] = 0  # SpecForge's normalizer drops the last row from the loss
        assert torch.equal(item["loss_mask"][0], mask)
    input_ids, logits = _specforge_teacher(world, refs, batch)
    agree = []
    for b, item in enumerate(items):
        t = world.by_tokens[tuple(item["input_ids"][0].tolist())]
        n = len(t.tokens) - 1  # TargetHead.preprocess shifts left by one
        assert input_ids[b, :n].tolist() == t.tokens[1:]
        torch.testing.assert_close(logits[b, :n].float(), t.logits[1:], rtol=1e-5, atol=1e-5)
        agree.append(top1_agreement(logits[b, :n], t.logits[1:]))
    assert min(agree) == 1.0
    assert check_output(out, world.model)["files_checked"] == len(world.truths)

    # Negative control: what a writer unaware of the norm produces (the pre-norm base in SpecForge's post-norm key).
    bad = tmp_path / "specforge-prenorm"
    summary_bad = write(world, "specforge-eagle3", bad)
    for path in sorted(bad.rglob("*.ckpt")):
        data = torch.load(path, weights_only=True)
        t = world.by_tokens[tuple(data["input_ids"].tolist())]
        data["hidden_state"] = t.pre_norm.clone().unsqueeze(0)
        buf = io.BytesIO()
        torch.save(data, buf)
        path.write_bytes(buf.getvalue())
    assert summary_bad["base_plane_norm"] == "post"
    with pytest.raises(FormatError, match="pre-norm .* declares it post-norm"):
        check_output(bad, world.model)
    refs, items, batch = _specforge_batch(bad)
    _, logits = _specforge_teacher(world, refs, batch)
    wrong = [
        top1_agreement(logits[b, : len(t.tokens) - 1], t.logits[1:])
        for b, t in enumerate(world.by_tokens[tuple(it["input_ids"][0].tolist())] for it in items)
    ]
    assert sum(wrong) / len(wrong) < 0.9


def test_specforge_dflash_reads_every_plane(world: World, tmp_path: Path) -> None:
    need("specforge.algorithms.common.dflash_family_data", "specforge")
    from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    out = tmp_path / "dflash"
    summary = write(world, "specforge-dflash", out)
    ids = summary["trainer_layer_ids"]
    assert ids == [0, 1, 2, 3]
    keys = ("input_ids", "loss_mask", "hidden_states")
    refs = OfflineManifestReader(str(out), strategy="dflash", feature_keys=keys, target_repr=None).read()
    assert len(refs) == len(world.truths)
    store = LocalFeatureStore()
    for ref in refs:
        raw, _ = store.get(ref)
        item = normalize_offline_sample(raw, 512)
        t = world.by_tokens[tuple(item["input_ids"][0].tolist())]
        assert torch.equal(item["hidden_states"][0], aux_truth(t, ids, 1))
        assert not torch.allclose(item["hidden_states"][0], aux_truth(t, ids, 0))
        assert torch.equal(item["loss_mask"][0], generated_mask(t))


# --- ModelOpt -------------------------------------------------------------------------------------------------------
def _modelopt_logits(world: World, out: Path) -> tuple[list[dict[str, Any]], dict[str, Any], torch.Tensor]:
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.modeling_fakebase import FakeBaseModel
    from modelopt.torch.speculative.plugins.modeling_final_norm import _maybe_apply_base_final_norm

    files = sorted(str(p) for p in out.glob("*.pt"))  # what ModelOpt's offline training globs
    ds = OfflineSupervisedDataset(files, answer_only_loss=True)
    items = [ds[i] for i in range(len(ds))]
    batch = EagleOfflineDataCollator(train_len=64)(items)
    fake = FakeBaseModel.from_source(world.model).float()
    outputs = batch["base_model_outputs"]
    # What HFEagleModel's offline forward does with them: re-apply the base norm if the file says pre-norm, lm_head.
    hidden = _maybe_apply_base_final_norm(outputs["base_model_hidden_states"], outputs, getattr(fake, "norm", None))
    with torch.no_grad():
        return items, batch, fake.lm_head(hidden)


def test_modelopt_reads_exact_records_and_builds_exact_teacher(world: World, tmp_path: Path) -> None:
    need("modelopt.torch.speculative.eagle.utils", "modelopt")
    out = tmp_path / "modelopt"
    summary = write(world, "modelopt", out)
    ids = summary["trainer_layer_ids"]
    assert ids == [0, 1, 2] and summary["flags"] == {"hidden_states_prenorm": True}
    items, batch, logits = _modelopt_logits(world, out)
    assert len(items) == len(world.truths)
    assert batch["base_model_outputs"]["base_hidden_prenorm"] is True
    agree = []
    for b, item in enumerate(items):
        t = world.by_tokens[tuple(item["input_ids"].tolist())]
        assert torch.equal(item["base_model_hidden_states"], t.pre_norm)
        assert torch.equal(item["aux_hidden_states"], aux_truth(t, ids, 1))  # forward hooks on layers[j]: outputs
        assert not torch.allclose(item["aux_hidden_states"], aux_truth(t, ids, 0))
        assert torch.equal(item["loss_mask"], generated_mask(t))
        n = len(t.tokens)
        torch.testing.assert_close(logits[b, :n], t.logits, rtol=1e-5, atol=1e-5)
        agree.append(top1_agreement(logits[b, :n], t.logits))
    assert min(agree) == 1.0
    assert check_output(out, world.model)["files_checked"] == len(world.truths)

    # Negative control: the same files without the flag (ModelOpt's default: post-norm) -- the silent 30 %.
    bad = tmp_path / "modelopt-noflag"
    write(world, "modelopt", bad)
    for path in bad.glob("*.pt"):
        data = torch.load(path, weights_only=True)
        data["hidden_states_prenorm"] = False
        torch.save(data, path)
    with pytest.raises(FormatError, match="pre-norm .* declares it post-norm"):
        check_output(bad, world.model)
    items, _, logits = _modelopt_logits(world, bad)
    wrong = [
        top1_agreement(logits[b, : len(it["input_ids"])], world.by_tokens[tuple(it["input_ids"].tolist())].logits)
        for b, it in enumerate(items)
    ]
    assert sum(wrong) / len(wrong) < 0.9


def test_specforge_post_norm_base_of_bf16_records_is_the_verifiers_own(world: World, tmp_path: Path) -> None:
    """On bf16 records (what a bf16 server captures) the written post-norm base equals the bf16 verifier's own
    post-norm hidden state bit for bit: the norm is the verifier's, in its rounding."""
    need("specforge.runtime.data_plane.offline_reader", "specforge")
    bf16 = truths(world.model, 3, dtype=torch.bfloat16, seed=1)
    out = tmp_path / "bf16"
    sink = FileSink(str(out), format="specforge-eagle3", verifier=world.model)
    for t in bf16:
        sink.write(t.record)
    sink.close()
    _, items, _ = _specforge_batch(out)
    assert len(items) == 3
    for item in items:
        t = next(x for x in bf16 if x.tokens == item["input_ids"][0].tolist())
        assert item["target"].dtype == torch.bfloat16
        assert torch.equal(item["target"][0], t.post_norm)
