"""The consumer's state, declared once: what the jobs of :class:`~.core.ExportConsumer` share.

The consumer is built in layers, one per job and module (channel, releases, claims, reads, batches, streams; each
layer's mixin builds on the one before), because every job reads most of this state (counters, transport,
landing space, the attached producer) and the hooks tests and benchmarks patch (``_call``, ``_release``,
``_transfer``) must stay the consumer's own attributes.  ``ExportConsumer.__init__`` sets them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_hs_compat.core.records import CaptureRecord
    from vllm_hs_compat.export import protocol as P
    from vllm_hs_compat.export.batch import RecordBatch
    from vllm_hs_compat.export.consumer.channel import ControlChannel
    from vllm_hs_compat.export.consumer.landing import _Landing
    from vllm_hs_compat.export.nixl_backend import UcxSettings
    from vllm_hs_compat.export.transport import ConsumerTransport


class _State:
    """The attributes every layer of the consumer may use (their meaning: the comments in
    ``ExportConsumer.__init__``)."""

    endpoint: str
    timeout_s: float
    verify_checksum: bool
    overlap_verification: bool
    defer_releases: bool
    inline_bytes: int
    lend_bytes: int
    spill_bytes: int
    producer: str | None
    hello: dict[str, Any]
    counters: dict[str, int]
    _ticket: P.ExportTicket | None
    _want: str
    _landing_bytes: int
    _shm_dir: str
    _ucx: UcxSettings | None
    _direct_wanted: bool
    _channel: ControlChannel
    _hello: P.HelloReply | None
    _fetch_op: bool | None
    _transport: ConsumerTransport | None
    _landing: _Landing
    _held: dict[int, tuple[CaptureRecord | RecordBatch, int, int]]
    _unsettled: dict[bytes, list[str]]
    _reader: Any
    _raw: memoryview
    _raw_key: tuple[int, int]

    if TYPE_CHECKING:  # the one call up the layers: a control call checks the answers to posted releases

        def _reconcile(self) -> None: ...
