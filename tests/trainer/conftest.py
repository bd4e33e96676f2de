"""Fixtures of the trainer suite: real export producers (shared memory and NIXL over loopback) and file-sink
records, built with the export suite's deterministic test data."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

# UCX reads its environment once, when NIXL is first imported: set it before anything imports nixl.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "export"))

from hsx_harness import BACKENDS, producer_factory  # noqa: E402

from vllm_hs_compat.export import ExportProducer  # noqa: E402

MiB = 1 << 20


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_producer(backend: str) -> Iterator[Callable[..., ExportProducer]]:
    with producer_factory(backend) as make:
        yield make
