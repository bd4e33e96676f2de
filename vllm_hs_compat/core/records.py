"""Self-describing capture records.

A record is the hidden states one finished request produced: a tensor ``[tokens, planes, hidden]`` whose
planes are stored in ascending layer-id order, plus the metadata a trainer needs to use it without trusting
anything else (layer ids, pre-norm flag, dtype, shape, token ids, checksum, provenance), and what it was made for
(schema 2: the sample id, its source, the loss-mask spans and free user metadata, see :class:`RecordMeta`).

Pure: imports torch, msgspec (the metadata's type: :class:`RecordMeta` is a :class:`msgspec.Struct`, the one shape
of a record's metadata from the connector to the trainer), xxhash and the standard library only, never vLLM.
msgspec and xxhash are hard dependencies of the package (pyproject), as torch is; vLLM depends on msgspec too.

Checksums (a transport-integrity check, not a defence against deliberate tampering):

* ``xxh3_64`` (default): XXH3, 64 bits, from the maintained ``xxhash`` library; memory speed (about the cost of
  one pass over the bytes, see docs/export.md for the figure against memcpy).  Any changed, swapped, truncated or
  misplaced bytes change it with probability 1 - 2**-64.
* ``crc32``: zlib's CRC-32, about 4x slower, for readers that only have zlib.
"""

from __future__ import annotations

import array
import contextvars
import copy
import ctypes
import dataclasses
import json
import math
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Final, TypeVar

import msgspec
import torch

from ..errors import ChecksumMismatchError, RecordFormatError

#: The schema writers write.  2 added the sample fields (``sample_id``, ``source``, ``loss_mask_spans``,
#: ``metadata``); readers accept every version in :data:`SCHEMA_VERSIONS`.
SCHEMA_VERSION: Final = 2
SCHEMA_VERSIONS: Final = (1, 2)
CHECKSUM_ALGORITHMS: Final = ("xxh3_64", "crc32")
DEFAULT_CHECKSUM: Final = "xxh3_64"
_MAX_CHECKSUM: Final = (1 << 64) - 1
_MAX_ID_CHARS: Final = 512
_MAX_TOKENS: Final = 1 << 24
_MAX_PLANES: Final = 4096
_MAX_HIDDEN: Final = 1 << 20
_MAX_LAYER_ID: Final = 1 << 20
_MAX_VOCAB_ID: Final = (1 << 32) - 1
#: Bounds of the sample fields (a client sets them per request: they travel in every descriptor and manifest).
MAX_SAMPLE_ID_CHARS: Final = 512
MAX_SOURCE_CHARS: Final = 1024
MAX_LOSS_MASK_SPANS: Final = 1024
#: Bytes of the canonical JSON of ``metadata`` (ASCII: ``ensure_ascii``, so characters = bytes).
MAX_METADATA_BYTES: Final = 4096
#: ``metadata_json`` of a record without metadata (the canonical JSON of an empty object).
EMPTY_METADATA: Final = "{}"
_METADATA_DEPTH: Final = 16

#: dtype name on the wire -> torch dtype.  Names are ``str(torch.dtype)`` without the ``torch.`` prefix.
DTYPES: Final[Mapping[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


_ITEMSIZE: Final[Mapping[str, int]] = {
    name: int(torch.empty((), dtype=dt).element_size()) for name, dt in DTYPES.items()
}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype; raises :class:`RecordFormatError` for dtypes records cannot carry."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise RecordFormatError(
        f"dtype {dtype} cannot be carried in a record; expected one of {sorted(DTYPES)}; "
        "cast the hidden states before exporting"
    )


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a wire dtype name (:class:`RecordFormatError` for an unknown one)."""
    torch_dtype(name)
    return _ITEMSIZE[name]


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a wire dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise RecordFormatError(
            f"unknown dtype name {name!r}; expected one of {sorted(DTYPES)}; "
            "producer and consumer may run different vllm-hs-compat versions"
        ) from None


def byte_view(data: torch.Tensor) -> memoryview:
    """Zero-copy buffer over a contiguous CPU tensor's bytes (no numpy needed).  Keep ``data`` alive while
    used."""
    n = data.numel() * data.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(data.data_ptr())).cast("B")


def _xxhash() -> Any:
    """The ``xxhash`` module (a dependency of this package; imported on first use, so an environment set up with
    ``--no-deps`` fails here with the fix, not at import)."""
    try:
        import xxhash
    except ImportError:
        raise RecordFormatError(
            "the xxh3_64 record checksum needs the 'xxhash' package (a dependency of vllm-hs-compat): pip install "
            "xxhash"
        ) from None
    return xxhash


class ChecksumState:
    """Incremental checksum over consecutive chunks of one byte string of ``total_bytes`` bytes (lets a reader
    verify chunk ``k`` while chunk ``k + 1`` is still in flight)."""

    def __init__(self, algorithm: str, total_bytes: int) -> None:
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise RecordFormatError(
                f"unknown checksum algorithm {algorithm!r}; expected one of {CHECKSUM_ALGORITHMS} "
                "(bsum64 was removed: it missed swapped words; re-export with xxh3_64)"
            )
        self.algorithm = algorithm
        self.total = total_bytes
        self.seen = 0
        self._xxh = _xxhash().xxh3_64() if algorithm == "xxh3_64" else None
        self._crc = 0

    def update(self, data: torch.Tensor) -> ChecksumState:
        """Feed the next chunk: a 1-D contiguous CPU ``uint8`` tensor."""
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous() or data.device.type != "cpu":
            raise RecordFormatError(
                f"checksum input must be a 1-D contiguous CPU uint8 tensor, got dtype={data.dtype} "
                f"dim={data.dim()} contiguous={data.is_contiguous()} device={data.device}; "
                "pass tensor.contiguous().view(torch.uint8).reshape(-1).cpu()"
            )
        n = data.numel()
        if self.seen + n > self.total:
            raise RecordFormatError(f"checksum fed {self.seen + n} bytes, expected {self.total}")
        if self._xxh is not None:
            self._xxh.update(byte_view(data))
        else:
            self._crc = zlib.crc32(byte_view(data), self._crc)
        self.seen += n
        return self

    def update_bytes(self, data: bytes | bytearray | memoryview) -> ChecksumState:
        """Feed the next chunk as a byte buffer (what :meth:`update` does after its tensor checks)."""
        n = len(data)
        if self.seen + n > self.total:
            raise RecordFormatError(f"checksum fed {self.seen + n} bytes, expected {self.total}")
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)
        self.seen += n
        return self

    def digest(self) -> int:
        """The checksum (an int in ``[0, 2**64)``); every byte must have been fed."""
        if self.seen != self.total:
            raise RecordFormatError(f"checksum fed {self.seen} of {self.total} bytes")
        if self._xxh is not None:
            return int(self._xxh.intdigest())
        return self._crc & 0xFFFFFFFF


def checksum_bytes(data: bytes | bytearray | memoryview, algorithm: str = DEFAULT_CHECKSUM) -> int:
    """Checksum of a byte string (same values as :func:`compute_checksum` of the same bytes)."""
    if algorithm == "xxh3_64":
        return int(_xxhash().xxh3_64_intdigest(data))
    if algorithm == "crc32":
        return zlib.crc32(data) & 0xFFFFFFFF
    raise RecordFormatError(f"unknown checksum algorithm {algorithm!r}; expected one of {CHECKSUM_ALGORITHMS}")


def checksum_function(algorithm: str) -> Callable[[bytes | bytearray | memoryview], int]:
    """The function :func:`checksum_bytes` calls for ``algorithm`` (looked up once for a loop over many
    records)."""
    if algorithm == "xxh3_64":
        fn: Callable[[bytes | bytearray | memoryview], int] = _xxhash().xxh3_64_intdigest
        return fn
    if algorithm == "crc32":
        return _crc32
    raise RecordFormatError(f"unknown checksum algorithm {algorithm!r}; expected one of {CHECKSUM_ALGORITHMS}")


def _crc32(data: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def compute_checksum(data: torch.Tensor, algorithm: str = DEFAULT_CHECKSUM) -> int:
    """Checksum of a 1-D contiguous CPU ``uint8`` tensor (see the module docstring for the algorithms)."""
    if not isinstance(data, torch.Tensor):
        raise RecordFormatError(f"checksum input must be a torch.Tensor, found {type(data).__name__}")
    return ChecksumState(algorithm, data.numel()).update(data).digest()


def _field(d: Mapping[str, Any], key: str) -> Any:
    if key not in d:
        raise RecordFormatError(f"record metadata lacks field {key!r}; found fields {sorted(d)}")
    return d[key]


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordFormatError(f"{what} must be an int, found {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise RecordFormatError(f"{what} = {value} is outside [{lo}, {hi}]")
    return value


def _str(value: Any, what: str, max_chars: int = _MAX_ID_CHARS, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RecordFormatError(f"{what} must be a str, found {type(value).__name__}")
    if len(value) > max_chars or (not allow_empty and not value):
        raise RecordFormatError(f"{what} must have 1..{max_chars} characters, found {len(value)}")
    return value


def _check_ints(seq: Sequence[Any], what: str, lo: int, hi: int) -> tuple[int, ...]:
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
        _int(v, f"{what}[{i}]", lo, hi)
    return tuple(seq)


def _seq(value: Any, what: str, max_len: int) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise RecordFormatError(f"{what} must be a list of ints, found {type(value).__name__}")
    if len(value) > max_len:
        raise RecordFormatError(f"{what} has {len(value)} entries, at most {max_len} allowed")
    return tuple(value)


def _int_seq(value: Any, what: str, lo: int, hi: int, max_len: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise RecordFormatError(f"{what} must be a list of ints, found {type(value).__name__}")
    if len(value) > max_len:
        raise RecordFormatError(f"{what} has {len(value)} entries, at most {max_len} allowed")
    return _check_ints(value, what, lo, hi)


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
    if depth > _METADATA_DEPTH:
        raise RecordFormatError(f"{what} nests deeper than {_METADATA_DEPTH} levels")
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
        a = _int(span[0], f"{what}[{i}][0] (start)", 0, _MAX_TOKENS)
        b = _int(span[1], f"{what}[{i}][1] (stop)", 0, _MAX_TOKENS)
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
    """What a record was made for (the sample fields of :class:`RecordMeta`, as one value)."""

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
        return self == _NO_SAMPLE


_NO_SAMPLE: Final = RecordSample()


def check_sample(sample: RecordSample, *, start: int, tokens: int, schema_version: int, what: str) -> RecordSample:
    """``sample`` validated for a record of rows ``[start, start + tokens)`` (spans as tuples); raises
    :class:`RecordFormatError` naming record ``what`` and the bad field.  A schema-1 record carries none."""
    if schema_version < 2:
        if sample != _NO_SAMPLE:
            raise RecordFormatError(
                f"record {what!r} is schema {schema_version} but carries sample fields (schema 2: sample_id, source, "
                "loss_mask_spans, metadata); write it as schema 2"
            )
        return sample
    _str(sample.sample_id, "sample_id", MAX_SAMPLE_ID_CHARS, allow_empty=True)
    _str(sample.source, "source", MAX_SOURCE_CHARS, allow_empty=True)
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


#: Field types of :class:`RecordMeta` (bounds the decoder checks in C; :meth:`RecordMeta.validate` checks them
#: again for a value built in Python, which msgspec does not check).
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=_MAX_VOCAB_ID)]
_LayerId = Annotated[int, msgspec.Meta(ge=0, le=_MAX_LAYER_ID)]
_Position = Annotated[int, msgspec.Meta(ge=0, le=_MAX_TOKENS)]
_REQUEST_ID_DEPRECATED: Final = (
    "RecordMeta's 'request_id' is now 'record_id' (one name for the id from the connector to the trainer); "
    "'request_id' still works in this release and will be removed in the next one"
)


def _warn_request_id(stacklevel: int) -> None:
    warnings.warn(_REQUEST_ID_DEPRECATED, DeprecationWarning, stacklevel=stacklevel + 1)


class _RecordMetaType(msgspec.StructMeta):
    """The metaclass of :class:`RecordMeta`: takes the deprecated keyword ``request_id`` for ``record_id``, with a
    :class:`DeprecationWarning` (a Struct cannot define ``__init__``; decoding never passes through here)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "request_id" in kwargs:
            _warn_request_id(2)
            if args or "record_id" in kwargs:
                raise TypeError("RecordMeta got both 'record_id' and its deprecated name 'request_id'")
            kwargs["record_id"] = kwargs.pop("request_id")
        return super().__call__(*args, **kwargs)


class RecordMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, metaclass=_RecordMetaType):
    """Metadata of one record: the one type that describes a record from the connector through the export wire to
    the trainer (a frozen :class:`msgspec.Struct`, validated once, when it is made or decoded).  ``shape`` is
    ``(tokens, planes, hidden)``; ``layer_ids[i]`` is plane ``i``.

    ``record_id`` names the record (the vLLM request id of the request that made it, unless the client chose
    another); ``request_id`` is its deprecated alias (it warns, and goes in the next release).

    ``token_ids`` holds the token id of each row.  It is empty (``()``) in one place only: the record descriptor
    on the export wire (:meth:`without_token_ids`), whose token ids travel in the pool after the hidden states and
    are attached, checksummed, by the reader (:meth:`with_token_ids`).  :attr:`has_token_ids` says which; every
    record a reader hands out has them, and the producer and the file sink refuse a record without them.

    Sample fields (schema 2; a schema-1 record has their defaults): ``sample_id`` and ``source`` say which
    dataset row the record was made for (``""``: not given); ``loss_mask_spans`` are the ``[start, stop)``
    position ranges whose rows are trained, numbered like ``start`` (positions of the request's sequence) and
    lying within the record's own rows ``[start, start + tokens)`` (``None``: no mask was given; ``()``: no row is
    trained); ``metadata_json`` is the free user metadata as canonical JSON (sorted keys, compact, ASCII, at most
    :data:`MAX_METADATA_BYTES` bytes; ``"{}"`` when none), read as a dict through :attr:`metadata`.  Stored as a
    string so the frozen metadata stays hashable and cannot be changed behind the checksum's back; ``to_dict``
    writes it as the JSON object ``metadata``.

    Encoded as a msgpack map with every field (no field is left out at its default: a reader never fills in a
    value the writer did not send); the file sink's JSON manifest is :meth:`to_dict` (schema 1 and 2, whose key
    for the id stays ``request_id``)."""

    record_id: Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_ID_CHARS)]
    token_ids: Annotated[tuple[_TokenId, ...], msgspec.Meta(max_length=_MAX_TOKENS)]
    layer_ids: Annotated[tuple[_LayerId, ...], msgspec.Meta(max_length=_MAX_PLANES)]
    pre_norm: bool
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    shape: tuple[
        Annotated[int, msgspec.Meta(ge=1, le=_MAX_TOKENS)],
        Annotated[int, msgspec.Meta(ge=1, le=_MAX_PLANES)],
        Annotated[int, msgspec.Meta(ge=1, le=_MAX_HIDDEN)],
    ]
    checksum: Annotated[int, msgspec.Meta(ge=0)] | None = None  # (msgpack's integers stop at 2**64 - 1)
    checksum_algorithm: Annotated[str, msgspec.Meta(max_length=32)] = DEFAULT_CHECKSUM
    vllm_version: Annotated[str, msgspec.Meta(max_length=64)] = ""
    adapter: Annotated[str, msgspec.Meta(max_length=128)] = ""
    start: _Position = 0
    """Position of row 0 in the request's sequence (rows are positions ``start .. start + tokens``)."""
    num_prompt_tokens: _Position = 0
    """Prompt length of the request (positions at or past it are generated tokens); 0 when unknown."""
    sample_id: Annotated[str, msgspec.Meta(max_length=MAX_SAMPLE_ID_CHARS)] = ""
    """The dataset sample the record was made for (``""``: not given)."""
    source: Annotated[str, msgspec.Meta(max_length=MAX_SOURCE_CHARS)] = ""
    """Where the sample came from, e.g. ``file:row`` (``""``: not given)."""
    loss_mask_spans: (
        Annotated[tuple[tuple[_Position, _Position], ...], msgspec.Meta(max_length=MAX_LOSS_MASK_SPANS)] | None
    ) = None
    """Trained positions: sorted, non-overlapping ``[start, stop)`` ranges inside ``[start, start + tokens)``;
    ``None`` = no mask was given, ``()`` = no row is trained.  See :meth:`loss_mask`."""
    metadata_json: Annotated[str, msgspec.Meta(max_length=MAX_METADATA_BYTES)] = EMPTY_METADATA
    """Free user metadata, canonical JSON of an object (see :func:`canonical_metadata`); :attr:`metadata` reads it."""
    schema_version: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if _TYPED_BY_DECODER.get() and self._relations_hold():
            return  # decode_typed: the decoder checked every field's type and bounds, and the relations hold
        self.validate()

    # --- derived -------------------------------------------------------------------------------------------
    @property
    def request_id(self) -> str:
        """Deprecated alias of :attr:`record_id` (warns; removed in the next release)."""
        _warn_request_id(2)
        return self.record_id

    @property
    def has_token_ids(self) -> bool:
        """The token ids are here (False only for a descriptor's metadata, see :meth:`without_token_ids`)."""
        return len(self.token_ids) == self.shape[0]

    @property
    def has_sample(self) -> bool:
        """Any sample field is set (a sample id, a source, loss-mask spans or metadata)."""
        return not (
            self.loss_mask_spans is None
            and self.metadata_json == EMPTY_METADATA
            and not self.sample_id
            and not self.source
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def metadata(self) -> dict[str, Any]:
        """The free user metadata (a fresh dict parsed from :attr:`metadata_json`)."""
        out: dict[str, Any] = json.loads(self.metadata_json)
        return out

    @property
    def sample(self) -> RecordSample:
        """The sample fields as one value."""
        return RecordSample(self.sample_id, self.source, self.loss_mask_spans, self.metadata_json)

    def loss_mask(self) -> torch.Tensor | None:
        """The record's per-row loss mask from :attr:`loss_mask_spans`: a ``[tokens]`` int64 tensor of 0/1
        (row ``i`` is position ``start + i``), or ``None`` when the record carries no mask."""
        if self.loss_mask_spans is None:
            return None
        mask = torch.zeros(self.shape[0], dtype=torch.int64)
        for a, b in self.loss_mask_spans:
            mask[a - self.start : b - self.start] = 1
        return mask

    def with_sample(self, sample: RecordSample) -> RecordMeta:
        """A copy carrying ``sample``'s fields (validated)."""
        return msgspec.structs.replace(
            self,
            sample_id=sample.sample_id,
            source=sample.source,
            loss_mask_spans=sample.loss_mask_spans,
            metadata_json=sample.metadata_json,
        )

    # --- validation ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`RecordFormatError` naming the first inconsistency.  Runs once per value, when it is made
        (``__post_init__``: in Python, by :func:`msgspec.convert` and by the export wire's decoder); the copies
        :meth:`with_checksum`, :meth:`with_token_ids` and :meth:`without_token_ids` check only what they change.
        Lists given for the tuple fields are stored as tuples (the value stays hashable)."""
        for name in ("token_ids", "layer_ids", "shape"):
            value = getattr(self, name)
            if type(value) is not tuple:
                if not isinstance(value, Sequence) or isinstance(value, str | bytes):
                    raise RecordFormatError(f"{name} must be a list of ints, found {type(value).__name__}")
                msgspec.structs.force_setattr(self, name, tuple(value))
        if self._plain_and_valid():
            return
        self._validate_fields()

    def _plain_and_valid(self) -> bool:
        """Every check of :meth:`_validate_fields` in one pass, for the common record (no token ids to check, as a
        descriptor's, or few; no sample fields): False when it cannot tell, and then :meth:`_validate_fields` names
        what is wrong.  (This runs for every descriptor decoded: 1 us here against 4 us there.)"""
        (rid, ids, layers, pre_norm, dtype, shape, checksum, algorithm, vllm_version, adapter, start, prompt,
         sample_id, source, spans, metadata_json, schema) = msgspec.structs.astuple(self)  # fmt: skip
        if not (
            len(shape) == 3
            and type(shape[0]) is int
            and type(shape[1]) is int
            and type(shape[2]) is int
            and 1 <= shape[0] <= _MAX_TOKENS
            and 1 <= shape[1] <= _MAX_PLANES
            and 1 <= shape[2] <= _MAX_HIDDEN
            and type(rid) is str
            and 0 < len(rid) <= _MAX_ID_CHARS
            and type(schema) is int
            and schema in SCHEMA_VERSIONS
            and type(dtype) is str
            and dtype in _ITEMSIZE
            and type(pre_norm) is bool
            and (checksum is None or (type(checksum) is int and 0 <= checksum <= _MAX_CHECKSUM))
            and type(algorithm) is str
            and algorithm in CHECKSUM_ALGORITHMS
            and type(vllm_version) is str
            and len(vllm_version) <= 64
            and type(adapter) is str
            and len(adapter) <= 128
            and type(start) is int
            and 0 <= start <= _MAX_TOKENS
            and type(prompt) is int
            and 0 <= prompt <= _MAX_TOKENS
            and spans is None
            and metadata_json == EMPTY_METADATA
            and type(sample_id) is str
            and type(source) is str
            and len(sample_id) <= MAX_SAMPLE_ID_CHARS
            and len(source) <= MAX_SOURCE_CHARS
            and (schema >= 2 or not (sample_id or source))
            and len(layers) == shape[1]
            and (not ids or len(ids) == shape[0])
        ):
            return False
        prev = -1
        for x in layers:
            if type(x) is not int or x <= prev:
                return False
            prev = x
        if prev > _MAX_LAYER_ID:
            return False
        if ids:
            checked = _check_ints(ids, "token_ids", 0, _MAX_VOCAB_ID)
            if checked != ids:  # e.g. 0-d tensors given: store plain ints
                msgspec.structs.force_setattr(self, "token_ids", checked)
        return True

    def _relations_hold(self) -> bool:
        """What relates the fields to each other and to the known names (dtype, checksum algorithm, schema), for
        a value whose every field a msgspec decoder has just checked against its annotated type and bounds
        (:func:`decode_typed`); False when something is off or needs the sample fields' checks, and then
        :meth:`validate` names it.  (0.3 us against :meth:`validate`'s 1.4 for a descriptor's metadata.)"""
        (_, ids, layers, _, dtype, shape, _, algorithm, _, _, _, _,
         sample_id, source, spans, metadata_json, schema) = msgspec.structs.astuple(self)  # fmt: skip
        if not (
            schema in SCHEMA_VERSIONS
            and dtype in _ITEMSIZE
            and algorithm in CHECKSUM_ALGORITHMS
            and len(layers) == shape[1]
            and (not ids or len(ids) == shape[0])
            and spans is None
            and metadata_json == EMPTY_METADATA
            and (schema >= 2 or not (sample_id or source))
        ):
            return False
        prev = -1
        for x in layers:
            if x <= prev:
                return False
            prev = x
        return True

    def _validate_fields(self) -> None:
        _str(self.record_id, "record_id")
        if self.schema_version not in SCHEMA_VERSIONS:
            raise RecordFormatError(
                f"record schema version {self.schema_version} is not supported (this build reads "
                f"{list(SCHEMA_VERSIONS)}); upgrade vllm-hs-compat on the side that reads it"
            )
        torch_dtype(self.dtype)
        if not isinstance(self.pre_norm, bool):
            raise RecordFormatError(f"pre_norm must be a bool, found {type(self.pre_norm).__name__}")
        if len(self.shape) != 3:
            raise RecordFormatError(f"shape must be [tokens, planes, hidden], found {list(self.shape)}")
        tokens = _int(self.shape[0], "shape[0] (tokens)", 1, _MAX_TOKENS)
        planes = _int(self.shape[1], "shape[1] (planes)", 1, _MAX_PLANES)
        _int(self.shape[2], "shape[2] (hidden)", 1, _MAX_HIDDEN)
        if self.token_ids:  # () only in a descriptor's metadata (see the class docstring)
            if len(self.token_ids) != tokens:
                raise RecordFormatError(
                    f"record {self.record_id!r}: {len(self.token_ids)} token ids but shape says {tokens} tokens; "
                    "every row needs its token id"
                )
            ids = _check_ints(self.token_ids, "token_ids", 0, _MAX_VOCAB_ID)
            if ids is not self.token_ids and ids != self.token_ids:  # e.g. 0-d tensors given: store plain ints
                msgspec.structs.force_setattr(self, "token_ids", ids)
        if len(self.layer_ids) != planes:
            raise RecordFormatError(
                f"record {self.record_id!r}: {len(self.layer_ids)} layer ids but shape says {planes} planes"
            )
        _check_ints(self.layer_ids, "layer_ids", 0, _MAX_LAYER_ID)
        if any(a >= b for a, b in zip(self.layer_ids, self.layer_ids[1:], strict=False)):
            raise RecordFormatError(
                f"layer_ids must be strictly ascending (planes are stored in ascending layer-id order), "
                f"found {list(self.layer_ids)}; sort them and permute the planes the same way"
            )
        if self.checksum_algorithm not in CHECKSUM_ALGORITHMS:
            raise RecordFormatError(
                f"unknown checksum algorithm {self.checksum_algorithm!r}; expected one of {CHECKSUM_ALGORITHMS}"
            )
        if self.checksum is not None:
            _int(self.checksum, "checksum", 0, _MAX_CHECKSUM)
        _str(self.vllm_version, "vllm_version", 64, allow_empty=True)
        _str(self.adapter, "adapter", 128, allow_empty=True)
        _int(self.start, "start", 0, _MAX_TOKENS)
        _int(self.num_prompt_tokens, "num_prompt_tokens", 0, _MAX_TOKENS)
        self._validate_sample(tokens)

    def _validate_sample(self, tokens: int) -> None:
        if (  # the common record (no spans, no metadata): no RecordSample built (this runs per record)
            self.loss_mask_spans is None
            and self.metadata_json == EMPTY_METADATA
            and (self.schema_version >= 2 or not (self.sample_id or self.source))
            and isinstance(self.sample_id, str)
            and isinstance(self.source, str)
            and len(self.sample_id) <= MAX_SAMPLE_ID_CHARS
            and len(self.source) <= MAX_SOURCE_CHARS
        ):
            return
        checked = check_sample(
            self.sample, start=self.start, tokens=tokens, schema_version=self.schema_version, what=self.record_id
        )
        if checked.loss_mask_spans != self.loss_mask_spans:  # lists instead of tuples: keep the value hashable
            msgspec.structs.force_setattr(self, "loss_mask_spans", checked.loss_mask_spans)

    # --- copies that change one part (the rest was validated when this value was made) ---------------------
    def _copy_with(self, **changes: Any) -> RecordMeta:
        new = copy.copy(self)  # msgspec's copy: no __post_init__
        for name, value in changes.items():
            msgspec.structs.force_setattr(new, name, value)
        return new

    def with_checksum(self, checksum: int, algorithm: str | None = None) -> RecordMeta:
        """A copy carrying ``checksum`` (only the changed fields are checked: this runs per record)."""
        algorithm = algorithm or self.checksum_algorithm
        _int(checksum, "checksum", 0, _MAX_CHECKSUM)
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise RecordFormatError(f"unknown checksum algorithm {algorithm!r}; expected one of {CHECKSUM_ALGORITHMS}")
        return self._copy_with(checksum=checksum, checksum_algorithm=algorithm)

    def without_token_ids(self) -> RecordMeta:
        """A copy without its token ids: the metadata a record descriptor carries on the export wire (the ids
        travel in the pool, after the hidden states)."""
        return self._copy_with(token_ids=())

    def with_token_ids(self, token_ids: Sequence[int]) -> RecordMeta:
        """A copy carrying ``token_ids``, one per row (their count and range are checked; the rest was validated
        when this value was made): how a reader completes a descriptor's metadata with the ids it read."""
        ids = tuple(token_ids)
        if len(ids) != self.shape[0]:
            raise RecordFormatError(
                f"record {self.record_id!r}: {len(ids)} token ids but shape says {self.shape[0]} tokens; "
                "every row needs its token id"
            )
        return self._copy_with(token_ids=_check_ints(ids, "token_ids", 0, _MAX_VOCAB_ID))

    # --- the file sink's manifest ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of str/int/bool/list values (and, schema 2, the ``metadata`` object), safe for JSON and
        msgpack: the file sink's manifest (the id's key is ``request_id``, as in every schema-1 and -2 file)."""
        d = {
            "schema_version": self.schema_version,
            "request_id": self.record_id,
            "token_ids": list(self.token_ids),
            "layer_ids": list(self.layer_ids),
            "pre_norm": self.pre_norm,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "checksum": self.checksum,
            "checksum_algorithm": self.checksum_algorithm,
            "vllm_version": self.vllm_version,
            "adapter": self.adapter,
            "start": self.start,
            "num_prompt_tokens": self.num_prompt_tokens,
        }
        if self.schema_version >= 2:
            d["sample_id"] = self.sample_id
            d["source"] = self.source
            spans = self.loss_mask_spans
            d["loss_mask_spans"] = None if spans is None else [[a, b] for a, b in spans]
            d["metadata"] = self.metadata
        return d

    @classmethod
    def from_dict(cls, d: Any) -> RecordMeta:
        """Strictly validated inverse of :meth:`to_dict`; unknown fields are refused (a schema-1 dict has no sample
        fields; a schema-2 dict must have all four), and so is a record without its token ids."""
        if not isinstance(d, Mapping):
            raise RecordFormatError(f"record metadata must be a mapping, found {type(d).__name__}")
        version = _int(_field(d, "schema_version"), "schema_version", 0, 1 << 16)
        known = _DICT_FIELDS_V1 | (_SAMPLE_DICT_FIELDS if version >= 2 else frozenset())
        extra = set(d) - known
        if extra:
            raise RecordFormatError(
                f"record metadata (schema {version}) has unknown fields {sorted(map(str, extra))}; expected only "
                f"{sorted(known)}"
            )
        sample = _NO_SAMPLE
        if version >= 2:
            spans = _field(d, "loss_mask_spans")
            sample = RecordSample(
                sample_id=_str(_field(d, "sample_id"), "sample_id", MAX_SAMPLE_ID_CHARS, allow_empty=True),
                source=_str(_field(d, "source"), "source", MAX_SOURCE_CHARS, allow_empty=True),
                loss_mask_spans=None if spans is None else check_spans(spans, "loss_mask_spans", 0, _MAX_TOKENS),
                metadata_json=canonical_metadata(_field(d, "metadata")),
            )
        shape = _int_seq(_field(d, "shape"), "shape", 0, 1 << 40, 3)
        if len(shape) != 3:
            raise RecordFormatError(f"shape must have 3 entries [tokens, planes, hidden], found {list(shape)}")
        token_ids = _seq(_field(d, "token_ids"), "token_ids", _MAX_TOKENS)  # values checked by validate()
        record_id = _str(_field(d, "request_id"), "request_id")
        if len(token_ids) != shape[0]:
            raise RecordFormatError(
                f"record {record_id!r}: {len(token_ids)} token ids but shape says {shape[0]} tokens; "
                "every row needs its token id"
            )
        checksum = _field(d, "checksum")
        return cls(
            record_id=record_id,
            token_ids=token_ids,
            layer_ids=_int_seq(_field(d, "layer_ids"), "layer_ids", 0, _MAX_LAYER_ID, _MAX_PLANES),
            pre_norm=_field(d, "pre_norm"),
            dtype=_str(_field(d, "dtype"), "dtype", 32),
            shape=(shape[0], shape[1], shape[2]),
            checksum=None if checksum is None else _int(checksum, "checksum", 0, _MAX_CHECKSUM),
            checksum_algorithm=_str(_field(d, "checksum_algorithm"), "checksum_algorithm", 32),
            vllm_version=_str(d.get("vllm_version", ""), "vllm_version", 64, allow_empty=True),
            adapter=_str(d.get("adapter", ""), "adapter", 128, allow_empty=True),
            start=_int(d.get("start", 0), "start", 0, _MAX_TOKENS),
            num_prompt_tokens=_int(d.get("num_prompt_tokens", 0), "num_prompt_tokens", 0, _MAX_TOKENS),
            sample_id=sample.sample_id,
            source=sample.source,
            loss_mask_spans=sample.loss_mask_spans,
            metadata_json=sample.metadata_json,
            schema_version=version,
        )

    @classmethod
    def for_tensor(
        cls,
        record_id: str,
        rows: torch.Tensor,
        token_ids: Sequence[int],
        layer_ids: Sequence[int],
        pre_norm: bool,
        vllm_version: str = "",
        adapter: str = "",
        checksum_algorithm: str = DEFAULT_CHECKSUM,
        start: int = 0,
        num_prompt_tokens: int = 0,
        sample: RecordSample | None = None,
    ) -> RecordMeta:
        """Metadata describing ``rows`` (``[tokens, planes, hidden]``); the checksum is left for the
        producer.  ``sample``: what the record was made for (its spans must lie within the record's rows)."""
        sample = sample or _NO_SAMPLE
        if rows.dim() != 3:
            raise RecordFormatError(
                f"record {record_id!r}: rows must be [tokens, planes, hidden], found shape {tuple(rows.shape)}"
            )
        return cls(
            record_id=record_id,
            token_ids=tuple(int(t) for t in token_ids),
            layer_ids=tuple(int(x) for x in layer_ids),
            pre_norm=pre_norm,
            dtype=dtype_name(rows.dtype),
            shape=(int(rows.shape[0]), int(rows.shape[1]), int(rows.shape[2])),
            checksum_algorithm=checksum_algorithm,
            vllm_version=vllm_version,
            adapter=adapter,
            start=start,
            num_prompt_tokens=num_prompt_tokens,
            sample_id=sample.sample_id,
            source=sample.source,
            loss_mask_spans=sample.loss_mask_spans,
            metadata_json=sample.metadata_json,
        )


#: True while :func:`decode_typed` decodes: the ``RecordMeta`` values made then were type- and bounds-checked by the
#: decoder (in C, from their annotated field types), so their ``__post_init__`` checks only the relations.
_TYPED_BY_DECODER: Final[contextvars.ContextVar[bool]] = contextvars.ContextVar("hs_compat_typed", default=False)

_T = TypeVar("_T")


def decode_typed(decoder: msgspec.msgpack.Decoder[_T], data: bytes | memoryview) -> _T:
    """``decoder.decode(data)``, the ``RecordMeta`` values in it validated once: the decoder checks each field's
    type and bounds (in C), their ``__post_init__`` only what relates the fields (a value built in Python, or
    decoded elsewhere, is checked in full by :meth:`RecordMeta.validate`).  Only a msgspec decoder may run here:
    that is what makes the types sure."""
    token = _TYPED_BY_DECODER.set(True)
    try:
        return decoder.decode(data)
    finally:
        _TYPED_BY_DECODER.reset(token)


_SAMPLE_DICT_FIELDS: Final = frozenset({"sample_id", "source", "loss_mask_spans", "metadata"})
#: The manifest's keys of a schema-1 record: every field but the sample fields, the id under ``request_id``.
_DICT_FIELDS_V1: Final = frozenset(
    "request_id" if name == "record_id" else name
    for name in RecordMeta.__struct_fields__
    if name not in {"sample_id", "source", "loss_mask_spans", "metadata_json"}
)


@dataclasses.dataclass(slots=True)
class CaptureRecord:
    """A verified record: metadata plus ``hidden_states`` shaped ``meta.shape``."""

    meta: RecordMeta
    hidden_states: torch.Tensor

    def check(self) -> None:
        """Raise if the tensor's dtype/shape disagree with the metadata or (when present) the checksum
        fails."""
        hs = self.hidden_states
        if not self.meta.has_token_ids:
            raise RecordFormatError(
                f"record {self.meta.record_id!r}: its metadata has no token ids (a descriptor's, see "
                "RecordMeta.without_token_ids); attach them with meta.with_token_ids(ids)"
            )
        if tuple(hs.shape) != self.meta.shape or hs.dtype != self.meta.torch_dtype:
            raise RecordFormatError(
                f"record {self.meta.record_id!r}: tensor is {tuple(hs.shape)} {hs.dtype}, "
                f"metadata says {self.meta.shape} {self.meta.dtype}"
            )
        if self.meta.checksum is not None:
            flat = hs.detach().contiguous().cpu().view(torch.uint8).reshape(-1)
            got = compute_checksum(flat, self.meta.checksum_algorithm)
            if got != self.meta.checksum:
                raise ChecksumMismatchError(
                    f"record {self.meta.record_id!r}: {self.meta.checksum_algorithm} checksum of the "
                    f"{flat.numel()} bytes is {got:#018x}, metadata says {self.meta.checksum:#018x}; "
                    "the bytes were damaged or overwritten in transit"
                )
