"""Consumer client: fetch records by id (or stream them) into its own landing buffer.

::

    with ExportConsumer.from_params(response["kv_transfer_params"]) as c:       # trainer token, or the ticket
        rec = c.fetch(response["kv_transfer_params"]["hs_export"]["record_id"])
        rec.hidden_states  # [tokens, planes, hidden], checksum and shape verified

    for rec in ExportConsumer(endpoint, token).iter_records(batch=64, idle_timeout_s=30):   # trainer only
        ...

    for batch in ExportConsumer(endpoint, token).iter_batches(max_records=256):   # many small records, fast
        batch.hidden_states, batch.token_ids, batch.cu_tokens    # packed, see vllm_hs_compat.export.batch

Two kinds of consumer:

* a **trainer** (``token``): claims any record or streams them all, and reads over the producer's data
  transport (NIXL READ into a registered landing buffer, or a copy out of the ``/dev/shm`` pool);
* a **ticket holder** (``ticket`` with a capability, no token): fetches that one record, whose bytes come through
  the control plane (it is never given the pool's transport description, which would open every record).

Every read is verified (hidden-state checksum unless ``verify_checksum=False``; the token ids' checksum always)
and then released with its outcome; only a record whose lease was held through its read is handed out
(:class:`LeaseExpiredError` otherwise): the producer's answer to the release says so, or, for a release made
before half the lease TTL has passed since the claim was sent, the clock does (the release is then posted and its
answer checked later: ``defer_releases``, see docs/export.md "Ledger").  Not thread-safe: one consumer per thread
or process.  With ``copy=False`` a record's tensor is a view of the landing buffer, valid until
:meth:`ExportConsumer.release`; with ``copy=True`` (default) it is owned: valid as long as it is referenced, after
``release`` and ``close`` too.  An owned record is not copied while the landing buffer has room (``lend_fraction``,
three quarters of it by default): its tensor views the landing space it was read into, which comes back to the
consumer when the tensor is garbage collected.  Past that share it is copied into freshly allocated memory.

The package, one module a job.  ``landing.py`` is the landing space (landing buffer, spill arenas; a component
the consumer holds).  The other jobs are layers :class:`ExportConsumer` stacks, each built on the one before
(``state.py`` declares the state they share and says why they are layers, not components):

* ``channel.py``: the control connection (gate, direct endpoint), the hello that attaches the transport, calls;
* ``releases.py``: leases released with their outcomes, posted releases and their verdicts;
* ``claims.py``: :class:`Claim` and claiming records;
* ``reads.py``: checked reads of claimed records;
* ``batches.py``: records read together, packed into :class:`~vllm_hs_compat.export.batch.RecordBatch` objects;
* ``streams.py``: ``iter_records`` and ``iter_batches``;
* ``core.py``: :class:`ExportConsumer` itself (constructor, ``fetch``, ``release``, ``stats``, ``close``).

The tuning constants below are re-exported for reading; a test or benchmark that changes one patches it in the
module that uses it (``reads.CHECK_PIECE_BYTES``...).
"""

from __future__ import annotations

from vllm_hs_compat.export.consumer.batches import BATCH_DIRECT_MIN_BYTES
from vllm_hs_compat.export.consumer.channel import DIRECT_CONFIRM_S
from vllm_hs_compat.export.consumer.claims import INLINE_BYTES, MAX_BATCH, Claim
from vllm_hs_compat.export.consumer.core import ExportConsumer
from vllm_hs_compat.export.consumer.landing import LEND_MIN_BYTES, PAGE, SPILL_ROUND_BYTES
from vllm_hs_compat.export.consumer.reads import (
    CHECK_PIECE_BYTES,
    OVERLAP_MIN_BYTES,
    PIECE_MAX_BYTES,
    PIECE_MIN_BYTES,
    PIECE_SPIN_S,
    READ_WINDOW,
)
from vllm_hs_compat.export.consumer.releases import CLOSE_COLLECT_S, DEFER_FRACTION

__all__ = [
    "BATCH_DIRECT_MIN_BYTES",
    "CHECK_PIECE_BYTES",
    "CLOSE_COLLECT_S",
    "DEFER_FRACTION",
    "DIRECT_CONFIRM_S",
    "INLINE_BYTES",
    "LEND_MIN_BYTES",
    "MAX_BATCH",
    "OVERLAP_MIN_BYTES",
    "PAGE",
    "PIECE_MAX_BYTES",
    "PIECE_MIN_BYTES",
    "PIECE_SPIN_S",
    "READ_WINDOW",
    "SPILL_ROUND_BYTES",
    "Claim",
    "ExportConsumer",
]
