"""Trainer formats without the trainers (fast): files, keys, shapes, dtypes and flags each writer produces, the final
norm read from a model folder, layer numbering, drafter-config checks, the norm-state check, the sink option and
the ``convert`` command.  The real trainers reading these files: test_real_trainers.py (opt-in nox sessions)."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_hs_compat.cli import main
from vllm_hs_compat.connector.config import ConnectorConfig
from vllm_hs_compat.connector.sinks import FileSink
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.errors import CaptureConfigError, FinalNormError, FormatError, LayerNumberingError
from vllm_hs_compat.export.files import write_record
from vllm_hs_compat.trainer.final_norm import load_final_norm
from vllm_hs_compat.trainer.formats import (
    FORMAT_FILE,
    FormatWriter,
    base_norm_state,
    check_drafter_config,
    check_output,
    trainer_layer_ids,
)

C = 16
IDS = (1, 2, 3, 4)


def verifier(folder: Path, model_type: str = "llama", **extra: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": model_type, "num_hidden_layers": 4, "hidden_size": C, "rms_norm_eps": 1e-5, **extra}
    (folder / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    save_file(
        {"model.norm.weight": torch.randn(C, generator=gen) + 0.3, "model.embed_tokens.weight": torch.zeros(8, C)},
        str(folder / "model.safetensors"),
    )
    return folder


def record(k: int, t: int = 7, ids: tuple[int, ...] = IDS, dtype: torch.dtype = torch.float32) -> CaptureRecord:
    gen = torch.Generator().manual_seed(k)
    rows = (torch.randn(t, len(ids), C, generator=gen) * 3).to(dtype)
    meta = RecordMeta.for_tensor(f"r{k}", rows, list(range(10 + k, 10 + k + t)), ids, True, num_prompt_tokens=3)
    return CaptureRecord(meta, rows)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return verifier(tmp_path / "verifier")


# --- final norm ----------------------------------------------------------------------------------------------------
def test_final_norm_is_read_from_the_folder_and_applied_as_rmsnorm(model: Path) -> None:
    norm = load_final_norm(model)
    w = load_file(str(model / "model.safetensors"))["model.norm.weight"]
    assert torch.equal(norm.weight, w) and norm.eps == 1e-5 and norm.kind == "rmsnorm"
    x = torch.randn(5, C) * 4
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.allclose(norm.apply(x), want, rtol=1e-6, atol=1e-6)
    assert base_norm_state(norm.apply(x), norm) == "post"
    assert base_norm_state(x, norm) == "pre"  # negative control


def test_final_norm_refusals_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FinalNormError, match="no verifier model folder"):
        load_final_norm(tmp_path / "missing")
    with pytest.raises(FinalNormError, match="Gemma-style"):
        load_final_norm(verifier(tmp_path / "g", "gemma2"))
    with pytest.raises(FinalNormError, match="not known"):
        load_final_norm(verifier(tmp_path / "u", "mystery"))
    assert load_final_norm(tmp_path / "u", kind="rmsnorm").kind == "rmsnorm"
    with pytest.raises(FinalNormError, match="rms_norm_eps"):
        load_final_norm(verifier(tmp_path / "e", rms_norm_eps=None))
    bare = verifier(tmp_path / "w")
    save_file({"lm_head.weight": torch.zeros(2, C)}, str(bare / "model.safetensors"))
    with pytest.raises(FinalNormError, match="no final norm weight"):
        load_final_norm(bare)


# --- layer numbering -----------------------------------------------------------------------------------------------
def test_layer_ids_in_each_trainers_numbering() -> None:
    assert trainer_layer_ids("speculators", IDS, 4).trainer_ids == (1, 2, 3)
    assert trainer_layer_ids("specforge-eagle3", IDS, 4).trainer_ids == (0, 1, 2)
    assert trainer_layer_ids("modelopt", IDS, 4).trainer_ids == (0, 1, 2)
    assert trainer_layer_ids("specforge-dflash", IDS, 4).trainer_ids == (0, 1, 2, 3)
    assert "vLLM id - 1" in trainer_layer_ids("modelopt", IDS, 4).line()
    with pytest.raises(FormatError, match="base plane"):
        trainer_layer_ids("specforge-eagle3", (1, 2, 3), 4)
    with pytest.raises(FormatError, match="embeddings"):
        trainer_layer_ids("modelopt", (0, 2, 4), 4)


def test_drafter_config_off_by_one_is_refused() -> None:
    lm = trainer_layer_ids("specforge-eagle3", IDS, 4)
    ok = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    assert "matches" in check_drafter_config(ok, lm)
    with pytest.raises(LayerNumberingError, match="vLLM's numbering .* off by one"):
        check_drafter_config({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, lm)
    with pytest.raises(LayerNumberingError, match="differs"):
        check_drafter_config({"eagle_aux_hidden_state_layer_ids": [5, 9, 11]}, lm)
    assert "defaults" in check_drafter_config({"hidden_size": 8}, lm)
    spec = trainer_layer_ids("speculators", IDS, 4)
    with pytest.raises(LayerNumberingError, match="off by one"):
        check_drafter_config({"target_layer_ids": [0, 1, 2]}, spec)


# --- writers -------------------------------------------------------------------------------------------------------
def test_modelopt_files(model: Path, tmp_path: Path) -> None:
    w = FormatWriter(tmp_path / "mo", "modelopt", verifier=model, loss_mask="generated")
    recs = [record(0), record(1, t=4)]
    for r in recs:
        w.write(r)
    s = w.close()
    assert s["trainer_layer_ids"] == [0, 1, 2] and s["flags"] == {"hidden_states_prenorm": True}
    data = torch.load(tmp_path / "mo" / "r0.pt", weights_only=True)
    assert set(data) == {
        "input_ids",
        "hidden_states",
        "aux_hidden_states",
        "loss_mask",
        "hidden_states_prenorm",
        "conversation_id",
    }
    rows = recs[0].hidden_states
    assert torch.equal(data["hidden_states"], rows[:, 3]) and data["hidden_states_prenorm"] is True
    assert torch.equal(data["aux_hidden_states"], rows[:, :3].reshape(7, 3 * C))
    assert data["input_ids"].dtype == torch.int64 and data["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert (tmp_path / "mo" / "r0.pt").stat().st_size < rows.numel() * 4 + 4096  # no shared storage saved
    assert check_output(tmp_path / "mo", model)["files_checked"] == 2


@pytest.mark.parametrize("compress", [False, True])
def test_specforge_eagle3_files_hold_the_post_norm_base(model: Path, tmp_path: Path, compress: bool) -> None:
    w = FormatWriter(tmp_path / "sf", "specforge-eagle3", verifier=model, compress=compress)
    rec = record(0, dtype=torch.bfloat16)
    w.write(rec)
    s = w.close()
    assert s["base_plane_norm"] == "post" and s["final_norm"]["eps"] == 1e-5
    (path,) = (tmp_path / "sf").rglob("data_00000000.ckpt*")
    raw = gzip.decompress(path.read_bytes()) if compress else path.read_bytes()
    data = torch.load(io.BytesIO(raw), weights_only=True)
    assert set(data) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert data["hidden_state"].shape == (1, 7, C) and data["aux_hidden_state"].shape == (1, 7, 3 * C)
    assert data["hidden_state"].dtype == torch.bfloat16
    norm = load_final_norm(model)
    assert torch.equal(data["hidden_state"][0], norm.apply(rec.hidden_states[:, 3]))
    assert check_output(tmp_path / "sf", model)["files_checked"] == 1
    # negative control: the pre-norm base under SpecForge's post-norm key
    data["hidden_state"] = rec.hidden_states[:, 3].clone().unsqueeze(0)
    buf = io.BytesIO()
    torch.save(data, buf)
    path.write_bytes(gzip.compress(buf.getvalue()) if compress else buf.getvalue())
    with pytest.raises(FormatError, match="pre-norm .* declares it post-norm"):
        check_output(tmp_path / "sf", model)


def test_specforge_eagle3_without_the_norm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FinalNormError, match="after the verifier's final norm"):
        FormatWriter(tmp_path / "sf", "specforge-eagle3", num_hidden_layers=4)
    with pytest.raises(FinalNormError, match="Gemma"):
        FormatWriter(tmp_path / "sf", "specforge-eagle3", verifier=verifier(tmp_path / "g", "gemma3_text"))


def test_specforge_dflash_and_speculators_files(model: Path, tmp_path: Path) -> None:
    w = FormatWriter(tmp_path / "df", "specforge-dflash", verifier=model)
    rec = record(0)
    w.write(rec)
    assert w.close()["trainer_layer_ids"] == [0, 1, 2, 3]
    data = torch.load(next((tmp_path / "df").rglob("*.ckpt")), weights_only=True)
    assert torch.equal(data["hidden_states"][0], rec.hidden_states.reshape(7, 4 * C))

    w = FormatWriter(tmp_path / "sp", "speculators", num_hidden_layers=4, loss_mask="generated")
    for k in range(3):
        w.write(record(k))
    hs = load_file(str(tmp_path / "sp" / "hidden_states" / "hs_2.safetensors"))
    assert set(hs) == {"hidden_states", "token_ids"} and torch.equal(hs["hidden_states"], record(2).hidden_states)
    rows = [json.loads(line) for line in (tmp_path / "sp" / "rows.jsonl").read_text().splitlines()]
    assert [r["i"] for r in rows] == [0, 1, 2] and rows[2]["loss_mask"] == [0, 0, 0, 1, 1, 1, 1]
    pytest.importorskip("datasets")
    w.close()
    from datasets import load_from_disk

    ds = load_from_disk(str(tmp_path / "sp"))
    assert ds[2]["record_id"] == "r2" and torch.equal(ds[2]["input_ids"], torch.arange(12, 19))
    assert (tmp_path / "sp" / "token_freq.pt").exists()


def test_one_output_holds_one_geometry(model: Path, tmp_path: Path) -> None:
    w = FormatWriter(tmp_path / "mo", "modelopt", verifier=model)
    w.write(record(0))
    with pytest.raises(FormatError, match="one drafter config cannot describe both"):
        w.write(record(1, ids=(1, 2, 4)))


# --- sink and command ----------------------------------------------------------------------------------------------
def test_file_sink_format_option(model: Path, tmp_path: Path) -> None:
    extra = {"sink": "file", "file": {"path": str(tmp_path / "o"), "format": "modelopt", "verifier": str(model)}}
    cfg = ConnectorConfig.from_extra(extra)
    assert cfg.file_options == {"format": "modelopt", "verifier": str(model)}
    with pytest.raises(CaptureConfigError, match="file.format"):
        ConnectorConfig.from_extra({"sink": "file", "file": {"path": "x", "format": "eagle"}})
    with pytest.raises(CaptureConfigError, match="unknown keys"):
        ConnectorConfig.from_extra({"sink": "file", "file": {"path": "x", "layout": "x"}})
    with pytest.raises(CaptureConfigError, match="specforge-eagle3"):
        FileSink(str(tmp_path / "s"), format="specforge-eagle3")
    sink = FileSink(str(tmp_path / "o"), **cfg.file_options)
    sink.write(record(0))
    sink.close()
    assert json.loads((tmp_path / "o" / FORMAT_FILE).read_text())["records"] == 1


def test_convert_command(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "native"
    src.mkdir()
    for k in range(2):
        write_record(src, record(k))
    out = tmp_path / "sf"
    assert main(["convert", str(src), "--to", "specforge-eagle3", "--out", str(out), "--verifier", str(model)]) == 0
    text = capsys.readouterr().out
    assert "= [0, 1, 2]" in text and "post-norm as declared" in text
    # the printed train command pastes into a shell: the ids are one word (SpecForge's override parser needs that)
    assert " model.aux_hidden_state_layer_ids=[0,1,2]" in text
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps({"eagle_architecture_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}))
    argv = ["convert", str(src), "--to", "modelopt", "--out", str(tmp_path / "m"), "--verifier", str(model)]
    assert main([*argv, "--drafter-config", str(draft)]) == 2
    assert "off by one" in capsys.readouterr().err


def test_a_second_writer_continues_the_numbering_and_dp_ranks_write_apart(model: Path, tmp_path: Path) -> None:
    for k in range(2):  # a restarted server, or a second convert into the same folder
        w = FormatWriter(tmp_path / "sf", "specforge-eagle3", verifier=model)
        w.write(record(k))
        w.close()
    assert sorted(p.name for p in (tmp_path / "sf").rglob("*.ckpt")) == ["data_00000000.ckpt", "data_00000001.ckpt"]
    for k in range(2):
        w = FormatWriter(tmp_path / "sp", "speculators", num_hidden_layers=4)
        w.write(record(k))
        assert w.count == k + 1
    assert sorted(p.name for p in (tmp_path / "sp" / "hidden_states").iterdir()) == [
        "hs_0.safetensors",
        "hs_1.safetensors",
    ]
    w = FormatWriter(tmp_path / "sf", "specforge-eagle3", verifier=model)
    with pytest.raises(FormatError, match="already holds records of layer ids"):
        w.write(record(5, ids=(1, 2, 4)))
    with pytest.raises(FormatError, match="holds a 'specforge-eagle3' output"):
        FormatWriter(tmp_path / "sf", "modelopt", verifier=model)
    sink = FileSink(str(tmp_path / "dp"), format="modelopt", verifier=str(model), dp_rank=1)
    assert sink.path == tmp_path / "dp" / "dp1"
