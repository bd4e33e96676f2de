"""The record's sample fields (schema 2): validation, dict round trip, schema 1 compatibility, the loss mask."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat.core.records import (
    MAX_LOSS_MASK_SPANS,
    MAX_METADATA_BYTES,
    SCHEMA_VERSION,
    RecordMeta,
    RecordSample,
    canonical_metadata,
)
from vllm_hs_compat.errors import RecordFormatError


def meta(**kw: object) -> RecordMeta:
    base: dict[str, object] = dict(
        record_id="r",
        token_ids=tuple(range(10)),
        layer_ids=(3, 7),
        pre_norm=True,
        dtype="bfloat16",
        shape=(10, 2, 8),
        start=4,
        num_prompt_tokens=8,
    )
    base.update(kw)
    return RecordMeta(**base)  # type: ignore[arg-type]


def test_schema_2_round_trips_through_a_plain_dict_and_json() -> None:
    m = meta(
        sample_id="row-17",
        source="data/chat.jsonl:17",
        loss_mask_spans=((5, 7), (8, 14)),
        metadata_json=canonical_metadata({"lang": "de", "turns": [1, 2], "score": 0.5, "ok": None}),
        checksum=123,
    )
    d = m.to_dict()
    assert d["schema_version"] == SCHEMA_VERSION == 2
    assert d["loss_mask_spans"] == [[5, 7], [8, 14]] and d["metadata"]["lang"] == "de"
    back = RecordMeta.from_dict(json.loads(json.dumps(d)))
    assert back == m and hash(back) == hash(m)
    assert back.metadata == {"lang": "de", "turns": [1, 2], "score": 0.5, "ok": None}
    assert back.sample == RecordSample("row-17", "data/chat.jsonl:17", ((5, 7), (8, 14)), m.metadata_json)
    # the mask: rows are positions 4..13
    assert back.loss_mask().tolist() == [0, 1, 1, 0, 1, 1, 1, 1, 1, 1]  # type: ignore[union-attr]
    # defaults: no mask given / nothing trained are different things
    assert meta().loss_mask() is None
    assert meta(loss_mask_spans=()).loss_mask().tolist() == [0] * 10  # type: ignore[union-attr]
    assert RecordMeta.from_dict(meta(loss_mask_spans=()).to_dict()).loss_mask_spans == ()


def test_schema_1_dicts_still_read_and_cannot_carry_sample_fields() -> None:
    d1 = meta().to_dict()
    for k in ("sample_id", "source", "loss_mask_spans", "metadata"):
        del d1[k]
    d1["schema_version"] = 1
    m1 = RecordMeta.from_dict(d1)
    assert m1.schema_version == 1 and m1.loss_mask_spans is None and m1.metadata == {}
    assert m1.to_dict() == d1  # written back as it was read
    with pytest.raises(RecordFormatError, match=r"schema 1\) has unknown fields \['sample_id'\]"):
        RecordMeta.from_dict({**d1, "sample_id": "x"})
    with pytest.raises(RecordFormatError, match="schema 1 but carries sample fields"):
        meta(schema_version=1, sample_id="x")
    d2 = meta().to_dict()
    del d2["metadata"]
    with pytest.raises(RecordFormatError, match="lacks field 'metadata'"):  # schema 2 needs all four
        RecordMeta.from_dict(d2)


@pytest.mark.parametrize(
    ("spans", "needle"),
    [
        (((3, 6),), r"before position 4"),  # rows start at position 4
        (((5, 15),), r"runs past position 14"),  # the record's last row is position 13
        (((6, 6),), r"empty or reversed"),
        (((8, 6),), r"empty or reversed"),
        (((8, 10), (5, 7)), r"sorted and not overlap"),
        (((5, 9), (8, 10)), r"sorted and not overlap"),
        (((5, 9, 1),), r"\[start, stop\] pair"),
        (((5, True),), r"must be an int"),
        ("5-9", r"list of \[start, stop\] pairs"),
    ],
)
def test_bad_spans_are_refused_by_name(spans: object, needle: str) -> None:
    with pytest.raises(RecordFormatError, match=needle):
        meta(loss_mask_spans=spans)
    d = meta().to_dict()
    d["loss_mask_spans"] = spans if isinstance(spans, str) else [list(s) for s in spans]  # type: ignore[union-attr]
    with pytest.raises(RecordFormatError, match=needle):
        RecordMeta.from_dict(d)


def test_adjacent_spans_are_fine_and_the_span_count_is_bounded() -> None:
    assert meta(loss_mask_spans=((4, 6), (6, 14))).loss_mask().tolist() == [1] * 10  # type: ignore[union-attr]
    many = tuple((i, i + 1) for i in range(MAX_LOSS_MASK_SPANS + 1))
    with pytest.raises(RecordFormatError, match=f"at most {MAX_LOSS_MASK_SPANS}"):
        meta(shape=(len(many), 2, 8), token_ids=(1,) * len(many), start=0, loss_mask_spans=many)


@pytest.mark.parametrize(
    ("metadata", "needle"),
    [
        ([1, 2], "must be a JSON object"),
        ({1: "a"}, "JSON keys are strings"),
        ({"x": float("nan")}, "NaN"),
        ({"x": (1, 2)}, "tuple"),
        ({"x": b"a"}, "bytes"),
        ({"x": "y" * MAX_METADATA_BYTES}, f"at most {MAX_METADATA_BYTES} allowed"),
    ],
)
def test_bad_metadata_is_refused_by_name(metadata: object, needle: str) -> None:
    with pytest.raises(RecordFormatError, match=needle):
        canonical_metadata(metadata)
    d = meta().to_dict()
    d["metadata"] = metadata
    with pytest.raises(RecordFormatError, match=needle):
        RecordMeta.from_dict(d)


def test_metadata_json_must_be_canonical() -> None:
    with pytest.raises(RecordFormatError, match="canonical form"):
        meta(metadata_json='{"b":1,"a":2}')
    with pytest.raises(RecordFormatError, match="JSON object"):
        meta(metadata_json="[]")
    assert meta(metadata_json='{"a":2,"b":1}').metadata == {"a": 2, "b": 1}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(0, 100))
def test_spans_from_any_mask_give_that_mask_back(bits: list[bool], start: int) -> None:
    spans, a = [], None
    for i, b in enumerate([*bits, False]):
        if b and a is None:
            a = i
        elif not b and a is not None:
            spans.append((start + a, start + i))
            a = None
    m = meta(token_ids=(1,) * len(bits), shape=(len(bits), 2, 8), start=start, loss_mask_spans=tuple(spans))
    back = RecordMeta.from_dict(json.loads(json.dumps(m.to_dict())))
    assert torch.equal(back.loss_mask(), torch.tensor(bits, dtype=torch.int64))  # type: ignore[arg-type]


# --- the request's entry (kv_transfer_params["hs_capture"]["sample"]) -------------------------------------------
def test_request_entry_parses_clips_and_refuses_by_name() -> None:
    from vllm_hs_compat.core.capture import CaptureSpec, RequestSample, parse_request
    from vllm_hs_compat.errors import CaptureConfigError

    raw = {"capture": "all", "sample": {"id": "a", "loss_mask_spans": [[2, 5], [9, None]], "metadata": {"k": 1}}}
    spec, sample = parse_request(raw, base=CaptureSpec(), what="r")
    assert spec.mode == "all" and sample is not None and sample.spans == ((2, 5), (9, None))
    rs = sample.for_record(4, 12, 13, what="r")  # rows 4..11 of a 13-token request
    assert rs.loss_mask_spans == ((4, 5), (9, 12)) and rs.metadata == {"k": 1} and rs.sample_id == "a"
    assert sample.for_record(5, 9, 13, what="r").loss_mask_spans == ()  # nothing of the mask in these rows
    assert parse_request({"capture": "prompt"}, base=CaptureSpec(), what="r")[1] is None
    no_mask = RequestSample.parse({"id": "b"}, what="r").for_record(0, 3, 3, what="r")
    assert no_mask.loss_mask_spans is None
    for bad, needle in [
        ({"loss_mask_spans": [[0, None], [3, 4]]}, "only the last one may have a null stop"),
        ({"loss_mask_spans": [[-1, 2]]}, r"start\) must be an int >= 0"),
        ({"loss_mask_spans": [[0, "3"]]}, "int or null"),
        ({"id": 7}, r"r.id must be a string"),
        ({"source": "x" * 2000}, "at most 1024"),
        ({"metadata": {"a": {1, 2}}}, "set"),
        ({"loss_mask_spans": [[0, 1]] * 2000}, "at most 1024"),
        ("row-1", "must be a map"),
    ]:
        with pytest.raises(CaptureConfigError, match=needle):
            RequestSample.parse(bad, what="r")
    with pytest.raises(CaptureConfigError, match="runs past the request's 13 tokens"):
        RequestSample.parse({"loss_mask_spans": [[0, 14]]}, what="r").for_record(0, 13, 13, what="r")
    with pytest.raises(CaptureConfigError, match="unknown keys"):  # the config's own map takes no sample entry
        CaptureSpec.parse({"sample": {}}, what="config")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from([0, 1]), min_size=1, max_size=30), st.integers(0, 6), st.booleans())
def test_sample_entry_gives_the_record_the_mask_it_was_built_from(prompt: list[int], gen: int, on_policy: bool) -> None:
    """``sample_entry`` (what a capture client sends) -> the connector's parsing -> the record's ``loss_mask()``."""
    from vllm_hs_compat.core.capture import RequestSample, sample_entry

    entry = sample_entry(sample_id="x", loss_mask=prompt, generated=on_policy, metadata={"n": len(prompt)})
    total = len(prompt) + gen  # a capture of everything: prompt then generated rows
    rs = RequestSample.parse(json.loads(json.dumps(entry)), what="r").for_record(0, total, total, what="r")
    m = meta(token_ids=(1,) * total, shape=(total, 2, 8), start=0, loss_mask_spans=rs.loss_mask_spans)
    assert m.loss_mask().tolist() == prompt + [int(on_policy)] * gen  # type: ignore[union-attr]
    assert rs.metadata == {"n": len(prompt)} and rs.sample_id == "x"
