"""``vllm-hs-compat convert tcp://HOST:PORT``: records streamed from a real shared-memory producer are written in
a trainer's format exactly as converting the same records from the file sink's files; a wrong token is refused
before anything is written (the negative control); the producer's ledger balances."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hsx_harness import ledger_balanced, producer_factory
from test_formats import record, verifier

from vllm_hs_compat.cli import main
from vllm_hs_compat.export.control import TOKEN_ENV
from vllm_hs_compat.export.files import write_record
from vllm_hs_compat.trainer.formats import FORMAT_FILE

TOKEN = "k" * 43


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _same_output(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        if name == FORMAT_FILE:  # the summary names its own folder
            sa, sb = json.loads(fa[name]), json.loads(fb[name])
            assert {**sa, "out": ""} == {**sb, "out": ""}
        elif name.endswith((".ckpt", ".pt")):
            da, db = torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)
            assert da.keys() == db.keys()
            for k, v in da.items():
                assert torch.equal(v, db[k]) if isinstance(v, torch.Tensor) else v == db[k], (name, k)
        else:
            assert fa[name] == fb[name], name


@pytest.mark.parametrize("fmt", ["specforge-eagle3", "modelopt"])
def test_convert_from_a_live_export_equals_converting_the_files(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = verifier(tmp_path / "verifier")
    recs = [record(k) for k in range(5)]
    src = tmp_path / "native"
    src.mkdir()
    for rec in recs:
        write_record(src, rec)
    want = tmp_path / "from-files"
    assert main(["convert", str(src), "--to", fmt, "--out", str(want), "--verifier", str(model)]) == 0
    capsys.readouterr()
    with producer_factory("shm") as make:
        p = make(token=TOKEN)
        for rec in recs:  # published in the files' name order: the stream gives them oldest first
            p.publish(rec.meta, rec.hidden_states)
        # the negative control: a wrong token is refused, nothing is written, nothing leaves the producer
        monkeypatch.setenv(TOKEN_ENV, "w" * 43)
        bad = tmp_path / "refused"
        assert main(["convert", p.endpoint, "--to", fmt, "--out", str(bad), "--verifier", str(model)]) == 2
        err = capsys.readouterr().err
        assert "AuthError" in err and not bad.exists() and p.occupancy() == 5
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        got = tmp_path / "from-export"
        argv = ["convert", p.endpoint, "--to", fmt, "--out", str(got), "--verifier", str(model), "--wait-s", "0.5"]
        assert main([*argv, "--max-records", "3"]) == 0  # stops at 3; the other two stay at the producer
        assert p.occupancy() == 2
        assert main(argv) == 0  # a second run continues the same output, then stops when idle
        text = capsys.readouterr().out
        st = p.stats()
    assert "= [0, 1, 2]" in text and "as declared" in text and "stream: 2 records" in text
    _same_output(want, got)
    assert (st["published"], st["delivered"]) == (5, 5)
    ledger_balanced(st)
