"""``vllm-hs-compat serve`` before anything starts (no vLLM needed): what it refuses and how fast, the command it
would run (the engine runs of the front door are tests/e2e/test_serve.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_hs_compat.adapters import adapter_for_version
from vllm_hs_compat.cli import main
from vllm_hs_compat.commands import serve as F
from vllm_hs_compat.commands import serve_args as S

CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 512,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def _ns(model: Path, *extra: str) -> object:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    F.register(sub)
    return parser.parse_args(["serve", str(model), "--layers", "2,4", *extra])


def test_extra_config_merges_and_is_checked(model: Path) -> None:
    ns = _ns(model, "--backend", "shm", "--extra-config", '{"export": {"num_slots": 8}, "check_requests": 0}')
    p = S.plan(ns, adapter_for_version("0.32.0"), "0.32.0", CONFIG)  # type: ignore[arg-type]
    extra = p.kv_transfer_config["kv_connector_extra_config"]
    assert not p.errors and extra["export"] == {"backend": "shm", "num_slots": 8} and extra["check_requests"] == 0
    bad = _ns(model, "--extra-config", '{"export": {"num_slot": 8}}')
    p = S.plan(bad, adapter_for_version("0.32.0"), "0.32.0", CONFIG)  # type: ignore[arg-type]
    assert len(p.errors) == 1 and "did you mean 'num_slots'" in p.errors[0]


def test_flags_the_front_door_owns_are_refused_after_the_separator(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(model), "--layers", "2,4", "--", "--port=9", "--max-model-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "['--port'] after -- would be read two ways" in err
    assert main(["serve", str(model), "--layers", "2,4", "--warmup-tokens", "4"]) == 2
    assert "too few" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # only serve takes arguments after --
        main(["serve-args", "--model", str(model), "--layers", "2,4", "--", "--enforce-eager"])


def test_a_typo_fails_in_seconds_with_the_message_last(model: Path) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_hs_compat.cli", "serve", str(model), "--layers", "2,4",
         "--extra-config", '{"captur": "all"}'],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("vllm-hs-compat serve: "), proc.stderr
    assert "unknown keys ['captur'] (did you mean 'capture'" in last, last  # checked before vLLM is looked for
    assert seconds < 20.0, seconds
