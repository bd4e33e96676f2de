"""Record batches: the records of one claim read together, their hidden states in one tensor and their metadata
as arrays.

A drafter trainer that streams many short records (a few KiB each) spends more time on per-record Python than
on the bytes when every record is its own tensor and its own :class:`~vllm_hs_compat.core.records.RecordMeta`.
:meth:`ExportConsumer.iter_batches <vllm_hs_compat.export.consumer.ExportConsumer.iter_batches>` hands out
:class:`RecordBatch` objects instead: the records of one claim that share a schema (layer ids, dtype, planes,
hidden size, provenance), packed back to back::

    for batch in consumer.iter_batches(max_records=256, idle_timeout_s=30):
        hs = batch.hidden_states            # [total_tokens, planes, hidden]
        ids = batch.token_ids               # [total_tokens] int64
        cu = batch.cu_tokens                # [len(batch) + 1]: record i is rows cu[i]:cu[i + 1]

Every record in a batch was verified exactly as :meth:`ExportConsumer.fetch` verifies one (hidden-state
checksum, token ids' checksum, its lease held through the read); a record that failed is not in any batch and its
error is handed out on its own (see ``iter_batches``).

Pure: torch and the standard library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

from vllm_hs_compat.core.dtypes import torch_dtype
from vllm_hs_compat.core.record_bounds import SCHEMA_VERSION
from vllm_hs_compat.core.record_sample import RecordSample
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.errors import RecordFormatError

__all__ = ["BatchSchema", "RecordBatch"]

_NONE = RecordSample()


@dataclasses.dataclass(frozen=True, slots=True)
class BatchSchema:
    """What every record of a batch shares: everything of its :class:`RecordMeta` except the request id, the token
    ids, the position fields and the checksum."""

    layer_ids: tuple[int, ...]
    pre_norm: bool
    dtype: str
    planes: int
    hidden: int
    checksum_algorithm: str
    vllm_version: str = ""
    adapter: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


class RecordBatch(Sequence[CaptureRecord]):
    """Verified records of one schema, packed.

    * ``hidden_states``: ``[total_tokens, planes, hidden]``, record ``i`` at rows ``cu_tokens[i]:cu_tokens[i + 1]``
      (planes in ascending layer-id order, as in every record);
    * ``token_ids``: ``[total_tokens]`` int64, the token id of every row;
    * ``cu_tokens``: ``[len + 1]`` int64 cumulative row counts (the ``cu_seqlens`` of varlen attention);
    * ``start``, ``num_prompt_tokens``: ``[len]`` int64, per record (see :class:`RecordMeta`);
    * ``record_ids`` and ``checksums``: per record;
    * ``samples``: per record, what it was made for (:class:`RecordSample`: sample id, source, loss-mask spans,
      metadata), or ``None`` when no record of the batch carries any (:meth:`sample` answers either way).

    Indexing or iterating gives :class:`CaptureRecord` views (their metadata is built and validated on access:
    the convenient path, not the fast one).  With ``copy=False`` the tensors view the consumer's landing buffer
    until :meth:`ExportConsumer.release` is called with the batch; otherwise the batch owns them."""

    __slots__ = (
        "checksums",
        "cu_tokens",
        "hidden_states",
        "num_prompt_tokens",
        "record_ids",
        "samples",
        "schema",
        "start",
        "token_ids",
    )

    def __init__(
        self,
        schema: BatchSchema,
        record_ids: tuple[str, ...],
        hidden_states: torch.Tensor,
        token_ids: torch.Tensor,
        cu_tokens: torch.Tensor,
        start: torch.Tensor,
        num_prompt_tokens: torch.Tensor,
        checksums: tuple[int, ...],
        samples: tuple[RecordSample, ...] | None = None,
    ) -> None:
        n = len(record_ids)
        rows = int(cu_tokens[-1]) if cu_tokens.numel() else -1
        if (
            cu_tokens.shape != (n + 1,)
            or hidden_states.shape != (rows, schema.planes, schema.hidden)
            or token_ids.shape != (rows,)
            or start.shape != (n,)
            or num_prompt_tokens.shape != (n,)
            or len(checksums) != n
            or (samples is not None and len(samples) != n)
        ):
            raise RecordFormatError(
                f"record batch of {n} records is inconsistent: cu_tokens {tuple(cu_tokens.shape)}, hidden states "
                f"{tuple(hidden_states.shape)} (expected [{rows}, {schema.planes}, {schema.hidden}]), token ids "
                f"{tuple(token_ids.shape)}, start {tuple(start.shape)}, {len(checksums)} checksums"
            )
        self.schema = schema
        self.record_ids = record_ids
        self.hidden_states = hidden_states
        self.token_ids = token_ids
        self.cu_tokens = cu_tokens
        self.start = start
        self.num_prompt_tokens = num_prompt_tokens
        self.checksums = checksums
        self.samples = samples

    def sample(self, i: int) -> RecordSample:
        """Record ``i``'s sample fields (the defaults when the batch carries none)."""
        return _NONE if self.samples is None else self.samples[i]

    def __len__(self) -> int:
        return len(self.record_ids)

    @property
    def num_tokens(self) -> int:
        """Rows in the batch (all records)."""
        return int(self.hidden_states.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        """Rows per record, ``[len]`` int64."""
        return self.cu_tokens[1:] - self.cu_tokens[:-1]

    def split(self) -> tuple[torch.Tensor, ...]:
        """Per-record views of ``hidden_states``."""
        return torch.split(self.hidden_states, self.lengths.tolist())

    def meta(self, i: int) -> RecordMeta:
        """Record ``i``'s full metadata (validated)."""
        s = self.schema
        a, b = int(self.cu_tokens[i]), int(self.cu_tokens[i + 1])
        sample = self.sample(i)
        return RecordMeta(
            record_id=self.record_ids[i],
            token_ids=tuple(self.token_ids[a:b].tolist()),
            layer_ids=s.layer_ids,
            pre_norm=s.pre_norm,
            dtype=s.dtype,
            shape=(b - a, s.planes, s.hidden),
            checksum=self.checksums[i],
            checksum_algorithm=s.checksum_algorithm,
            vllm_version=s.vllm_version,
            adapter=s.adapter,
            start=int(self.start[i]),
            num_prompt_tokens=int(self.num_prompt_tokens[i]),
            sample_id=sample.sample_id,
            source=sample.source,
            loss_mask_spans=sample.loss_mask_spans,
            metadata_json=sample.metadata_json,
            schema_version=s.schema_version,
        )

    def __getitem__(self, i: int) -> CaptureRecord:  # type: ignore[override]
        if not isinstance(i, int):
            raise TypeError(f"a record batch is indexed by int, not {type(i).__name__}")
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} of a batch of {len(self)}")
        a, b = int(self.cu_tokens[i]), int(self.cu_tokens[i + 1])
        return CaptureRecord(self.meta(i), self.hidden_states[a:b])

    def __iter__(self) -> Iterator[CaptureRecord]:
        return iter(self.records())

    def records(self) -> list[CaptureRecord]:
        """Every record: its tensor a view of ``hidden_states``, its metadata built and validated as :meth:`meta`
        builds it, with the batch's arrays converted to Python once (not per record)."""
        s = self.schema
        ids = self.token_ids.tolist()
        cu = self.cu_tokens.tolist()
        start = self.start.tolist()
        prompt = self.num_prompt_tokens.tolist()
        hs = self.hidden_states
        samples = self.samples or (_NONE,) * len(self.record_ids)
        out: list[CaptureRecord] = []
        for k, rid in enumerate(self.record_ids):
            lo, hi = cu[k], cu[k + 1]
            sample = samples[k]
            meta = RecordMeta(
                record_id=rid,
                token_ids=tuple(ids[lo:hi]),
                layer_ids=s.layer_ids,
                pre_norm=s.pre_norm,
                dtype=s.dtype,
                shape=(hi - lo, s.planes, s.hidden),
                checksum=self.checksums[k],
                checksum_algorithm=s.checksum_algorithm,
                vllm_version=s.vllm_version,
                adapter=s.adapter,
                start=start[k],
                num_prompt_tokens=prompt[k],
                sample_id=sample.sample_id,
                source=sample.source,
                loss_mask_spans=sample.loss_mask_spans,
                metadata_json=sample.metadata_json,
                schema_version=s.schema_version,
            )
            out.append(CaptureRecord(meta, hs[lo:hi]))
        return out

    def __repr__(self) -> str:
        s = self.schema
        return (
            f"RecordBatch({len(self)} records, {self.num_tokens} tokens, planes {list(s.layer_ids)}, "
            f"hidden {s.hidden}, {s.dtype})"
        )
