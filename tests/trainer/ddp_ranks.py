"""One rank of the DDP tests (tests/trainer/test_ddp.py), run by ``torch.multiprocessing.spawn``: a real gloo
process group, DataLoaders of two forked workers each, over real export producers (shared memory) in the test
process and over file-sink records.  Each rank writes what it saw to ``OUT/rank<r>.json``."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

LAYERS = (2, 5, 8)  # 8 = num_hidden_layers: the base plane
C = 8


def rows_for(rid: str) -> torch.Tensor:
    """The hidden states of record ``rid`` (deterministic: the test process and every rank make the same)."""
    seed = sum(ord(ch) * (i + 1) for i, ch in enumerate(rid))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3 + seed % 4, len(LAYERS), C, generator=g)


def record_for(rid: str, token: int = 7) -> Any:
    from vllm_hs_compat.core.records import CaptureRecord, RecordMeta

    rows = rows_for(rid)
    meta = RecordMeta.for_tensor(rid, rows, [token] * rows.shape[0], LAYERS, pre_norm=True)
    return CaptureRecord(meta, rows)


def _content_ok(batch: dict[str, Any]) -> int:
    """How many items of ``batch`` (eagle3 layout, collate_padded) do NOT hold their record's tensors."""
    bad = 0
    for b, rid in enumerate(batch["record_id"]):
        rows = rows_for(rid)
        t = rows.shape[0]
        if not (
            torch.equal(batch["hidden_states"][b, :t], rows[:, -1])
            and torch.equal(batch["aux_hidden_states"][b, :t], rows[:, :-1].reshape(t, -1))
        ):
            bad += 1
    return bad


def _stream_phase(
    eps: list[str], token: str, even: bool, dedupe_window: int | None, max_records: int | None = None
) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from vllm_hs_compat.trainer import HiddenStatesDataset, collate_padded, even_steps

    kw: dict[str, Any] = {} if dedupe_window is None else {"dedupe_window": dedupe_window}
    kw["consumer_kwargs"] = {"landing_bytes": 1 << 20}  # small records: a small landing buffer opens faster
    ds = HiddenStatesDataset.from_export(eps, token, wait_s=1.0, poll_s=0.2, max_records=max_records, **kw)
    loader = DataLoader(ds, batch_size=1, num_workers=2, collate_fn=collate_padded, multiprocessing_context="fork")
    batches: Any = even_steps(loader) if even else loader
    steps, padded, bad = 0, 0, 0
    seen: list[tuple[str, bool]] = []
    for batch in batches:
        steps += 1
        if even and batches.padding:
            padded += 1
            assert int(batch["loss_mask"].sum()) == 0
            continue
        bad += _content_ok(batch)
        for b, rid in enumerate(batch["record_id"]):
            seen.append((rid, int(batch["loss_mask"][b].sum()) > 0))
    return {
        "steps": steps,
        "padded": padded,
        "seen": seen,
        "content_mismatch": bad,
        "ds_stats": ds.stats,
        "step_stats": batches.stats if even else None,
    }


def _files_phase(root: str) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from vllm_hs_compat.trainer import RecordFileDataset, collate_padded

    shard = RecordFileDataset(root, layout="eagle3").shard(shuffle=True, seed=5)  # rank and world from the group
    steps = 0
    in_loss: list[int] = []
    seen: list[int] = []
    for batch in DataLoader(
        shard, batch_size=2, num_workers=2, collate_fn=collate_padded, multiprocessing_context="fork"
    ):
        steps += 1
        for b in range(batch["input_ids"].shape[0]):
            k = int(batch["input_ids"][b, 0])
            seen.append(k)
            if int(batch["loss_mask"][b].sum()) > 0:
                in_loss.append(k)
    return {"steps": steps, "seen": seen, "in_loss": in_loss, "rank": shard.rank, "world": shard.world_size}


def _batch(rids: list[str]) -> dict[str, Any]:
    return {"record_id": rids, "loss_mask": torch.ones(len(rids), 2, dtype=torch.int64)}


def _lists_phase(rank: int) -> dict[str, Any]:
    """even_steps over fixed per-rank batches: deterministic cross-rank dedupe, pad and drop."""
    from vllm_hs_compat.trainer import even_steps

    mine = {0: [["x", "y"], ["p"], ["q"]], 1: [["y", "z"]]}[rank]  # "y" on both ranks in the same step
    out: dict[str, Any] = {}
    for uneven in ("pad", "drop"):
        steps = even_steps([_batch(b) for b in mine], uneven=uneven)
        got = [(b["record_id"], b["loss_mask"][:, 0].tolist(), steps.padding) for b in steps]
        out[uneven] = {"got": got, "stats": steps.stats}
    return out


def rank_main(rank: int, world: int, store: str, out: str, phases: dict[str, Any]) -> None:
    """Run the phases named in ``phases`` on rank ``rank`` of ``world`` and write what was seen."""
    import torch.distributed as dist

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    result: dict[str, Any] = {"t_start": time.time()}
    try:
        if "control" in phases:  # without even_steps and without dedupe: the negative controls
            p = phases["control"]
            result["control"] = _stream_phase(p["endpoints"], p["token"], even=False, dedupe_window=0)
            dist.barrier()
            result["t_control"] = time.time()
        for name in ("even", "empty"):  # with even_steps; a rank's budget (max_records) makes the split uneven
            if name in phases:
                p = phases[name]
                budget = p["max_records"][rank]
                result[name] = _stream_phase(p["endpoints"], p["token"], True, None, budget)
                dist.barrier()
                result[f"t_{name}"] = time.time()
        if "lists" in phases:
            result["lists"] = _lists_phase(rank)
        if "files" in phases:
            result["files"] = _files_phase(phases["files"])
            dist.barrier()
            result["t_files"] = time.time()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
