"""What the capture's index says of a sample: who it is, which rank owns it, and its index row.

* :func:`sample_key` -- the key a sample is split, deduplicated and marked done by;
* :func:`owner_of` -- the rank that owns a key (``xxh3_64(key) % world_size``);
* :class:`SampleInfo` -- what the store needs to know of one sample;
* :class:`IndexRow` -- one row of an index part (the columns :data:`INDEX_COLUMNS`).

Pure Python (the rank split's hash through :mod:`vllm_hs_compat.core.checksums`).  Re-exported by
:mod:`vllm_hs_compat.capture.store`, where users import them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

#: Columns of every index part, in order.
INDEX_COLUMNS: Final = (
    "sample_id",
    "source",
    "status",
    "reason",
    "message",
    "record",
    "tokens",
    "loss_tokens",
    "bytes",
    "rank",
    "checksum",
    "metadata",
    "time",
)
#: Characters of a failure's message kept in an index row (and shown by the breaker).
MAX_MESSAGE: Final = 2000


def trim(message: str) -> str:
    """``message`` cut to :data:`MAX_MESSAGE` characters (an ellipsis says it was)."""
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def sample_key(sample_id: str, source: str) -> str:
    """The key a sample is split, deduplicated and marked done by: its id, or ``"@" + source`` without one."""
    return sample_id if sample_id else "@" + source


def owner_of(key: str, world_size: int) -> int:
    """The rank that owns ``key`` (see :func:`sample_key`) among ``world_size`` ranks: xxh3_64 of its UTF-8 bytes
    modulo the world size."""
    from vllm_hs_compat.core.checksums import checksum_bytes

    return checksum_bytes(key.encode("utf-8"), "xxh3_64") % world_size


@dataclass(frozen=True, slots=True)
class SampleInfo:
    """What the store needs to know of one sample.

    ``input_ids`` are exactly the token ids the engine was given; :meth:`CaptureStore.adopt
    <vllm_hs_compat.capture.store.CaptureStore.adopt>` needs them and adopts a record only when its token ids begin
    with them (and the record's prompt is exactly them: see adopt).  ``sample_id`` may be empty for a row that has
    none (a malformed line): the row is then keyed by its source."""

    sample_id: str
    source: str
    num_tokens: int
    loss_tokens: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    input_ids: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        return sample_key(self.sample_id, self.source)

    @classmethod
    def of(cls, sample: Any) -> SampleInfo:
        """From a :class:`vllm_hs_compat.capture.samples.Sample` (``sample_id``, ``source``, ``input_ids``,
        ``loss_mask``, ``metadata``)."""
        ids = tuple(int(t) for t in sample.input_ids)
        mask = getattr(sample, "loss_mask", None)
        return cls(
            sample_id=str(sample.sample_id),
            source=str(sample.source),
            num_tokens=len(ids),
            loss_tokens=None if mask is None else int(sum(mask)),
            metadata=dict(getattr(sample, "metadata", None) or {}),
            input_ids=ids,
        )


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One row of the index (the columns of ``index/rank-R-part-NNNNN.parquet``, :data:`INDEX_COLUMNS`)."""

    sample_id: str
    source: str
    status: str
    """"ok" (a verified record) or "failed"."""
    reason: str | None
    """Why it failed (None when ok): "tokenizer_mismatch", "bad_record", "partial_record", "missing_record",
    "non_finite", the connector's own reason from an ``.error.json``, or what the caller passed to
    :meth:`CaptureStore.fail <vllm_hs_compat.capture.store.CaptureStore.fail>`."""
    message: str | None
    record: str | None
    """The record's manifest, relative to the tree's root (posix separators); None when failed."""
    tokens: int
    """Token rows of the record (ok), or the sample's token count (failed)."""
    loss_tokens: int | None
    bytes: int
    """Bytes on disk of the record's two files (0 when failed)."""
    rank: int
    checksum: int | None
    """The record's hidden-states checksum (its manifest's ``checksum``)."""
    metadata: str
    """The sample's metadata as JSON text."""
    time: float
    """Unix time the row was written."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> IndexRow:
        return cls(**{k: d[k] for k in INDEX_COLUMNS})
