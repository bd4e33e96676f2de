"""The capture tree's Parquet index: its parts, read and merged (:func:`read_index`), and written
(:class:`TreeIndex`).

A record counts when, and only when, a row of an index part names it.  Parts are ``index/rank-R-part-NNNNN.parquet``
(:data:`~vllm_hs_compat.capture.rows.INDEX_COLUMNS`); :meth:`TreeIndex.write` writes one to a temporary name,
fsynced after the record files it names, and renames it into place, so a part is either whole or absent.  Merged,
a sample's earliest "ok" row wins over any failed row, and a sample with only failed rows keeps its latest.

Pure Python + pyarrow (``vllm-hs-compat[capture]``, imported when first used).  :func:`read_index` and
:func:`failed_rows` are re-exported by :mod:`vllm_hs_compat.capture.store`, where users import them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from vllm_hs_compat.errors import CaptureStoreError

from . import durable
from .rows import IndexRow, sample_key

if TYPE_CHECKING:
    import pyarrow as pa

PART_RE: Final = re.compile(r"^rank-(\d+)-part-(\d+)\.parquet$")


def pyarrow() -> Any:
    """The ``pyarrow`` module with its Parquet submodule loaded, or :class:`CaptureStoreError` with the fix."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (loads the submodule)
    except ImportError:
        raise CaptureStoreError(
            "the capture index is Parquet and needs pyarrow: pip install 'vllm-hs-compat[capture]' (or pyarrow)"
        ) from None
    return pyarrow


def schema() -> pa.Schema:
    """Every index part's Arrow schema (the columns :data:`~vllm_hs_compat.capture.rows.INDEX_COLUMNS`)."""
    pa = pyarrow()
    return pa.schema(
        [
            ("sample_id", pa.string()),
            ("source", pa.string()),
            ("status", pa.string()),
            ("reason", pa.string()),
            ("message", pa.string()),
            ("record", pa.string()),
            ("tokens", pa.int64()),
            ("loss_tokens", pa.int64()),
            ("bytes", pa.int64()),
            ("rank", pa.int32()),
            ("checksum", pa.uint64()),
            ("metadata", pa.string()),
            ("time", pa.float64()),
        ]
    )


def list_parts(index_dir: Path) -> list[tuple[int, int, Path]]:
    """``(rank, part, path)`` of every index part, sorted; temporary and foreign files are not parts."""
    found = []
    if index_dir.is_dir():
        for p in index_dir.iterdir():
            m = PART_RE.match(p.name)
            if m:
                found.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(found)


def read_part(path: Path) -> pa.Table:
    """One index part, refused by name when it cannot be read or has other columns."""
    pa = pyarrow()
    try:
        table = pa.parquet.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise CaptureStoreError(
            f"index part {path} cannot be read ({type(e).__name__}: {e}); index parts are renamed into place only "
            "when complete, so it was damaged after it was written (disk, copy, or a writer that is not this "
            "package); restore it from a copy, or move it away and re-run: its samples are then captured again"
        ) from None
    want = schema()
    if table.schema.names != want.names:
        raise CaptureStoreError(
            f"index part {path} has columns {table.schema.names}, expected {want.names}; it was written by "
            "another version of vllm-hs-compat or another tool"
        )
    return table.cast(want)


def dedup(table: pa.Table) -> pa.Table:
    """One row per sample key: the earliest "ok" row when there is one, else the latest failed row."""
    pa = pyarrow()
    ids = table.column("sample_id").to_pylist()
    sources = table.column("source").to_pylist()
    status = table.column("status").to_pylist()
    times = table.column("time").to_pylist()
    best: dict[str, int] = {}
    for i, (sid, src, st, t) in enumerate(zip(ids, sources, status, times, strict=True)):
        key = sample_key(sid, src)
        j = best.get(key)
        if j is None:
            best[key] = i
        elif status[j] == "ok":
            if st == "ok" and t < times[j]:
                best[key] = i
        elif st == "ok" or t >= times[j]:
            best[key] = i
    order = sorted(best, key=lambda k: (ids[best[k]], sources[best[k]]))
    return table.take(pa.array([best[k] for k in order], type=pa.int64()))


def concat(tables: list[pa.Table]) -> pa.Table:
    """The tables one after the other (an empty table of the index's schema for none)."""
    pa = pyarrow()
    if not tables:
        return schema().empty_table()
    return pa.concat_tables(tables)


def read_index(out: str | os.PathLike[str]) -> pa.Table:
    """Every index part of every rank of the tree at ``out``, merged into one ``pyarrow.Table`` (columns
    :data:`~vllm_hs_compat.capture.rows.INDEX_COLUMNS`), one row per sample (by
    :func:`~vllm_hs_compat.capture.rows.sample_key`): its earliest "ok" row when it has one, else its latest failed
    row; sorted by sample id.  Record files that no part names are not in it (they do not count).  Raises
    :class:`CaptureStoreError` for a part that cannot be read."""
    index_dir = Path(out) / "index"
    return dedup(concat([read_part(p) for _, _, p in list_parts(index_dir)]))


def failed_rows(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The failed rows of the merged index (:func:`read_index`), in source order: ``sample_id``, ``source``,
    ``reason``, ``message``, ``tokens`` (the sample's token count when it had one), ``rank``, ``time``."""
    keys = ("sample_id", "source", "reason", "message", "tokens", "rank", "time")
    rows = [{k: r[k] for k in keys} for r in read_index(out).to_pylist() if r["status"] != "ok"]

    def place(row: dict[str, Any]) -> tuple[str, int, str]:
        file, _, n = str(row["source"]).rpartition(":")
        return (file, int(n), row["sample_id"]) if n.isdigit() else (str(row["source"]), -1, row["sample_id"])

    return sorted(rows, key=place)


class TreeIndex:
    """The index of the tree at ``out`` as this process knows it: every part read once (at a store's start), and
    every part this process writes added.

    ``parts``: ``(rank, part)`` of each part; ``records``: the record manifests they name (relative to ``out``);
    ``shards``: the shard folders of those records (sealed: no record is added to a shard a part names);
    ``ok_keys``: the sample keys whose merged row is "ok" when it was read."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.dir = out / "index"
        found = list_parts(self.dir)
        every = concat([read_part(p) for _, _, p in found])
        merged = dedup(every)
        self.parts: set[tuple[int, int]] = {(r, n) for r, n, _ in found}
        self.records: set[str] = {r for r in every.column("record").to_pylist() if r is not None}
        self.shards: set[str] = {r.split("/", 1)[0] for r in self.records}
        self.ok_keys: set[str] = {
            sample_key(s, src)
            for s, src, st in zip(
                merged.column("sample_id").to_pylist(),
                merged.column("source").to_pylist(),
                merged.column("status").to_pylist(),
                strict=True,
            )
            if st == "ok"
        }

    def next_part(self, rank: int) -> int:
        """The number of ``rank``'s next part."""
        return max((n for r, n in self.parts if r == rank), default=-1) + 1

    def write(self, rank: int, n: int, rows: list[IndexRow]) -> None:
        """Index part ``n`` of ``rank``: the record files it names reach the disk first (one syncfs of the tree's
        file system; fsync of each file where there is no syncfs), then the part is written to a temporary name,
        fsynced and renamed into place."""
        pa = pyarrow()
        unsafe = durable.unsafe()
        records = [self.out / row.record for row in rows if row.record is not None]
        if records and not unsafe and not durable.syncfs(self.out):
            for manifest in records:
                durable.fsync_path(manifest)
                durable.fsync_path(manifest.with_suffix(".safetensors"))
            for d in {m.parent for m in records}:
                durable.fsync_path(d, directory=True)
        table = pa.Table.from_pylist([row.to_dict() for row in rows], schema=schema())
        sink = pa.BufferOutputStream()
        pa.parquet.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        final = self.dir / f"rank-{rank}-part-{n:05d}.parquet"
        target = final if unsafe else self.dir / f".rank-{rank}-part-{n:05d}.parquet.{os.getpid()}.tmp"
        with open(target, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            durable.point("index.mid_write")
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        durable.point("index.before_rename")
        if target != final:
            os.replace(target, final)
        durable.fsync_path(self.dir, directory=True)
        self.parts.add((rank, n))
        self.records.update(row.record for row in rows if row.record is not None)
        self.shards.update(row.record.split("/", 1)[0] for row in rows if row.record is not None)
