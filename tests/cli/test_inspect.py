"""``vllm-hs-compat inspect`` on file-sink records and on export tickets (shared memory and NIXL)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hsx_harness import BACKENDS

from vllm_hs_compat.cli import main
from vllm_hs_compat.commands.inspect import plane_stats
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.export import ExportProducer
from vllm_hs_compat.export.control import TOKEN_ENV, TOKEN_FILE_ENV
from vllm_hs_compat.export.files import record_paths, write_failure, write_record

LAYERS = (3, 7, 12)


def record(rid: str = "req-1", tokens: int = 20, *, planted: bool = True) -> CaptureRecord:
    """Random rows; ``planted``: one NaN in plane 1 and two Infs in plane 2 (a record that must never be ok)."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(tokens, 3, 16, generator=g).to(torch.bfloat16)
    if planted:
        rows[0, 1, 0] = float("nan")
        rows[1, 2, 3] = float("inf")
        rows[2, 2, 4] = float("-inf")
    meta = RecordMeta.for_tensor(rid, rows, list(range(100, 100 + tokens)), LAYERS, pre_norm=True, num_prompt_tokens=12)
    return CaptureRecord(meta, rows)


def inspect_in_a_process(target: str, token: str | None) -> subprocess.CompletedProcess[str]:
    """``inspect --json`` in a fresh process: with the trainer token in its environment, or with no credential
    but the ticket."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env[TOKEN_FILE_ENV] = "/nonexistent/hs-no-token"
    if token is not None:
        env[TOKEN_ENV] = token
    return subprocess.run(
        [sys.executable, "-m", "vllm_hs_compat.cli", "inspect", target, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["inspect", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)  # stdout holds the report and nothing else


def test_plane_statistics_match_torch_over_finite_values() -> None:
    rec = record(tokens=9000)  # more than one chunk of rows
    stats = plane_stats(rec.hidden_states, LAYERS)
    for p, st in enumerate(stats):
        x = rec.hidden_states[:, p].double().reshape(-1)
        f = x[torch.isfinite(x)]
        assert st["layer_id"] == LAYERS[p] and st["finite"] == f.numel()
        assert math.isclose(st["mean"], float(f.mean()), rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(st["std"], float(f.std(unbiased=False)), rel_tol=1e-9)
        assert (st["min"], st["max"]) == (float(f.min()), float(f.max()))
        assert st["absmax"] == float(f.abs().max())
    assert [(s["nan"], s["inf"]) for s in stats] == [(0, 0), (1, 0), (0, 2)]
    empty = plane_stats(torch.full((3, 1, 4), float("nan")), (5,))[0]
    assert (empty["mean"], empty["std"], empty["absmax"], empty["nan"]) == (None, None, None, 12)


def test_inspect_a_file_record_by_either_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = record(planted=False)
    manifest = write_record(tmp_path, rec)
    for target in (manifest, record_paths(tmp_path, "req-1")[0]):
        code, rep = run_json(capsys, str(target))
        assert code == 0 and rep["ok"] is True and rep["checksum"]["ok"] is True
        assert rep["record_id"] == "req-1" and rep["tokens"] == 20 and rep["layer_ids"] == list(LAYERS)
        assert rep["manifest"] == rec.meta.with_checksum(rep["checksum"]["expected"]).to_dict()
        assert rep["nonfinite"] == 0
    assert main(["inspect", str(manifest)]) == 0
    out = capsys.readouterr().out
    assert "checksum xxh3_64" in out and " ok" in out and "layer ids [3, 7, 12]" in out and "RESULT: ok" in out
    # the response's hs_file ticket names the manifest
    code, rep = run_json(capsys, json.dumps({"hs_file": {"v": 1, "record_id": "req-1", "manifest": str(manifest)}}))
    assert code == 0 and rep["record_id"] == "req-1"


def test_a_record_holding_nan_or_inf_is_never_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its checksum matches (it is of the NaN rows), its statistics are printed, and the verdict is ``non_finite``
    with exit status 1, never ``RESULT: ok``."""
    manifest = write_record(tmp_path, record("nan-1"))
    code, rep = run_json(capsys, str(manifest))
    assert code == 1 and rep["ok"] is False and rep["checksum"]["ok"] is True
    assert [p["nan"] for p in rep["planes"]] == [0, 1, 0] and rep["nonfinite"] == 3
    assert main(["inspect", str(manifest)]) == 1
    out = capsys.readouterr().out
    assert "RESULT: non_finite -- 3 NaN/Inf value(s) in layer ids [7, 12]" in out and "RESULT: ok" not in out


def test_inspect_reports_a_checksum_mismatch_and_unreadable_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = record()
    write_record(tmp_path, rec)
    tensors = record_paths(tmp_path, "req-1")[0]
    manifest = json.loads(record_paths(tmp_path, "req-1")[1].read_text())
    blob = bytearray(tensors.read_bytes())
    # flip a bit inside the hidden states (safetensors: 8-byte header length, JSON header, then the data)
    header = int.from_bytes(blob[:8], "little")
    start, _ = json.loads(blob[8 : 8 + header])["hidden_states"]["data_offsets"]
    blob[8 + header + start + 40] ^= 0x01
    tensors.write_bytes(bytes(blob))
    code, rep = run_json(capsys, str(tensors))
    assert code == 1 and rep["ok"] is False and rep["checksum"]["ok"] is False
    assert rep["checksum"]["expected"] == manifest["checksum"] != rep["checksum"]["computed"]
    assert main(["inspect", str(tensors)]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    write_failure(tmp_path, "gone", "blocks_unreadable", "preempted")
    code, rep = run_json(capsys, str(record_paths(tmp_path, "gone")[2]))
    assert code == 1 and rep["error"] == "RecordFailedError" and "preempted" in rep["message"]
    code, rep = run_json(capsys, str(tmp_path / "nothing.json"))
    assert code == 1 and rep["error"] == "RecordFormatError"


@pytest.mark.parametrize("backend", BACKENDS)
def test_inspect_fetches_an_export_ticket(backend: str, tmp_path: Path) -> None:
    p = ExportProducer(backend=backend, num_slots=4, slot_bytes=1 << 20)
    try:
        rec = record("exported", planted=False)
        params = p.publish(rec.meta, rec.hidden_states).kv_transfer_params()
        ticket_file = tmp_path / "response.json"
        ticket_file.write_text(json.dumps({"id": "cmpl-1", "kv_transfer_params": params}))
        # a client with nothing but its ticket: another process without the trainer token
        proc = inspect_in_a_process(str(ticket_file), token=None)
        assert proc.returncode == 0, proc.stderr
        rep = json.loads(proc.stdout)  # NIXL's and our progress lines went to stderr
        assert rep["source"] == {"kind": "export", "endpoint": p.endpoint, "principal": "record"}
        assert rep["record_id"] == "exported" and rep["checksum"]["ok"] is True
        assert rep["nonfinite"] == 0
        assert "fetching record 'exported'" in proc.stderr
        # the trainer token (environment) and a corrupted slot: fetched, reported as a mismatch, exit 1
        rec2 = record("bent", planted=False)
        params2 = p.publish(rec2.meta, rec2.hidden_states).kv_transfer_params()
        p.transport.buffer[p.pool._by_record["bent"].offset + 7] ^= 0x02
        proc = inspect_in_a_process(json.dumps(params2), token=p.token)
        assert proc.stdout, proc.stderr[-3000:]
        rep = json.loads(proc.stdout)
        assert proc.returncode == 1 and rep["source"]["principal"] == "trainer" and rep["checksum"]["ok"] is False
        st = p.stats()
        assert st["delivered"] == 2 and p.occupancy() == 0  # inspect takes the record (it says so)
    finally:
        p.close()
