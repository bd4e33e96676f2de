"""Reading rows: JSONL / JSON / Parquet files, folders (sorted, recursive), ``hf:NAME[:split]``; a bad line or
file is one ``Unreadable`` and reading goes on; a source that cannot be read is refused when opened."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_hs_compat.capture import sources
from vllm_hs_compat.capture.sources import RawRow, SourceRef, Unreadable, open_source
from vllm_hs_compat.errors import CaptureDataError


def rows_of(src: str | Path) -> list[RawRow | Unreadable]:
    return list(open_source(src))


def test_source_ref_prints_file_and_row() -> None:
    assert str(SourceRef("data/a.jsonl", 7)) == "data/a.jsonl:7"


def test_jsonl_rows_keep_line_numbers_and_bad_lines_do_not_stop_reading(
    write_jsonl: Callable[..., Path],
) -> None:
    path = write_jsonl(
        [
            {"id": 1},
            "",  # blank: no row, but line 1 is counted
            "{not json",
            "[1, 2]",
            '{"a": 1, "a": 2}',
            '{"x": NaN}',
            {"id": 2, "text": "ünï"},
        ]
    )
    got = rows_of(path)
    assert [(type(r).__name__, r.source.row) for r in got] == [
        ("RawRow", 0),
        ("Unreadable", 2),
        ("Unreadable", 3),
        ("Unreadable", 4),
        ("Unreadable", 5),
        ("RawRow", 6),
    ]
    assert all(r.source.file == str(path) for r in got)
    bad = [r for r in got if isinstance(r, Unreadable)]
    assert "not one JSON object" in bad[0].message
    assert "expected a JSON object per line, found a list" in bad[1].message
    assert "appears twice" in bad[2].message
    assert "NaN" in bad[3].message
    last = got[-1]
    assert isinstance(last, RawRow) and last.row == {"id": 2, "text": "ünï"}


def test_jsonl_line_that_is_not_utf8_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": 1}\r\n{"t": "\xff\xfe"}\n{"id": 3}\n')  # a BOM, CRLF, a bad line
    got = rows_of(path)
    assert [type(r).__name__ for r in got] == ["RawRow", "Unreadable", "RawRow"]
    assert got[1].source == SourceRef(str(path), 1) and "not UTF-8" in got[1].message  # type: ignore[union-attr]
    assert got[0].row == {"id": 1}  # type: ignore[union-attr]


@pytest.mark.parametrize("wrapped", [False, True], ids=["list", "data-object"])
def test_json_file_is_a_list_or_an_object_with_data(tmp_path: Path, wrapped: bool) -> None:
    items: list[Any] = [{"id": "a"}, 5, {"id": "b"}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"data": items, "version": 1} if wrapped else items))
    got = rows_of(path)
    assert [(type(r).__name__, r.source.row) for r in got] == [("RawRow", 0), ("Unreadable", 1), ("RawRow", 2)]
    assert "found a int" in got[1].message  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ('{"rows": [{"id": 1}]}', "an object with keys ['rows']"),
        ("[{]", "not valid JSON"),
        ('"just text"', "found a str"),
    ],
)
def test_json_file_of_another_shape_is_one_unreadable(tmp_path: Path, text: str, expect: str) -> None:
    path = tmp_path / "rows.json"
    path.write_text(text)
    (got,) = rows_of(path)
    assert isinstance(got, Unreadable) and got.source == SourceRef(str(path), 0)
    assert expect in got.message and "none of its rows were read" in got.message


def test_parquet_rows_in_order_across_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 3)
    rows = [
        {"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}], "input_ids": None if i % 2 else [i, 1]}
        for i in range(8)
    ]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    got = rows_of(path)
    assert [r.source for r in got] == [SourceRef(str(path), i) for i in range(8)]
    assert [r.row for r in got if isinstance(r, RawRow)] == rows


def test_folder_is_read_recursively_in_sorted_order(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    root = tmp_path / "data"
    (root / "b").mkdir(parents=True)
    (root / ".cache").mkdir()
    (root / "b" / "z.jsonl").write_text('{"n": 3}\n')
    (root / "a.json").write_text('[{"n": 1}, {"n": 2}]')
    pq.write_table(pa.Table.from_pylist([{"n": 4}]), root / "c.parquet")
    (root / "README.md").write_text("not data")
    (root / ".hidden.jsonl").write_text('{"n": -1}\n')
    (root / ".cache" / "x.jsonl").write_text('{"n": -2}\n')
    src = open_source(root)
    assert [Path(f).relative_to(root).as_posix() for f, _ in src.files] == ["a.json", "b/z.jsonl", "c.parquet"]
    got = list(src)
    assert [r.row["n"] for r in got if isinstance(r, RawRow)] == [1, 2, 3, 4]
    assert [str(r.source) for r in got] == [
        f"{root}/a.json:0",
        f"{root}/a.json:1",
        f"{root}/b/z.jsonl:0",
        f"{root}/c.parquet:0",
    ]


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (lambda p: p / "missing.jsonl", "does not exist"),
        (lambda p: (p / "rows.csv", (p / "rows.csv").write_text("a,b"))[0], "has suffix '.csv'"),
        (lambda p: (p / "empty", (p / "empty").mkdir(), (p / "empty" / "x.txt").write_text("x"))[0], "no data file"),
        (lambda p: (p / "bad.parquet", (p / "bad.parquet").write_bytes(b"not parquet at all"))[0], "cannot be read"),
        (lambda p: "hf:", "expected hf:NAME"),
    ],
    ids=["missing", "suffix", "empty-folder", "broken-parquet", "hf-no-name"],
)
def test_unusable_sources_are_refused_when_opened(tmp_path: Path, make: Callable[[Path], Any], expect: str) -> None:
    src = make(tmp_path)
    if str(src).endswith(".parquet"):
        pytest.importorskip("pyarrow")
    with pytest.raises(CaptureDataError) as info:
        open_source(src)
    assert expect in str(info.value)


def test_hf_source_without_datasets_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError, as when not installed
    with pytest.raises(CaptureDataError, match=r"needs the `datasets` library.*pip install datasets"):
        open_source("hf:org/name:train")


def test_parquet_without_pyarrow_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(CaptureDataError, match=r"need pyarrow.*pip install 'vllm-hs-compat\[capture\]'"):
        open_source(path)


def test_hf_source_through_datasets(
    tmp_path: Path, write_jsonl: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))  # read when datasets is first imported
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    write_jsonl([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}], name="ds/train.jsonl")
    got = rows_of(f"hf:{folder}:train")
    assert [str(r.source) for r in got] == [f"hf:{folder}:train:0", f"hf:{folder}:train:1"]
    assert [r.row for r in got if isinstance(r, RawRow)] == [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}]
    with pytest.raises(CaptureDataError, match="load_dataset failed"):
        open_source(f"hf:{folder}:nosuchsplit")
