"""Self-describing capture records: :class:`RecordMeta`, the one metadata type from the connector to the trainer,
and :class:`CaptureRecord`, a record's metadata with its hidden states.

A record is the hidden states one finished request produced: a tensor ``[tokens, planes, hidden]`` whose
planes are stored in ascending layer-id order, plus the metadata a trainer needs to use it without trusting
anything else (layer ids, pre-norm flag, dtype, shape, token ids, checksum, provenance), and what it was made for
(schema 2: the sample id, its source, the loss-mask spans and free user metadata, see :class:`RecordMeta`).

Pure: imports torch, msgspec (the metadata's type: :class:`RecordMeta` is a :class:`msgspec.Struct`, the one shape
of a record's metadata from the connector to the trainer), xxhash and the standard library only, never vLLM.
msgspec and xxhash are hard dependencies of the package (pyproject), as torch is; vLLM depends on msgspec too.

The record's parts, each a module of its own (this module re-exports their public names, where users import
them):

* :mod:`.checksums` -- ``xxh3_64`` and ``crc32`` over a record's bytes, whole or chunk by chunk;
* :mod:`.dtypes` -- the dtypes a record can carry, by wire name;
* :mod:`.record_bounds` -- every field's bounds, and the checks that name a value outside them;
* :mod:`.record_sample` -- the sample fields (schema 2) as one value, :class:`RecordSample`, and their checks;
* :mod:`.record_checks` -- the one validation pass a :class:`RecordMeta` gets when it is made or decoded.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Final, TypeVar

import msgspec
import torch

from ..errors import ChecksumMismatchError, RecordFormatError
from .checksums import (
    CHECKSUM_ALGORITHMS,
    DEFAULT_CHECKSUM,
    MAX_CHECKSUM,
    ChecksumState,
    byte_view,
    checksum_bytes,
    checksum_function,
    compute_checksum,
)
from .dtypes import DTYPES, ITEMSIZE, dtype_itemsize, dtype_name, torch_dtype
from .record_bounds import (
    EMPTY_METADATA,
    MAX_HIDDEN,
    MAX_ID_CHARS,
    MAX_LAYER_ID,
    MAX_LOSS_MASK_SPANS,
    MAX_METADATA_BYTES,
    MAX_PLANES,
    MAX_SAMPLE_ID_CHARS,
    MAX_SOURCE_CHARS,
    MAX_TOKENS,
    MAX_VOCAB_ID,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    check_int,
    check_int_seq,
    check_ints,
    check_seq,
    check_str,
    field_of,
)
from .record_checks import check_meta
from .record_sample import NO_SAMPLE, RecordSample, canonical_metadata, check_sample, check_spans

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "DEFAULT_CHECKSUM",
    "DTYPES",
    "EMPTY_METADATA",
    "MAX_LOSS_MASK_SPANS",
    "MAX_METADATA_BYTES",
    "MAX_SAMPLE_ID_CHARS",
    "MAX_SOURCE_CHARS",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "CaptureRecord",
    "ChecksumState",
    "RecordMeta",
    "RecordSample",
    "byte_view",
    "canonical_metadata",
    "check_sample",
    "check_spans",
    "checksum_bytes",
    "checksum_function",
    "compute_checksum",
    "decode_typed",
    "dtype_itemsize",
    "dtype_name",
    "torch_dtype",
]

#: Field types of :class:`RecordMeta` (bounds the decoder checks in C; :meth:`RecordMeta.validate` checks them
#: again for a value built in Python, which msgspec does not check).
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_VOCAB_ID)]
_LayerId = Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYER_ID)]
_Position = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
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

    record_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
    token_ids: Annotated[tuple[_TokenId, ...], msgspec.Meta(max_length=MAX_TOKENS)]
    layer_ids: Annotated[tuple[_LayerId, ...], msgspec.Meta(max_length=MAX_PLANES)]
    pre_norm: bool
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    shape: tuple[
        Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)],
        Annotated[int, msgspec.Meta(ge=1, le=MAX_PLANES)],
        Annotated[int, msgspec.Meta(ge=1, le=MAX_HIDDEN)],
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
        check_meta(self, _TYPED_BY_DECODER.get())  # typed: decode_typed's decoder checked every field's type

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
        return ITEMSIZE[self.dtype]

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
        """Raise :class:`RecordFormatError` naming the first inconsistency (the one pass of
        :func:`~vllm_hs_compat.core.record_checks.check_meta`).  Runs once per value, when it is made
        (``__post_init__``: in Python, by :func:`msgspec.convert` and by the export wire's decoder); the copies
        :meth:`with_checksum`, :meth:`with_token_ids` and :meth:`without_token_ids` check only what they change.
        Lists given for the tuple fields are stored as tuples (the value stays hashable)."""
        check_meta(self)

    # --- copies that change one part (the rest was validated when this value was made) ---------------------
    def _copy_with(self, **changes: Any) -> RecordMeta:
        new = copy.copy(self)  # msgspec's copy: no __post_init__
        for name, value in changes.items():
            msgspec.structs.force_setattr(new, name, value)
        return new

    def with_checksum(self, checksum: int, algorithm: str | None = None) -> RecordMeta:
        """A copy carrying ``checksum`` (only the changed fields are checked: this runs per record)."""
        algorithm = algorithm or self.checksum_algorithm
        check_int(checksum, "checksum", 0, MAX_CHECKSUM)
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
        return self._copy_with(token_ids=check_ints(ids, "token_ids", 0, MAX_VOCAB_ID))

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
        version = check_int(field_of(d, "schema_version"), "schema_version", 0, 1 << 16)
        known = _DICT_FIELDS_V1 | (_SAMPLE_DICT_FIELDS if version >= 2 else frozenset())
        extra = set(d) - known
        if extra:
            raise RecordFormatError(
                f"record metadata (schema {version}) has unknown fields {sorted(map(str, extra))}; expected only "
                f"{sorted(known)}"
            )
        sample = NO_SAMPLE
        if version >= 2:
            spans = field_of(d, "loss_mask_spans")
            sample = RecordSample(
                sample_id=check_str(field_of(d, "sample_id"), "sample_id", MAX_SAMPLE_ID_CHARS, allow_empty=True),
                source=check_str(field_of(d, "source"), "source", MAX_SOURCE_CHARS, allow_empty=True),
                loss_mask_spans=None if spans is None else check_spans(spans, "loss_mask_spans", 0, MAX_TOKENS),
                metadata_json=canonical_metadata(field_of(d, "metadata")),
            )
        shape = check_int_seq(field_of(d, "shape"), "shape", 0, 1 << 40, 3)
        if len(shape) != 3:
            raise RecordFormatError(f"shape must have 3 entries [tokens, planes, hidden], found {list(shape)}")
        token_ids = check_seq(field_of(d, "token_ids"), "token_ids", MAX_TOKENS)  # values checked by validate()
        record_id = check_str(field_of(d, "request_id"), "request_id")
        if len(token_ids) != shape[0]:
            raise RecordFormatError(
                f"record {record_id!r}: {len(token_ids)} token ids but shape says {shape[0]} tokens; "
                "every row needs its token id"
            )
        checksum = field_of(d, "checksum")
        return cls(
            record_id=record_id,
            token_ids=token_ids,
            layer_ids=check_int_seq(field_of(d, "layer_ids"), "layer_ids", 0, MAX_LAYER_ID, MAX_PLANES),
            pre_norm=field_of(d, "pre_norm"),
            dtype=check_str(field_of(d, "dtype"), "dtype", 32),
            shape=(shape[0], shape[1], shape[2]),
            checksum=None if checksum is None else check_int(checksum, "checksum", 0, MAX_CHECKSUM),
            checksum_algorithm=check_str(field_of(d, "checksum_algorithm"), "checksum_algorithm", 32),
            vllm_version=check_str(d.get("vllm_version", ""), "vllm_version", 64, allow_empty=True),
            adapter=check_str(d.get("adapter", ""), "adapter", 128, allow_empty=True),
            start=check_int(d.get("start", 0), "start", 0, MAX_TOKENS),
            num_prompt_tokens=check_int(d.get("num_prompt_tokens", 0), "num_prompt_tokens", 0, MAX_TOKENS),
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
        sample = sample or NO_SAMPLE
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
