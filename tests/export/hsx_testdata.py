"""Deterministic record contents shared by the test process and the peer process."""

from __future__ import annotations

import hashlib

import torch

from vllm_hs_compat.core.records import RecordMeta, torch_dtype

DEFAULT_LAYERS = (2, 11, 23, 31)


def make_rows(seed: int, tokens: int, planes: int, hidden: int, dtype: str = "bfloat16") -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern is exercised, NaNs included)."""
    dt = torch_dtype(dtype)
    itemsize = torch.empty((), dtype=dt).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (tokens * planes * hidden * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dt).view(tokens, planes, hidden)


def make_finite_rows(seed: int, tokens: int, planes: int, hidden: int, dtype: str = "bfloat16") -> torch.Tensor:
    """:func:`make_rows` with every NaN and Inf made finite: for records read through a reader that refuses
    non-finite rows (the trainer datasets fail them as ``non_finite``)."""
    return torch.nan_to_num(make_rows(seed, tokens, planes, hidden, dtype), nan=0.0, posinf=1.0, neginf=-1.0)


def make_meta(record_id: str, rows: torch.Tensor, seed: int = 0) -> RecordMeta:
    tokens, planes, _ = rows.shape
    g = torch.Generator().manual_seed(seed + 1)
    token_ids = torch.randint(0, 150_000, (tokens,), generator=g).tolist()
    layers = tuple(range(3, 3 + 4 * planes, 4))
    return RecordMeta.for_tensor(
        record_id, rows, token_ids, layers, pre_norm=True, vllm_version="0.20.1", adapter="v0_20"
    )


def digest(t: torch.Tensor) -> str:
    flat = t.contiguous().view(torch.uint8).reshape(-1)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


class Clock:
    """A clock the pool tests move by hand (``LeasePool(clock=...)``)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def meta(rid: str) -> RecordMeta:
    """The metadata of a one-byte record (pool tests, where the bytes do not matter)."""
    return RecordMeta(rid, (1,), (0,), True, "uint8", (1, 1, 1), checksum=0)
