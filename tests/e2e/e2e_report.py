"""Collects what the e2e session shows at its end (pairing matrices, timings) and writes it to a report file
(``$HS_E2E_REPORT``, set by the nox session)."""

from __future__ import annotations

import os
from pathlib import Path

_SECTIONS: list[str] = []


def add(text: str) -> None:
    _SECTIONS.append(text)
    path = os.environ.get("HS_E2E_REPORT")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(text + "\n\n")


def lines() -> list[str]:
    out: list[str] = []
    for s in _SECTIONS:
        out.extend(f"[e2e] {line}" for line in s.splitlines())
    return out
