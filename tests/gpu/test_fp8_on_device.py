"""fp8 storage quantized on the capture layer's GPU (runs where CUDA exists; skipped elsewhere).

A GPU engine's file sink quantizes ``--storage fp8_e4m3`` rows on the device (``files.quantize_fp8_measured(...,
device=cuda)``, piece by piece on a stream of its own) instead of on a host core.  The stored bytes and scales must be
the host's bit for bit (the same division and float8 rounding), the error figures equal to float32 rounding (the
norms reduce in another order), and the file it writes must read back like a host-written one.  Control: the rows of
another record give other bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.export import files

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")


def _rows(tokens: int = 300, planes: int = 4, hidden: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(tokens, planes, hidden, generator=g)
    rows[:, :, 11] *= 60.0  # outlier channels, as a residual stream has
    rows[7, 2] = 0.0  # a row of zeros: scale 1, error 0
    return rows.to(torch.bfloat16)


def test_device_quantization_equals_the_hosts_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _rows()
    host = files.quantize_fp8_measured(rows)
    monkeypatch.setattr(files, "FP8_PIECE_BYTES", 1 << 20)  # several pieces, a ragged last one
    dev = files.quantize_fp8_measured(rows, device=torch.device("cuda"))
    assert dev[0].device.type == "cpu" and dev[1].device.type == "cpu"
    assert torch.equal(dev[0].view(torch.uint8), host[0].view(torch.uint8)) and torch.equal(dev[1], host[1])
    assert dev[2] == pytest.approx(host[2], rel=1e-5) and dev[3] == pytest.approx(host[3], rel=1e-5)
    other = files.quantize_fp8_measured(rows.roll(1, 0), device=torch.device("cuda"))
    assert not torch.equal(other[0].view(torch.uint8), host[0].view(torch.uint8))


def test_a_record_written_with_the_device_reads_back_as_the_hosts(tmp_path: Path) -> None:
    rows = _rows(tokens=64)
    meta = RecordMeta.for_tensor("r", rows, list(range(64)), [2, 16, 29, 32], pre_norm=True)
    (tmp_path / "dev").mkdir()
    (tmp_path / "host").mkdir()
    m_dev = files.write_record(
        tmp_path / "dev", CaptureRecord(meta, rows), storage="fp8_e4m3", device=torch.device("cuda")
    )
    m_host = files.write_record(tmp_path / "host", CaptureRecord(meta, rows), storage="fp8_e4m3")
    assert torch.equal(files.read_record(m_dev).hidden_states, files.read_record(m_host).hidden_states)
    assert files.verify_record(m_dev).non_finite is None
