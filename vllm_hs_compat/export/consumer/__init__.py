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

The package: :class:`ExportConsumer` (``core.py``) is a facade that holds the parts below, each the one owner of
its state, and hands each public call to the part that does it.  Reading order, each part using only the ones
before it (a test patches one part's method, e.g. ``consumer._session.call`` or ``consumer._releases.release``):

1. ``landing.py``, :class:`Landing`: the data transport (NIXL or the ``/dev/shm`` ring, made for the producer's
   kind of pool) and the space records land in: the landing buffer, spill arenas, records lent or held;
2. ``channel.py``, :class:`ControlChannel`: the control connection (gate, plain channel, direct endpoint);
3. ``session.py``, :class:`Session`: hello, the producer attached (its transport checked and attached through the
   landing), every call to it;
4. ``releases.py``, :class:`Releases`: leases released with their outcomes, posted releases and their verdicts;
5. ``claims.py``, :class:`Claims` and :class:`Claim`: claiming records, descriptors checked one by one;
6. ``reads.py``, :class:`Reads`: checked reads of claimed records (transfer, verification, release, hand-out);
7. ``batches.py``, :class:`Batches`: records read together, packed into
   :class:`~vllm_hs_compat.export.batch.RecordBatch` objects;
8. ``streams.py``, :class:`Streams`: rounds of records and the streams made of them; :class:`Sweep` over several
   consumers (the trainer's dataset streams through it).

Common changes: how a record is claimed -- ``claims.py``; what is checked before bytes are handed out --
``reads.py`` (``batches.py`` for batches); when a release waits for its answer -- ``releases.py``; where bytes land
and when they are lent or copied -- ``landing.py``.  Tests: ``tests/export`` (``test_export_suite.py`` and
``test_export_faults.py`` on both transports, ``test_export_batches.py``, ``test_export_inline.py``,
``test_export_direct.py``, ``test_export_plain.py``, ``test_export_ucx.py``), ``tests/trainer/test_dataset.py``.

The tuning constants below are re-exported for reading; a test or benchmark that changes one patches it in the
module that uses it (``reads.CHECK_PIECE_BYTES``...).
"""

from __future__ import annotations

from vllm_hs_compat.export.consumer.batches import BATCH_DIRECT_MIN_BYTES, Batches
from vllm_hs_compat.export.consumer.channel import DIRECT_CONFIRM_S, ControlChannel
from vllm_hs_compat.export.consumer.claims import INLINE_BYTES, MAX_BATCH, Claim, Claims
from vllm_hs_compat.export.consumer.core import ExportConsumer
from vllm_hs_compat.export.consumer.landing import LEND_MIN_BYTES, PAGE, SPILL_ROUND_BYTES, Landing
from vllm_hs_compat.export.consumer.reads import (
    CHECK_PIECE_BYTES,
    OVERLAP_MIN_BYTES,
    PIECE_MAX_BYTES,
    PIECE_MIN_BYTES,
    PIECE_SPIN_S,
    READ_WINDOW,
    Reads,
)
from vllm_hs_compat.export.consumer.releases import CLOSE_COLLECT_S, DEFER_FRACTION, Releases
from vllm_hs_compat.export.consumer.session import Session
from vllm_hs_compat.export.consumer.streams import EMPTY_BACKOFF_S, Streams, Sweep

__all__ = [
    "BATCH_DIRECT_MIN_BYTES",
    "CHECK_PIECE_BYTES",
    "CLOSE_COLLECT_S",
    "DEFER_FRACTION",
    "DIRECT_CONFIRM_S",
    "EMPTY_BACKOFF_S",
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
    "Batches",
    "Claim",
    "Claims",
    "ControlChannel",
    "ExportConsumer",
    "Landing",
    "Reads",
    "Releases",
    "Session",
    "Streams",
    "Sweep",
]
