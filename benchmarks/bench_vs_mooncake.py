"""The export against Mooncake's transfer engine and store, side by side in one run (not a test).

    bash benchmarks/install_mooncake.sh       # once: Mooncake into .venv-mooncake (for this benchmark only)
    python benchmarks/bench_vs_mooncake.py [--reps 10] [--quick] [--profile] [--markdown] [--json F]

``python`` is the project's environment (torch, nixl, pyzmq, msgspec, xxhash); the Mooncake processes run under
``--mooncake-python`` (default ``.venv-mooncake/bin/python``).  Every system runs as two processes, a producer
(the side holding the bytes) and a consumer (the side that reads them), started by this script (``--role``),
each pair with its own transport settings:

* ``ours tcp``: :class:`ExportProducer` / :class:`ExportConsumer` with the defaults (``backend="nixl"``,
  checksum verification on), NIXL/UCX forced onto TCP over loopback (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=lo``):
  the equal-transport comparison with Mooncake, whose non-CUDA build moves bytes over TCP;
* ``mc-te tcp``: Mooncake's transfer engine (``protocol="tcp"``, P2P handshake, no metadata server): the target
  registers a buffer holding the records, the initiator reads them into its registered landing buffer
  (``transfer_sync_read`` per record, ``batch_transfer_sync_read`` per batch);
* ``mc-store tcp``: Mooncake's store (``mooncake_master`` started here; the producer is a store client that
  mounts the segment and ``put_from``s the records, the consumer mounts nothing and ``get_into``s /
  ``batch_get_into``s them into a registered buffer);
* context rows (``[ctx]``), not equal transports or not equal work: ``ours nixl-shm`` (UCX left to pick its
  transports: same-host shared memory), ``ours shm`` (``backend="shm"``), ours with ``verify_checksum=False``,
  the raw NIXL READ of the claimed bytes with no API around it (our wire), and Mooncake's read followed by an
  xxh3_64 pass over the bytes (what a Mooncake reader pays to check what our consumer checks).

Cases: single records of 64 KiB, 1 MiB, 16 MiB and 64 MiB (``fetch(id)`` as a user calls it, the previous
record still alive; Mooncake: one read of the same size), and a stream of 1,000 records of 64 KiB
(ours: ``iter_batches(max_records=256)`` and ``fetch_batch`` of 256 ids at a time; Mooncake: 256 ranges per
batched read, and one read per record), and a loop of 200 records of 64 KiB fetched one after another by id (ours:
``fetch(id)`` back to back, the previous record alive; Mooncake: ``get_into`` per key, and its engine's
``transfer_sync_read`` per record).  Every repetition runs every row once, rows rotated between
repetitions; the first repetition (connection wire-up) is dropped.  Printed per row: min / median / max (per
record microseconds for the stream) and the ours/Mooncake throughput ratio against Mooncake's engine (``vs te``:
its fastest row of the case) and its store (``vs store``): Mooncake's median time / the row's median time,
above 1.0 the row is faster.  The load average is printed before, during and after: on a shared machine label
the run "under load".

``--profile`` adds where our consumer's time goes on TCP: a 64 MiB ``fetch`` split into its claim round trip,
transfer and checksum (with raw transport READs of the same bytes in one request, in the 2 MiB pieces a checked
read uses, and in those pieces checksummed one after another vs posted at once), the steps of one 64 KiB NIXL
READ, and per record for fetches by id (back to back, and after 1 s idle) and for the 64 KiB stream: control
round trips, transfer, checksum and the rest.  The ``--producer-*`` / ``--consumer-spin-s`` / ``--tcp-env``
options change our TCP pair only, to measure the changes docs/benchmarks.md proposes; they change no file of
the package (the producer's are its constructor's arguments; the consumer's overrides a module constant in this
benchmark's consumer process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from role_worker import Worker

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB)
#: the consumer's default inline_bytes (consumer.INLINE_BYTES; not imported here: the driver needs no torch)
INLINE_BYTES = 256 * KiB
STREAM_N, STREAM_REC, BATCH = 1000, 64 * KiB, 256
#: records of the by-id loop: 64 KiB records fetched one after another, each by its id, as a loop over a list of
#: request ids does (ours: ``fetch(id)``, the previous record kept alive; Mooncake: ``get_into`` per key, and its
#: engine reading each record at an address it knows)
LOOP_N = 200
#: a stream record's slot: its 64 KiB of rows and its 8 token ids, rounded up (Mooncake's records sit at the
#: same stride, so neither side reads one contiguous range)
STREAM_SLOT = STREAM_REC + 64
HIDDEN, PLANES = 1024, 4  # bf16 rows: 8 KiB per token
LARGE_SLOT = 1 * MiB
PROFILE_SINGLES = 20  # single fetches per profiled size
PROFILE_LONE = 4  # lone fetches, each after a second without requests

TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
NIXL_DEFAULT = {"UCX_NET_DEVICES": "lo"}  # UCX picks its transports: same-host shared memory on one host


# --- the worker processes --------------------------------------------------------------------------------
def _rows(nbytes: int) -> Any:
    import torch

    tokens = nbytes // (HIDDEN * PLANES * 2)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(torch.bfloat16).view(tokens, PLANES, HIDDEN)


def _serve(handlers: dict[str, Callable[..., Any]]) -> None:
    """Answer one JSON command per stdin line on the original stdout (library logs go to stderr)."""
    chan = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            ans = handlers[op](**cmd)
        except Exception as e:  # the orchestrator prints it and stops
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans if ans is not None else {}), file=chan, flush=True)


def role_ours_producer() -> None:
    from vllm_hs_compat.core.records import RecordMeta
    from vllm_hs_compat.export import ExportProducer

    prods: dict[str, ExportProducer] = {}
    rows = {n: _rows(n) for n in SIZES}

    def start(backend: str, poll_s: float | None = None, idle_poll_s: float | None = None) -> dict[str, Any]:
        out = {}
        kw: dict[str, Any] = {} if poll_s is None else {"poll_interval_s": poll_s}
        if idle_poll_s is not None:
            kw["idle_poll_interval_s"] = idle_poll_s
        for name, slots, slot in (("L", 4 * 65 + 16, LARGE_SLOT), ("S", STREAM_N + 64, STREAM_SLOT)):
            p = ExportProducer(
                backend=backend,
                num_slots=slots,
                slot_bytes=slot,
                lease_ttl_s=60,
                ready_ttl_s=None,
                on_full="wait",
                wait_timeout_s=10.0,
                **kw,
            )
            prods[name] = p
            out[name] = {"endpoint": p.endpoint, "token": p.token}
        return out

    def publish(name: str, size: int, ids: list[str]) -> dict[str, Any]:
        p = prods[name]
        big = rows[size] if size in rows else rows.setdefault(size, _rows(size))
        for rid in ids:
            p.publish(RecordMeta.for_tensor(rid, big, [0] * big.shape[0], [1, 2, 3, 4], True), big)
        p.flush(30.0)
        return {}

    def stop() -> None:
        for p in prods.values():
            p.close()

    _serve({"start": start, "publish": publish, "stop": stop})


def role_ours_consumer() -> None:
    import torch

    from vllm_hs_compat.export import ExportConsumer

    spin = os.environ.get("HSX_BENCH_DIAG_SPIN_S")
    if spin:  # diagnostic only (--consumer-spin-s): how long a READ is polled before the polls pause
        from vllm_hs_compat.export import nixl_backend

        nixl_backend.SPIN_S = float(spin)
    cons: dict[str, ExportConsumer] = {}
    keep: list[Any] = [None]  # the previous record stays alive while the next is fetched, as in a user's loop

    def connect(eps: dict[str, dict[str, str]]) -> None:
        cons["L"] = ExportConsumer(eps["L"]["endpoint"], eps["L"]["token"])  # the defaults
        cons["S"] = ExportConsumer(eps["S"]["endpoint"], eps["S"]["token"], landing_bytes=64 * MiB)
        # context: the trainer's control calls CURVE-encrypted over ZeroMQ (its direct socket), not the plain channel
        cons["LC"] = ExportConsumer(eps["L"]["endpoint"], eps["L"]["token"], landing_bytes=128 * MiB, plain=False)
        cons["SC"] = ExportConsumer(eps["S"]["endpoint"], eps["S"]["token"], landing_bytes=64 * MiB, plain=False)

    def single(rid: str, verify: bool, inline: bool = True, curve: bool = False) -> dict[str, Any]:
        c = cons["LC" if curve else "L"]
        c.verify_checksum = verify
        default_inline = c.inline_bytes
        if not inline:
            c.inline_bytes = 0
        t0 = time.perf_counter()
        rec = c.fetch(rid)
        dt = time.perf_counter() - t0
        keep[0] = rec
        c.verify_checksum = True
        c.inline_bytes = default_inline
        return {"s": dt}

    def stream(ids: list[str], mode: str, verify: bool, curve: bool = False) -> dict[str, Any]:
        c = cons["SC" if curve else "S"]
        c.verify_checksum = verify
        got = 0
        t0 = time.perf_counter()
        if mode == "each":  # one fetch(id) after another, the previous record alive
            for rid in ids:
                keep[0] = c.fetch(rid)
                got += 1
        elif mode == "iter_batches":
            for b in c.iter_batches(max_records=BATCH, wait_s=1.0, idle_timeout_s=2.0):
                got += len(b)
                keep[0] = b
                if got >= len(ids):
                    break
        else:
            for i in range(0, len(ids), BATCH):
                for got_b in c.fetch_batch(ids[i : i + BATCH]):
                    if isinstance(got_b, Exception):
                        raise RuntimeError(f"fetch_batch failed a record: {got_b!r}")
                    got += len(got_b)
                    keep[0] = got_b
        dt = time.perf_counter() - t0
        c.verify_checksum = True
        if got != len(ids):
            raise RuntimeError(f"streamed {got} of {len(ids)} records")
        return {"s": dt}

    def raw(rid: str) -> dict[str, Any]:
        """The transport alone: claim (not timed), one READ of the record's bytes (timed), abandon."""
        c = cons["L"]
        cl = c.claim(rid)
        off = c._landing.alloc(cl.extent)
        tr = c._landing.transport
        if off is None or tr is None:
            raise RuntimeError("no landing space or no transport for the raw read")
        try:
            t0 = time.perf_counter()
            tr.read([(cl.offset, off, cl.extent)], time.monotonic() + 60)
            dt = time.perf_counter() - t0
        finally:
            c._landing.free(off, cl.extent)
            c.abandon([cl])
        return {"s": dt}

    def profile_large(rid_a: str, rid_b: str, rid_c: str, n: int) -> dict[str, Any]:
        return _profile_large(cons["L"], rid_a, rid_b, rid_c, n)

    def profile_stream(ids: list[str], mode: str, verify: bool) -> dict[str, Any]:
        return _profile_stream(cons["S"], ids, mode, verify)

    def profile_single(ids: list[str], idle_s: float = 0.0) -> dict[str, Any]:
        return _profile_single(cons["L"], ids, idle_s)

    def cprofile(ids: list[str], what: str) -> dict[str, Any]:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        if what == "single":
            prof.runcall(_profile_single, cons["L"], ids)
        else:
            prof.runcall(_profile_stream, cons["S"], ids, what, True)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        return {"text": buf.getvalue()}

    del torch
    _serve(
        {
            "connect": connect,
            "raw": raw,
            "single": single,
            "stream": stream,
            "profile_large": profile_large,
            "profile_stream": profile_stream,
            "profile_single": profile_single,
            "cprofile": cprofile,
        }
    )


def role_mc_target() -> None:
    import torch
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake transfer engine did not initialize (tcp, P2PHANDSHAKE)")
    large = torch.randint(0, 256, (max(SIZES),), dtype=torch.uint8)
    small = torch.randint(0, 256, (STREAM_N * STREAM_SLOT,), dtype=torch.uint8)
    for t in (large, small):
        if eng.register_memory(t.data_ptr(), t.numel()) != 0:
            raise RuntimeError("Mooncake register_memory failed")

    def info() -> dict[str, Any]:
        return {"session": f"127.0.0.1:{eng.get_rpc_port()}", "large": large.data_ptr(), "small": small.data_ptr()}

    _serve({"info": info})


def _xxh3() -> Callable[[Any], int]:
    import xxhash

    fn: Callable[[Any], int] = xxhash.xxh3_64_intdigest
    return fn


def role_mc_initiator() -> None:
    import torch
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake transfer engine did not initialize (tcp, P2PHANDSHAKE)")
    land = torch.zeros(max(SIZES) + BATCH * STREAM_REC, dtype=torch.uint8)
    eng.register_memory(land.data_ptr(), land.numel())
    lb = land.data_ptr()
    view = memoryview(land.numpy().data).cast("B")
    xxh3 = _xxh3()
    tgt: dict[str, Any] = {}

    def connect(session: str, large: int, small: int) -> None:
        tgt.update(session=session, large=large, small=small)
        if eng.transfer_sync_read(session, lb, large, 4096) != 0:
            raise RuntimeError("Mooncake first read failed")

    def single(size: int, check: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        if eng.transfer_sync_read(tgt["session"], lb, tgt["large"], size) != 0:
            raise RuntimeError("Mooncake read failed")
        if check:
            xxh3(view[:size])
        return {"s": time.perf_counter() - t0}

    def stream(n: int, mode: str, check: bool) -> dict[str, Any]:
        s, base = tgt["session"], tgt["small"]
        t0 = time.perf_counter()
        for b in range(0, n, BATCH):
            k = min(BATCH, n - b)
            if mode == "each":
                for j in range(k):
                    if eng.transfer_sync_read(s, lb + j * STREAM_REC, base + (b + j) * STREAM_SLOT, STREAM_REC):
                        raise RuntimeError("Mooncake read failed")
            else:
                rc = eng.batch_transfer_sync_read(
                    s,
                    [lb + j * STREAM_REC for j in range(k)],
                    [base + (b + j) * STREAM_SLOT for j in range(k)],
                    [STREAM_REC] * k,
                )
                if rc != 0:
                    raise RuntimeError(f"Mooncake batch read failed: {rc}")
            if check:
                for j in range(k):
                    xxh3(view[j * STREAM_REC : (j + 1) * STREAM_REC])
        return {"s": time.perf_counter() - t0}

    _serve({"connect": connect, "single": single, "stream": stream})


def _store(master: str, segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    st = MooncakeDistributedStore()
    if st.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * MiB, "tcp", "", master) != 0:
        raise RuntimeError(f"Mooncake store setup failed (master {master})")
    return st


def role_mc_store_producer() -> None:
    st: list[Any] = []
    rows = {n: _rows(n).view(-1).view(__import__("torch").uint8) for n in SIZES}
    old: list[str] = []

    def start(master: str) -> None:
        st.append(_store(master, 640 * MiB))
        for t in rows.values():
            st[0].register_buffer(t.data_ptr(), t.numel())

    def publish(size: int, ids: list[str]) -> None:
        s = st[0]
        t = rows[size] if size in rows else rows[min(n for n in rows if n >= size)]  # registered: put its prefix
        for k in old:  # what the last round put is gone before this one's puts, as a consumed record would be
            s.remove(k, True)
        old.clear()
        for rid in ids:
            if s.put_from(rid, t.data_ptr(), size) != 0:
                raise RuntimeError(f"Mooncake put_from({rid}) failed")
        old.extend(ids)

    _serve({"start": start, "publish": publish})


def role_mc_store_consumer() -> None:
    import torch

    st: list[Any] = []
    land = torch.zeros(max(SIZES) + BATCH * STREAM_REC, dtype=torch.uint8)
    lb = land.data_ptr()

    def start(master: str) -> None:
        st.append(_store(master, 0))
        if st[0].register_buffer(lb, land.numel()) != 0:
            raise RuntimeError("Mooncake store register_buffer failed")

    def single(rid: str, size: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        got = st[0].get_into(rid, lb, size)
        dt = time.perf_counter() - t0
        if got != size:
            raise RuntimeError(f"Mooncake get_into({rid}) returned {got}")
        return {"s": dt}

    def stream(ids: list[str], mode: str = "batched") -> dict[str, Any]:
        t0 = time.perf_counter()
        if mode == "each":  # one get_into per key, one after another
            for rid in ids:
                if (one := st[0].get_into(rid, lb, STREAM_REC)) != STREAM_REC:
                    raise RuntimeError(f"Mooncake get_into({rid}) returned {one}")
            return {"s": time.perf_counter() - t0}
        for b in range(0, len(ids), BATCH):
            chunk = ids[b : b + BATCH]
            got = st[0].batch_get_into(
                chunk, [lb + j * STREAM_REC for j in range(len(chunk))], [STREAM_REC] * len(chunk)
            )
            if any(g != STREAM_REC for g in got):
                raise RuntimeError(f"Mooncake batch_get_into returned {sorted(set(got))}")
        return {"s": time.perf_counter() - t0}

    _serve({"start": start, "single": single, "stream": stream})


# --- profile of our consumer (run in the ours-tcp consumer process) ----------------------------------------
def _profile_large(c: Any, rid_a: str, rid_b: str, rid_c: str, n: int) -> dict[str, Any]:
    """A 64 MiB fetch split up: claim round trip, read without verification (transfer), read with it, the
    checksum of the same bytes alone, a ping round trip, and a raw NIXL READ of the claimed bytes in one request
    and in the pieces a checked read uses."""
    import torch

    from vllm_hs_compat.core.records import compute_checksum
    from vllm_hs_compat.export import consumer as consumer_mod
    from vllm_hs_compat.export import protocol as P

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    c._session.call(P.PingReq())
    out["ping"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ca = c.claim(rid_a)
    out["claim"] = time.perf_counter() - t0
    c.verify_checksum = False
    t0 = time.perf_counter()
    (ra,) = c.read([ca])
    out["read_noverify"] = time.perf_counter() - t0
    c.verify_checksum = True
    cb = c.claim(rid_b)
    t0 = time.perf_counter()
    (rb,) = c.read([cb])
    out["read_verify"] = time.perf_counter() - t0
    if isinstance(ra, Exception) or isinstance(rb, Exception):
        raise RuntimeError(f"profile read failed: {ra!r} {rb!r}")
    flat = rb.hidden_states.reshape(-1).view(torch.uint8)
    t0 = time.perf_counter()
    compute_checksum(flat)
    out["xxh3"] = time.perf_counter() - t0
    del ra, rb
    # the raw transport under the same consumer: one READ of the whole record, then 2 MiB pieces
    cc = c.claim(rid_c)
    tr = c._landing.transport
    off = c._landing.alloc(cc.extent)
    try:
        dl = time.monotonic() + 30
        t0 = time.perf_counter()
        tr.read([(cc.offset, off, cc.extent)], dl)
        out["raw_one"] = time.perf_counter() - t0
        step = consumer_mod.CHECK_PIECE_BYTES
        t0 = time.perf_counter()
        for at in range(0, cc.extent, step):
            tr.read([(cc.offset + at, off + at, min(step, cc.extent - at))], dl)
        out["raw_pieces"] = time.perf_counter() - t0
        out["pieces"] = -(-cc.extent // step)
        out["raw_pieces_xxh3_seq"], out["raw_pieces_xxh3_posted"] = _pieces_checked(tr, cc.offset, off, cc.nbytes, step)
        out.update(_nixl_small_read_parts(tr, cc.offset, off))
    finally:
        c._landing.free(off, cc.extent)
        c.abandon([cc])
    out["nbytes"] = n
    return out


@contextlib.contextmanager
def _instrumented(c: Any) -> Iterator[dict[str, float]]:
    """Time the consumer's inner steps while the block runs (wrapped in this process only): control-plane calls
    (claims and their round trips, releases posted or waited for), transport reads, checksum calls; the rest is
    Python around them."""
    from vllm_hs_compat.core import records as records_mod
    from vllm_hs_compat.export.consumer import batches as batches_mod
    from vllm_hs_compat.export.consumer import reads as reads_mod

    acc = {k: 0.0 for k in ("control", "control_n", "transfer", "transfer_n", "checksum", "checksum_n")}

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrap(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0
                acc[key + "_n"] += 1

        return wrap

    client_cls, state_cls = type(c._channel.client), records_mod.ChecksumState
    tr = c._landing.transport
    # (owner, attribute) -> what it was; checksum_bytes and checksum_function as the consumer's reads and batches
    # modules imported them
    targets: list[tuple[Any, str, str]] = [
        (client_cls, "call", "control"),
        (client_cls, "post", "control"),
        (state_cls, "update_bytes", "checksum"),
        (reads_mod, "checksum_bytes", "checksum"),
        (tr, "read", "transfer"),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
    for obj, name, key in targets:
        setattr(obj, name, timed(key, getattr(obj, name)))
    make = batches_mod.__dict__["checksum_function"]
    batches_mod.__dict__["checksum_function"] = lambda alg: timed("checksum", make(alg))
    deferred = _counter(c, "deferred_releases")
    t0 = time.perf_counter()
    try:
        yield acc
    finally:
        acc["total"] = time.perf_counter() - t0
        for obj, name, was in saved[:4]:
            setattr(obj, name, was)
        delattr(tr, "read")  # the instance attribute set above: the class's method shows again
        batches_mod.__dict__["checksum_function"] = make
        acc["deferred_releases"] = _counter(c, "deferred_releases") - deferred


def _pieces_checked(tr: Any, roff: int, loff: int, n: int, step: int) -> tuple[float, float]:
    """The verified read at the transport level, two ways: the pieces read one after another, each checksummed
    once it landed (what the consumer does now), and every piece's READ posted at once (NIXL transfers are
    asynchronous), each checksummed as it completes, in order, on the same thread (the proposed change)."""
    agent, remote = tr._agent, tr._remote
    lb, rb = int(tr.landing.data_ptr()) + loff, tr.remote_base + roff
    view = memoryview(tr.landing.numpy().data).cast("B")
    xxh3 = _xxh3()
    spans = [(at, min(step, n - at)) for at in range(0, n, step)]

    def post(at: int, k: int) -> tuple[Any, str]:
        ld = agent.get_xfer_descs([(lb + at, k, 0)], "DRAM")
        rd = agent.get_xfer_descs([(rb + at, k, 0)], "DRAM")
        h = agent.initialize_xfer("READ", ld, rd, remote, b"")
        return h, agent.transfer(h)

    def wait(h: Any, state: str) -> None:
        while state == "PROC":
            state = agent.check_xfer_state(h)
        h.release()
        if state != "DONE":
            raise RuntimeError(f"NIXL READ ended {state}")

    t0 = time.perf_counter()
    for at, k in spans:
        wait(*post(at, k))
        xxh3(view[loff + at : loff + at + k])
    seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    posted = [(at, k, *post(at, k)) for at, k in spans]
    for at, k, h, state in posted:
        wait(h, state)
        xxh3(view[loff + at : loff + at + k])
    return seq, time.perf_counter() - t0


def _nixl_small_read_parts(tr: Any, roff: int, loff: int, n: int = 64 * KiB, reps: int = 50) -> dict[str, float]:
    """One NIXL READ of 64 KiB over the consumer's agent, its steps timed (medians of ``reps``): building the two
    descriptor lists, ``initialize_xfer``, ``transfer`` until DONE (busy polling), releasing the handle."""
    agent, remote = tr._agent, tr._remote
    lb, rb = int(tr.landing.data_ptr()) + loff, tr.remote_base + roff
    parts: dict[str, list[float]] = {"descs": [], "init": [], "wire": [], "release": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        ld = agent.get_xfer_descs([(lb, n, 0)], "DRAM")
        rd = agent.get_xfer_descs([(rb, n, 0)], "DRAM")
        t1 = time.perf_counter()
        h = agent.initialize_xfer("READ", ld, rd, remote, b"")
        t2 = time.perf_counter()
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        t3 = time.perf_counter()
        h.release()
        t4 = time.perf_counter()
        if state != "DONE":
            raise RuntimeError(f"NIXL READ ended {state}")
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            v_list = parts[k]
            v_list.append(v)
    return {f"small_{k}": statistics.median(v) for k, v in parts.items()}


def _profile_stream(c: Any, ids: list[str], mode: str, verify: bool) -> dict[str, Any]:
    """The stream with the consumer's inner steps timed."""
    c.verify_checksum = verify
    got = 0
    try:
        with _instrumented(c) as acc:
            if mode == "iter_batches":
                for b in c.iter_batches(max_records=BATCH, wait_s=1.0, idle_timeout_s=2.0):
                    got += len(b)
                    if got >= len(ids):
                        break
            else:
                for i in range(0, len(ids), BATCH):
                    got += sum(len(b) for b in c.fetch_batch(ids[i : i + BATCH]))
    finally:
        c.verify_checksum = True
    acc["records"] = got
    return acc


def _profile_single(c: Any, ids: list[str], idle_s: float = 0.0) -> dict[str, Any]:
    """``fetch`` of each id (the previous record kept alive) with the inner steps timed; ``idle_s``: a pause
    before each fetch (not counted: the time is taken around the fetches only)."""
    keep = None
    with _instrumented(c) as acc:
        for rid in ids:
            if idle_s:
                t0 = time.perf_counter()
                time.sleep(idle_s)
                acc["idle"] = acc.get("idle", 0.0) + time.perf_counter() - t0
            keep = c.fetch(rid)
    acc["total"] -= acc.get("idle", 0.0)
    del keep
    acc["records"] = len(ids)
    return acc


def _counter(c: Any, key: str) -> int:
    return int(c.counters.get(key, 0))


# --- the orchestrator --------------------------------------------------------------------------------------


def _mooncake_env(mc_py: str) -> dict[str, str]:
    """LD_LIBRARY_PATH for Mooncake's processes: the libibverbs that install_mooncake.sh unpacked into the venv."""
    root = Path(mc_py).parent.parent / "sysroot"
    libs = sorted(str(p) for p in [*root.glob("usr/lib/*-linux-gnu"), *root.glob("lib/*-linux-gnu")])
    return {"LD_LIBRARY_PATH": ":".join(libs)} if libs else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


class Bench:
    """Starts every pair, then runs the rows."""

    def __init__(self, a: argparse.Namespace, log_dir: Path) -> None:
        self.a, self.log_dir = a, log_dir
        self.workers: list[Worker] = []
        self.master: subprocess.Popen[bytes] | None = None
        self.seq = 0
        self.ours: dict[str, tuple[Worker, Worker]] = {}
        for label, backend, env in self._our_configs():
            if a.consumer_spin_s is not None:
                env = {**env, "HSX_BENCH_DIAG_SPIN_S": str(a.consumer_spin_s)}
            prod = self._start("ours_producer", env)
            cons = self._start("ours_consumer", env)
            cons(
                "connect",
                eps=prod("start", backend=backend, poll_s=a.producer_poll_s, idle_poll_s=a.producer_idle_poll_s),
            )
            self.ours[label] = (prod, cons)
        mc_py = a.mooncake_python
        mc_env = _mooncake_env(mc_py)
        tgt = self._start("mc_target", mc_env, mc_py)
        self.mc = self._start("mc_initiator", mc_env, mc_py)
        self.mc("connect", **tgt("info"))
        self.store: tuple[Worker, Worker] | None = None
        if not a.no_store:
            port = _free_port()
            master_bin = str(Path(mc_py).parent / "mooncake_master")
            self.master = subprocess.Popen(
                [master_bin, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={_free_port()}"],
                stdout=open(log_dir / "mooncake_master.log", "w"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
                env={**os.environ, **mc_env},
            )
            time.sleep(1.0)
            sp = self._start("mc_store_producer", mc_env, mc_py)
            sc = self._start("mc_store_consumer", mc_env, mc_py)
            sp("start", master=f"127.0.0.1:{port}")
            sc("start", master=f"127.0.0.1:{port}")
            self.store = (sp, sc)

    def _our_configs(self) -> list[tuple[str, str, dict[str, str]]]:
        tcp = {**TCP, **dict(kv.split("=", 1) for kv in self.a.tcp_env)}
        out = [("ours tcp", "nixl", tcp)]
        if not self.a.no_context:
            out += [("ours nixl-shm", "nixl", NIXL_DEFAULT), ("ours shm", "shm", NIXL_DEFAULT)]
        return out

    def _start(self, role: str, env: dict[str, str], python: str | None = None) -> Worker:
        log = self.log_dir / f"{role}-{len(os.listdir(self.log_dir))}.log"
        w = Worker(role, __file__, python or sys.executable, ROOT, env, log)
        self.workers.append(w)
        return w

    def _id(self, tag: str) -> str:
        self.seq += 1
        return f"{tag}{self.seq}"

    def close(self) -> None:
        for w in reversed(self.workers):
            w.close()
        if self.master is not None:
            self.master.terminate()
            self.master.wait(10)

    # rows: (case, label) -> one measurement (seconds); the stream's rows return the whole stream's seconds
    def rows(self) -> list[tuple[str, str, Callable[[], float]]]:
        out: list[tuple[str, str, Callable[[], float]]] = []
        ctx = not self.a.no_context
        for size in self.a.sizes:
            case = _size_name(size)
            out.append((case, "ours tcp  fetch() (verify on, default)", self._ours_single("ours tcp", size, True)))
            if size <= INLINE_BYTES:  # the default answers the claim with the bytes: the same fetch without that
                out.append(
                    (case, "ours tcp  fetch(), claim then READ [ctx]", self._ours_single("ours tcp", size, True, False))
                )
            out.append((case, "mc-te tcp transfer_sync_read", self._mc_single(size, False)))
            if self.store is not None:
                out.append((case, "mc-store tcp get_into", self._store_single(size)))
            if ctx:
                out.append((case, "ours tcp  fetch(), verify off [ctx]", self._ours_single("ours tcp", size, False)))
                curve = self._ours_single("ours tcp", size, True, curve=True)
                out.append((case, "ours tcp  fetch(), CURVE control [ctx]", curve))
                out.append((case, "mc-te tcp read + xxh3 [ctx]", self._mc_single(size, True)))
                out.append((case, "ours tcp  raw NIXL READ, no API [ctx]", self._ours_raw("ours tcp", size)))
                out.append((case, "ours nixl-shm fetch() [ctx]", self._ours_single("ours nixl-shm", size, True)))
                out.append((case, "ours shm  fetch() [ctx]", self._ours_single("ours shm", size, True)))
        case = f"loop by id {LOOP_N} x 64 KiB"
        loop = self._ours_stream("ours tcp", "each", True, n=LOOP_N)
        out.append((case, "ours tcp  fetch(id) each (verify on, default)", loop))
        out.append((case, "mc-te tcp one read per record", self._mc_stream("each", False, LOOP_N)))
        if self.store is not None:
            out.append((case, "mc-store tcp get_into per id", self._store_stream("each", LOOP_N)))
        case = f"stream {STREAM_N} x 64 KiB"
        out.append(
            (case, f"ours tcp  iter_batches({BATCH}) verify on", self._ours_stream("ours tcp", "iter_batches", True))
        )
        out.append(
            (case, f"ours tcp  fetch_batch({BATCH} ids) verify on", self._ours_stream("ours tcp", "fetch_batch", True))
        )
        out.append((case, f"mc-te tcp batch read ({BATCH}/request)", self._mc_stream("batched", False)))
        out.append((case, "mc-te tcp one read per record", self._mc_stream("each", False)))
        if self.store is not None:
            out.append((case, f"mc-store tcp batch_get_into ({BATCH})", self._store_stream()))
        if ctx:
            out.append(
                (case, "ours tcp  iter_batches verify off [ctx]", self._ours_stream("ours tcp", "iter_batches", False))
            )
            out.append((case, "mc-te tcp batch read + xxh3 [ctx]", self._mc_stream("batched", True)))
            out.append(
                (
                    case,
                    "ours tcp  iter_batches, CURVE control [ctx]",
                    self._ours_stream("ours tcp", "iter_batches", True, curve=True),
                )
            )
            out.append(
                (case, "ours nixl-shm iter_batches [ctx]", self._ours_stream("ours nixl-shm", "iter_batches", True))
            )
            out.append((case, "ours shm  iter_batches [ctx]", self._ours_stream("ours shm", "iter_batches", True)))
        return out

    def _ours_single(
        self, cfg: str, size: int, verify: bool, inline: bool = True, curve: bool = False
    ) -> Callable[[], float]:
        prod, cons = self.ours[cfg]

        def run() -> float:
            rid = self._id("r")
            prod("publish", name="L", size=size, ids=[rid])
            return float(cons("single", rid=rid, verify=verify, inline=inline, curve=curve)["s"])

        return run

    def _ours_raw(self, cfg: str, size: int) -> Callable[[], float]:
        prod, cons = self.ours[cfg]

        def run() -> float:
            rid = self._id("w")
            prod("publish", name="L", size=size, ids=[rid])
            return float(cons("raw", rid=rid)["s"])

        return run

    def _ours_stream(
        self, cfg: str, mode: str, verify: bool, curve: bool = False, n: int = STREAM_N
    ) -> Callable[[], float]:
        prod, cons = self.ours[cfg]

        def run() -> float:
            tag = self._id("s")
            ids = [f"{tag}-{i}" for i in range(n)]
            prod("publish", name="S", size=STREAM_REC, ids=ids)
            return float(cons("stream", ids=ids, mode=mode, verify=verify, curve=curve)["s"])

        return run

    def _mc_single(self, size: int, check: bool) -> Callable[[], float]:
        return lambda: float(self.mc("single", size=size, check=check)["s"])

    def _mc_stream(self, mode: str, check: bool, n: int = STREAM_N) -> Callable[[], float]:
        return lambda: float(self.mc("stream", n=n, mode=mode, check=check)["s"])

    def _store_single(self, size: int) -> Callable[[], float]:
        assert self.store is not None
        sp, sc = self.store

        def run() -> float:
            rid = self._id("k")
            sp("publish", size=size, ids=[rid])
            return float(sc("single", rid=rid, size=size)["s"])

        return run

    def _store_stream(self, mode: str = "batched", n: int = STREAM_N) -> Callable[[], float]:
        assert self.store is not None
        sp, sc = self.store

        def run() -> float:
            tag = self._id("m")
            ids = [f"{tag}-{i}" for i in range(n)]
            sp("publish", size=STREAM_REC, ids=ids)
            return float(sc("stream", ids=ids, mode=mode)["s"])

        return run

    def profile(self) -> dict[str, Any]:
        prod, cons = self.ours["ours tcp"]
        big = max(SIZES)
        ids = [self._id("p") for _ in range(3)]
        prod("publish", name="L", size=big, ids=ids)
        out: dict[str, Any] = {"large": cons("profile_large", rid_a=ids[0], rid_b=ids[1], rid_c=ids[2], n=big)}
        for size in (64 * KiB, 1 * MiB):
            ids = [self._id("p") for _ in range(PROFILE_SINGLES)]
            prod("publish", name="L", size=size, ids=ids)
            out[f"single {_size_name(size)}"] = cons("profile_single", ids=ids)
        ids = [self._id("p") for _ in range(PROFILE_LONE)]
        prod("publish", name="L", size=64 * KiB, ids=ids)
        out["single 64 KiB, 1 s idle before"] = cons("profile_single", ids=ids, idle_s=1.0)
        for mode, verify in (("iter_batches", True), ("iter_batches", False), ("fetch_batch", True)):
            tag = self._id("q")
            sids = [f"{tag}-{i}" for i in range(STREAM_N)]
            prod("publish", name="S", size=STREAM_REC, ids=sids)
            key = f"stream {mode} verify {'on' if verify else 'off'}"
            out[key] = cons("profile_stream", ids=sids, mode=mode, verify=verify)
        return out

    def cprofile(self) -> list[str]:
        """cProfile of our TCP consumer (its main thread): 200 fetches of 64 KiB by id, then the 64 KiB stream."""
        prod, cons = self.ours["ours tcp"]
        ids = [self._id("c") for _ in range(200)]
        prod("publish", name="L", size=64 * KiB, ids=ids)
        out = [cons("cprofile", ids=ids, what="single")["text"]]
        tag = self._id("c")
        sids = [f"{tag}-{i}" for i in range(STREAM_N)]
        prod("publish", name="S", size=STREAM_REC, ids=sids)
        out.append(cons("cprofile", ids=sids, what="iter_batches")["text"])
        return out


def _size_name(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _run(a: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vs-mooncake-"))
    print(
        f"# bench_vs_mooncake  {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  {_load()}  "
        f"cpus {os.cpu_count()}  logs {log_dir}",
        flush=True,
    )
    b = Bench(a, log_dir)
    results: dict[str, Any] = {"loads": [os.getloadavg()], "rows": {}}
    try:
        rows = b.rows()
        times: dict[tuple[str, str], list[float]] = {(c, label): [] for c, label, _ in rows}
        for rep in range(a.reps + 1):  # repetition 0 wires the connections up: dropped
            k = rep % len(rows)
            for case, label, fn in rows[k:] + rows[:k]:
                dt = fn()
                if rep:
                    times[(case, label)].append(dt)
            results["loads"].append(os.getloadavg())
            print(f"#   repetition {rep}/{a.reps} done  {_load()}", flush=True)
        if a.reps:
            _report(times)
            if a.markdown:
                _markdown(times)
        results["rows"] = {f"{c} | {label}": v for (c, label), v in times.items()}
        if a.profile:
            prof = [b.profile() for _ in range(a.profile_reps)]
            _report_profile(prof)
            results["profile"] = prof
        if a.cprofile:
            for title, text in zip(
                ("200 x fetch(64 KiB)", f"iter_batches over {STREAM_N} x 64 KiB"), b.cprofile(), strict=True
            ):
                print(f"\n== cProfile, ours tcp consumer: {title} (top by own time) ==")
                print("\n".join(line[:150] for line in text.splitlines() if line.strip())[:6000])
    finally:
        b.close()
    results["loads"].append(os.getloadavg())
    print(f"# end  {_load()}")
    if not a.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return results


def _report(times: dict[tuple[str, str], list[float]]) -> None:
    cases: dict[str, list[tuple[str, list[float]]]] = {}
    for (case, label), v in times.items():
        cases.setdefault(case, []).append((label, v))
    print("\nRatios are ours/Mooncake throughput ratios: Mooncake's median time / the row's median time (above 1.0 the")
    print("row is faster).  'vs te': Mooncake transfer engine's fastest row of the case (no lookup, the reader knows")
    print("the address); 'vs store': Mooncake store's get (a master lookup, then the engine's read).  Rows marked")
    print("[ctx] are context: not equal transports or not equal work.")
    for case, rows in cases.items():
        per = _records_of(case)
        med = {label: statistics.median(v) for label, v in rows}
        te = [m for label, m in med.items() if label.startswith("mc-te") and "xxh3" not in label]
        store = [m for label, m in med.items() if label.startswith("mc-store")]
        ref_te, ref_store = min(te, default=float("nan")), min(store, default=float("nan"))
        unit = "us/record" if per else "ms"
        print(f"\n== {case} ({unit}: min / median / max over {len(rows[0][1])} reps) ==")
        for label, v in sorted(rows, key=lambda r: (r[0].endswith("[ctx]"), med[r[0]])):
            scale = 1e6 / per if per else 1e3
            lo, md, hi = min(v) * scale, med[label] * scale, max(v) * scale
            rate = (per * STREAM_REC if per else _parse_size(case)) / med[label] / 1e9
            print(
                f"  {label:<44} {lo:9.2f} {md:9.2f} {hi:9.2f}  {rate:5.2f} GB/s  "
                f"vs te {ref_te / med[label]:5.2f}x  vs store {ref_store / med[label]:5.2f}x"
            )


def _markdown(times: dict[tuple[str, str], list[float]]) -> None:
    """The same table as markdown (docs/benchmarks.md)."""
    print("\n| case | row | min / median / max | ours/Mooncake: vs te | vs store |")
    print("|---|---|---|---|---|")
    cases: dict[str, list[tuple[str, list[float]]]] = {}
    for (case, label), v in times.items():
        cases.setdefault(case, []).append((label, v))
    for case, rows in cases.items():
        per = _records_of(case)
        med = {label: statistics.median(v) for label, v in rows}
        ref_te = min((m for lb, m in med.items() if lb.startswith("mc-te") and "xxh3" not in lb), default=float("nan"))
        ref_store = min((m for lb, m in med.items() if lb.startswith("mc-store")), default=float("nan"))
        scale, unit = (1e6 / per, "us/rec") if per else (1e3, "ms")
        for label, v in sorted(rows, key=lambda r: (r[0].endswith("[ctx]"), med[r[0]])):
            cell = f"{min(v) * scale:.2f} / **{med[label] * scale:.2f}** / {max(v) * scale:.2f} {unit}"
            te, st = ref_te / med[label], ref_store / med[label]
            print(f"| {case} | {' '.join(label.split())} | {cell} | {te:.2f}x | {st:.2f}x |")


def _records_of(case: str) -> int:
    """Records per measurement of a per-record case (the stream, the by-id loop); 0 for a single record's."""
    return STREAM_N if case.startswith("stream") else LOOP_N if case.startswith("loop") else 0


def _parse_size(case: str) -> int:
    n, unit = case.split()
    return int(n) * (MiB if unit == "MiB" else KiB)


def _report_profile(prof: list[dict[str, Any]]) -> None:
    def med(part: str, key: str) -> float:
        return float(statistics.median(p[part][key] for p in prof))

    n = prof[0]["large"]["nbytes"]
    print(f"\n== profile, ours tcp (medians of {len(prof)}) ==")
    print(f"fetch of a {_size_name(n)} record, its parts (ms):")
    for key, label in (
        ("claim", "claim round trip (claim())"),
        ("ping", "ping round trip (control plane floor)"),
        ("read_noverify", "read(), verify off: transfer + release (deferred)"),
        ("read_verify", "read(), verify on: 2 MiB pieces, each checksummed"),
        ("xxh3", "xxh3_64 of the same bytes alone"),
        ("raw_one", "raw transport READ of the record, one request"),
        ("raw_pieces", f"raw transport READs in {prof[0]['large']['pieces']} pieces of 2 MiB"),
        ("raw_pieces_xxh3_seq", "raw: 2 MiB pieces one after another, xxh3 each (as now)"),
        ("raw_pieces_xxh3_posted", "raw: all pieces posted at once, xxh3 each as it lands"),
    ):
        print(f"  {label:<56} {med('large', key) * 1e3:8.2f}")
    print(
        "  raw NIXL READ of 64 KiB, its steps (us): "
        + "  ".join(f"{k} {med('large', 'small_' + k) * 1e6:.0f}" for k in ("descs", "init", "wire", "release"))
    )
    share = med("large", "read_verify") - med("large", "read_noverify")
    piecing = med("large", "raw_pieces") - med("large", "raw_one")
    print(f"  => verifying costs {share * 1e3:.2f} ms; the pieces cost on the wire {piecing * 1e3:.2f} ms")
    print("per record (us): control = claim round trips + releases posted, transfer = transport reads (NIXL requests),")
    print("checksum = xxh3 calls, rest = Python around them (descriptors, landing space, tensors, leases)")
    for key in [k for k in prof[0] if k != "large"]:
        recs = prof[0][key]["records"]
        parts = {k: med(key, k) for k in ("control", "transfer", "checksum")}
        calls = {k: statistics.median(p[key][k + "_n"] for p in prof) for k in parts}
        tot = med(key, "total")
        cells = "  ".join(f"{k} {v / recs * 1e6:7.1f} ({calls[k]:.0f})" for k, v in parts.items())
        rest = (tot - sum(parts.values())) / recs * 1e6
        print(f"  {key:<32} {cells}  rest {rest:6.1f}  total {tot / recs * 1e6:7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=10, help="measured repetitions (one more is run and dropped)")
    ap.add_argument("--quick", action="store_true", help="3 repetitions, no context rows: a smoke run")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="single-record sizes in bytes")
    ap.add_argument("--no-store", action="store_true", help="leave Mooncake's store (and its master) out")
    ap.add_argument("--no-context", action="store_true", help="only the equal-transport rows")
    ap.add_argument("--profile", action="store_true", help="also break our TCP side down")
    ap.add_argument("--profile-reps", type=int, default=3)
    ap.add_argument("--cprofile", action="store_true", help="also cProfile our TCP consumer (fetches, the stream)")
    ap.add_argument(
        "--mooncake-python",
        default=str(ROOT / ".venv-mooncake" / "bin" / "python"),
        help="a Python with mooncake-transfer-engine-non-cuda (benchmarks/install_mooncake.sh)",
    )
    ap.add_argument(
        "--producer-poll-s",
        type=float,
        default=None,
        help="diagnostic: ExportProducer(poll_interval_s=...) for our producers (default: the package's)",
    )
    ap.add_argument(
        "--producer-idle-poll-s",
        type=float,
        default=None,
        help="diagnostic: ExportProducer(idle_poll_interval_s=...) for our producers (default: the package's)",
    )
    ap.add_argument(
        "--consumer-spin-s",
        type=float,
        default=None,
        help="diagnostic: how long our consumer busy-polls a READ before pausing 50 us between polls "
        "(the package's SPIN_S, default 2 ms; patched in the benchmark's consumer process only)",
    )
    ap.add_argument(
        "--tcp-env",
        action="append",
        default=[],
        metavar="UCX_X=V",
        help="diagnostic: more UCX settings for our TCP pair (repeatable), e.g. UCX_TCP_SEG_SIZE=256k",
    )
    ap.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--json", help="also write the raw figures to this file")
    a = ap.parse_args()
    if a.role:
        ROLES[a.role]()
        return
    a.sizes = [int(s) for s in a.sizes.split(",")]
    if a.quick:
        a.reps, a.no_context = 3, True
    if not Path(a.mooncake_python).exists():
        sys.exit(f"{a.mooncake_python} not found: run benchmarks/install_mooncake.sh first")
    res = _run(a)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


ROLES: dict[str, Callable[[], None]] = {
    "ours_producer": role_ours_producer,
    "ours_consumer": role_ours_consumer,
    "mc_target": role_mc_target,
    "mc_initiator": role_mc_initiator,
    "mc_store_producer": role_mc_store_producer,
    "mc_store_consumer": role_mc_store_consumer,
}

if __name__ == "__main__":
    main()
