"""``even_steps``: equal step counts over ``torch.distributed`` ranks for data whose length nobody knows (a stream
from export endpoints), and every record exactly once in the loss across ranks and DataLoader workers.

A stream cannot know its length: the producers hand each record to whichever consumer claims it first, so rank 0
may take 7 records and rank 1 six, and a DDP job whose ranks take different numbers of steps hangs in the
gradient all-reduce of the rank with one step more.  :func:`even_steps` wraps each rank's batches (a
``DataLoader``) and, before yielding a batch, has the ranks agree on what every rank holds -- one small
``all_gather_object`` per step on a gloo group (a separate one when the default group is NCCL, so no GPU sync),
as DDP's ``Join`` does with its per-step all-reduce:

* ``uneven="pad"`` (default): the pass ends when **every** rank has run out.  A rank that ran out earlier yields
  *padding* batches -- its last batch with an all-zero ``loss_mask`` (a rank that never had a batch gets one
  from a rank that has) -- so every rank takes the same number of steps and every record taken counts once in
  the loss.  ``steps.padding`` is True while the batch just yielded is padding.
* ``uneven="drop"``: the pass ends as soon as **one** rank has run out; the batches the others hold at that
  step are not trained (counted ``dropped_batches`` / ``dropped_records``) and neither are the records already
  in their DataLoaders' prefetch queues (delivered by the producers: compare the dataset's ``records`` counter
  with ``records_in_loss``).

Duplicates (``dedupe=True``, default): the same exchange carries each batch's record ids, so every rank sees every
rank's ids in the same order and drops the same copies: a record id already in the loss (on any rank, in the last
``window`` ids) or earlier in this step's order (lower rank first) has its rows' ``loss_mask`` zeroed on the rank
that holds the later copy, counted ``duplicates``.  The dataset's own window (``dedupe_window``) drops a
redelivered record that comes back to the same stream before it is batched; this one catches a copy that reached
another DataLoader worker or another rank (the producer delivers at least once; the same request retried on a
second server publishes the same id twice).  Padding batches carry no ids.

The loss must allow a batch whose ``loss_mask`` is all zeros (a padding step, or a batch of duplicates): divide
by ``loss_mask.sum().clamp(min=1)``, not by ``loss_mask.sum()``.  DDP still runs that rank's forward and backward
(its gradient is zero), so all ranks take part in every all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, Generic, TypeVar

import torch

from vllm_hs_compat import errors as E

B = TypeVar("B")

UNEVEN: Final = ("pad", "drop")
#: Default of ``window``: record ids remembered to drop a later copy (about 100 bytes each).
WINDOW: Final = 1 << 16
#: Counter names of :attr:`EvenSteps.stats`.
STEP_COUNTERS: Final = (
    "steps",  # batches yielded (padding included): the same on every rank
    "padded_steps",  # padding batches yielded by this rank
    "records_in_loss",  # record ids of this rank's batches that count in the loss (duplicates and padding not)
    "duplicates",  # items of this rank's batches whose loss mask was zeroed: an earlier copy is in the loss
    "duplicates_seen",  # duplicates over every rank (the same on every rank)
    "dropped_batches",  # uneven="drop": batches this rank held when another ran out (not yielded)
    "dropped_records",  # uneven="drop": the record ids in them
)

# code each rank sends per step: 2 = it holds a batch; 1 = it ran out and has a batch to pad with; 0 = it ran out
# and never had one
_HAS, _OUT, _EMPTY = 2, 1, 0
_GLOO_GROUPS: dict[int, Any] = {}


def _group_for(group: Any) -> Any:
    """The process group the per-step exchange runs on: ``group`` if given, the default group when it is gloo, else
    a gloo group over the same ranks (made once per default group; every rank must reach this point)."""
    import torch.distributed as dist

    if group is not None:
        return group
    if "gloo" in str(dist.get_backend()).lower():
        return None
    key = id(dist.group.WORLD)
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo")
    return _GLOO_GROUPS[key]


def zero_loss(batch: Any) -> Any:
    """``batch`` (a mapping with a ``loss_mask`` tensor) with an all-zero ``loss_mask`` (a new mapping; the
    tensors are not changed in place).  The default padding of :func:`even_steps`."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("loss_mask"), torch.Tensor):
        raise E.DatasetConfigError(
            "even_steps(uneven='pad') pads a rank that ran out with a batch whose loss_mask is zero, and this batch "
            f"has no loss_mask tensor (a {type(batch).__name__}"
            f"{' with keys ' + str(sorted(batch)) if isinstance(batch, Mapping) else ''}): pass pad_fn=... that "
            "makes a batch that trains nothing, or uneven='drop'"
        )
    out = dict(batch)
    out["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    return out


def _record_ids(batch: Any) -> list[str]:
    rid = batch.get("record_id") if isinstance(batch, Mapping) else None
    if isinstance(rid, str):
        return [rid]
    if isinstance(rid, list | tuple) and all(isinstance(r, str) for r in rid):
        return list(rid)
    raise E.DatasetConfigError(
        "even_steps(dedupe=True) drops a record that reached two ranks or workers by its record id, and this batch "
        f"has no 'record_id' (str, or a list of str): a {type(batch).__name__}"
        f"{' with keys ' + str(sorted(batch)) if isinstance(batch, Mapping) else ''}.  Keep record_id in the batch "
        "(HiddenStatesDataset items and collate_padded batches have it) or pass dedupe=False (files: "
        "RecordFileDataset.shard gives every rank equal, disjoint shares and needs no even_steps)"
    )


def _drop_items(batch: Any, positions: set[int], n: int) -> Any:
    """``batch`` with the loss mask of items ``positions`` (of ``n``) zeroed."""
    mask = batch.get("loss_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor):
        raise E.DatasetConfigError(
            "even_steps found a duplicate record in a batch without a loss_mask tensor, so it cannot take it out "
            "of the loss: keep loss_mask in the batch, or pass dedupe=False and drop duplicates yourself"
        )
    out = dict(batch)
    mask = mask.clone()
    if n == 1 and isinstance(batch.get("record_id"), str):
        mask.zero_()  # one item (batch_size=None): its whole mask
    else:
        if mask.dim() == 0 or mask.shape[0] != n:
            raise E.DatasetConfigError(
                f"even_steps: the batch has {n} record ids but its loss_mask has shape {tuple(mask.shape)} "
                "(expected the items on axis 0)"
            )
        for p in positions:
            mask[p].zero_()
    out["loss_mask"] = mask
    return out


class _Window:
    """The last ``size`` ids added."""

    def __init__(self, size: int) -> None:
        from collections import deque

        self.size = size
        self.ids: set[str] = set()
        self.order: deque[str] = deque()

    def add(self, rid: str) -> None:
        if rid in self.ids or self.size == 0:
            return
        self.ids.add(rid)
        self.order.append(rid)
        if len(self.order) > self.size:
            self.ids.discard(self.order.popleft())


class EvenSteps(Generic[B]):
    """Iterable over a rank's batches with equal step counts over ranks (see the module docstring); build it with
    :func:`even_steps`.  Each ``iter()`` is one pass (one epoch), and every rank must start it together."""

    def __init__(
        self,
        batches: Iterable[B],
        *,
        uneven: str = "pad",
        dedupe: bool = True,
        window: int = WINDOW,
        group: Any = None,
        pad_fn: Callable[[B], B] | None = None,
    ) -> None:
        if uneven not in UNEVEN:
            raise E.DatasetConfigError(f"uneven must be one of {UNEVEN}, found {uneven!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise E.DatasetConfigError(f"window must be an int >= 0, found {window!r}")
        self.batches = batches
        self.uneven = uneven
        self.dedupe = dedupe
        self.window = window
        self.group = group
        self.pad_fn: Callable[[Any], Any] = pad_fn if pad_fn is not None else zero_loss
        #: True while the batch just yielded is padding (this rank had run out)
        self.padding = False
        self._counts = dict.fromkeys(STEP_COUNTERS, 0)
        #: the record ids in the loss, over every rank, across passes (bounded by ``window``)
        self._seen = _Window(window)

    @property
    def stats(self) -> dict[str, int]:
        """This rank's counters (:data:`STEP_COUNTERS`), summed over passes."""
        return dict(self._counts)

    def __iter__(self) -> Iterator[B]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            group = _group_for(self.group)
            rank = dist.get_rank(group)
            world = dist.get_world_size(group)
        else:
            group, rank, world = None, 0, 1
        return self._iterate(group, rank, world)

    def _exchange(self, group: Any, world: int, mine: tuple[int, list[str]]) -> list[tuple[int, list[str]]]:
        if world == 1:
            return [mine]
        import torch.distributed as dist

        out: list[Any] = [None] * world
        dist.all_gather_object(out, mine, group=group)
        return [(int(c), list(ids)) for c, ids in out]

    def _template(self, group: Any, rank: int, src: int, batch: Any) -> Any:
        """Rank ``src``'s batch, sent to every rank (only when a rank that never had a batch must pad)."""
        import torch.distributed as dist

        obj = [batch if rank == src else None]
        global_src = src if group is None else dist.get_global_rank(group, src)
        dist.broadcast_object_list(obj, src=global_src, group=group)
        return obj[0]

    def _iterate(self, group: Any, rank: int, world: int) -> Iterator[B]:
        c = self._counts
        it = iter(self.batches)
        template: Any = None
        done = False
        self.padding = False
        while True:
            batch: Any = None
            if not done:
                try:
                    batch = next(it)
                except StopIteration:
                    done = True
            ids = _record_ids(batch) if self.dedupe and batch is not None else []
            code = _HAS if batch is not None else (_OUT if template is not None else _EMPTY)
            states = self._exchange(group, world, (code, ids))
            codes = [s[0] for s in states]
            if all(k != _HAS for k in codes):
                break
            if self.uneven == "drop" and any(k != _HAS for k in codes):
                if batch is not None:
                    c["dropped_batches"] += 1
                    c["dropped_records"] += len(ids)
                break
            if _EMPTY in codes:  # a rank must pad and has nothing to pad with: the first rank holding one sends it
                sent = self._template(group, rank, codes.index(_HAS), batch)
                if code == _EMPTY:
                    template = sent
            c["steps"] += 1
            drop: set[int] = set()
            if self.dedupe:  # on every rank, padding or not: all keep the same view of the ids in the loss
                step: set[str] = set()
                for r, (_k, rids) in enumerate(states):
                    for pos, rid in enumerate(rids):
                        if rid in self._seen.ids or rid in step:
                            c["duplicates_seen"] += 1
                            if r == rank:
                                drop.add(pos)
                        else:
                            step.add(rid)
                for rid in step:
                    self._seen.add(rid)
            if batch is None:
                self.padding = True
                c["padded_steps"] += 1
                yield self.pad_fn(template)
                continue
            self.padding = False
            template = batch
            if self.dedupe:
                c["records_in_loss"] += len(ids) - len(drop)
                if drop:
                    c["duplicates"] += len(drop)
                    batch = _drop_items(batch, drop, len(ids))
            yield batch
        self.padding = False


def even_steps(
    batches: Iterable[B],
    *,
    uneven: str = "pad",
    dedupe: bool = True,
    window: int = WINDOW,
    group: Any = None,
    pad_fn: Callable[[B], B] | None = None,
) -> EvenSteps[B]:
    """Wrap this rank's ``batches`` (a ``DataLoader``) so every ``torch.distributed`` rank takes the same number
    of steps and every record id counts once in the loss over all ranks (see the module docstring).

    ``uneven``: ``"pad"`` (default; ranks that ran out yield zero-loss padding batches until all have) or
    ``"drop"`` (stop when the first rank runs out).  ``dedupe``: drop later copies of a record id across ranks
    (needs ``record_id`` and ``loss_mask`` in the batch).  ``window``: how many ids are remembered.  ``group``: the
    process group to agree on (default: the default group if it is gloo, else a gloo group over the same ranks).
    ``pad_fn``: makes a padding batch from a real one (default :func:`zero_loss`).  Without an initialised process
    group it yields the batches as they are (dedupe still applies).

    ::

        steps = even_steps(DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate_padded))
        for batch in steps:
            loss = (per_token_loss(batch) * batch["loss_mask"]).sum() / batch["loss_mask"].sum().clamp(min=1)
    """
    return EvenSteps(batches, uneven=uneven, dedupe=dedupe, window=window, group=group, pad_fn=pad_fn)
