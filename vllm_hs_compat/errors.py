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


class CaptureConfigError(HsCompatError):
    """A capture setting (``kv_connector_extra_config`` or a request's ``hs_capture`` entry) is invalid."""


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


class TransferError(HsCompatError):
    """A rows copy was misused (wrong destination shape or dtype, waited past its deadline)."""


# --- records ------------------------------------------------------------------------------------
class RecordFormatError(HsCompatError):
    """Record metadata is malformed or contradicts itself (e.g. shape against token ids)."""


class ChecksumMismatchError(RecordFormatError):
    """The bytes of a record do not match the checksum in its metadata."""


class NonFiniteRecordError(RecordFormatError):
    """A record's rows hold NaN or Inf values (positions past the model's own context, an overflow): it is never
    used, whatever its checksum says (the checksum is of what was captured).  The reason ``non_finite``."""


# --- export -------------------------------------------------------------------------------------
class ExportError(HsCompatError):
    """Base class of every export error."""


class ExportConfigError(ExportError):
    """A producer or consumer setting is invalid."""


class UnsafeTokenFileError(ExportConfigError):
    """The token file (or its directory) could have been read or planted by someone else: not a regular file,
    group/other permission bits, another owner, or a directory others can write.  Refused, never adopted."""


class ExportClosedError(ExportError):
    """The producer or consumer was used after close()."""


class ExportTimeoutError(ExportError, TimeoutError):
    """A wait ran past its deadline."""


# --- producer side: the record fails, the producer keeps serving --------------------------------------------
class RecordTooLargeError(ExportError):
    """A record needs more bytes than the whole pool (or the consumer's landing buffer) holds."""


class PoolFullError(ExportError):
    """No free slots for a record (policy ``drop``, or ``wait`` ran past its timeout).  The record is
    counted."""


class DuplicateRecordError(ExportError):
    """A record id is already held in the pool."""


# --- consumer side ------------------------------------------------------------------------------------------
class UnknownRecordError(ExportError):
    """The producer holds no record with this id (never published, already taken, expired or dropped)."""


class RecordFailedError(ExportError):
    """The record will never exist: the producer (or the file sink) recorded why (e.g. its blocks could not
    be read, or the pool was full)."""


class LeaseExpiredError(ExportError):
    """The lease on a record ran out before the consumer finished with it; its slots may hold other data
    now."""


class LandingBufferFullError(ExportError):
    """The consumer's landing buffer has no room: release records fetched with ``copy=False``."""


# --- control plane ------------------------------------------------------------------------------------------
class ControlPlaneError(ExportError):
    """The control connection failed (refused, reset, closed)."""


class AuthError(ControlPlaneError):
    """Authentication failed (wrong or missing token, or the server could not prove it knows the token)."""


class CapabilityError(AuthError):
    """The credential presented does not open what was asked: a ticket's capability opens its own record only,
    and streaming, listing and stats need the trainer token."""


class ProducerUnreachableError(ControlPlaneError, ExportTimeoutError):
    """No answer from the producer's control plane before the deadline, and no connection was ever made."""


class ProtocolError(ControlPlaneError):
    """A control message is malformed, truncated, oversized or of an unknown kind."""


class WireVersionError(ProtocolError):
    """The peer speaks another version of the control-plane wire format."""


class GateError(ControlPlaneError):
    """The control plane's gate process (which holds the public socket) could not be started or did not report
    its port in time."""


class RemoteError(ControlPlaneError):
    """The peer answered a request with an error it could not map to a more specific class."""


# --- data plane ---------------------------------------------------------------------------------------------
class TransportError(ExportError):
    """The data transport (NIXL or shared memory) failed."""


class TransportUnavailableError(TransportError):
    """The requested transport cannot be used here (e.g. ``nixl`` is not installed)."""


class UnsafePoolFileError(TransportUnavailableError):
    """The shared-memory pool file a consumer was told to map is not a regular file of this user (a FIFO, a
    symbolic link, a directory, another user's file): refused, never mapped."""


class TransportSettingsMismatchError(TransportUnavailableError):
    """The two sides disagree on a setting a transfer depends on (UCX's TCP segment sizes, which UCX does not
    negotiate): refused by the consumer before any transfer, since the first large READ would abort a process."""


class RemoteDisconnectedError(TransportError):
    """The peer agent went away during or before a transfer."""


class StaleMetadataError(TransportError):
    """The transport metadata or a descriptor belongs to an earlier producer instance."""


class DescriptorError(TransportError):
    """A descriptor points outside the registered memory, or lengths disagree."""


# --- trainer side -------------------------------------------------------------------------------------------
class DatasetConfigError(HsCompatError):
    """A :class:`~vllm_hs_compat.trainer.HiddenStatesDataset` setting or resume state is invalid."""


class LayoutError(RecordFormatError):
    """A record cannot be laid out as the trainer asked (e.g. the ``eagle3`` layout needs at least two planes:
    the auxiliary layers and the base layer)."""


class FinalNormError(DatasetConfigError):
    """The verifier's final norm is needed (a trainer format whose base plane is post-norm) but its folder, weight,
    eps or norm type is not available or not known."""


class LayerNumberingError(DatasetConfigError):
    """A drafter config's layer ids do not match the records' planes in the trainer's numbering (typically off by
    one: vLLM's id ``i`` is the residual entering layer ``i``; SGLang/SpecForge/ModelOpt name layer outputs)."""


class FormatError(DatasetConfigError):
    """Records cannot be written in the trainer format asked for (unknown format, planes that format cannot carry,
    records of different layer ids or hidden sizes in one output)."""


# --- tools: demo, verify, serve-args ------------------------------------------------------------------------
class ToolError(HsCompatError):
    """A command-line tool (``demo``, ``verify``, ``serve-args``) cannot go on; the message names the fix."""


# capture: the output tree ---------------------------------------------------------------------------------
class CaptureStoreError(ToolError):
    """The capture's output tree cannot be used as asked: a resume into a tree made with other settings, a sample
    adopted twice or by a rank that does not own it, a damaged index part.  The message names what was found and
    the fix."""


class CaptureFeedError(ToolError):
    """The capture command's engine dropped requests it queued (never finished them), or left their records unread
    with nothing else to run; or the command ran its batches out of the order it queued them."""


class RunConfigMismatchError(CaptureStoreError):
    """``--out`` holds a tree made with a different run configuration (model, layers, capture mode, template...);
    the message names the keys that differ."""


class CircuitOpenError(CaptureStoreError):
    """The capture stopped after too many consecutive failures; the message names the last reasons."""


class EngineStartError(ToolError):
    """vLLM refused to start the engine with the arguments it was given (or could not be imported); the message
    quotes vLLM's error, names the argument to change and where vLLM's output went."""


class TinyModelError(ToolError):
    """A tiny model was asked for with an unknown kind or geometry."""


class HfReferenceError(ToolError):
    """The transformers reference could not be computed for a record (model structure, layer ids, shapes)."""


class ModelConfigError(ToolError):
    """A model's config lacks what a tool needs (hidden size, layer count, heads, dtype) or cannot be read."""


# --- capture: dataset to records ----------------------------------------------------------------------------
class CaptureDataError(ToolError):
    """The capture's input cannot be used as asked (a source that cannot be read, a chat template without
    ``{% generation %}`` markers when the assistant loss mask is asked, a bad ``--field`` mapping); raised before
    any engine starts.  A single bad row is a per-row error instead, never this."""


# --- evaluate: a drafter against its verifier -----------------------------------------------------------------
class DrafterError(ToolError):
    """A drafter cannot be evaluated as asked: its checkpoint is missing or damaged, or it was made for another
    verifier (hidden size, vocabulary, layer ids).  The message names what was found and what was expected."""
