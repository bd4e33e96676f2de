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


def test_the_environment_table_is_envs() -> None:
    from vllm_hs_compat import envs

    assert _table("Environment variables", "| variable |") == list(envs.VARIABLES)


def _env_names_read_elsewhere(package: Path = PACKAGE) -> list[str]:
    """``VLLM_HS_COMPAT_*`` names written as string literals in code outside envs.py (docstrings and comments
    may name them; code reads them through :mod:`vllm_hs_compat.envs`)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "envs.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
                and re.fullmatch(r"VLLM_HS_COMPAT_[A-Z_]+", node.value)
            ):
                found.append(f"{path.relative_to(package.parent)}: {node.value}")
    return found


def test_no_module_reads_a_variable_by_its_own_spelling() -> None:
    assert _env_names_read_elsewhere() == []


def test_the_env_scan_finds_a_direct_read(tmp_path: Path) -> None:
    """Negative control: ``os.environ.get("VLLM_HS_COMPAT_LONE_READ")`` in a module is found; its docstring is not."""
    fake = tmp_path / "vllm_hs_compat"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "transfer.py").write_text(
        '"""VLLM_HS_COMPAT_LONE_READ"""\nimport os\nLONE = os.environ.get("VLLM_HS_COMPAT_LONE_READ", "1")\n'
    )
    assert _env_names_read_elsewhere(fake) == ["vllm_hs_compat/core/transfer.py: VLLM_HS_COMPAT_LONE_READ"]
