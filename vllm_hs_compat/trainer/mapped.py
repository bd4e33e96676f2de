"""``RecordFileDataset``: the file sink's records as a map-style ``torch.utils.data.Dataset``.

Indexable, with every record's length known from its manifest before any tensor is read (``lengths``), so
shuffling, length-grouped and packing batch samplers work.  An item holds only tensors (the layout's token-axis
tensors plus ``lengths`` ``[1]``); what describes the record (its id, layer ids, prompt length, start, file) is
``metadata(i)``, never in the item, so any collate function that stacks or packs tensors takes it as is.

Sharding over ``torch.distributed`` ranks (:meth:`RecordFileDataset.shard`) is deterministic and gives every rank
the same number of items, so equal batch sizes make equal step counts (no rank waits in a collective for a peer
that ran out of data):

* ``uneven="drop"`` -- the last ``len % world_size`` records (of the possibly shuffled order) are left out of this
  epoch: every record at most once.
* ``uneven="pad"`` (default) -- the shortfall is filled with records from the start of the order, marked
  ``metadata(i)["padding"] = True`` and given an all-zero ``loss_mask``: every record exactly once in the loss,
  the padding items cost compute but no gradient signal.

Rank ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...`` of the order (the order is ``range(len)``, or a
permutation seeded by ``seed + epoch`` with ``shuffle=True``: the same on every rank).  DataLoader workers split a
map-style dataset's batches among themselves, so ranks x workers see every index once.  A sampler that packs by
length decides its own per-rank batch counts: use it over the unsharded dataset with its own rank handling.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import torch
from torch.utils.data import Dataset

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.finite import check_record
from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.trainer.layouts import LossMaskFn, check_layout, check_loss_mask, to_item

UNEVEN: Final = ("pad", "drop")
#: Item keys that are metadata (moved to :meth:`RecordFileDataset.metadata`).
META_KEYS: Final = ("record_id", "layer_ids", "num_prompt_tokens", "start", "sample_id", "loss_mask_from")


def dist_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default process group, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


class RecordFileDataset(Dataset[dict[str, torch.Tensor]]):
    """Native records under ``path`` (a folder, or a list of folders / manifests), sorted by name, as a map-style
    dataset of tensor-only items in ``layout`` (see :mod:`vllm_hs_compat.trainer.layouts`).

    Records whose manifest says they failed (``<record>.error.json``) are not items: they are listed in
    :attr:`failed`.  A record that fails when read (checksum, damaged file, does not fit the layout) raises its
    named error from ``__getitem__``."""

    def __init__(
        self,
        path: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        *,
        layout: str = "eagle3",
        loss_mask: str | LossMaskFn = "auto",
        dtype: torch.dtype | None = None,
        verify_checksum: bool = True,
    ) -> None:
        from vllm_hs_compat.trainer.dataset import _FileSource

        self.layout = check_layout(layout)
        self.loss_mask = check_loss_mask(loss_mask)
        self.dtype = dtype
        self.verify_checksum = verify_checksum
        self.manifests: list[Path] = []
        self.metas: list[RecordMeta] = []
        self.failed: list[Path] = []
        for m in _FileSource(path, verify_checksum).manifests():
            if m.name.endswith(".error.json"):
                self.failed.append(m)
                continue
            try:
                raw = json.loads(m.read_text())
            except (OSError, ValueError) as exc:
                raise E.RecordFormatError(f"{m}: cannot read the manifest ({type(exc).__name__}: {exc})") from None
            if not isinstance(raw, dict):
                raise E.RecordFormatError(f"{m}: the manifest is not a JSON object")
            raw.pop("tensors", None)
            self.manifests.append(m)
            self.metas.append(RecordMeta.from_dict(raw))

    def __len__(self) -> int:
        return len(self.manifests)

    @property
    def lengths(self) -> list[int]:
        """Token count of every item (from the manifests; no tensor read)."""
        return [m.shape[0] for m in self.metas]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from vllm_hs_compat.export.files import read_record

        record = read_record(self.manifests[index], verify_checksum=self.verify_checksum)
        if record.meta.record_id != self.metas[index].record_id:
            raise E.RecordFormatError(
                f"{self.manifests[index]}: the record changed since the dataset was built "
                f"({self.metas[index].record_id!r} -> {record.meta.record_id!r})"
            )
        check_record(record, "read by RecordFileDataset")  # NaN/Inf rows: NonFiniteRecordError, never an item
        item = to_item(record, self.layout, self.loss_mask, self.dtype)
        for key in META_KEYS:
            item.pop(key, None)
        item["lengths"] = torch.tensor([record.meta.shape[0]], dtype=torch.int64)
        return item

    def metadata(self, index: int) -> dict[str, Any]:
        """What describes item ``index``: ``record_id``, ``layer_ids`` (vLLM's numbering), ``pre_norm``,
        ``num_prompt_tokens``, ``start``, ``length``, ``path``, and what the record was made for: ``sample_id``,
        ``source``, ``loss_mask_spans`` (None: the record carries no mask) and ``metadata``."""
        m = self.metas[index]
        return {
            "sample_id": m.sample_id,
            "source": m.source,
            "loss_mask_spans": None if m.loss_mask_spans is None else [list(s) for s in m.loss_mask_spans],
            "metadata": m.metadata,
            "record_id": m.record_id,
            "layer_ids": list(m.layer_ids),
            "pre_norm": m.pre_norm,
            "num_prompt_tokens": m.num_prompt_tokens,
            "start": m.start,
            "length": m.shape[0],
            "path": str(self.manifests[index]),
        }

    def shard(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        uneven: str = "pad",
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
    ) -> RecordShard:
        """This rank's share (see the module docstring).  ``rank`` / ``world_size`` default to the initialised
        ``torch.distributed`` group's (``(0, 1)`` without one)."""
        if (rank is None) != (world_size is None):
            raise E.DatasetConfigError("pass both rank and world_size, or neither (torch.distributed's)")
        if rank is None or world_size is None:
            rank, world_size = dist_rank_world()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise E.DatasetConfigError(f"world_size must be an int >= 1, found {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise E.DatasetConfigError(f"rank must be an int in [0, {world_size}), found {rank!r}")
        if uneven not in UNEVEN:
            raise E.DatasetConfigError(f"uneven must be one of {UNEVEN}, found {uneven!r}")
        n = len(self)
        if shuffle:
            gen = torch.Generator().manual_seed(int(seed) + int(epoch))
            order = torch.randperm(n, generator=gen).tolist()
        else:
            order = list(range(n))
        padding = [False] * n
        if uneven == "drop":
            keep = n // world_size * world_size
            order, padding = order[:keep], padding[:keep]
        else:
            per = -(-n // world_size) if n else 0
            short = per * world_size - n
            if short > n:
                raise E.DatasetConfigError(
                    f"{n} records cannot pad {world_size} ranks to equal shares without using a record more than "
                    "twice; use fewer ranks or uneven='drop'"
                )
            order, padding = order + order[:short], padding + [True] * short
        return RecordShard(self, order[rank::world_size], padding[rank::world_size], rank, world_size)


class RecordShard(Dataset[dict[str, torch.Tensor]]):
    """One rank's share of a :class:`RecordFileDataset` (from :meth:`RecordFileDataset.shard`)."""

    def __init__(
        self, base: RecordFileDataset, indices: list[int], padding: list[bool], rank: int, world_size: int
    ) -> None:
        self.base = base
        self.indices = indices
        self.padding = padding
        self.rank = rank
        self.world_size = world_size

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def lengths(self) -> list[int]:
        all_lengths = self.base.lengths
        return [all_lengths[i] for i in self.indices]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = self.base[self.indices[index]]
        if self.padding[index]:
            item["loss_mask"] = torch.zeros_like(item["loss_mask"])
        return item

    def metadata(self, index: int) -> dict[str, Any]:
        """The record's :meth:`RecordFileDataset.metadata` plus ``padding`` (a repeat with a zero loss mask) and
        ``index`` (its position in the unsharded dataset)."""
        return {**self.base.metadata(self.indices[index]), "padding": self.padding[index], "index": self.indices[index]}
