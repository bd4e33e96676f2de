"""The tools that moved out of ``demo/`` (issue 18) keep their old import names for one release, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = {
    "vllm_hs_compat.demo.reference": ("vllm_hs_compat.reference.forward", "ROW_TOL"),
    "vllm_hs_compat.demo.models": ("vllm_hs_compat.reference.models", "make_model"),
    "vllm_hs_compat.demo.drafter": ("vllm_hs_compat.drafter.head", "Eagle3Head"),
    "vllm_hs_compat.demo.acceptance": ("vllm_hs_compat.drafter.acceptance", "measure"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_warns_and_gives_the_moved_objects(old: str) -> None:
    new, name = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"moved to {new}"):
        mod = importlib.import_module(old)
    assert getattr(mod, name) is getattr(importlib.import_module(new), name)
    # negative control: a name the moved module lacks is still an AttributeError, not a silent None
    with pytest.raises(AttributeError):
        mod.no_such_name  # noqa: B018


def test_the_package_itself_imports_no_old_name() -> None:
    """Nothing in the package goes through a shim (each would warn at every user's import)."""
    import pathlib

    root = pathlib.Path(importlib.import_module("vllm_hs_compat").__file__).parent  # type: ignore[arg-type]
    users = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.parent.name != "demo" or p.stem not in {"reference", "models", "drafter", "acceptance"}
        if any(f"vllm_hs_compat.demo.{m}" in p.read_text() for m in ("reference", "models", "drafter", "acceptance"))
    ]
    assert users == [], users
