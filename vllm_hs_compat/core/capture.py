"""What a capture record holds, and the neutral request/step types the connector works on.

The adapters read vLLM's objects (``SchedulerOutput``, ``Request``) into the types here; the connector's
scheduler half decides from them, without touching vLLM attributes itself.

Positions: at finish, a request's first ``num_computed_tokens`` positions hold hidden states (later slots may
hold rejected draft tokens), paired with ``all_token_ids[:n]``.  A :class:`CaptureSpec` picks the positions of
the record out of those: the prompt, everything, or the generated part, optionally narrowed by a window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from ..errors import CaptureConfigError, RecordFormatError
from .record_bounds import MAX_LOSS_MASK_SPANS, MAX_SAMPLE_ID_CHARS, MAX_SOURCE_CHARS
from .record_sample import RecordSample, canonical_metadata
from .vocabulary import REASON_DISABLED, REASON_EMPTY, REASON_PROMPT_INCOMPLETE, SAMPLE_KEY

CaptureMode = Literal["prompt", "all", "output"]
MODES: Final[tuple[CaptureMode, ...]] = ("prompt", "all", "output")
#: The keys, statuses and reasons users read live in :mod:`vllm_hs_compat.core.vocabulary`; re-exported here.
#: ``SAMPLE_FIELDS``: the keys of a request's ``sample`` entry.
SAMPLE_FIELDS: Final = ("id", "source", "loss_mask_spans", "metadata")


class NoRecord(Exception):  # noqa: N818 - a decision, not an error: the request simply has no record
    """Raised by :meth:`CaptureSpec.positions` when a request yields no record; carries the reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _window_bound(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise CaptureConfigError(f"{what} must be an int or null, found {value!r}")
    return value


@dataclass(frozen=True)
class CaptureSpec:
    """Which positions of a finished request form its record."""

    mode: CaptureMode = "prompt"
    """``prompt``: the prompt tokens; ``all``: every position with a hidden state; ``output``: generated ones."""
    window: tuple[int | None, int | None] | None = None
    """``(start, stop)`` slice over the positions ``mode`` selects (Python semantics, negatives from the end)."""
    enabled: bool = True

    @classmethod
    def parse(cls, raw: Mapping[str, Any], *, base: CaptureSpec | None = None, what: str) -> CaptureSpec:
        """Settings from a config map (``capture``/``window``/``enabled`` keys) over ``base``.

        Raises :class:`CaptureConfigError` naming ``what`` (the config or request the map came from)."""
        if not isinstance(raw, Mapping):
            raise CaptureConfigError(f"{what} must be a map, found {type(raw).__name__}")
        known = {"capture", "window", "enabled"}
        extra = sorted(str(k) for k in raw if k not in known)
        if extra:
            raise CaptureConfigError(f"{what} has unknown keys {extra}; expected any of {sorted(known)}")
        spec = base or cls()
        mode = raw.get("capture", spec.mode)
        if mode not in MODES:
            raise CaptureConfigError(f"{what}: capture must be one of {list(MODES)}, found {mode!r}")
        window = spec.window
        if "window" in raw:
            w = raw["window"]
            if w is None:
                window = None
            elif isinstance(w, Sequence) and not isinstance(w, str | bytes) and len(w) == 2:
                window = (_window_bound(w[0], f"{what}: window[0]"), _window_bound(w[1], f"{what}: window[1]"))
            else:
                raise CaptureConfigError(f"{what}: window must be [start, stop] (ints or null), found {w!r}")
        enabled = raw.get("enabled", spec.enabled)
        if not isinstance(enabled, bool):
            raise CaptureConfigError(f"{what}: enabled must be true or false, found {enabled!r}")
        return cls(mode=mode, window=window, enabled=enabled)

    def positions(self, *, num_prompt_tokens: int, num_valid: int) -> tuple[int, int]:
        """``[start, stop)`` of the record, given the prompt length and the number of positions whose hidden
        states exist.  Raises :class:`NoRecord` when the selection is empty or the prompt is incomplete."""
        if not self.enabled:
            raise NoRecord(REASON_DISABLED, "capture is disabled for this request")
        if self.mode == "prompt":
            if num_valid < num_prompt_tokens:
                raise NoRecord(
                    REASON_PROMPT_INCOMPLETE,
                    f"only {num_valid} of the {num_prompt_tokens} prompt positions were computed before the "
                    "request finished (aborted or capped during prefill)",
                )
            lo, hi = 0, num_prompt_tokens
        elif self.mode == "all":
            lo, hi = 0, num_valid
        else:
            lo, hi = num_prompt_tokens, max(num_prompt_tokens, num_valid)
        if self.window is not None:
            picked = range(lo, hi)[slice(*self.window)]
            lo, hi = (picked.start, picked.stop) if len(picked) else (lo, lo)
        if hi <= lo:
            raise NoRecord(
                REASON_EMPTY,
                f"capture={self.mode!r} window={list(self.window) if self.window else None} selects no position "
                f"(prompt {num_prompt_tokens} tokens, {num_valid} positions computed)",
            )
        return lo, hi


@dataclass(frozen=True)
class RequestSample:
    """What a request's record is made for, from its ``kv_transfer_params``::

        {"hs_capture": {"sample": {"id": "row-17", "source": "chat.jsonl:17",
                                   "loss_mask_spans": [[12, 40], [55, null]], "metadata": {"lang": "de"}}}}

    Every key is optional.  ``loss_mask_spans``: ``[start, stop)`` ranges of positions of the request's token
    sequence (prompt then generated tokens, position 0 = the first prompt token; the numbering of
    ``RecordMeta.start``), sorted and not overlapping; the last span's stop may be null = through the record's
    last position (the generated part of an on-policy request).  The record keeps the spans' intersection with its
    own rows (a window or ``capture: "prompt"`` narrows it); absent or null = no mask, ``[]`` = nothing trained.
    Bounded (a client sets it): id <= 512 characters, source <= 1024, <= 1024 spans, metadata <= 4 KiB of compact
    JSON."""

    sample_id: str = ""
    source: str = ""
    spans: tuple[tuple[int, int | None], ...] | None = None
    metadata_json: str = "{}"

    @classmethod
    def parse(cls, raw: object, *, what: str) -> RequestSample:
        """A ``sample`` entry, validated; :class:`CaptureConfigError` naming ``what`` and the bad field."""
        if not isinstance(raw, Mapping):
            raise CaptureConfigError(f"{what} must be a map of {list(SAMPLE_FIELDS)}, found {type(raw).__name__}")
        extra = sorted(str(k)[:40] for k in raw if k not in SAMPLE_FIELDS)
        if extra:
            raise CaptureConfigError(f"{what} has unknown keys {extra[:8]}; expected any of {list(SAMPLE_FIELDS)}")
        sample_id = _bounded_str(raw.get("id", ""), f"{what}.id", MAX_SAMPLE_ID_CHARS)
        source = _bounded_str(raw.get("source", ""), f"{what}.source", MAX_SOURCE_CHARS)
        try:
            metadata_json = canonical_metadata(raw.get("metadata"), f"{what}.metadata")
        except RecordFormatError as e:
            raise CaptureConfigError(str(e)) from None
        spans = _request_spans(raw.get("loss_mask_spans"), f"{what}.loss_mask_spans")
        return cls(sample_id, source, spans, metadata_json)

    def for_record(self, start: int, stop: int, seq_len: int, *, what: str) -> RecordSample:
        """The record's sample fields for rows ``[start, stop)`` of a request of ``seq_len`` tokens: the spans
        clipped to the rows (a null stop is ``stop``).  A span that runs past the request's sequence is refused
        (:class:`CaptureConfigError`): the client numbered it against something else."""
        clipped: tuple[tuple[int, int], ...] | None = None
        if self.spans is not None:
            out: list[tuple[int, int]] = []
            for i, (a, b) in enumerate(self.spans):
                end = stop if b is None else b
                if end > seq_len or (b is None and a > seq_len):
                    raise CaptureConfigError(
                        f"{what}.loss_mask_spans[{i}] = [{a}, {b}] runs past the request's {seq_len} tokens "
                        "(positions are numbered over prompt then generated tokens, from 0)"
                    )
                lo, hi = max(a, start), min(end, stop)
                if lo < hi:
                    out.append((lo, hi))
            clipped = tuple(out)
        return RecordSample(self.sample_id, self.source, clipped, self.metadata_json)


def _bounded_str(value: object, what: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise CaptureConfigError(f"{what} must be a string, found {type(value).__name__}")
    if len(value) > max_chars:
        raise CaptureConfigError(f"{what} has {len(value)} characters, at most {max_chars} allowed")
    return value


def _request_spans(raw: object, what: str) -> tuple[tuple[int, int | None], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list | tuple):
        raise CaptureConfigError(f"{what} must be a list of [start, stop] pairs, found {type(raw).__name__}")
    if len(raw) > MAX_LOSS_MASK_SPANS:
        raise CaptureConfigError(f"{what} has {len(raw)} spans, at most {MAX_LOSS_MASK_SPANS} allowed")
    out: list[tuple[int, int | None]] = []
    prev: int | None = 0
    for i, span in enumerate(raw):
        if not isinstance(span, list | tuple) or len(span) != 2:
            raise CaptureConfigError(f"{what}[{i}] must be a [start, stop] pair, found {span!r:.60}")
        a, b = span
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise CaptureConfigError(f"{what}[{i}][0] (start) must be an int >= 0, found {a!r:.40}")
        if b is not None and (isinstance(b, bool) or not isinstance(b, int)):
            raise CaptureConfigError(f"{what}[{i}][1] (stop) must be an int or null, found {b!r:.40}")
        if prev is None or a < prev:
            raise CaptureConfigError(
                f"{what}[{i}] = [{a}, {b}] overlaps or precedes the span before it; spans must be sorted and not "
                "overlap, and only the last one may have a null stop"
            )
        if b is not None and b <= a:
            raise CaptureConfigError(f"{what}[{i}] = [{a}, {b}] is empty or reversed; a span is [start, stop)")
        out.append((a, b))
        prev = b
    return tuple(out)


def mask_spans(mask: Sequence[int | bool], start: int = 0) -> list[list[int]]:
    """The sorted ``[start, stop)`` spans of the 1s of a per-position 0/1 ``mask`` whose entry 0 is position
    ``start`` (the inverse of :meth:`RecordMeta.loss_mask <vllm_hs_compat.core.records.RecordMeta.loss_mask>`)."""
    spans: list[list[int]] = []
    run: int | None = None
    for i, v in enumerate(mask):
        if v not in (0, 1):
            raise CaptureConfigError(f"a loss mask holds 0/1 values only, found {v!r} at index {i}")
        if v and run is None:
            run = i
        elif not v and run is not None:
            spans.append([start + run, start + i])
            run = None
    if run is not None:
        spans.append([start + run, start + len(mask)])
    return spans


def sample_entry(
    *,
    sample_id: str = "",
    source: str = "",
    loss_mask: Sequence[int | bool] | None = None,
    generated: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A request's ``hs_capture["sample"]`` entry (see :class:`RequestSample`), validated as the connector will.

    ``loss_mask``: per prompt position 0/1 (position 0 = the first prompt token; None = no mask unless
    ``generated``).  ``generated``: the generated part is trained too (a last span ``[len(loss_mask), null)``;
    ``loss_mask`` is then required, all zeros for "the generated part only").  Use it as
    ``{"kv_transfer_params": {"hs_capture": {"capture": "all", "sample": sample_entry(...)}}}``."""
    entry: dict[str, Any] = {"id": sample_id, "source": source}
    if generated and loss_mask is None:
        raise CaptureConfigError(
            "sample_entry(generated=True) needs the prompt's loss_mask (all zeros: prompt untrained)"
        )
    if loss_mask is not None:
        spans: list[list[int | None]] = [list(s) for s in mask_spans(loss_mask)]
        if generated:
            n = len(loss_mask)
            if spans and spans[-1][1] == n:
                spans[-1][1] = None  # the prompt's last span runs on into the generated part
            else:
                spans.append([n, None])
        entry["loss_mask_spans"] = spans
    if metadata is not None:
        entry["metadata"] = dict(metadata)
    RequestSample.parse(entry, what="sample_entry()")
    return entry


def parse_request(raw: object, *, base: CaptureSpec, what: str) -> tuple[CaptureSpec, RequestSample | None]:
    """A request's ``hs_capture`` entry: its capture settings over ``base`` and its ``sample`` entry (None when
    absent).  Raises :class:`CaptureConfigError` naming the bad key."""
    if not isinstance(raw, Mapping):
        raise CaptureConfigError(f"{what} must be a map, found {type(raw).__name__}")
    sample = RequestSample.parse(raw[SAMPLE_KEY], what=f"{what}.{SAMPLE_KEY}") if SAMPLE_KEY in raw else None
    settings = {k: v for k, v in raw.items() if k != SAMPLE_KEY}
    return CaptureSpec.parse(settings, base=base, what=what), sample


# --- neutral views of vLLM's objects (filled by the adapters) --------------------------------------------------
@dataclass(frozen=True)
class ScheduledNew:
    """A request scheduled for the first time (or, under Model Runner V2, resumed with its full block list)."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]
    """Per KV-cache group."""
    num_computed_tokens: int


@dataclass(frozen=True)
class ScheduledCached:
    """A request scheduled again: new blocks appended, or (resumed after preemption) the full list replaced."""

    req_id: str
    new_block_ids: tuple[tuple[int, ...], ...] | None
    resumed: bool
    num_computed_tokens: int


@dataclass(frozen=True)
class StepInfo:
    """One scheduler step, as far as the connector cares."""

    new: tuple[ScheduledNew, ...]
    cached: tuple[ScheduledCached, ...]
    num_scheduled_tokens: Mapping[str, int]
    preempted: frozenset[str] = frozenset()
    finished: frozenset[str] = frozenset()
    spec_tokens: Mapping[str, int] = field(default_factory=dict)
    """Draft tokens scheduled per request in this step (counted in ``num_scheduled_tokens``); absent: none."""


@dataclass(frozen=True)
class FinishedRequest:
    """A request handed to ``request_finished``."""

    req_id: str
    num_computed_tokens: int
    num_prompt_tokens: int
    token_ids: tuple[int, ...]
    """``all_token_ids``: prompt then generated tokens."""
    aborted: bool
    status: str
    params: Mapping[str, Any] | None = None
    """The request's own ``kv_transfer_params``."""
    arrival_time: float | None = None
    """When the engine received the request (the children of an ``n > 1`` request share it)."""
    num_output_placeholders: int = 0
    """Of ``num_computed_tokens``, the tokens of steps scheduled ahead whose outputs the scheduler has not seen
    (async scheduling: a step already in flight when the request finished); their positions are not final."""

    @property
    def num_valid(self) -> int:
        """Positions whose hidden states exist and are final: the computed ones the scheduler has confirmed (under
        async scheduling ``num_computed_tokens`` also counts a step in flight, which writes past them)."""
        confirmed = self.num_computed_tokens - max(0, self.num_output_placeholders)
        return max(0, min(confirmed, len(self.token_ids)))

    @property
    def first_generated_repeat(self) -> int | None:
        """The position of the first generated token equal to the generated token before it, or None.

        ``extract_hidden_states`` proposes a request's last sampled token as its draft, so a step that emits two
        tokens (the draft accepted, then the bonus token) always starts with such a repeat: no step before this
        position emitted more than one token (a repeat without an accepted draft is possible, so this errs early)."""
        tokens = self.token_ids
        for pos in range(max(self.num_prompt_tokens, 0) + 1, len(tokens)):
            if tokens[pos] == tokens[pos - 1]:
                return pos
        return None


# --- what the scheduler half sends the worker half -------------------------------------------------------------
@dataclass(frozen=True)
class SaveRequest:
    """Read positions ``[start, stop)`` of a finished request whose blocks are held, and publish the record."""

    record_id: str
    req_id: str
    block_ids: tuple[int, ...]
    """Capture-group block ids covering positions ``[0, stop)``."""
    start: int
    stop: int
    token_ids: tuple[int, ...]
    """Token ids of positions ``[start, stop)``."""
    num_prompt_tokens: int
    publication: str | None = None
    """The publication nonce the record's ticket capability is bound to (drawn by the scheduler half with the
    ticket, kept by the export producer with the record); None for sinks without tickets."""
    sample: RecordSample | None = None
    """What the record is made for (the request's ``hs_capture.sample``, spans clipped to ``[start, stop)``)."""

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SlotCheck:
    """Positions ``[start, start + num_tokens)`` of a request are written in this step; every slot derived from
    its block ids must be one the step's slot mapping writes."""

    req_id: str
    block_ids: tuple[int, ...]
    start: int
    num_tokens: int


@dataclass
class StepPlan:
    """The connector metadata's payload for one step."""

    step: int
    group_index: int
    group_block_size: int
    saves: list[SaveRequest] = field(default_factory=list)
    checks: list[SlotCheck] = field(default_factory=list)


@dataclass(frozen=True)
class RecordFailure:
    """A record that will not exist, with the reason (handed to the sink so a waiting reader learns why)."""

    record_id: str
    req_id: str
    reason: str
    message: str
    publication: str | None = None
    """The publication nonce of the record's ticket (see :class:`SaveRequest`): only that ticket learns why."""


class BlockTracker:
    """Capture-group block ids of a set of watched requests, followed through scheduler steps.

    New requests (and, under Model Runner V2, resumed ones) bring their full list; cached ones append new blocks;
    a request resumed after preemption (V1) brings its full list again; a preempted one holds no blocks until it
    resumes; a finished one is no longer watched.
    """

    def __init__(self, group_index: int) -> None:
        self.group_index = group_index
        self._blocks: dict[str, list[int]] = {}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self, req_id: str) -> tuple[int, ...]:
        return tuple(self._blocks.get(req_id, ()))

    def _group(self, per_group: tuple[tuple[int, ...], ...]) -> list[int]:
        if self.group_index >= len(per_group):
            raise CaptureConfigError(
                f"the scheduler sent block ids for {len(per_group)} KV-cache group(s), but the capture layer is in "
                f"group {self.group_index}; the scheduler's KV-cache config differs from the one the connector "
                "resolved"
            )
        return list(per_group[self.group_index])

    def watch(self, new: ScheduledNew) -> None:
        """Start following ``new`` (a request scheduled for the first time)."""
        self._blocks[new.req_id] = self._group(new.block_ids)

    def apply(self, step: StepInfo) -> None:
        """Follow the watched requests through one step (others are ignored)."""
        for rid in step.preempted:
            if rid in self._blocks:
                self._blocks[rid] = []  # its blocks were freed; it recomputes from scratch when resumed
        for new in step.new:
            if new.req_id in self._blocks:
                self._blocks[new.req_id] = self._group(new.block_ids)  # V2: resumed as new, full list
        for c in step.cached:
            held = self._blocks.get(c.req_id)
            if held is None:
                continue
            if c.resumed:
                self._blocks[c.req_id] = self._group(c.new_block_ids) if c.new_block_ids is not None else []
            elif c.new_block_ids is not None:
                held.extend(self._group(c.new_block_ids))
        for rid in step.finished:
            self._blocks.pop(rid, None)

    def forget(self, req_id: str) -> None:
        self._blocks.pop(req_id, None)
