"""Trainer side: capture records as PyTorch datasets (torch only; no vLLM).

::

    from torch.utils.data import DataLoader
    from vllm_hs_compat.trainer import HiddenStatesDataset

    ds = HiddenStatesDataset.from_export("tcp://10.0.0.5:7001", layout="eagle3")   # token from the env/file
    for item in DataLoader(ds, batch_size=None, num_workers=2):
        item["input_ids"], item["hidden_states"], item["aux_hidden_states"], item["loss_mask"]

Several export endpoints (DP engines, several servers) over torch.distributed ranks, equal step counts and every
record once in the loss: ``even_steps(DataLoader(HiddenStatesDataset.from_export([ep1, ep2]), ...))``.
Map-style over files, sharded over torch.distributed ranks: ``RecordFileDataset(path).shard()``.  A drafter
trainer's own on-disk format (speculators, SpecForge, ModelOpt): ``FormatWriter`` / ``vllm-hs-compat convert``.

See docs/trainer.md for the layouts, workers, resume and errors, and docs/trainers.md for the trainer formats.
"""

from vllm_hs_compat.trainer.collate import collate_padded
from vllm_hs_compat.trainer.dataset import COUNTERS, STATE_VERSION, HiddenStatesDataset
from vllm_hs_compat.trainer.formats import FormatWriter, check_output
from vllm_hs_compat.trainer.layouts import LAYOUTS, LOSS_MASKS, make_loss_mask, resolve_loss_mask, to_item
from vllm_hs_compat.trainer.mapped import RecordFileDataset, RecordShard
from vllm_hs_compat.trainer.specs import FORMATS, check_drafter_config, trainer_layer_ids
from vllm_hs_compat.trainer.steps import STEP_COUNTERS, EvenSteps, even_steps, zero_loss

__all__ = [
    "COUNTERS",
    "STEP_COUNTERS",
    "EvenSteps",
    "even_steps",
    "zero_loss",
    "FORMATS",
    "FormatWriter",
    "RecordFileDataset",
    "RecordShard",
    "check_drafter_config",
    "check_output",
    "trainer_layer_ids",
    "LAYOUTS",
    "LOSS_MASKS",
    "STATE_VERSION",
    "HiddenStatesDataset",
    "collate_padded",
    "make_loss_mask",
    "resolve_loss_mask",
    "to_item",
]
