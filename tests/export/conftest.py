"""Fixtures of the export suite (the harness itself lives in hsx_harness.py, importable by the tests)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# UCX reads its environment once, when NIXL is first imported: set it before anything imports nixl.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hsx_harness import BACKENDS, Peer  # noqa: E402


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    """Long-lived peer processes for the module, created on first use by name.  A peer is transport-neutral:
    each test points its consumer at the test's own producer."""
    made: dict[str, Peer] = {}

    class _Lazy(dict[str, Peer]):
        def __missing__(self, key: str) -> Peer:
            p = Peer()
            made[key] = p
            self[key] = p
            return p

    yield _Lazy()
    for p in made.values():
        p.close()


@pytest.fixture
def peer(peers: dict[str, Peer], backend: str) -> Peer:
    return peers["main"]
