"""Every word a user reads in ``kv_transfer_params``: the keys, the record statuses and the reasons a record does
not exist.  One module, one table (docs/connector.md "Keys, statuses and reasons"; a test keeps them equal).

Pure: no torch, no vLLM.  The connector, the export and the file sink import these names; nothing else spells them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from vllm_hs_compat.errors import PoolFullError

# --- keys of kv_transfer_params ---------------------------------------------------------------------------------
#: A request's own entry that overrides the capture settings (``{"hs_capture": {"capture": "all", ...}}``).
REQUEST_KEY: Final = "hs_capture"
#: Inside a request's ``hs_capture`` entry: what the record is made for (sample id, source, loss mask, metadata).
SAMPLE_KEY: Final = "sample"
#: The returned entry saying what became of the request's record (a key of its own, so params fed back into a new
#: request are never mistaken for settings).
RESULT_KEY: Final = "hs_record"
#: The returned ticket of an exported record (``ExportTicket.kv_transfer_params()``; never the trainer token).
EXPORT_KEY: Final = "hs_export"
#: The returned location of a record written by the file sink.
FILE_KEY: Final = "hs_file"
#: The returned entries of an ``n > 1`` request's choices, in choice order.
CHOICES_KEY: Final = "hs_choices"

KEYS: Final[Mapping[str, str]] = {
    REQUEST_KEY: "request: per-request capture settings (`capture`, `window`, `enabled`, `sample`)",
    RESULT_KEY: "response: the record's status, and its reason when it will not exist",
    EXPORT_KEY: "response: the ticket that fetches this record (endpoint, record id, server key, capability)",
    FILE_KEY: "response: the record's file and manifest (file sink)",
    CHOICES_KEY: "response of an `n > 1` request: every choice's entries, in choice order",
}

# --- hs_record.status ---------------------------------------------------------------------------------------------
#: Accepted and queued for the worker.  Not a promise: a later drop is reported when the ticket is fetched.
STATUS_QUEUED: Final = "queued"
#: An ``n > 1`` choice whose prompt-only record is its sibling's (``same_as`` names it).
STATUS_SHARED: Final = "shared"
#: The record will never exist (``reason`` and ``message`` say why).
STATUS_FAILED: Final = "failed"
#: The request opted out (``reason`` is ``disabled``).
STATUS_SKIPPED: Final = "skipped"

STATUSES: Final[Mapping[str, str]] = {
    STATUS_QUEUED: "accepted and queued for the worker; a later drop shows when the ticket is fetched",
    STATUS_SHARED: "an `n > 1` choice whose prompt-only record is the sibling named by `same_as`",
    STATUS_FAILED: "the record will never exist; `reason` and `message` say why",
    STATUS_SKIPPED: "the request opted out (`reason`: `disabled`)",
}

# --- reasons: hs_record.reason (decided in the scheduler) or the fetch error's (decided in the worker) ----------
REASON_ABORTED: Final = "aborted"
REASON_PROMPT_INCOMPLETE: Final = "prompt_incomplete"
REASON_EMPTY: Final = "empty_selection"
REASON_DISABLED: Final = "disabled"
REASON_BAD_PARAMS: Final = "bad_params"
REASON_BLOCKS: Final = "blocks"
REASON_PADDING: Final = "padding_slot"
REASON_ENGINE_STOPPED: Final = "engine_stopped"
REASON_SLOT_CHECK: Final = "slot_check"
REASON_BACKLOG: Final = "backlog"
REASON_POOL_FULL: Final = "pool_full"
REASON_SINK: Final = "sink"
REASON_NON_FINITE: Final = "non_finite"
REASON_ASYNC_DRAFTS: Final = "async_drafts"

#: reason -> (where it is decided, what it means and what to do).  "scheduler" reasons come back in the response's
#: ``hs_record``; "worker" reasons after the response, as the ``RecordFailedError`` of the ticket's fetch (the
#: trainer stream counts them, the file sink writes ``<record>.error.json``).
REASONS: Final[Mapping[str, tuple[str, str]]] = {
    REASON_ABORTED: ("scheduler", "the request did not finish normally (aborted by the client, or an engine error)"),
    REASON_PROMPT_INCOMPLETE: ("scheduler", "the request ended before its whole prompt was computed"),
    REASON_EMPTY: ("scheduler", "the capture mode and window select no position of this request"),
    REASON_DISABLED: ("scheduler", "the request opted out (`hs_capture.enabled: false`); status `skipped`"),
    REASON_BAD_PARAMS: ("scheduler", "the request's `hs_capture` entry is invalid; the message names the key"),
    REASON_BLOCKS: ("scheduler/worker", "the capture blocks miss positions, lie outside the cache, or cannot be read"),
    REASON_PADDING: ("scheduler", "a position would be read from the CUDA-graph padding slot another write clobbers"),
    REASON_ENGINE_STOPPED: ("scheduler", "the engine shut down before the record was read (file sink: `.error.json`)"),
    REASON_SLOT_CHECK: ("worker", "a slot derived from the request's block ids is not one its step wrote"),
    REASON_BACKLOG: ("worker", "the worker's records waiting for the sink passed their byte limit"),
    REASON_POOL_FULL: ("worker", "the export pool had no free slot (`on_full: \"drop\"`, or after `wait_timeout_s`)"),
    REASON_SINK: ("worker", "the sink raised (a file error, a callback's exception); the message names the error"),
    REASON_NON_FINITE: ("worker", "the rows hold NaN/Inf (positions past the model's own context, an overflow)"),
    REASON_ASYNC_DRAFTS: (
        "scheduler",
        "generated positions after a step that emitted two tokens, which this engine placed wrong under async "
        "scheduling (vllm-project/vllm#56417); run with --no-async-scheduling",
    ),
}  # fmt: skip


def reason_of(exc: BaseException) -> str:
    """The reason a sink's exception fails a record for: ``pool_full`` for a full export pool, else ``sink`` (the
    record's message names the exception)."""
    return REASON_POOL_FULL if isinstance(exc, PoolFullError) else REASON_SINK


def describe_reason(reason: str) -> str:
    """One line for a reason a user received; an unknown reason is named as such (never an exception)."""
    where, what = REASONS.get(reason, ("?", "a reason this version does not know"))
    return f"{reason} ({where}): {what}"
