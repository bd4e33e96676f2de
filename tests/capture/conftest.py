"""The capture data suite: a real tokenizer (the tiny local one of vllm_hs_compat.reference.models, trained once per
session and loaded through transformers) and row files written per test."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny tokenizer, saved by make_tokenizer (it carries the package's chat template) and loaded back."""
    from transformers import AutoTokenizer

    from vllm_hs_compat.reference.models import make_tokenizer

    path = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tokenizer(str(path))
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """Write rows (objects are dumped; strings are written as given, for malformed lines) to a JSONL file."""

    def write(rows: Iterable[Any], name: str = "rows.jsonl") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return path

    return write
