"""Rows into samples against the real tiny tokenizer and real template rendering (transformers'
``apply_chat_template``): the assistant loss mask equals exactly the assistant spans, computed here independently
by tokenizing the template's pieces one by one; every bad input is a named per-row error and the other rows go on;
templates that cannot give the mask asked for are refused before anything is read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat.capture.data import CONVERSATIONS, TINY_CHAT_TEMPLATE, tiny_chat_template
from vllm_hs_compat.capture.samples import (
    METADATA_MAX_BYTES,
    ROW_ERROR_REASONS,
    RowError,
    Sample,
    canonical_json,
    check_template,
    content_id,
    mask_spans,
    read_samples,
)
from vllm_hs_compat.capture.sources import SourceRef
from vllm_hs_compat.errors import CaptureDataError

NO_MARKERS = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TALK = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi you"},
    {"role": "user", "content": "more words please"},
    {"role": "assistant", "content": "fine then"},
]


# --- the independent model of the tiny template: its pieces, each tokenized alone -----------------------------
def pieces(messages: list[dict[str, str]], generation_prompt: bool = False) -> list[tuple[str, int]]:
    """The tiny template's output as (text, is-assistant-content) pieces, written from its documented format:
    ``<s>``, then per turn ``<|ROLE|>\\n`` CONTENT ``</s>`` ``\\n``; the assistant's CONTENT and ``</s>`` are
    trained."""
    out = [("<s>", 0)]
    for m in messages:
        a = int(m["role"] == "assistant")
        out += [(f"<|{m['role']}|>\n", 0), (m["content"], a), ("</s>", a), ("\n", 0)]
    if generation_prompt:
        out.append(("<|assistant|>\n", 0))
    return out


def expected(tok: Any, parts: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in parts:
        piece = tok(text, add_special_tokens=False)["input_ids"] if text else []
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def samples(src: Path, tok: Any, **kw: Any) -> list[Sample | RowError]:
    return list(read_samples(src, tok, **kw))


def only(items: list[Sample | RowError]) -> Sample:
    (s,) = items
    assert isinstance(s, Sample), s
    return s


def errors(items: list[Sample | RowError]) -> list[tuple[int, str]]:
    return [(e.source.row, e.reason) for e in items if isinstance(e, RowError)]


# --- templates and masks -------------------------------------------------------------------------------------
def test_rendered_text_is_the_documented_piece_model(tok: Any) -> None:
    assert tok.chat_template == tiny_chat_template()  # make_tokenizer saved the shipped template with the vocabulary
    rendered = tok.apply_chat_template(TALK, tokenize=False)
    assert rendered == "".join(text for text, _ in pieces(TALK))


def test_shipped_set_masks_equal_the_assistant_spans(tok: Any) -> None:
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()]
    got = samples(CONVERSATIONS, tok)
    assert len(got) == len(rows) >= 20
    multi = 0
    for row, s in zip(rows, got, strict=True):
        assert isinstance(s, Sample), s
        ids, mask = expected(tok, pieces(row["messages"]))
        assert s.sample_id == row["id"] and s.metadata == row["metadata"]
        assert list(s.input_ids) == ids and s.prompt_len == len(ids)
        assert list(s.loss_mask or ()) == mask
        # The trained tokens decode to the assistant turns, each with its end-of-turn token.
        answers = "".join(m["content"] + "</s>" for m in row["messages"] if m["role"] == "assistant")
        assert tok.decode([t for t, m in zip(s.input_ids, s.loss_mask or (), strict=True) if m]) == answers
        multi += sum(m["role"] == "assistant" for m in row["messages"]) > 1
    assert multi >= 8  # multi-turn conversations: several disjoint spans per sample


def test_a_wrong_span_is_detected(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    """Negative control: the span model must tell a mask shifted by one token, or missing its end-of-turn token."""
    s = only(samples(write_jsonl([{"messages": TALK}]), tok))
    ids, mask = expected(tok, pieces(TALK))
    assert list(s.loss_mask or ()) == mask
    shifted = [0] + mask[:-1]
    assert shifted != list(s.loss_mask or ())
    no_eos = [m if t != tok.eos_token_id else 0 for t, m in zip(ids, mask, strict=True)]
    assert no_eos != list(s.loss_mask or ())


def test_sharegpt_rows_equal_openai_rows(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    share = [{"from": names[m["role"]], "value": m["content"]} for m in TALK]
    got = samples(write_jsonl([{"id": 1, "messages": TALK}, {"id": 2, "conversations": share}]), tok)
    a, b = (only([g]) for g in got)
    assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask)
    assert (a.sample_id, b.sample_id) == ("1", "2")


@pytest.mark.parametrize(("mode", "fill"), [("all", 1), ("none", None)])
def test_loss_mask_all_and_none(tok: Any, write_jsonl: Callable[..., Path], mode: str, fill: int | None) -> None:
    s = only(samples(write_jsonl([{"messages": TALK}]), tok, loss_mask=mode, chat_template=NO_MARKERS))
    ids, _ = expected(tok, pieces(TALK))
    assert list(s.input_ids) == ids
    assert s.loss_mask == (None if fill is None else (fill,) * len(ids))


def test_template_from_a_file_is_the_one_used(tok: Any, write_jsonl: Callable[..., Path], tmp_path: Path) -> None:
    path = tmp_path / "other.jinja"
    path.write_text(tiny_chat_template().replace("<|assistant|>", "<|bot|>"))
    s = only(samples(write_jsonl([{"messages": TALK}]), tok, chat_template=str(path)))
    assert "<|bot|>" in tok.decode(list(s.input_ids)) and "<|assistant|>" not in tok.decode(list(s.input_ids))
    assert (
        tok.decode([t for t, m in zip(s.input_ids, s.loss_mask or (), strict=True) if m]) == "hi you</s>fine then</s>"
    )


def test_template_without_markers_is_refused_naming_the_file(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(NO_MARKERS)
    with pytest.raises(CaptureDataError) as info:
        check_template(tok, str(path), "assistant")
    text = str(info.value)
    assert repr(str(path)) in text and "{% generation %}...{% endgeneration %}" in text and "--loss-mask all" in text
    # read_samples refuses too, before it opens the source (which does not even exist here).
    with pytest.raises(CaptureDataError, match="no \\{% generation %\\} markers"):
        read_samples(tmp_path / "missing.jsonl", tok, chat_template=path)
    # The same template is fine when no assistant mask is asked, or on-policy (the prompt's mask is all 0).
    check_template(tok, str(path), "all")
    check_template(tok, str(path), "none")
    check_template(tok, str(path), "assistant", on_policy=True)


def test_tokenizer_template_without_markers_is_refused_naming_it(tok: Any) -> None:
    own = tok.chat_template
    try:
        tok.chat_template = NO_MARKERS
        with pytest.raises(CaptureDataError, match="the tokenizer's chat_template has no"):
            check_template(tok, None, "assistant")
    finally:
        tok.chat_template = own
    check_template(tok, None, "assistant")  # the shipped template passes
    check_template(tok, TINY_CHAT_TEMPLATE, "assistant")


def test_markers_that_enclose_no_content_are_refused(tok: Any) -> None:
    hollow = (
        tiny_chat_template()
        .replace("{{- message['content'] + eos_token -}}", "")
        .replace("{{- '\\n' -}}\n{%- else -%}", "{{- message['content'] + eos_token + '\\n' -}}\n{%- else -%}")
    )
    assert "{%- generation -%}" in hollow and hollow != tiny_chat_template()
    with pytest.raises(CaptureDataError, match="marks no token"):
        check_template(tok, hollow, "assistant")


def test_bad_template_arguments_are_refused(tok: Any) -> None:
    with pytest.raises(CaptureDataError, match="neither an existing file nor a Jinja template"):
        check_template(tok, "no/such/template.jinja", "assistant")
    with pytest.raises(CaptureDataError, match="loss_mask must be one of"):
        check_template(tok, None, "assistants")
    for mode in ("assistant", "all"):
        with pytest.raises(CaptureDataError, match="not a valid Jinja template"):
            check_template(tok, "{% generation %}{% endgeneration %}{% if %}", mode)
    # A template that refuses the test conversation itself is not refused up front: its rows say why.
    check_template(tok, "{% generation %}{{ raise_exception('needs a system turn') }}{% endgeneration %}", "assistant")


# --- on-policy --------------------------------------------------------------------------------------------------
def test_on_policy_prompt_is_the_conversation_before_the_last_answer(
    tok: Any, write_jsonl: Callable[..., Path]
) -> None:
    asks = TALK[:-1]  # ends with a user turn: kept whole
    got = samples(
        write_jsonl([{"messages": TALK}, {"messages": asks}, {"prompt": "tell me more"}]), tok, on_policy=True
    )
    a, b, c = (only([g]) for g in got)
    ids, _ = expected(tok, pieces(asks, generation_prompt=True))
    assert list(a.input_ids) == ids and a.prompt_len == len(ids) and a.loss_mask == (0,) * len(ids)
    assert (b.input_ids, b.loss_mask) == (a.input_ids, a.loss_mask)
    assert list(c.input_ids) == tok("tell me more")["input_ids"] and c.loss_mask == (0,) * len(c.input_ids)
    none = only(samples(write_jsonl([{"messages": TALK}]), tok, on_policy=True, loss_mask="none"))
    assert none.loss_mask is None and none.input_ids == a.input_ids


# --- row shapes and fields --------------------------------------------------------------------------------------
def test_pretokenized_rows(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    vocab = len(tok)
    rows: list[Any] = [
        {"id": "ok", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"id": "oov", "input_ids": [5, vocab], "loss_mask": [0, 1]},
        {"id": "neg", "input_ids": [-1, 3], "loss_mask": [0, 1]},
        {"id": "txt", "input_ids": [5, "6"], "loss_mask": [0, 1]},
        {"id": "bool", "input_ids": [True, 6], "loss_mask": [0, 1]},
        {"id": "short", "input_ids": [5, 6], "loss_mask": [1]},
        {"id": "two", "input_ids": [5, 6], "loss_mask": [0, 2]},
        {"id": "nomask", "input_ids": [5, 6]},
        {"id": "zeros", "input_ids": [5, 6], "loss_mask": [0, 0]},
        {"id": "none", "input_ids": []},
        {"id": "last", "input_ids": [vocab - 1], "loss_mask": [1]},
    ]
    got = samples(write_jsonl(rows), tok)
    assert errors(got) == [
        (1, "bad_field"),
        (2, "bad_field"),
        (3, "bad_field"),
        (4, "bad_field"),
        (5, "bad_field"),
        (6, "bad_field"),
        (7, "bad_field"),
        (8, "empty"),
        (9, "empty"),
    ]
    first, last = (g for g in got if isinstance(g, Sample))
    assert (first.input_ids, first.loss_mask, first.prompt_len) == ((5, 6, 7), (0, 1, 1), 3)
    assert last.sample_id == "last"
    msg = {e.sample_id: e.message for e in got if isinstance(e, RowError)}
    assert f"in [0, {vocab})" in msg["oov"] and "another tokenizer" in msg["oov"]
    assert "--loss-mask all" in msg["nomask"]
    everything = only(samples(write_jsonl([{"input_ids": [5, 6]}]), tok, loss_mask="all"))
    assert everything.loss_mask == (1, 1)


def test_prompt_rows_are_raw_text(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    got = samples(write_jsonl([{"prompt": "some plain text"}, {"prompt": "   "}, {"prompt": 3}]), tok, loss_mask="all")
    s = got[0]
    assert isinstance(s, Sample) and list(s.input_ids) == tok("some plain text")["input_ids"]
    assert s.loss_mask == (1,) * len(s.input_ids)
    assert errors(got) == [(1, "empty"), (2, "bad_field")]
    (err,) = samples(write_jsonl([{"prompt": "text"}]), tok)  # --loss-mask assistant: nothing to mark
    assert isinstance(err, RowError) and err.reason == "empty" and "--loss-mask all" in err.message


def test_fields_map_other_names(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    rows = [{"uid": 42, "dialog": TALK, "meta": {"k": "v"}, "messages": "ignored: mapped away"}]
    s = only(samples(write_jsonl(rows), tok, fields={"id": "uid", "messages": "dialog", "metadata": "meta"}))
    assert s.sample_id == "42" and s.metadata == {"k": "v"}
    assert list(s.input_ids) == expected(tok, pieces(TALK))[0]
    with pytest.raises(CaptureDataError, match="'dialogue' is not one of"):
        read_samples(CONVERSATIONS, tok, fields={"dialogue": "x"})


def test_unknown_shape_names_found_and_expected_keys(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    got = samples(write_jsonl([{"id": 1, "dialog": TALK}, {"id": 2, "messages": TALK}]), tok)
    assert errors(got) == [(0, "unknown_shape")]
    msg = got[0].message  # type: ignore[union-attr]
    assert "['dialog', 'id']" in msg and "messages" in msg and "conversations" in msg and "--field" in msg
    mapped = samples(write_jsonl([{"dialog": 1}]), tok, fields={"messages": "talk"})
    assert "messages (mapped to 'talk')" in mapped[0].message  # type: ignore[union-attr]


def test_bad_rows_are_named_and_the_run_goes_on(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    user_only = [{"role": "user", "content": "anyone there"}]
    rows: list[Any] = [
        {"id": "a", "messages": TALK},
        "{broken",
        {"id": "b", "messages": []},
        {"id": "c", "messages": user_only},
        {"id": "d", "conversations": [{"from": "alien", "value": "x"}]},
        {"id": "e", "messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
        {"id": "f", "messages": [{"content": "no role"}]},
        {"id": True, "messages": TALK},
        {"id": "", "messages": TALK},
        {"id": "g", "messages": TALK, "metadata": "not an object"},
        {"id": "h", "messages": TALK, "metadata": {"blob": "x" * METADATA_MAX_BYTES}},
        {"id": "a", "messages": TALK[:3]},
        {"id": "z", "messages": TALK, "metadata": {"ok": [1, 2]}},
    ]
    path = write_jsonl(rows)
    got = samples(path, tok)
    assert errors(got) == [
        (1, "malformed"),
        (2, "empty"),
        (3, "empty"),
        (4, "bad_field"),
        (5, "template"),
        (6, "bad_field"),
        (7, "bad_field"),
        (8, "bad_field"),
        (9, "bad_field"),
        (10, "bad_field"),
        (11, "duplicate_id"),
    ]
    assert [s.sample_id for s in got if isinstance(s, Sample)] == ["a", "z"]
    assert all(e.reason in ROW_ERROR_REASONS for e in got if isinstance(e, RowError))
    msg = {e.source.row: e for e in got if isinstance(e, RowError)}
    assert msg[1].source == SourceRef(str(path), 1) and msg[1].sample_id is None
    assert "roles ['user']" in msg[3].message
    assert "from='alien'" in msg[4].message and "'gpt'" in msg[4].message
    assert "failed on this row" in msg[5].message
    assert f"more than the {METADATA_MAX_BYTES}" in msg[10].message
    assert msg[11].sample_id == "a" and f"first seen at {path}:0" in msg[11].message


def test_roles_are_checked_alike_in_every_shape(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    """An OpenAI message with role ``wizard`` is refused as ShareGPT's ``from: wizard`` is (it rendered as an ``ok``
    record under ``--loss-mask all`` before), so are a capitalised role and ShareGPT's names inside ``messages``,
    and a ShareGPT item given as role/content; the documented roles pass in both shapes (control)."""
    wizard = [{"role": "wizard", "content": "abracadabra"}, {"role": "assistant", "content": "hi"}]
    rows: list[Any] = [
        {"id": "openai", "messages": wizard},
        {"id": "sharegpt", "conversations": [{"from": "wizard", "value": "x"}, {"from": "gpt", "value": "hi"}]},
        {"id": "items", "conversations": wizard},
        {"id": "caps", "messages": [{"role": "User", "content": "x"}, {"role": "assistant", "content": "hi"}]},
        {"id": "names", "messages": [{"role": "human", "content": "x"}, {"role": "gpt", "content": "hi"}]},
        {"id": "ok-openai", "messages": [{"role": "system", "content": "s"}, *TALK]},
        {"id": "ok-sharegpt", "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "hi"}]},
    ]
    for mode in ("all", "assistant"):
        got = samples(write_jsonl(rows), tok, loss_mask=mode)
        assert errors(got) == [(i, "bad_field") for i in range(5)], mode
        assert [s.sample_id for s in got if isinstance(s, Sample)] == ["ok-openai", "ok-sharegpt"]
        first = got[0]
        assert isinstance(first, RowError) and "'messages'[0] has role 'wizard'; expected one of" in first.message


def test_too_long_rows_say_length_and_limit(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    n = len(expected(tok, pieces(TALK))[0])
    path = write_jsonl([{"messages": TALK}, {"input_ids": [5] * n, "loss_mask": [1] * n}])
    assert errors(samples(path, tok, max_len=n)) == []
    got = samples(path, tok, max_len=n - 1)
    assert errors(got) == [(0, "too_long"), (1, "too_long")]
    assert f"has {n} tokens, more than the {n - 1}" in got[0].message  # type: ignore[union-attr]
    assert [e.num_tokens for e in got if isinstance(e, RowError)] == [n, n]  # the index row carries the count
    # On-policy leaves room for at least one generated token.
    m = len(expected(tok, pieces(TALK[:-1], generation_prompt=True))[0])
    assert errors(samples(path, tok, max_len=m + 1, on_policy=True)) == [(1, "too_long")]
    assert errors(samples(path, tok, max_len=m, on_policy=True)) == [(0, "too_long"), (1, "too_long")]
    with pytest.raises(CaptureDataError, match="max_len must be a positive integer"):
        read_samples(path, tok, max_len=0)


def test_conversation_without_any_template_fails_per_row(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    own = tok.chat_template
    try:
        tok.chat_template = None
        check_template(tok, None, "assistant")  # pre-tokenized data needs no template: not refused up front
        got = samples(write_jsonl([{"messages": TALK}, {"input_ids": [5], "loss_mask": [1]}]), tok)
    finally:
        tok.chat_template = own
    assert errors(got) == [(0, "template")] and "--chat-template" in got[0].message  # type: ignore[union-attr]
    assert isinstance(got[1], Sample)


def test_select_skips_rows_without_templating_them(tok: Any, write_jsonl: Callable[..., Path]) -> None:
    rows = [{"id": i, "messages": TALK} for i in range(4)] + [{"id": 1, "messages": []}]
    got = samples(write_jsonl(rows), tok, select=lambda sid: sid in {"1", "3"})
    assert [(type(g).__name__, g.sample_id) for g in got] == [
        ("Sample", "1"),
        ("Sample", "3"),
        ("RowError", "1"),  # duplicates are found over every row, selected or not
    ]


def test_parquet_and_jsonl_rows_give_the_same_samples(tok: Any, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()][:5]
    for r in rows[1::2]:
        del r["id"]  # Parquet has them as null: content ids are equal whatever the file format
    rows[2]["messages"][0]["name"] = "ann"  # the other rows' messages get name=null in Parquet
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    a = samples(jsonl, tok)
    b = samples(tmp_path / "rows.parquet", tok)
    assert [(s.sample_id, s.input_ids, s.loss_mask) for s in a] == [(s.sample_id, s.input_ids, s.loss_mask) for s in b]  # type: ignore[union-attr]
    assert a[0].sample_id == rows[0]["id"] and a[1].sample_id.startswith("h:")
    assert pq.read_table(tmp_path / "rows.parquet").to_pylist()[1]["id"] is None


# --- sample ids -------------------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
rows_st = st.dictionaries(st.text(max_size=8), json_values, max_size=6)


def drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    return [drop_nulls(v) for v in value] if isinstance(value, list) else value


@settings(max_examples=25, deadline=None)
@given(rows_st, st.randoms(use_true_random=False))
def test_content_id_is_stable_under_key_order_and_json_round_trip(row: dict[str, Any], rnd: Any) -> None:
    keys = list(row)
    rnd.shuffle(keys)
    shuffled = {k: row[k] for k in keys}
    again = json.loads(json.dumps(shuffled, indent=2))
    assert content_id(row) == content_id(shuffled) == content_id(again) == content_id({**row, "\0null": None})
    # The documented recipe, computed here from its parts.
    text = json.dumps(drop_nulls(row), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert canonical_json(drop_nulls(row)) == text.encode("utf-8")
    assert content_id(row) == "h:" + xxhash.xxh3_128(text.encode("utf-8")).hexdigest()


@settings(max_examples=20, deadline=None)
@given(rows_st, st.text(min_size=1, max_size=8), json_values)
def test_content_id_changes_with_the_content(row: dict[str, Any], key: str, value: Any) -> None:
    other = {**row, key: value}
    if drop_nulls(other) != drop_nulls(row):
        assert content_id(other) != content_id(row)


def test_content_id_is_pinned() -> None:
    """The id of a fixed row: a change of recipe (and so of every stored sample id) fails here."""
    row = {"messages": [{"role": "user", "content": "héllo"}], "b": 1.5, "a": [1, None, True]}
    assert canonical_json(row) == '{"a":[1,null,true],"b":1.5,"messages":[{"content":"héllo","role":"user"}]}'.encode()
    assert content_id(row) == "h:" + xxhash.xxh3_128_hexdigest(canonical_json(row))
    assert content_id(row) == "h:22ae984e2ceabd0abd55e1cde3faff01"


# --- helpers for the capture command ----------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 1), max_size=40))
def test_mask_spans_give_back_the_mask(mask: list[int]) -> None:
    spans = mask_spans(mask)
    rebuilt = [0] * len(mask)
    for a, b in spans:
        assert 0 <= a < b <= len(mask)
        rebuilt[a:b] = [1] * (b - a)
    assert rebuilt == mask
    assert all(b < c for (_, b), (c, _) in zip(spans, spans[1:], strict=False))  # disjoint, not touching


def test_shipped_sample_spans_are_its_assistant_turns(tok: Any) -> None:
    s = next(g for g in read_samples(CONVERSATIONS, tok) if isinstance(g, Sample) and g.sample_id == "conv-013")
    spans = mask_spans(s.loss_mask or ())
    assert [tok.decode(list(s.input_ids[a:b])) for a, b in spans] == [
        "Air scatters blue light more than red light, so blue reaches us from every direction.</s>",
        "The light travels through more air, and most of the blue is scattered away.</s>",
        "You are welcome.</s>",
    ]
