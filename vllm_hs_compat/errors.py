"""Named errors.  Library code raises these (never ``assert``); each message says what was found,
what was expected and how to fix it."""

from __future__ import annotations


class HsCompatError(Exception):
    """Base class of every error raised by vllm-hs-compat."""


# --- adapter selection -------------------------------------------------------------------------
class VllmNotInstalledError(HsCompatError):
    """vLLM is not importable in this environment."""


class UnsupportedVllmError(HsCompatError):
    """The installed vLLM release is outside the supported range and no override was given."""


class AdapterProbeMismatchError(HsCompatError):
    """A feature probe contradicts the adapter chosen for the installed version."""


# --- core ---------------------------------------------------------------------------------------
class CaptureGroupError(HsCompatError):
    """The KV-cache group holding the capture layer cannot be identified unambiguously."""


class CaptureViewError(HsCompatError):
    """The registered capture tensor does not have the shape or strides the adapter declares."""


class AmbiguousViewError(CaptureViewError):
    """The view's plane and token axes cannot be told apart (P == N and no declared order)."""


class LayerIdError(HsCompatError):
    """The configured capture layer ids are invalid for this model or vLLM release."""


class SlotError(HsCompatError):
    """A request's block ids cannot address its tokens.  Carries the request id."""

    def __init__(self, req_id: str, message: str) -> None:
        super().__init__(f"request {req_id!r}: {message}")
        self.req_id = req_id


class BlockCoverageError(SlotError):
    """A request has fewer blocks than its tokens need."""


class BlockRangeError(SlotError):
    """A request's block id lies outside the capture cache."""
