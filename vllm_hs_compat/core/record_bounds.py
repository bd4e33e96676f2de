"""The bounds of a record's metadata fields, and the checks that name a value outside them.

Every limit a :class:`~vllm_hs_compat.core.records.RecordMeta` field has lives here once: the struct's annotated
field types (checked by msgspec's decoder, in C), its one validation pass
(:mod:`vllm_hs_compat.core.record_checks`) and the manifest reader (``RecordMeta.from_dict``) all read them.  Each
``check_*`` function returns the value when it is good and raises :class:`RecordFormatError` naming the field, what
was found and what is allowed otherwise.

Pure: the standard library only.
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ..errors import RecordFormatError

#: The schema writers write.  2 added the sample fields (``sample_id``, ``source``, ``loss_mask_spans``,
#: ``metadata``); readers accept every version in :data:`SCHEMA_VERSIONS`.
SCHEMA_VERSION: Final = 2
SCHEMA_VERSIONS: Final = (1, 2)
MAX_ID_CHARS: Final = 512
MAX_TOKENS: Final = 1 << 24
MAX_PLANES: Final = 4096
MAX_HIDDEN: Final = 1 << 20
MAX_LAYER_ID: Final = 1 << 20
MAX_VOCAB_ID: Final = (1 << 32) - 1
#: Bounds of the sample fields (a client sets them per request: they travel in every descriptor and manifest).
MAX_SAMPLE_ID_CHARS: Final = 512
MAX_SOURCE_CHARS: Final = 1024
MAX_LOSS_MASK_SPANS: Final = 1024
#: Bytes of the canonical JSON of ``metadata`` (ASCII: ``ensure_ascii``, so characters = bytes).
MAX_METADATA_BYTES: Final = 4096
#: ``metadata_json`` of a record without metadata (the canonical JSON of an empty object).
EMPTY_METADATA: Final = "{}"
#: Deepest nesting of a record's free user metadata.
METADATA_DEPTH: Final = 16


def field_of(d: Mapping[str, Any], key: str) -> Any:
    """``d[key]``, or :class:`RecordFormatError` naming the missing field and those found."""
    if key not in d:
        raise RecordFormatError(f"record metadata lacks field {key!r}; found fields {sorted(d)}")
    return d[key]


def check_int(value: Any, what: str, lo: int, hi: int) -> int:
    """An int (not a bool) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordFormatError(f"{what} must be an int, found {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise RecordFormatError(f"{what} = {value} is outside [{lo}, {hi}]")
    return value


def check_str(value: Any, what: str, max_chars: int = MAX_ID_CHARS, allow_empty: bool = False) -> str:
    """A str of at most ``max_chars`` characters (at least one unless ``allow_empty``)."""
    if not isinstance(value, str):
        raise RecordFormatError(f"{what} must be a str, found {type(value).__name__}")
    if len(value) > max_chars or (not allow_empty and not value):
        raise RecordFormatError(f"{what} must have 1..{max_chars} characters, found {len(value)}")
    return value


def check_ints(seq: Sequence[Any], what: str, lo: int, hi: int) -> tuple[int, ...]:
    """Validate a list of ids and return it as a tuple of plain ints.

    Fast path for long lists: ``array("I", ...)`` converts in C, refusing non-integers and values outside
    uint32 (a bool would pass as 0/1 and come back as an int).  The per-item check runs only to name the
    culprit."""
    try:
        arr = array.array("I", seq)
    except (TypeError, OverflowError):
        arr = None
    in_range = lo <= 0 and hi >= 0xFFFFFFFF  # implied by uint32; min/max over 10^4 items is not free
    if arr is not None and (not arr or in_range or (min(arr) >= lo and max(arr) <= hi)):
        return tuple(arr.tolist())
    for i, v in enumerate(seq):
        check_int(v, f"{what}[{i}]", lo, hi)
    return tuple(seq)


def check_seq(value: Any, what: str, max_len: int) -> tuple[Any, ...]:
    """A list or tuple of at most ``max_len`` entries, as a tuple (its entries unchecked)."""
    if not isinstance(value, list | tuple):
        raise RecordFormatError(f"{what} must be a list of ints, found {type(value).__name__}")
    if len(value) > max_len:
        raise RecordFormatError(f"{what} has {len(value)} entries, at most {max_len} allowed")
    return tuple(value)


def check_int_seq(value: Any, what: str, lo: int, hi: int, max_len: int) -> tuple[int, ...]:
    """A list or tuple of at most ``max_len`` ints in ``[lo, hi]``, as a tuple of plain ints."""
    return check_ints(check_seq(value, what, max_len), what, lo, hi)
