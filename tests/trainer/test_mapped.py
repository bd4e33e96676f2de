"""``RecordFileDataset``: map-style items (tensors only), lengths without reading tensors, rank sharding with equal
step counts, ranks x DataLoader workers seeing every record exactly once (in the loss)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.errors import DatasetConfigError
from vllm_hs_compat.export.files import write_failure, write_record
from vllm_hs_compat.trainer import RecordFileDataset, collate_padded


def write_dir(d: Path, n: int) -> dict[str, CaptureRecord]:
    d.mkdir(exist_ok=True)
    out = {}
    for k in range(n):
        t = 3 + k % 5
        rows = torch.full((t, 3, 8), float(k)) + torch.arange(3 * 8, dtype=torch.float32).reshape(1, 3, 8)
        meta = RecordMeta.for_tensor(f"r{k:02d}", rows, [k] * t, (2, 5, 8), True, num_prompt_tokens=1)
        rec = CaptureRecord(meta, rows)
        write_record(d, rec)
        out[meta.record_id] = rec
    return out


def test_items_are_tensors_only_and_lengths_come_from_manifests(tmp_path: Path) -> None:
    recs = write_dir(tmp_path, 7)
    write_failure(tmp_path, "lost", "aborted", "client went away")
    ds = RecordFileDataset(tmp_path, layout="eagle3", loss_mask="generated")
    assert len(ds) == 7 and len(ds.failed) == 1
    assert ds.lengths == [recs[f"r{k:02d}"].meta.shape[0] for k in range(7)]
    item = ds[3]
    assert all(isinstance(v, torch.Tensor) for v in item.values())
    assert set(item) == {"input_ids", "loss_mask", "hidden_states", "aux_hidden_states", "lengths"}
    rec = recs["r03"]
    assert torch.equal(item["hidden_states"], rec.hidden_states[:, 2])
    assert torch.equal(item["aux_hidden_states"], rec.hidden_states[:, :2].reshape(-1, 16))
    assert item["loss_mask"].tolist() == [0] + [1] * (rec.meta.shape[0] - 1)
    meta = ds.metadata(3)
    assert meta["record_id"] == "r03" and meta["layer_ids"] == [2, 5, 8] and meta["pre_norm"] is True
    batch = collate_padded([ds[0], ds[1]])  # a stacking collate takes the items as they are
    assert batch["hidden_states"].shape[0] == 2


@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_two_ranks_two_workers_every_record_once_equal_steps(tmp_path: Path, uneven: str) -> None:
    write_dir(tmp_path, 11)
    ds = RecordFileDataset(tmp_path, layout="planes")
    seen: list[str] = []
    in_loss: list[str] = []
    steps = []
    for rank in range(2):
        shard = ds.shard(rank, 2, uneven=uneven, shuffle=True, seed=3, epoch=1)
        assert shard.lengths == [ds.lengths[i] for i in shard.indices]
        assert all(shard.metadata(i)["index"] == shard.indices[i] for i in range(len(shard)))
        loader = DataLoader(shard, batch_size=2, num_workers=2, collate_fn=collate_padded)
        n = 0
        for batch in loader:
            n += 1
            for b in range(batch["input_ids"].shape[0]):
                rid = f"r{int(batch['input_ids'][b, 0]):02d}"
                seen.append(rid)
                if int(batch["loss_mask"][b].sum()) > 0:
                    in_loss.append(rid)
        steps.append(n)
    assert steps[0] == steps[1]  # equal step counts
    if uneven == "pad":
        assert len(seen) == 12 and sorted(in_loss) == [f"r{k:02d}" for k in range(11)]  # each once in the loss
    else:
        assert len(seen) == 10 and len(set(seen)) == 10
    # deterministic: the same seed and epoch give the same shards; another epoch another order
    assert (
        ds.shard(0, 2, shuffle=True, seed=3, epoch=1).indices == ds.shard(0, 2, shuffle=True, seed=3, epoch=1).indices
    )
    assert (
        ds.shard(0, 2, shuffle=True, seed=3, epoch=2).indices != ds.shard(0, 2, shuffle=True, seed=3, epoch=1).indices
    )


def test_shard_reads_torch_distributed_and_refuses_bad_arguments(tmp_path: Path) -> None:
    import torch.distributed as dist

    write_dir(tmp_path / "d", 3)
    ds = RecordFileDataset(tmp_path / "d")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard = ds.shard()
        assert (shard.rank, shard.world_size, len(shard)) == (0, 1, 3)
    finally:
        dist.destroy_process_group()
    with pytest.raises(DatasetConfigError, match="rank"):
        ds.shard(2, 2)
    with pytest.raises(DatasetConfigError, match="uneven"):
        ds.shard(0, 2, uneven="repeat")
    with pytest.raises(DatasetConfigError, match="both"):
        ds.shard(0)
