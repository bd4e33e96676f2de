"""Finite or failed: rows holding NaN or Inf never make a record anyone calls ok.

A model run past its own context (vLLM told to allow a longer ``max_model_len``), or a forward that overflows,
writes NaN/Inf rows that no checksum can tell from good ones: the checksum is of whatever was captured.  So every
record is checked where it is made (the connector's worker, on the rows' own device) and again where it is adopted
or read (the capture's store, ``inspect``, ``verify``, the trainer datasets, ``convert``); a record that fails is
the named reason ``non_finite`` (:data:`vllm_hs_compat.core.vocabulary.REASON_NON_FINITE`) or a
:class:`~vllm_hs_compat.errors.NonFiniteRecordError`.

The check looks at the bits: a float is NaN or Inf exactly when its exponent bits are all ones, so one masked
maximum per token row over the rows' integer view answers it (a single reduction, on the device that holds the
rows; about 3x the speed of ``isfinite(...).all()`` on a CPU, where bf16 arithmetic is emulated; on a CPU through
numpy where it is installed, see :func:`_host_flags`).

Pure: torch (and numpy, for CPU tensors, where installed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import torch

from vllm_hs_compat.errors import NonFiniteRecordError

if TYPE_CHECKING:
    from vllm_hs_compat.core.records import CaptureRecord

#: dtype -> (the integer dtype of the same width, its exponent mask): NaN/Inf iff ``bits & mask == mask``.
_EXPONENT: Final[dict[torch.dtype, tuple[torch.dtype, int]]] = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    # float8 e4m3fn has no Inf and one NaN per sign, S.1111.111: the same test with every low bit in the mask
    torch.float8_e4m3fn: (torch.int8, 0x7F),
}


def exponent_mask(dtype: torch.dtype) -> int | None:
    """The exponent bits of ``dtype`` as an integer mask (a value is NaN/Inf exactly when ``bits & mask == mask``;
    for float8 e4m3fn, its NaN), or None for a dtype the bit test does not cover.  The Triton row kernel flags token
    rows with it while it gathers them (:mod:`vllm_hs_compat.core._triton_rows`)."""
    spec = _EXPONENT.get(dtype)
    return None if spec is None else spec[1]


#: Bytes of rows :func:`_host_flags` masks at a time (within a core's L2 cache).
_HOST_BLOCK_BYTES: Final = 512 << 10

#: What a user reads about why rows are not finite, appended to every message.
CAUSES: Final = (
    "positions past the model's own context (max_position_embeddings: vLLM allowed a longer max_model_len), or an "
    "overflow in the model's forward (fp16 weights?)"
)


def token_flags(rows: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool on ``rows``' device: True where every value of token row ``t`` (all planes) is finite.

    ``rows``: ``[T, ...]`` (any trailing shape; contiguous for the fast path).  One masked reduction over the
    rows' bits for bf16 / fp16 / fp32; other dtypes go through ``isfinite``.  Asynchronous on CUDA (no host
    synchronisation): the result stays on the device until copied."""
    t = int(rows.shape[0]) if rows.dim() else 1
    if t == 0 or rows.numel() == 0:
        return torch.ones(t, dtype=torch.bool, device=rows.device)
    spec = _EXPONENT.get(rows.dtype)
    if spec is None or not rows.is_contiguous():
        return torch.isfinite(rows.reshape(t, -1).float()).all(dim=1)
    int_dtype, mask = spec
    bits = rows.view(int_dtype).reshape(t, -1)
    if bits.device.type == "cpu":
        host = _host_flags(bits, mask)
        if host is not None:
            return host
    return torch.bitwise_and(bits, mask).amax(dim=1) != mask


def _host_flags(bits: torch.Tensor, mask: int) -> torch.Tensor | None:
    """:func:`token_flags` of a CPU tensor's integer view through numpy (None where numpy is not installed): one
    thread, no OpenMP team.  The capture command adopts records in a thread beside the engine's; torch's own
    reduction there slowed vLLM's CPU engine beside it 1.8x (bench_capture, 2 cores), numpy's did not."""
    try:
        import numpy as np
    except ImportError:
        return None
    view = bits.numpy()
    t, width = view.shape
    out = np.empty(t, dtype=bool)
    # in blocks of rows that stay in the core's cache: the masked copy and its maximum read each byte from memory
    # once (whole-tensor: a temporary the rows' size, written and read back; 2-4x slower on 64 MiB records)
    step = max(1, _HOST_BLOCK_BYTES // max(1, width * view.itemsize))
    tmp = np.empty((min(step, t), width), dtype=view.dtype)
    for i in range(0, t, step):
        block = view[i : i + step]
        part = tmp[: block.shape[0]]
        np.bitwise_and(block, mask, out=part)
        np.not_equal(part.max(axis=1), mask, out=out[i : i + step])
    return torch.from_numpy(out)


def problem(
    rows: torch.Tensor,
    flags: torch.Tensor | None = None,
    *,
    start: int = 0,
    layer_ids: Sequence[int] | None = None,
) -> str | None:
    """None when every value of ``rows`` (``[T, P, C]``) is finite, else what is not, in words: how many token rows
    and values, the first position (``start`` + row) and the layer ids of its non-finite planes.

    ``flags``: :func:`token_flags` of ``rows`` computed earlier (e.g. on the device, copied with the rows); computed
    here when None.  Only a failing record pays for the counting."""
    ok = token_flags(rows) if flags is None else flags
    if bool(ok.all()):
        return None
    bad = (~ok).nonzero().flatten()
    first = int(bad[0])
    row = rows[first]
    values = int((~torch.isfinite(rows if rows.dtype in _EXPONENT else rows.float())).sum())
    where = ""
    if row.dim() >= 2:
        planes = [i for i in range(int(row.shape[0])) if not bool(torch.isfinite(row[i].float()).all())]
        named = layer_ids is not None and len(layer_ids) == row.shape[0]
        ids = [int(layer_ids[i]) for i in planes] if named and layer_ids is not None else planes
        where = f", {'layer ids' if named else 'planes'} {ids}"
    return (
        f"{int(bad.numel())} of {int(ok.numel())} token rows hold NaN/Inf ({values} values; the first at position "
        f"{start + first}{where}): {CAUSES}"
    )


def check_record(record: CaptureRecord, where: str) -> None:
    """Raise :class:`~vllm_hs_compat.errors.NonFiniteRecordError` when ``record``'s rows hold NaN or Inf.

    ``where`` names the reader in the message (e.g. ``"read by the trainer dataset"``)."""
    meta = record.meta
    found = problem(record.hidden_states, start=meta.start, layer_ids=meta.layer_ids)
    if found is not None:
        raise NonFiniteRecordError(f"record {meta.record_id!r} ({where}): {found}; it is not used")
