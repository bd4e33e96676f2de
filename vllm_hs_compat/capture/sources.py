"""Where rows come from: JSONL / JSON / Parquet files, a folder of them, or ``hf:NAME[:split]`` (``datasets``).

:func:`open_source` checks the source when called (the path exists, its files have known suffixes, Parquet
footers can be read, ``datasets`` and ``pyarrow`` are installed when needed) and raises
:class:`~vllm_hs_compat.errors.CaptureDataError` otherwise, so a capture run refuses before any engine starts.
Iterating the returned :class:`Source` yields each row as a :class:`RawRow` (a JSON object and its
:class:`SourceRef`), or an :class:`Unreadable` for a line, element or file that cannot be parsed; reading goes on
after it.  The formats are described in docs/capture.md, "Input rows".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hs_compat.errors import CaptureDataError

__all__ = ["DATA_SUFFIXES", "HF_PREFIX", "RawRow", "Source", "SourceRef", "Unreadable", "open_source"]

#: File suffixes read, and the reader each gets.
DATA_SUFFIXES: dict[str, str] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
#: ``hf:NAME[:split]`` reads a dataset through ``datasets.load_dataset(NAME, split=split)`` (split ``train`` if none).
HF_PREFIX = "hf:"
#: Rows read from a Parquet file at a time.
PARQUET_BATCH_ROWS = 1024

_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark some editors write first: not part of the data
_PIP_CAPTURE = "pip install 'vllm-hs-compat[capture]'"


@dataclass(frozen=True, slots=True)
class SourceRef:
    """Where a row came from: ``file`` as given (a folder's file as ``FOLDER/REL``, a dataset as ``hf:NAME:split``)
    and its 0-based row number (the line number in a JSONL file, blank lines included)."""

    file: str
    row: int

    def __str__(self) -> str:
        return f"{self.file}:{self.row}"


@dataclass(frozen=True, slots=True)
class RawRow:
    """One parsed row (a JSON object, as read) and where it came from."""

    source: SourceRef
    row: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A line, element or whole file that could not be parsed into a row (a ``malformed`` row error)."""

    source: SourceRef
    message: str


class _DuplicateKeyError(ValueError):
    pass


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(f"key {key!r} appears twice in one object (which one is meant cannot be told)")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _loads(text: str | bytes) -> Any:
    """Strict JSON: duplicate keys and NaN/Infinity are refused (both could be read two ways)."""
    return json.loads(text, object_pairs_hook=_object_pairs, parse_constant=_no_constant)


def _describe(value: Any) -> str:
    kind = type(value).__name__
    text = repr(value)
    return f"a {kind} ({text[:60]}{'...' if len(text) > 60 else ''})"


class Source:
    """An opened source: the files (or the dataset) to read, in order.  Iterate it for the rows."""

    def __init__(self, name: str, files: list[tuple[str, str]] | None = None, dataset: Any = None) -> None:
        #: The source as given.
        self.name = name
        #: ``(path, reader)`` of each file in reading order (empty for a ``hf:`` dataset).
        self.files: list[tuple[str, str]] = files or []
        self._dataset = dataset

    def __iter__(self) -> Iterator[RawRow | Unreadable]:
        if self._dataset is not None:
            yield from _iter_dataset(self.name, self._dataset)
            return
        for path, reader in self.files:
            if reader == "jsonl":
                yield from _iter_jsonl(path)
            elif reader == "json":
                yield from _iter_json(path)
            else:
                yield from _iter_parquet(path)


def open_source(src: str | os.PathLike[str]) -> Source:
    """Check ``src`` and return it ready to read.

    ``src`` is a ``.jsonl``/``.ndjson``, ``.json`` or ``.parquet`` file; a folder, read recursively in sorted order
    of the files' relative paths (only files with those suffixes; names starting with ``.`` are skipped); or
    ``hf:NAME[:split]``.  Raises :class:`~vllm_hs_compat.errors.CaptureDataError` when it cannot be read.
    """
    text = os.fspath(src)
    if text.startswith(HF_PREFIX):
        return _open_hf(text)
    path = Path(text)
    if not path.exists():
        raise CaptureDataError(f"data source {text!r} does not exist; give a file, a folder or hf:NAME[:split]")
    if path.is_dir():
        found: list[tuple[str, str, str]] = []
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in names:
                suffix = Path(name).suffix.lower()
                if name.startswith(".") or suffix not in DATA_SUFFIXES:
                    continue
                full = os.path.join(root, name)
                rel = Path(os.path.relpath(full, path)).as_posix()
                found.append((rel, os.path.join(text, rel), DATA_SUFFIXES[suffix]))
        if not found:
            raise CaptureDataError(
                f"folder {text!r} holds no data file; expected files ending in {', '.join(DATA_SUFFIXES)} "
                "(names starting with '.' are skipped)"
            )
        found.sort()
        files = [(full, reader) for _, full, reader in found]
    elif path.is_file():
        suffix = path.suffix.lower()
        if suffix not in DATA_SUFFIXES:
            raise CaptureDataError(
                f"data file {text!r} has suffix {suffix or '(none)'!r}; expected one of {', '.join(DATA_SUFFIXES)}"
            )
        files = [(text, DATA_SUFFIXES[suffix])]
    else:
        raise CaptureDataError(f"data source {text!r} is neither a regular file nor a folder")
    for full, reader in files:
        if reader == "parquet":
            _parquet_file(full)  # the footer is readable: refuse a broken file before any engine starts
    return Source(text, files)


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise CaptureDataError(f"Parquet sources need pyarrow, which is not installed: {_PIP_CAPTURE}") from e
    return pq


def _parquet_file(path: str) -> Any:
    pq = _pyarrow_parquet()
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged or non-Parquet file
        raise CaptureDataError(f"Parquet file {path!r} cannot be read: {type(e).__name__}: {e}") from e


def _open_hf(text: str) -> Source:
    spec = text[len(HF_PREFIX) :]
    name, _, split = spec.partition(":")
    split = split or "train"
    if not name or ":" in split:
        raise CaptureDataError(f"data source {text!r}: expected hf:NAME or hf:NAME:split (e.g. hf:org/name:train)")
    try:
        import datasets
    except ImportError as e:
        raise CaptureDataError(
            f"data source {text!r} needs the `datasets` library, which is not installed: pip install datasets"
        ) from e
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many kinds (not found, offline, bad split): all end the same way
        raise CaptureDataError(f"data source {text!r}: datasets.load_dataset failed: {type(e).__name__}: {e}") from e
    return Source(f"{HF_PREFIX}{name}:{split}", dataset=dataset)


def _objects(name: str, items: Iterable[Any], expected: str) -> Iterator[RawRow | Unreadable]:
    """Each item of ``items`` as a row when it is a mapping, else an unreadable row saying what was found."""
    for i, item in enumerate(items):
        ref = SourceRef(name, i)
        if isinstance(item, dict):
            yield RawRow(ref, item)
        else:
            yield Unreadable(ref, f"expected {expected}, found {_describe(item)}")


def _iter_dataset(name: str, dataset: Any) -> Iterator[RawRow | Unreadable]:
    yield from _objects(name, dataset, "a row as a mapping of column to value")


def _iter_jsonl(path: str) -> Iterator[RawRow | Unreadable]:
    try:
        handle = open(path, "rb")  # closed by the `with` below
    except OSError as e:
        yield Unreadable(SourceRef(path, 0), f"cannot open the file: {e}; none of its rows were read")
        return
    with handle:
        for i, line in enumerate(handle):
            ref = SourceRef(path, i)
            if i == 0:
                line = line.removeprefix(_BOM)
            if not line.strip():
                continue  # blank lines (and a last newline) carry no row; line numbers still count them
            try:
                value = _loads(line)
            except UnicodeDecodeError as e:
                yield Unreadable(ref, f"line is not UTF-8: {e}")
                continue
            except ValueError as e:
                yield Unreadable(ref, f"line is not one JSON object: {e}")
                continue
            if not isinstance(value, dict):
                yield Unreadable(ref, f"expected a JSON object per line, found {_describe(value)}")
                continue
            yield RawRow(ref, value)


def _iter_json(path: str) -> Iterator[RawRow | Unreadable]:
    try:
        with open(path, "rb") as handle:
            value = _loads(handle.read().removeprefix(_BOM))
    except (OSError, ValueError) as e:
        yield Unreadable(SourceRef(path, 0), f"the file is not valid JSON ({e}); none of its rows were read")
        return
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        value = value["data"]
    if not isinstance(value, list):
        found = f"an object with keys {sorted(value)[:10]}" if isinstance(value, dict) else _describe(value)
        yield Unreadable(
            SourceRef(path, 0),
            f"expected a JSON list of row objects, or an object whose 'data' member is that list; found {found}; "
            "none of its rows were read",
        )
        return
    yield from _objects(path, value, "a JSON object per element")


def _iter_parquet(path: str) -> Iterator[RawRow | Unreadable]:
    row = 0
    try:
        pf = _parquet_file(path)
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for item in batch.to_pylist():
                yield RawRow(SourceRef(path, row), item)
                row += 1
    except CaptureDataError as e:
        yield Unreadable(SourceRef(path, row), str(e))
    except Exception as e:  # a damaged row group: the rest of the file is lost, and said so
        yield Unreadable(
            SourceRef(path, row), f"reading stopped here: {type(e).__name__}: {e}; the file's later rows were not read"
        )
