"""Rows templated and tokenized into :class:`Sample` (exactly the ids the engine gets, the loss mask, the sample
id), or a :class:`RowError` that is counted and never stops the run.  See docs/capture.md, "Input rows".

:func:`check_template` refuses, before any engine starts, a chat template that cannot give the assistant loss mask
asked for (no ``{% generation %}`` markers): never a silent all-zero or all-one mask.  :func:`read_samples` checks
its arguments and the source when called (raising :class:`~vllm_hs_compat.errors.CaptureDataError`) and returns
an iterator over the rows' samples and row errors, in the source's order.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from vllm_hs_compat.capture.sources import RawRow, SourceRef, Unreadable, open_source
from vllm_hs_compat.core.capture import mask_spans  # a 0/1 mask as the request's loss_mask_spans (re-exported)
from vllm_hs_compat.errors import CaptureDataError

__all__ = [
    "CHECKED_ROWS",
    "FIELD_NAMES",
    "LOSS_MASKS",
    "MESSAGE_ROLES",
    "METADATA_MAX_BYTES",
    "ROW_ERROR_REASONS",
    "SHAREGPT_ROLES",
    "RowError",
    "Sample",
    "SourceRef",
    "canonical_json",
    "check_rows",
    "check_template",
    "content_id",
    "has_generation_markers",
    "mask_spans",
    "read_samples",
    "resolve_template",
    "without_nulls",
]

#: Every reason a row can fail for (``RowError.reason``):
#:
#: * ``malformed`` -- the line/element/file is not a JSON object (or a Parquet row group cannot be read);
#: * ``unknown_shape`` -- none of ``messages``, ``conversations``, ``prompt``, ``input_ids`` (after ``fields``);
#: * ``empty`` -- nothing to capture: no messages, empty text, or no token under the loss mask asked for;
#: * ``too_long`` -- more tokens than ``max_len`` (the model's context);
#: * ``template`` -- the chat template failed to render this row (or there is no template at all);
#: * ``tokenizer_mismatch`` -- the engine ran other token ids than the sample's (set by the capture command);
#: * ``bad_field`` -- a field has the wrong type or value (id, metadata, roles, input_ids, loss_mask);
#: * ``duplicate_id`` -- a second row with a sample id already seen in this source (the first one is kept).
ROW_ERROR_REASONS: tuple[str, ...] = (
    "malformed",
    "unknown_shape",
    "empty",
    "too_long",
    "template",
    "tokenizer_mismatch",
    "bad_field",
    "duplicate_id",
)

#: ``loss_mask`` values: the template's assistant spans, every token, or no mask.
LOSS_MASKS: tuple[str, ...] = ("assistant", "all", "none")
#: Names ``fields`` may map to a row's own column names.
FIELD_NAMES: tuple[str, ...] = ("id", "messages", "conversations", "prompt", "input_ids", "loss_mask", "metadata")
#: Row shapes, in the order they are looked for (the first present wins).
SHAPES: tuple[str, ...] = ("input_ids", "messages", "conversations", "prompt")
#: A row's metadata, as compact JSON, is at most this many bytes.
METADATA_MAX_BYTES = 4096
#: The roles a message may have, whatever the row's shape (OpenAI ``messages``, ShareGPT ``conversations`` after
#: its ``from`` names are mapped, or its items given as role/content): the roles chat templates render.  Anything
#: else (``"wizard"``, ``"User"``, ShareGPT's ``"gpt"`` inside ``messages``) is ``bad_field``: a template either
#: raises on it or renders it as something the verifier was never trained on.
MESSAGE_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
#: ShareGPT ``from`` values and the chat role each becomes.
SHAREGPT_ROLES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

# The pattern transformers itself looks for (utils/chat_template_utils.py) before it tracks generation blocks.
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_END_GENERATION = re.compile(r"\{%-?\s*endgeneration\s*-?%\}")
_TOKENIZER_TEMPLATE = "the tokenizer's chat_template"
_MARKERS_HOW = (
    "put {% generation %}...{% endgeneration %} around each assistant message's content in the template "
    "(see docs/capture.md), or use --loss-mask all or --loss-mask none"
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One row, templated and tokenized, ready for the engine.

    ``input_ids`` are exactly the ids the engine gets (its ``prompt_token_ids``); ``loss_mask`` holds one 0/1 per
    input id (``None`` when ``loss_mask="none"``); ``prompt_len == len(input_ids)`` except for on-policy samples,
    where the engine generates after them (their mask is all 0: the generated part is the one trained);
    ``metadata`` is the row's own ``metadata`` object (JSON-able, at most :data:`METADATA_MAX_BYTES` compact).
    """

    sample_id: str
    source: SourceRef
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...] | None
    prompt_len: int
    metadata: Mapping[str, Any]

    @property
    def loss_tokens(self) -> int | None:
        """The number of 1s in the loss mask (``None`` without a mask)."""
        return None if self.loss_mask is None else sum(self.loss_mask)


@dataclass(frozen=True, slots=True)
class RowError:
    """A row that yields no sample: counted, never stops the run.  ``reason`` is one of
    :data:`ROW_ERROR_REASONS`; ``message`` says what was found, what was expected and how to fix it."""

    sample_id: str | None
    source: SourceRef
    reason: str
    message: str
    num_tokens: int = 0
    """The row's token count where it was known when it failed (``too_long``: its length), else 0."""


# --- sample ids ---------------------------------------------------------------------------------------------
def canonical_json(row: Any) -> bytes:
    """The canonical JSON of a row: keys sorted, separators ``,`` and ``:``, non-ASCII kept, UTF-8.

    Raises ``ValueError``/``TypeError`` for a value JSON cannot carry (NaN, bytes, dates...)."""
    return json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def without_nulls(value: Any) -> Any:
    """``value`` with every object member whose value is null left out, at any depth (Parquet and ``datasets``
    give a row's absent fields as null: both then read the same)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [without_nulls(v) for v in value]
    return value


def content_id(row: Any) -> str:
    """A row's content id: ``"h:"`` + the XXH3-128 hex digest of :func:`canonical_json` of
    :func:`without_nulls` of the row as read (before any ``fields`` mapping)."""
    return "h:" + xxhash.xxh3_128_hexdigest(canonical_json(without_nulls(row)))


# --- chat templates -----------------------------------------------------------------------------------------
def has_generation_markers(template: str) -> bool:
    """Whether a chat template has both ``{% generation %}`` and ``{% endgeneration %}``."""
    return bool(_GENERATION.search(template) and _END_GENERATION.search(template))


def resolve_template(tokenizer: Any, chat_template: str | os.PathLike[str] | None) -> tuple[str | None, str]:
    """The template text to render with, and how to name it in messages.

    ``chat_template`` is a path to a template file (a :class:`~pathlib.Path`, or a string naming an existing file),
    or a template's text itself (a string holding ``{{`` or ``{%``); ``None`` takes the tokenizer's own
    ``chat_template`` (its ``default`` entry when it holds several), which may be ``None``.  Anything else is
    refused (:class:`~vllm_hs_compat.errors.CaptureDataError`)."""
    if chat_template is None:
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):
            if "default" not in own:
                raise CaptureDataError(
                    f"{_TOKENIZER_TEMPLATE} holds several named templates {sorted(own)} and no 'default'; "
                    "pass the one to use as --chat-template FILE"
                )
            own = own["default"]
        if own is not None and not isinstance(own, str):
            raise CaptureDataError(f"{_TOKENIZER_TEMPLATE} is {type(own).__name__}, expected text")
        return own, _TOKENIZER_TEMPLATE
    if isinstance(chat_template, os.PathLike) or os.path.isfile(chat_template):
        path = os.fspath(chat_template)
        try:
            return Path(path).read_text(encoding="utf-8"), f"the template file {path!r}"
        except (OSError, UnicodeDecodeError) as e:
            raise CaptureDataError(f"chat template file {path!r} cannot be read as UTF-8 text: {e}") from e
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template, "the chat template given as text"
    raise CaptureDataError(
        f"chat template {chat_template!r} is neither an existing file nor a Jinja template's text; "
        "give the path of the template file"
    )


def check_template(
    tokenizer: Any,
    chat_template: str | os.PathLike[str] | None,
    loss_mask: str,
    *,
    on_policy: bool = False,
) -> None:
    """Refuse, before any engine starts, what would give wrong loss masks for a whole run.

    Raises :class:`~vllm_hs_compat.errors.CaptureDataError` when ``loss_mask`` is not one of :data:`LOSS_MASKS`,
    when ``chat_template`` cannot be read (see :func:`resolve_template`), and -- for ``loss_mask="assistant"``
    off-policy -- when the template (the given one, else the tokenizer's) has no ``{% generation %}`` markers, or
    has them but marks no token of a two-turn test conversation; for any ``loss_mask``, when the template is not
    valid Jinja or jinja2 is missing (a test conversation is rendered).  The message names the template (file or
    "the tokenizer's chat_template") and the fix.  A tokenizer without any chat template passes (rows that need
    one fail with reason ``template``; pre-tokenized and ``prompt`` rows do not need one).  On-policy samples take
    no assistant mask (their prompt's mask is all 0), so the markers are not needed there."""
    if loss_mask not in LOSS_MASKS:
        raise CaptureDataError(f"loss_mask must be one of {LOSS_MASKS}, found {loss_mask!r}")
    template, name = resolve_template(tokenizer, chat_template)
    if template is None:
        return
    want_mask = loss_mask == "assistant" and not on_policy
    if want_mask and not has_generation_markers(template):
        raise CaptureDataError(
            f"{name} has no {{% generation %}} markers, so the assistant loss mask asked for (--loss-mask "
            f"assistant) would come back all zero: {_MARKERS_HOW}"
        )
    probe = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    try:
        out = tokenizer.apply_chat_template(
            probe, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=want_mask
        )
    except ImportError as e:  # transformers renders templates with jinja2, an optional dependency of its own
        raise CaptureDataError(f"rendering {name} needs jinja2: {e}; pip install 'vllm-hs-compat[capture]'") from e
    except Exception as e:  # a template may refuse this probe (e.g. it needs a system turn): only a syntax error ends
        jinja2 = sys.modules.get("jinja2")
        if jinja2 is not None and isinstance(e, jinja2.TemplateSyntaxError):
            raise CaptureDataError(f"{name} is not a valid Jinja template: {e}") from e
        return
    if want_mask and not any(out.get("assistant_masks") or ()):
        raise CaptureDataError(
            f"{name} has {{% generation %}} markers but marks no token of the conversation "
            f"[user 'hello', assistant 'hi there']: the markers must enclose the assistant's content; {_MARKERS_HOW}"
        )


# --- rows ---------------------------------------------------------------------------------------------------
class _RowFail(Exception):
    def __init__(self, reason: str, message: str, num_tokens: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.num_tokens = num_tokens


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


class _Reader:
    def __init__(
        self,
        tokenizer: Any,
        template: str | None,
        template_name: str,
        loss_mask: str,
        fields: Mapping[str, str],
        max_len: int | None,
        on_policy: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.template_name = template_name
        self.loss_mask = loss_mask
        self.fields = fields
        self.max_len = max_len
        self.on_policy = on_policy
        self.vocab = len(tokenizer)

    def key(self, name: str) -> str:
        return self.fields.get(name, name)

    def get(self, row: Mapping[str, Any], name: str) -> Any:
        return row.get(self.key(name))

    # sample id ------------------------------------------------------------------------------------------------
    def sample_id(self, row: Mapping[str, Any]) -> str:
        value = self.get(row, "id")
        if value is None:
            try:
                return content_id(row)
            except (TypeError, ValueError) as e:
                raise _RowFail(
                    "bad_field",
                    f"the row has no {self.key('id')!r} field and cannot be hashed into a content id: {e}; "
                    f"give each row an {self.key('id')!r} (string or integer)",
                ) from e
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise _RowFail(
                "bad_field", f"field {self.key('id')!r} must be a string or an integer, found {_kind(value)}"
            )
        text = str(value)
        if not text:
            raise _RowFail("bad_field", f"field {self.key('id')!r} is an empty string; give a non-empty id")
        return text

    def metadata(self, row: Mapping[str, Any]) -> Mapping[str, Any]:
        value = self.get(row, "metadata")
        if value is None:
            return {}
        name = self.key("metadata")
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _RowFail("bad_field", f"field {name!r} must be a JSON object (text keys), found {_kind(value)}")
        try:
            size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())
        except (TypeError, ValueError) as e:
            raise _RowFail("bad_field", f"field {name!r} is not JSON-able: {e}") from e
        if size > METADATA_MAX_BYTES:
            raise _RowFail(
                "bad_field",
                f"field {name!r} is {size} bytes of compact JSON, more than the {METADATA_MAX_BYTES} a record "
                "carries; keep large data in your dataset and join on the sample id",
            )
        return value

    # shapes -----------------------------------------------------------------------------------------------------
    def build(self, row: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...] | None, int]:
        for shape in SHAPES:
            value = self.get(row, shape)
            if value is None:
                continue
            if shape == "input_ids":
                ids, mask, prompt_len = self.pretokenized(row, value)
            elif shape == "prompt":
                ids, mask, prompt_len = self.prompt(value)
            else:
                ids, mask, prompt_len = self.conversation(self.messages(shape, value))
            return self.check_len(ids), mask, prompt_len
        expected = ", ".join(f"{s}{'' if self.key(s) == s else f' (mapped to {self.key(s)!r})'}" for s in SHAPES)
        raise _RowFail(
            "unknown_shape",
            f"the row has keys {sorted(row)[:20]}; expected one of {expected} (messages: OpenAI role/content; "
            "conversations: ShareGPT from/value; prompt: text; input_ids: token ids); map other names with "
            "--field, e.g. --field messages=dialog",
        )

    def check_len(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        if not ids:
            raise _RowFail("empty", "the row gives no token ids")
        if self.max_len is not None:
            limit = self.max_len - 1 if self.on_policy else self.max_len
            if len(ids) > limit:
                room = " (on-policy: at least one position is left to generate)" if self.on_policy else ""
                raise _RowFail(
                    "too_long",
                    f"the row has {len(ids)} tokens, more than the {limit} a context of {self.max_len} takes{room}; "
                    "shorten or drop the row (positions past the context the engine and the model were made for give "
                    "no usable rows)",
                    num_tokens=len(ids),
                )
        return ids

    def plain_mask(self, n: int, what: str) -> tuple[int, ...] | None:
        """The mask of a sample with no assistant spans: on-policy all 0, ``all`` all 1, ``none`` None."""
        if self.loss_mask == "none":
            return None
        if self.on_policy:
            return (0,) * n
        if self.loss_mask == "all":
            return (1,) * n
        raise _RowFail(
            "empty",
            f"{what} has no assistant turn for --loss-mask assistant to mark; use --loss-mask all (train on all of "
            "it), --loss-mask none, or --on-policy (generate the answer)",
        )

    def pretokenized(self, row: Mapping[str, Any], value: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None, int]:
        name = self.key("input_ids")
        if not isinstance(value, list | tuple):
            raise _RowFail("bad_field", f"field {name!r} must be a list of token ids, found {_kind(value)}")
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab:
                raise _RowFail(
                    "bad_field",
                    f"field {name!r}[{i}] is {_kind(t)}; expected an integer token id in [0, {self.vocab}) "
                    "(the tokenizer's vocabulary): were these ids made by another tokenizer?",
                )
        ids = tuple(int(t) for t in value)
        if not ids:
            raise _RowFail("empty", f"field {name!r} is an empty list")
        own = self.get(row, "loss_mask")
        own_mask: tuple[int, ...] | None = None
        if own is not None:
            mname = self.key("loss_mask")
            if not isinstance(own, list | tuple) or len(own) != len(ids):
                found = f"{len(own)} entries" if isinstance(own, list | tuple) else _kind(own)
                raise _RowFail(
                    "bad_field", f"field {mname!r} must be a list of {len(ids)} zeros and ones, found {found}"
                )
            for i, m in enumerate(own):
                if m not in (0, 1) or isinstance(m, float):
                    raise _RowFail("bad_field", f"field {mname!r}[{i}] is {_kind(m)}; expected 0 or 1")
            own_mask = tuple(int(m) for m in own)
        if self.on_policy or self.loss_mask != "assistant":
            return ids, self.plain_mask(len(ids), "a pre-tokenized row"), len(ids)
        if own_mask is None:
            raise _RowFail(
                "bad_field",
                f"the pre-tokenized row has no {self.key('loss_mask')!r}: --loss-mask assistant takes a pre-tokenized "
                "row's own mask; add one (0/1 per id), or use --loss-mask all or --loss-mask none",
            )
        if not any(own_mask):
            raise _RowFail("empty", f"field {self.key('loss_mask')!r} is all zero: no token to train on")
        return ids, own_mask, len(ids)

    def prompt(self, value: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None, int]:
        if not isinstance(value, str):
            raise _RowFail("bad_field", f"field {self.key('prompt')!r} must be text, found {_kind(value)}")
        if not value.strip():
            raise _RowFail("empty", f"field {self.key('prompt')!r} is empty text")
        ids = tuple(int(t) for t in self.tokenizer(value, add_special_tokens=True)["input_ids"])
        return ids, self.plain_mask(len(ids), "a `prompt` row (raw text, no chat template)"), len(ids)

    def messages(self, shape: str, value: Any) -> list[dict[str, Any]]:
        name = self.key(shape)
        if not isinstance(value, list | tuple):
            raise _RowFail("bad_field", f"field {name!r} must be a list of messages, found {_kind(value)}")
        if not value:
            raise _RowFail("empty", f"field {name!r} holds no message")
        out: list[dict[str, Any]] = []
        for i, m in enumerate(value):
            if not isinstance(m, dict):
                raise _RowFail("bad_field", f"{name!r}[{i}] must be an object, found {_kind(m)}")
            if shape == "conversations" and "from" in m:
                who = m.get("from")
                role = SHAREGPT_ROLES.get(who.lower()) if isinstance(who, str) else None
                if role is None:
                    raise _RowFail(
                        "bad_field",
                        f"{name!r}[{i}] has from={who!r}; expected one of {sorted(SHAREGPT_ROLES)} (ShareGPT)",
                    )
                msg = {k: v for k, v in m.items() if k not in ("from", "value") and v is not None}
                msg["role"] = role
                if m.get("value") is not None:
                    msg["content"] = m["value"]
            else:
                # Null members are left out: a Parquet or datasets row has every struct field, absent ones null,
                # and a template's `is defined` tests must see them absent.
                msg = {k: v for k, v in m.items() if v is not None}
            if not isinstance(msg.get("role"), str):
                keys = "'from'/'value'" if shape == "conversations" else "'role'/'content'"
                raise _RowFail("bad_field", f"{name!r}[{i}] has keys {sorted(m)}; expected {keys}")
            if msg["role"] not in MESSAGE_ROLES:
                raise _RowFail(
                    "bad_field",
                    f"{name!r}[{i}] has role {msg['role']!r}; expected one of {list(MESSAGE_ROLES)} (ShareGPT's "
                    "names such as human/gpt go in 'conversations' as from/value)",
                )
            out.append(msg)
        return out

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool, mask: bool) -> Any:
        if self.template is None:
            raise _RowFail(
                "template",
                "the row is a conversation but there is no chat template (the tokenizer has none and none was "
                "given); pass --chat-template FILE",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=mask,
            )
        except Exception as e:  # whatever the template raises fails this row only
            raise _RowFail("template", f"{self.template_name} failed on this row: {type(e).__name__}: {e}") from e

    def conversation(self, messages: list[dict[str, Any]]) -> tuple[tuple[int, ...], tuple[int, ...] | None, int]:
        if self.on_policy:
            if messages[-1]["role"] == "assistant":
                messages = messages[:-1]  # the last assistant turn is the one the verifier regenerates
            if not messages:
                raise _RowFail("empty", "on-policy: the conversation holds only an assistant turn, no prompt")
            out = self.render(messages, generation_prompt=True, mask=False)
            ids = tuple(int(t) for t in out["input_ids"])
            return ids, self.plain_mask(len(ids), "the conversation"), len(ids)
        want_mask = self.loss_mask == "assistant"
        out = self.render(messages, generation_prompt=False, mask=want_mask)
        ids = tuple(int(t) for t in out["input_ids"])
        if not want_mask:
            return ids, self.plain_mask(len(ids), "the conversation"), len(ids)
        mask = tuple(int(m) for m in out.get("assistant_masks") or ())
        if len(mask) != len(ids):
            raise _RowFail("template", f"the template gave {len(mask)} assistant-mask entries for {len(ids)} token ids")
        if not any(mask):
            roles = [m["role"] for m in messages]
            raise _RowFail(
                "empty",
                f"no token is marked as assistant content (roles {roles}): a conversation needs an assistant turn "
                "with content for --loss-mask assistant; drop the row or use --loss-mask all",
            )
        return ids, mask, len(ids)


#: Rows :func:`check_rows` looks at before any engine starts: enough to tell a file's shape, cheap on any source.
CHECKED_ROWS = 256
_ASSISTANT_FROM = frozenset(k for k, v in SHAREGPT_ROLES.items() if v == "assistant")


def _row_kind(row: Mapping[str, Any], fields: Mapping[str, str]) -> tuple[str, bool] | None:
    """The row's shape (the first of :data:`SHAPES` present) and whether it can give an assistant loss mask (its
    own ``loss_mask``, or an assistant turn); None when it has none of the shapes."""
    for shape in SHAPES:
        value = row.get(fields.get(shape, shape))
        if value is None:
            continue
        if shape == "input_ids":
            return shape, row.get(fields.get("loss_mask", "loss_mask")) is not None
        if shape == "prompt":
            return shape, False
        turns = value if isinstance(value, list | tuple) else ()
        assistant = False
        for m in turns:
            if isinstance(m, dict):
                who = m.get("from") if shape == "conversations" and "from" in m else m.get("role")
                names = _ASSISTANT_FROM if shape == "conversations" and "from" in m else {"assistant"}
                assistant = assistant or (isinstance(who, str) and who.lower() in names)
        return shape, assistant
    return None


def check_rows(
    src: str | os.PathLike[str],
    loss_mask: str,
    *,
    fields: Mapping[str, str] | None = None,
    on_policy: bool = False,
    rows: int = CHECKED_ROWS,
) -> None:
    """Refuse, before any engine starts, a source whose first ``rows`` rows cannot give one sample as asked:
    no rows at all; none of a known shape (every one malformed, or without ``messages`` / ``conversations`` /
    ``prompt`` / ``input_ids`` after ``fields``); or, under ``loss_mask="assistant"`` off-policy, none that can be
    masked: ``prompt`` rows (text has no assistant turn), ``input_ids`` rows without their own ``loss_mask``,
    conversations without an assistant turn.  Raises :class:`~vllm_hs_compat.errors.CaptureDataError` naming what
    was found and the fix (``--loss-mask all``, ``--loss-mask none``, ``--on-policy``, a ``loss_mask`` column,
    ``--field``).  A source where some rows can be used passes: the others are counted row errors."""
    mapping = dict(fields or {})
    seen = 0
    malformed: list[Unreadable] = []
    unknown: list[RawRow] = []
    kinds: dict[tuple[str, bool], int] = {}
    for item in open_source(src):
        if seen >= rows:
            break
        seen += 1
        if isinstance(item, Unreadable):
            malformed.append(item)
            continue
        kind = _row_kind(item.row, mapping)
        if kind is None:
            unknown.append(item)
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    name = os.fspath(src)
    if not seen:
        raise CaptureDataError(f"{name} holds no rows: there is nothing to capture")
    first = f"the first {seen} rows" if seen == rows else f"its {seen} rows"
    if not kinds:
        found = []
        if malformed:
            found.append(f"{len(malformed)} malformed (first: {malformed[0].source}: {malformed[0].message[:200]})")
        if unknown:
            keys = sorted(unknown[0].row)[:12]
            found.append(f"{len(unknown)} of no known shape (first: {unknown[0].source}, keys {keys})")
        raise CaptureDataError(
            f"none of {first} of {name} is a row capture can read: {'; '.join(found)}. Rows are JSON objects with "
            f"{', '.join(SHAPES)}; map other column names with --field NAME=COLUMN (e.g. --field messages=dialog)"
        )
    if loss_mask != "assistant" or on_policy or any(can for (_, can) in kinds):
        return
    what = []
    for (shape, _), n in sorted(kinds.items()):
        if shape == "prompt":
            what.append(f"{n} `prompt` rows (text: no assistant turn)")
        elif shape == "input_ids":
            what.append(f"{n} `input_ids` rows without their own {mapping.get('loss_mask', 'loss_mask')!r}")
        else:
            what.append(f"{n} `{shape}` rows without an assistant turn")
    raise CaptureDataError(
        f"--loss-mask assistant (the default) trains on the assistant turns, and none of {first} of {name} has "
        f"one: {', '.join(what)}. Use --loss-mask all (train on every token), --loss-mask none (no mask), or "
        "--on-policy (the verifier generates the answer, which is trained); pre-tokenized rows can carry their own "
        "'loss_mask' (one 0/1 per id)"
    )


def read_samples(
    src: str | os.PathLike[str],
    tokenizer: Any,
    *,
    chat_template: str | os.PathLike[str] | None = None,
    loss_mask: str = "assistant",
    fields: Mapping[str, str] | None = None,
    max_len: int | None = None,
    on_policy: bool = False,
    select: Callable[[str], bool] | None = None,
) -> Iterator[Sample | RowError]:
    """The samples of ``src``, one :class:`Sample` or :class:`RowError` per row, in the source's order.

    Checked when called, raising :class:`~vllm_hs_compat.errors.CaptureDataError` before anything is read: the
    source (:func:`~vllm_hs_compat.capture.sources.open_source`), ``loss_mask`` and the template
    (:func:`check_template`), ``fields`` (keys from :data:`FIELD_NAMES`, values the row's own names) and
    ``max_len`` (a positive int, the model's context).  ``chat_template``: see :func:`resolve_template`.

    ``select(sample_id)``: when given, a row whose id it rejects is skipped without being templated (it yields
    nothing; another rank owns it, or it is already captured).  Duplicate ids are still detected over all rows.
    """
    if loss_mask not in LOSS_MASKS:
        raise CaptureDataError(f"loss_mask must be one of {LOSS_MASKS}, found {loss_mask!r}")
    mapping = dict(fields or {})
    for key, value in mapping.items():
        if key not in FIELD_NAMES:
            raise CaptureDataError(f"field mapping {key!r}={value!r}: {key!r} is not one of {FIELD_NAMES}")
        if not isinstance(value, str) or not value:
            raise CaptureDataError(f"field mapping {key!r}={value!r}: the row's column name must be non-empty text")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise CaptureDataError(f"max_len must be a positive integer (the model's context), found {max_len!r}")
    check_template(tokenizer, chat_template, loss_mask, on_policy=on_policy)
    template, name = resolve_template(tokenizer, chat_template)
    source = open_source(src)
    reader = _Reader(tokenizer, template, name, loss_mask, mapping, max_len, on_policy)
    return _samples(source, reader, select)


def _samples(
    rows: Iterator[RawRow | Unreadable] | Sequence[RawRow | Unreadable] | Any,
    reader: _Reader,
    select: Callable[[str], bool] | None,
) -> Iterator[Sample | RowError]:
    seen: dict[str, SourceRef] = {}
    for item in rows:
        if isinstance(item, Unreadable):
            yield RowError(None, item.source, "malformed", item.message)
            continue
        sample_id: str | None = None
        try:
            sample_id = reader.sample_id(item.row)
            first = seen.get(sample_id)
            if first is not None:
                raise _RowFail(
                    "duplicate_id", f"sample id {sample_id!r} was first seen at {first}; this row is not captured"
                )
            seen[sample_id] = item.source
            if select is not None and not select(sample_id):
                continue
            metadata = reader.metadata(item.row)
            ids, mask, prompt_len = reader.build(item.row)
        except _RowFail as e:
            yield RowError(sample_id, item.source, e.reason, e.message, e.num_tokens)
            continue
        yield Sample(sample_id, item.source, ids, mask, prompt_len, metadata)
