"""Rows templated and tokenized into :class:`Sample` (exactly the ids the engine gets, the loss mask, the sample
id), or a :class:`RowError` that is counted and never stops the run.  See docs/capture.md, "Input rows"."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hs_compat.capture.sources import SourceRef

__all__ = ["ROW_ERROR_REASONS", "RowError", "Sample", "SourceRef", "check_template", "read_samples"]

#: Every reason a row can fail for (``RowError.reason``).
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


@dataclass(frozen=True, slots=True)
class Sample:
    """One row, templated and tokenized, ready for the engine."""

    sample_id: str
    source: SourceRef
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...] | None
    prompt_len: int
    metadata: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class RowError:
    """A row that yields no sample: counted, never stops the run."""

    sample_id: str | None
    source: SourceRef
    reason: str
    message: str


def check_template(tokenizer: Any, chat_template: str | None, loss_mask: str) -> None:
    """Refuse (CaptureDataError) before any engine starts when ``loss_mask == "assistant"`` and the template has
    no ``{% generation %}`` markers (skeleton: implemented in a later commit)."""
    raise NotImplementedError("skeleton")


def read_samples(
    src: str,
    tokenizer: Any,
    *,
    chat_template: str | None = None,
    loss_mask: str = "assistant",
    fields: Mapping[str, str] | None = None,
    max_len: int | None = None,
    on_policy: bool = False,
) -> Iterator[Sample | RowError]:
    """The samples of ``src`` in order (skeleton: implemented in a later commit)."""
    raise NotImplementedError("skeleton")
