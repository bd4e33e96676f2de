"""The connector's worker on a CUDA capture cache (runs where CUDA exists; skipped elsewhere).

On a GPU a record's read is a copy queued on a side stream; vLLM may free the request's blocks once it is done.
The worker must report it then, whatever its sink is doing: before this, the publisher thread reported each read
only when it reached it, after the sink's writes of every record before it, so a sink slower than the engine held
the engine's blocks (measured on an H100: `capture --storage fp8_e4m3` stopped with records "unread" for 60 s of
steps while the sink was busy).  Held here with a sink that blocks in every write: every read is reported while no
record has reached the sink; releasing it publishes them all, with the rows of the cache.  Control: while the sink is
blocked, no record file exists (the sink really was the slow side).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_hs_compat.adapters import adapter_for_version
from vllm_hs_compat.adapters.reader import Ranks
from vllm_hs_compat.connector.config import ConnectorConfig
from vllm_hs_compat.connector.worker import CaptureWorker, WorkerFacts
from vllm_hs_compat.core.capture import SaveRequest, StepPlan
from vllm_hs_compat.core.groups import CaptureGroup
from vllm_hs_compat.core.labels import PlaneLabels
from vllm_hs_compat.export import files

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")

BLOCK, NUM_BLOCKS, PLANES, HIDDEN = 16, 64, 2, 256
LAYER = "cache_only_layers.4"


def _save(rid: str, blocks: list[int]) -> SaveRequest:
    n = len(blocks) * BLOCK
    return SaveRequest(rid, rid, tuple(blocks), 0, n, tuple(range(n)), n)


def test_reads_are_reported_when_their_copies_finish_not_when_the_sink_gets_them(tmp_path: Path) -> None:
    group = CaptureGroup(0, BLOCK, LAYER, merged=True, view="worker", capture_spec_type=None)  # type: ignore[arg-type]
    facts = WorkerFacts(group=group, labels=PlaneLabels((1, 3)), hidden_size=HIDDEN, ranks=Ranks())
    w = CaptureWorker(
        adapter_for_version("0.26.0"),
        ConnectorConfig.from_extra({"sink": "file", "file": {"path": str(tmp_path)}}),
        facts,
    )
    cache = torch.randn(NUM_BLOCKS, BLOCK, PLANES, HIDDEN, device="cuda").to(torch.bfloat16)
    w.register_kv_caches({LAYER: cache})
    sink = w.sink
    assert sink is not None
    release = threading.Event()
    write = sink.write

    def slow(record: Any, publication: Any) -> None:
        release.wait(30)
        write(record, publication)

    sink.write = slow  # type: ignore[method-assign,assignment]
    try:
        saves = {"a": [3, 7], "b": [9, 4, 5], "c": [11]}
        for step, (rid, blocks) in enumerate(saves.items()):
            w.reader.mark_written()  # type: ignore[union-attr]
            w.on_step(StepPlan(step, 0, BLOCK, [_save(rid, blocks)]))
        reported: set[str] = set()
        deadline = time.monotonic() + 10
        while reported != set(saves) and time.monotonic() < deadline:
            reported |= w.finished()
            time.sleep(0.01)
        assert reported == set(saves), f"reported {sorted(reported)} while the sink was blocked"
        assert not list(tmp_path.rglob("*.safetensors"))  # control: no record reached the sink yet
    finally:
        release.set()
    assert w.drain(30)
    for rid, blocks in saves.items():
        got = files.read_record(files.record_paths(tmp_path, rid)[1]).hidden_states
        want = cache[blocks].reshape(-1, PLANES, HIDDEN).cpu()
        assert torch.equal(got, want), rid
    w.shutdown(10)
