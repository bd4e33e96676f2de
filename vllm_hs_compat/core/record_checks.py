"""A record's metadata validated in one pass: each field checked once, in one order, the first inconsistency named.

:func:`check_meta` is the only validation of a :class:`~vllm_hs_compat.core.records.RecordMeta`; the struct runs
it once per value, when the value is made (``__post_init__``), and :meth:`RecordMeta.validate` runs it on demand.
It walks the fields in their declared order and, for each, tests the common case inline; only a value that fails
that test goes to the ``check_*`` function of :mod:`.record_bounds` that names it (or accepts an unusual but valid
one, such as an int subclass), so the message never depends on how the value was made.

Two entries, one pass:

* ``typed=False``: a value built in Python (``RecordMeta(...)``, ``msgspec.convert``, ``msgspec.structs.replace``,
  any decoder but the export wire's): every field's type and bounds, then what relates the fields to each other
  and to the known names.
* ``typed=True``: a value the export wire's decoder has just made (``decode_typed``): msgspec checked each field's
  type and bounds in C against the struct's annotated fields (the same bounds, :mod:`.record_bounds`), so only what
  relates the fields is left.  The checks it skips cannot fail on such a value, so both entries accept, refuse and
  name alike (tests/export/test_export_fuzz.py draws the values that keep them so).

Pure: msgspec and the standard library (torch only through :mod:`.dtypes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from ..errors import RecordFormatError
from .checksums import CHECKSUM_ALGORITHMS, MAX_CHECKSUM
from .dtypes import ITEMSIZE, torch_dtype
from .record_bounds import (
    EMPTY_METADATA,
    MAX_HIDDEN,
    MAX_ID_CHARS,
    MAX_LAYER_ID,
    MAX_PLANES,
    MAX_SAMPLE_ID_CHARS,
    MAX_SOURCE_CHARS,
    MAX_TOKENS,
    MAX_VOCAB_ID,
    SCHEMA_VERSIONS,
    check_int,
    check_ints,
    check_str,
)
from .record_sample import RecordSample, check_sample

#: ``RecordMeta``'s fields in their declared order: :func:`check_meta` reads them as one tuple
#: (``msgspec.structs.astuple``, one C call); tests/export/test_export_fuzz.py holds this equal to the struct's.
FIELDS: Final = (
    "record_id",
    "token_ids",
    "layer_ids",
    "pre_norm",
    "dtype",
    "shape",
    "checksum",
    "checksum_algorithm",
    "vllm_version",
    "adapter",
    "start",
    "num_prompt_tokens",
    "sample_id",
    "source",
    "loss_mask_spans",
    "metadata_json",
    "schema_version",
)


def check_meta(meta: msgspec.Struct, typed: bool = False) -> None:
    """Raise :class:`RecordFormatError` naming the first inconsistency of ``meta`` (a ``RecordMeta``), in field
    order.  Lists given for the tuple fields are stored as tuples (the value stays hashable), token ids given as
    other integer types as plain ints and loss-mask spans as tuples.  ``typed``: msgspec's decoder made the value
    and checked every field's type and bounds (see the module docstring)."""
    (rid, ids, layers, pre_norm, dtype, shape, checksum, algorithm, vllm_version, adapter, start, prompt,
     sample_id, source, spans, metadata_json, schema) = msgspec.structs.astuple(meta)  # fmt: skip
    if not typed:
        if type(ids) is not tuple:
            ids = _as_tuple(meta, "token_ids", ids)
        if type(layers) is not tuple:
            layers = _as_tuple(meta, "layer_ids", layers)
        if type(shape) is not tuple:
            shape = _as_tuple(meta, "shape", shape)
        if type(rid) is not str or not 0 < len(rid) <= MAX_ID_CHARS:
            check_str(rid, "record_id")
    if schema not in SCHEMA_VERSIONS:
        raise RecordFormatError(
            f"record schema version {schema} is not supported (this build reads {list(SCHEMA_VERSIONS)}); upgrade "
            "vllm-hs-compat on the side that reads it"
        )
    if dtype not in ITEMSIZE:
        torch_dtype(dtype)  # names it
    if typed:
        tokens, planes = shape[0], shape[1]
    else:
        if type(pre_norm) is not bool:
            raise RecordFormatError(f"pre_norm must be a bool, found {type(pre_norm).__name__}")
        if len(shape) != 3:
            raise RecordFormatError(f"shape must be [tokens, planes, hidden], found {list(shape)}")
        tokens, planes, hidden = shape
        if type(tokens) is not int or not 1 <= tokens <= MAX_TOKENS:
            tokens = check_int(tokens, "shape[0] (tokens)", 1, MAX_TOKENS)
        if type(planes) is not int or not 1 <= planes <= MAX_PLANES:
            planes = check_int(planes, "shape[1] (planes)", 1, MAX_PLANES)
        if type(hidden) is not int or not 1 <= hidden <= MAX_HIDDEN:
            check_int(hidden, "shape[2] (hidden)", 1, MAX_HIDDEN)
    if ids:  # () only in a descriptor's metadata (see RecordMeta's docstring)
        if len(ids) != tokens:
            raise RecordFormatError(
                f"record {rid!r}: {len(ids)} token ids but shape says {tokens} tokens; every row needs its token id"
            )
        if not typed:
            checked = check_ints(ids, "token_ids", 0, MAX_VOCAB_ID)
            if checked is not ids and checked != ids:  # e.g. 0-d tensors given: store plain ints
                msgspec.structs.force_setattr(meta, "token_ids", checked)
    if len(layers) != planes:
        raise RecordFormatError(f"record {rid!r}: {len(layers)} layer ids but shape says {planes} planes")
    prev = -1  # plain ints, strictly ascending, within [0, MAX_LAYER_ID]: the common case, told without naming
    for x in layers:
        if type(x) is not int or x <= prev:
            prev = MAX_LAYER_ID + 1
            break
        prev = x
    if prev > MAX_LAYER_ID:
        if not typed:
            check_ints(layers, "layer_ids", 0, MAX_LAYER_ID)
        if any(a >= b for a, b in zip(layers, layers[1:], strict=False)):
            raise RecordFormatError(
                f"layer_ids must be strictly ascending (planes are stored in ascending layer-id order), "
                f"found {list(layers)}; sort them and permute the planes the same way"
            )
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise RecordFormatError(f"unknown checksum algorithm {algorithm!r}; expected one of {CHECKSUM_ALGORITHMS}")
    if not typed:
        if checksum is not None and (type(checksum) is not int or not 0 <= checksum <= MAX_CHECKSUM):
            check_int(checksum, "checksum", 0, MAX_CHECKSUM)
        if type(vllm_version) is not str or len(vllm_version) > 64:
            check_str(vllm_version, "vllm_version", 64, allow_empty=True)
        if type(adapter) is not str or len(adapter) > 128:
            check_str(adapter, "adapter", 128, allow_empty=True)
        if type(start) is not int or not 0 <= start <= MAX_TOKENS:
            check_int(start, "start", 0, MAX_TOKENS)
        if type(prompt) is not int or not 0 <= prompt <= MAX_TOKENS:
            check_int(prompt, "num_prompt_tokens", 0, MAX_TOKENS)
    if (  # the common record (no spans, no metadata): no RecordSample built (this runs per record)
        spans is None
        and metadata_json == EMPTY_METADATA
        and (schema >= 2 or not (sample_id or source))
        and (
            typed
            or (
                isinstance(sample_id, str)
                and isinstance(source, str)
                and len(sample_id) <= MAX_SAMPLE_ID_CHARS
                and len(source) <= MAX_SOURCE_CHARS
            )
        )
    ):
        return
    sample = check_sample(
        RecordSample(sample_id, source, spans, metadata_json),
        start=start,
        tokens=tokens,
        schema_version=schema,
        what=rid,
    )
    if sample.loss_mask_spans != spans:  # lists instead of tuples: keep the value hashable
        msgspec.structs.force_setattr(meta, "loss_mask_spans", sample.loss_mask_spans)


def _as_tuple(meta: msgspec.Struct, name: str, value: Any) -> tuple[Any, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise RecordFormatError(f"{name} must be a list of ints, found {type(value).__name__}")
    out = tuple(value)
    msgspec.structs.force_setattr(meta, name, out)
    return out
