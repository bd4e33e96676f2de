"""What a record was made for: its sample fields (schema 2), as one value, and their checks.

``sample_id`` and ``source`` say which dataset row a record was made for; ``loss_mask_spans`` are the
``[start, stop)`` position ranges whose rows are trained; ``metadata_json`` is the client's free metadata as
canonical JSON (sorted keys, compact, ASCII, at most :data:`MAX_METADATA_BYTES` bytes), so the frozen record
metadata stays hashable.  :class:`~vllm_hs_compat.core.records.RecordMeta` carries them as four of its fields;
:class:`RecordSample` is the same four as one value, for the code that builds records (the connector, the capture
command, the trainer formats).

Pure: the standard library only.  Re-exported by :mod:`vllm_hs_compat.core.records`, where users import them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, Final

from ..errors import RecordFormatError
from .record_bounds import (
    EMPTY_METADATA,
    MAX_LOSS_MASK_SPANS,
    MAX_METADATA_BYTES,
    MAX_SAMPLE_ID_CHARS,
    MAX_SOURCE_CHARS,
    MAX_TOKENS,
    METADATA_DEPTH,
    check_int,
    check_str,
)


class _Budget:
    """A lower bound of the compact JSON's size, kept while walking a client's metadata: the walk stops as soon as
    the bound passes :data:`MAX_METADATA_BYTES` (so a huge object costs O(limit), not O(its size))."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = 0

    def spend(self, n: int, what: str) -> None:
        self.used += n
        if self.used > MAX_METADATA_BYTES:
            raise RecordFormatError(
                f"{what} is more than {MAX_METADATA_BYTES} bytes as compact JSON, at most {MAX_METADATA_BYTES} "
                "allowed; keep large data in your dataset and join it by sample_id"
            )


def _json_value(value: Any, what: str, depth: int, budget: _Budget) -> None:
    """Refuse what JSON cannot carry exactly (non-str keys, NaN/inf, tuples/sets/bytes/objects, deep nesting)."""
    if depth > METADATA_DEPTH:
        raise RecordFormatError(f"{what} nests deeper than {METADATA_DEPTH} levels")
    if isinstance(value, str):
        budget.spend(len(value) + 2, "metadata")
        return
    budget.spend(1, "metadata")
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RecordFormatError(f"{what} = {value!r}: JSON has no NaN or infinity")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _json_value(v, f"{what}[{i}]", depth + 1, budget)
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise RecordFormatError(f"{what} has key {k!r:.60} of type {type(k).__name__}; JSON keys are strings")
            budget.spend(len(k) + 3, "metadata")
            _json_value(v, f"{what}[{k!r}]", depth + 1, budget)
        return
    raise RecordFormatError(
        f"{what} holds a {type(value).__name__} ({value!r:.60}); metadata takes JSON values only (null, bool, int, "
        "float, str, list, object with str keys)"
    )


def canonical_metadata(metadata: Any, what: str = "metadata") -> str:
    """The canonical JSON (sorted keys, compact, ASCII) of a record's free user ``metadata``: a JSON object of at
    most :data:`MAX_METADATA_BYTES` bytes.  ``None`` is no metadata (``"{}"``).  Raises
    :class:`RecordFormatError` naming what cannot be carried."""
    if metadata is None:
        return EMPTY_METADATA
    if not isinstance(metadata, Mapping):
        raise RecordFormatError(
            f"{what} must be a JSON object (a mapping with str keys), found {type(metadata).__name__}"
        )
    _json_value(metadata, what, 0, _Budget())
    text = json.dumps(metadata, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    if len(text) > MAX_METADATA_BYTES:
        raise RecordFormatError(
            f"{what} is {len(text)} bytes as compact JSON, at most {MAX_METADATA_BYTES} allowed; keep large data "
            "in your dataset and join it by sample_id"
        )
    return text


def check_spans(spans: Any, what: str, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """``spans`` as a tuple of ``(start, stop)`` pairs, each non-empty (``start < stop``), sorted, not
    overlapping (adjacent is fine) and inside ``[lo, hi]``; at most :data:`MAX_LOSS_MASK_SPANS`.  Raises
    :class:`RecordFormatError` naming the first bad span."""
    if not isinstance(spans, list | tuple):
        raise RecordFormatError(f"{what} must be a list of [start, stop] pairs, found {type(spans).__name__}")
    if len(spans) > MAX_LOSS_MASK_SPANS:
        raise RecordFormatError(f"{what} has {len(spans)} spans, at most {MAX_LOSS_MASK_SPANS} allowed")
    out: list[tuple[int, int]] = []
    prev = lo
    for i, span in enumerate(spans):
        if not isinstance(span, list | tuple) or len(span) != 2:
            raise RecordFormatError(f"{what}[{i}] must be a [start, stop] pair, found {span!r:.60}")
        a = check_int(span[0], f"{what}[{i}][0] (start)", 0, MAX_TOKENS)
        b = check_int(span[1], f"{what}[{i}][1] (stop)", 0, MAX_TOKENS)
        if a >= b:
            raise RecordFormatError(
                f"{what}[{i}] = [{a}, {b}] is empty or reversed; a span is [start, stop), start < stop"
            )
        if a < prev:
            where = f"before position {lo}" if prev == lo else f"overlaps or precedes the span ending at {prev}"
            raise RecordFormatError(f"{what}[{i}] = [{a}, {b}] {where}; spans must be sorted and not overlap")
        if b > hi:
            raise RecordFormatError(f"{what}[{i}] = [{a}, {b}] runs past position {hi}")
        out.append((a, b))
        prev = b
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class RecordSample:
    """What a record was made for (the sample fields of :class:`~vllm_hs_compat.core.records.RecordMeta`, as one
    value)."""

    sample_id: str = ""
    source: str = ""
    loss_mask_spans: tuple[tuple[int, int], ...] | None = None
    metadata_json: str = EMPTY_METADATA

    @property
    def metadata(self) -> dict[str, Any]:
        """The metadata (a fresh dict from the canonical JSON)."""
        out: dict[str, Any] = json.loads(self.metadata_json)
        return out

    @property
    def empty(self) -> bool:
        return self == NO_SAMPLE


#: A record made for no particular sample (every sample field at its default).
NO_SAMPLE: Final = RecordSample()


def check_sample(sample: RecordSample, *, start: int, tokens: int, schema_version: int, what: str) -> RecordSample:
    """``sample`` validated for a record of rows ``[start, start + tokens)`` (spans as tuples); raises
    :class:`RecordFormatError` naming record ``what`` and the bad field.  A schema-1 record carries none."""
    if schema_version < 2:
        if sample != NO_SAMPLE:
            raise RecordFormatError(
                f"record {what!r} is schema {schema_version} but carries sample fields (schema 2: sample_id, source, "
                "loss_mask_spans, metadata); write it as schema 2"
            )
        return sample
    check_str(sample.sample_id, "sample_id", MAX_SAMPLE_ID_CHARS, allow_empty=True)
    check_str(sample.source, "source", MAX_SOURCE_CHARS, allow_empty=True)
    spans = sample.loss_mask_spans
    if spans is not None:
        spans = check_spans(spans, f"record {what!r}: loss_mask_spans", start, start + tokens)
    text = sample.metadata_json
    if not isinstance(text, str):
        raise RecordFormatError(f"record {what!r}: metadata_json must be a str, found {type(text).__name__}")
    if len(text) > MAX_METADATA_BYTES or text[:1] != "{":
        raise RecordFormatError(
            f"record {what!r}: metadata_json must be a JSON object of at most {MAX_METADATA_BYTES} bytes, found "
            f"{len(text)} characters starting {text[:20]!r}"
        )
    if text != EMPTY_METADATA:
        try:
            parsed = json.loads(text)
        except ValueError as e:
            raise RecordFormatError(f"record {what!r}: metadata_json is not JSON ({e})") from None
        if canonical_metadata(parsed, f"record {what!r}: metadata") != text:
            raise RecordFormatError(
                f"record {what!r}: metadata_json is not in canonical form (sorted keys, compact, ASCII); build it "
                "with canonical_metadata()"
            )
    if spans is sample.loss_mask_spans:
        return sample
    return RecordSample(sample.sample_id, sample.source, spans, text)
