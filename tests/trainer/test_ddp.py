"""DDP over several export endpoints and over files: a real gloo group of two spawned ranks, each with a DataLoader
of two forked workers, over two real shared-memory producers (the endpoints of two DP engines or two servers)
and over file-sink records.  Every published record reaches the loss exactly once, both ranks take the same
number of steps with ``even_steps``, a record published twice is dropped once and counted, and the producers'
ledgers balance.  Negative controls in the same run: without ``even_steps`` (and without dedupe) the ranks' step
counts differ for an odd number of items and the twice-published record reaches the loop twice."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from ddp_ranks import rank_main, record_for
from hsx_harness import ledger_balanced, producer_factory

from vllm_hs_compat.errors import DatasetConfigError
from vllm_hs_compat.export.files import write_record
from vllm_hs_compat.trainer import HiddenStatesDataset, even_steps

TOKEN = "t" * 43  # one trainer token for every producer: one server's DP engines share it


def _publish(p: Any, rid: str) -> None:
    rec = record_for(rid)
    p.publish(rec.meta, rec.hidden_states)


def test_two_ranks_two_workers_two_endpoints_every_record_once_equal_steps(tmp_path: Path) -> None:
    with producer_factory("shm") as make:
        # small pools: six producers fit a CI container's 64 MiB /dev/shm
        a1, b1, a2, b2, a3, b3 = (make(token=TOKEN, num_slots=32, slot_bytes=1 << 16) for _ in range(6))
        # uneven split over the endpoints (8 + 5) plus one record published on both: 15 items reach the loaders
        # (odd: two ranks cannot take equal steps of one item without even_steps)
        for phase, (a, b) in (("c", (a1, b1)), ("e", (a2, b2))):
            for i in range(8):
                _publish(a, f"{phase}-a{i}")
            for i in range(5):
                _publish(b, f"{phase}-b{i}")
            _publish(a, f"{phase}-dup")
            _publish(b, f"{phase}-dup")
        for i in range(3):
            _publish(a3 if i % 2 else b3, f"z-{i}")
        files = tmp_path / "files"
        files.mkdir()
        for k in range(11):
            write_record(files, record_for(f"f{k:02d}", token=k))
        phases = {
            "control": {"endpoints": [a1.endpoint, b1.endpoint], "token": TOKEN},
            # rank 1 stops after 3 records, rank 0 takes the rest: only even_steps can give them equal steps
            "even": {"endpoints": [a2.endpoint, b2.endpoint], "token": TOKEN, "max_records": [None, 3]},
            # rank 1 takes none: it pads with a batch sent by rank 0
            "empty": {"endpoints": [a3.endpoint, b3.endpoint], "token": TOKEN, "max_records": [None, 0]},
            "files": str(files),
            "lists": True,
        }
        mp.spawn(rank_main, args=(2, str(tmp_path / "store"), str(tmp_path), phases), nprocs=2, join=True)
        res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        named = {"a1": a1, "b1": b1, "a2": a2, "b2": b2, "a3": a3, "b3": b3}
        stats = {name: p.stats() for name, p in named.items()}

    for st in stats.values():  # every published record delivered once (the twice-published one once per producer)
        ledger_balanced(st)
        assert st["published"] == st["delivered"] and st["redelivered"] == 0 and st["claimed"] == st["delivered"]
    assert [stats[n]["delivered"] for n in ("a1", "b1", "a2", "b2", "a3", "b3")] == [9, 6, 9, 6, 1, 2]

    # the negative controls: without even_steps the step counts differ; without dedupe the copy reaches the loop
    control = [r["control"] for r in res]
    assert control[0]["steps"] + control[1]["steps"] == 15 and control[0]["steps"] != control[1]["steps"]
    got = collections.Counter(rid for c in control for rid, _ in c["seen"])
    assert got["c-dup"] == 2 and sum(got.values()) == 15 and all(n == 1 for rid, n in got.items() if rid != "c-dup")
    assert all(c["content_mismatch"] == 0 for c in control)

    # with even_steps: equal steps, every record once in the loss, the copy dropped and counted exactly once
    even = [r["even"] for r in res]
    assert even[0]["steps"] == even[1]["steps"] >= 11
    # rank 1 had at most 3 batches (fewer if rank 0 drained the producers before rank 1's workers asked)
    assert even[0]["padded"] == 0 and even[1]["steps"] - 3 <= even[1]["padded"] <= even[1]["steps"]
    assert even[1]["step_stats"]["padded_steps"] == even[1]["padded"]
    in_loss = collections.Counter(rid for e in even for rid, counted in e["seen"] if counted)
    want = {f"e-a{i}" for i in range(8)} | {f"e-b{i}" for i in range(5)} | {"e-dup"}
    assert set(in_loss) == want and all(n == 1 for n in in_loss.values())
    dropped = sum(e["ds_stats"]["duplicates"] + e["step_stats"]["duplicates"] for e in even)
    assert dropped == 1  # by the stream that got both copies, or by even_steps when two streams did
    assert sum(e["step_stats"]["records_in_loss"] for e in even) == 14
    assert all(e["content_mismatch"] == 0 for e in even)
    assert {e["step_stats"]["duplicates_seen"] for e in even} in ({0}, {1})  # the same view on both ranks

    empty = [r["empty"] for r in res]
    assert empty[0]["steps"] == empty[1]["steps"] == empty[1]["padded"] == 3 and empty[0]["padded"] == 0
    assert sorted(rid for rid, counted in empty[0]["seen"] if counted) == ["z-0", "z-1", "z-2"]

    # fixed batches: "y" reaches both ranks in one step: rank 0's copy counts, rank 1's is zeroed; pad and drop
    lists = [r["lists"] for r in res]
    assert lists[0]["pad"]["got"] == [[["x", "y"], [1, 1], False], [["p"], [1], False], [["q"], [1], False]]
    assert lists[1]["pad"]["got"] == [
        [["y", "z"], [0, 1], False],
        [["y", "z"], [0, 0], True],
        [["y", "z"], [0, 0], True],
    ]
    assert lists[1]["pad"]["stats"]["duplicates"] == 1 and lists[0]["pad"]["stats"]["duplicates"] == 0
    assert {r["pad"]["stats"]["duplicates_seen"] for r in lists} == {1}
    assert [len(r["drop"]["got"]) for r in lists] == [1, 1]  # the first rank to run out ends the pass
    assert lists[0]["drop"]["stats"]["dropped_batches"] == 1 and lists[0]["drop"]["stats"]["dropped_records"] == 1

    # files: RecordFileDataset.shard() over the real group, 2 ranks x 2 workers
    fl = [r["files"] for r in res]
    assert [(f["rank"], f["world"]) for f in fl] == [(0, 2), (1, 2)]
    assert fl[0]["steps"] == fl[1]["steps"] == 3
    assert sorted(k for f in fl for k in f["in_loss"]) == list(range(11))
    assert len([k for f in fl for k in f["seen"]]) == 12  # one padding item (zero loss mask)


def _batch(rids: list[str]) -> dict[str, Any]:
    import torch

    return {"record_id": rids, "loss_mask": torch.ones(len(rids), 3, dtype=torch.int64)}


def test_even_steps_in_one_process_drops_repeats_and_refuses_what_it_cannot_read() -> None:
    steps = even_steps([_batch(["a", "b"]), _batch(["b", "c"]), _batch(["d"])])
    out = list(steps)
    assert [b["loss_mask"][:, 0].tolist() for b in out] == [[1, 1], [0, 1], [1]]
    assert steps.stats["duplicates"] == 1 and steps.stats["records_in_loss"] == 4 and steps.stats["steps"] == 3
    assert [b["loss_mask"][:, 0].tolist() for b in even_steps([_batch(["a", "a"])], dedupe=False)] == [[1, 1]]
    with pytest.raises(DatasetConfigError, match="record_id"):
        list(even_steps([{"loss_mask": _batch(["a"])["loss_mask"]}]))
    with pytest.raises(DatasetConfigError, match="uneven"):
        even_steps([], uneven="repeat")
    with pytest.raises(DatasetConfigError, match="list of endpoints"):
        HiddenStatesDataset.from_export([], TOKEN)
    with pytest.raises(DatasetConfigError, match="listed twice"):
        HiddenStatesDataset.from_export(["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"], TOKEN)
