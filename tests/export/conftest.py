"""Fixtures of the export suite (the harness itself lives in hsx_harness.py, importable by the tests)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

# UCX reads its environment once, when NIXL is first imported: set it before anything imports nixl.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hsx_harness import BACKENDS, Peer, producer_factory  # noqa: E402

from vllm_hs_compat.export import ExportProducer  # noqa: E402
from vllm_hs_compat.export.control import TOKEN_ENV, TOKEN_FILE_ENV  # noqa: E402

NO_TOKEN_ENV: dict[str, str | None] = {TOKEN_ENV: None, TOKEN_FILE_ENV: "/nonexistent/hsx-no-token"}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_producer(backend: str) -> Iterator[Callable[..., ExportProducer]]:
    """``make(**kw)`` -> an ExportProducer on the test's ``backend``, closed after the test (a module may define its
    own)."""
    with producer_factory(backend) as make:
        yield make


@pytest.fixture(scope="session")
def peers() -> Iterator[dict[str, Peer]]:
    """Long-lived peer processes for the session (a peer costs seconds to start), created on first use by name.  A
    peer is transport-neutral: each test points its consumer at the test's own producer."""
    made: dict[str, Peer] = {}

    class _Lazy(dict[str, Peer]):
        def __missing__(self, key: str) -> Peer:
            # "no-token": a process that holds no trainer credential (no token variable, no token file)
            p = Peer(env=NO_TOKEN_ENV) if key == "no-token" else Peer()
            made[key] = p
            self[key] = p
            return p

    yield _Lazy()
    for p in made.values():
        p.close()


@pytest.fixture
def peer(peers: dict[str, Peer], backend: str) -> Peer:
    return peers["main"]
