"""When the capture tries a sample again, and when it stops: :class:`Retry` and :class:`Breaker`.

Pure Python.  Re-exported by :mod:`vllm_hs_compat.capture.store`, where users import them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Final

from vllm_hs_compat.core.vocabulary import REASON_ASYNC_DRAFTS, REASON_NON_FINITE
from vllm_hs_compat.errors import CaptureStoreError, CircuitOpenError

from .rows import MAX_MESSAGE

#: Failure reasons :class:`Retry` never retries by default: trying again gives the same answer.
NOT_RETRIED: Final = frozenset(
    {
        "tokenizer_mismatch",
        "partial_record",
        "wrong_sample",
        "malformed",
        "unknown_shape",
        "empty",
        "too_long",
        "template",
        "bad_field",
        "bad_params",
        REASON_NON_FINITE,
        REASON_ASYNC_DRAFTS,
    }
)


class Retry:
    """How many times one sample is tried (``max_attempts`` in all), for which failure reasons.

    ``retry_on``: the reasons worth another attempt; None = every reason except :data:`NOT_RETRIED`."""

    def __init__(self, max_attempts: int = 3, *, retry_on: Collection[str] | None = None) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise CaptureStoreError(f"Retry(max_attempts={max_attempts!r}): expected an int >= 1 (1 = no retry)")
        self.max_attempts = max_attempts
        self.retry_on = None if retry_on is None else frozenset(retry_on)
        self._failures: Counter[str] = Counter()

    def retriable(self, reason: str) -> bool:
        return reason not in NOT_RETRIED if self.retry_on is None else reason in self.retry_on

    def allow(self, sample_id: str, reason: str) -> bool:
        """Count a failed attempt of ``sample_id``; True when it may be tried again."""
        self._failures[sample_id] += 1
        return self.retriable(reason) and self._failures[sample_id] < self.max_attempts

    def attempts(self, sample_id: str) -> int:
        """Failed attempts of ``sample_id`` counted so far."""
        return self._failures[sample_id]

    def forget(self, sample_id: str) -> None:
        """Drop the count of a sample that is finished (captured, or failed for good)."""
        self._failures.pop(sample_id, None)


class Breaker:
    """Stops the run after ``max_consecutive`` failures in a row: :meth:`failure` raises :class:`CircuitOpenError`
    naming the reasons of those failures and the last message; :meth:`success` resets the count."""

    def __init__(self, max_consecutive: int = 20) -> None:
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise CaptureStoreError(f"Breaker(max_consecutive={max_consecutive!r}): expected an int >= 1")
        self.max_consecutive = max_consecutive
        self._recent: list[tuple[str, str]] = []

    @property
    def consecutive(self) -> int:
        return len(self._recent)

    def success(self) -> None:
        self._recent.clear()

    def failure(self, reason: str, message: str = "") -> None:
        self._recent.append((reason, message))
        if len(self._recent) >= self.max_consecutive:
            counts = Counter(r for r, _ in self._recent)
            reasons = ", ".join(f"{r} x{n}" for r, n in counts.most_common())
            last_reason, last_message = self._recent[-1]
            raise CircuitOpenError(
                f"stopped after {len(self._recent)} consecutive failures ({reasons}); last: {last_reason}: "
                f"{last_message[:MAX_MESSAGE]}; fix that cause and re-run the same command: records captured so "
                "far are kept and skipped"
            )
