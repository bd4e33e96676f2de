"""The words users read in ``kv_transfer_params`` come from one module and one table: docs/connector.md lists
exactly the vocabulary's keys, statuses and reasons, no other module of the package spells a reason or a key
itself, and a full export pool fails a record for ``pool_full`` (as the docs say), any other sink error for
``sink``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from vllm_hs_compat.core import vocabulary as V
from vllm_hs_compat.errors import PoolFullError, RecordFormatError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_hs_compat"


def _table(section: str, header: str) -> list[str]:
    """The first column's backticked names of the table under ``header`` in ``section`` of docs/connector.md."""
    text = (ROOT / "docs" / "connector.md").read_text()
    body = text[text.index(f"## {section}") :]
    body = body[: body.index("\n## ", 1)]
    lines = body[body.index(header) :].splitlines()[2:]
    out = []
    for line in lines:
        if not line.startswith("|"):
            break
        m = re.match(r"\| `([^`]+)` \|", line)
        assert m is not None, line
        out.append(m[1])
    return out


def test_the_docs_table_is_the_vocabulary() -> None:
    section = "Keys, statuses and reasons"
    assert _table(section, "| key |") == list(V.KEYS)
    assert _table(section, "| `hs_record.status` |") == list(V.STATUSES)
    assert _table(section, "| reason |") == list(V.REASONS)


def _spelled_elsewhere(package: Path = PACKAGE) -> list[str]:
    """Module-level ``REASON_*``/``*_KEY``/``STATUS_*`` names bound to a string literal outside the vocabulary, and
    vocabulary words written as dict keys of a returned entry (``{"hs_record": ...}``)."""
    words = set(V.KEYS) | {V.RESULT_KEY}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "vocabulary.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
                for t in targets:
                    name = t.id if isinstance(t, ast.Name) else ""
                    literal = isinstance(value, ast.Constant) and isinstance(value.value, str)
                    if literal and re.fullmatch(r"REASON_\w+|STATUS_\w+|\w*PARAMS_KEY|\w+_KEY", name):
                        if value.value in words or name.startswith(("REASON_", "STATUS_")):  # type: ignore[union-attr]
                            found.append(f"{path.relative_to(package.parent)}: {name} = {value.value!r}")  # type: ignore[union-attr]
    return found


def test_no_module_spells_a_reason_status_or_key_itself() -> None:
    assert _spelled_elsewhere() == []


def test_the_scan_finds_a_spelled_reason(tmp_path: Path) -> None:
    """Negative control: a module that binds its own reason literal is found."""
    fake = tmp_path / "vllm_hs_compat"
    (fake / "connector").mkdir(parents=True)
    (fake / "connector" / "worker.py").write_text('REASON_SLOT_CHECK = "slot_check"\nRESULT_KEY = "hs_record"\n')
    assert _spelled_elsewhere(fake) == [
        "vllm_hs_compat/connector/worker.py: REASON_SLOT_CHECK = 'slot_check'",
        "vllm_hs_compat/connector/worker.py: RESULT_KEY = 'hs_record'",
    ]


def test_a_full_pool_is_pool_full_and_other_sink_errors_are_sink() -> None:
    assert V.reason_of(PoolFullError("no free slot")) == V.REASON_POOL_FULL == "pool_full"
    assert V.reason_of(RecordFormatError("bad")) == V.REASON_SINK
    assert V.reason_of(OSError("disk full")) == V.REASON_SINK
    assert set(V.REASONS) >= {V.reason_of(PoolFullError("x")), V.reason_of(OSError())}
    assert V.describe_reason("pool_full").startswith("pool_full (worker): ")
    assert "does not know" in V.describe_reason("from_the_future")
