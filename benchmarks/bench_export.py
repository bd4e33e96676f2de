"""Export benchmark (not a test): the API against the limits it is compared with, measured side by side.

UCX_NET_DEVICES=lo python benchmarks/bench_export.py [--iters 10] [--small 10000] [--backends nixl,shm] [--json F]

The producer runs in a second process (this script with ``--serve``); the consumer side runs here.  Every case
prints the limit it is compared with, measured in the same run, interleaved with it:

* large records (64, 16 and 2 MiB; NIXL): ``fetch()`` as a user calls it (a trainer consumer built with the
  defaults, ``copy`` left at its default, the previous record still referenced, as in a loop) and
  ``fetch(copy=False)`` + ``release``, against one raw NIXL READ of the same bytes of the producer's pool by a
  bare agent; plus what bounds the difference: the checksum of the same bytes alone, the claim and a ping round
  trip alone, a bare ZeroMQ round trip with CURVE between the same two processes, a memcpy of the same size;
* large records (shm): the same fetches against a memcpy of the same size between warm buffers (the fastest of
  torch ``copy_``, one C ``memmove`` and ``memmove`` in 256 KiB chunks, each timed every iteration);
* small records: 10,000 records of 4 KiB streamed with ``iter_batches`` (``max_records=256``, defaults
  otherwise; one tensor per batch) and with ``iter_records`` (batches of 256, one record object each), against
  raw NIXL READs of the same 10,000 ranges at the same batching (256 descriptors per request) and
  one request per range (NIXL), or one C ``memmove`` per record (shm; a torch ``copy_`` per record is printed too);
* many records by id (``FETCH_BATCH`` records of 2 MiB; NIXL and shm): ``fetch_batch(ids)`` (one claim message,
  one transfer request, one release) and the same ids with one ``fetch()`` each, against one raw NIXL READ of
  the same ranges in one request (NIXL) or a memcpy of their total size (shm);
* publish: the time ``ExportProducer.publish`` takes in the calling (serving) thread, per small record and per
  64 MiB record.

Ratios are throughput ratios, the API over its limit (higher is better; 1.0 is the limit).  Medians over the
iterations of one run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch  # noqa: E402

from vllm_hs_compat.core.records import RecordMeta, compute_checksum  # noqa: E402
from vllm_hs_compat.export import ExportConsumer, ExportProducer, nixl_available  # noqa: E402
from vllm_hs_compat.export import protocol as P  # noqa: E402

try:  # the consumer's read tuning (OVERLAP_MIN_BYTES, READ_WINDOW): its own module since the consumer is a package
    from vllm_hs_compat.export.consumer import reads as consumer_mod  # noqa: E402
except ImportError:  # an older tree: one consumer module
    from vllm_hs_compat.export import consumer as consumer_mod  # type: ignore[no-redef]  # noqa: E402

MiB = 1 << 20
SIZES = (64 * MiB, 16 * MiB, 2 * MiB)
SMALL = 4096
#: a small record's slot: its 4 KiB of rows and its token id (4 bytes), rounded up to 64
SMALL_SLOT = SMALL + 64
BATCH = 256
#: records of one ``fetch_batch`` call (a step's finished requests, as a trainer holding their tickets sees them)
FETCH_BATCH = 32
HIDDEN, PLANES = 1024, 4  # bf16 rows: 8 KiB per token


def _rows(nbytes: int) -> torch.Tensor:
    tokens = nbytes // (HIDDEN * PLANES * 2)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(torch.bfloat16).view(tokens, PLANES, HIDDEN)


def _publisher(p: ExportProducer, nowait: bool) -> Any:
    """``publish_nowait`` where asked for and this release has it (earlier releases: ``publish``)."""
    return getattr(p, "publish_nowait", p.publish) if nowait else p.publish


# --- producer process ---------------------------------------------------------------------------------------
def serve() -> None:
    chan = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # NIXL logs go to stderr
    producers: dict[str, ExportProducer] = {}
    rows = {n: _rows(n) for n in SIZES}
    small = torch.randint(0, 256, (SMALL,), dtype=torch.uint8).view(torch.bfloat16).view(1, 4, 512)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        ans: dict[str, Any] = {}
        if op == "start":
            p = ExportProducer(
                backend=cmd["backend"],
                num_slots=cmd["num_slots"],
                slot_bytes=cmd["slot_bytes"],
                lease_ttl_s=60,
                ready_ttl_s=None,
                on_full="wait",
                wait_timeout_s=10.0,
            )
            producers[cmd["name"]] = p
            ans = {"endpoint": p.endpoint, "token": p.token}
        elif op == "publish_large":
            p = producers[cmd["name"]]
            big = rows[cmd["size"]]
            meta = RecordMeta.for_tensor(cmd["id"], big, [0] * big.shape[0], [1, 2, 3, 4], True)
            fn = _publisher(p, cmd.get("nowait", False))
            t0, c0 = time.perf_counter(), time.thread_time()
            fn(meta, big)
            ans = {"publish_s": time.perf_counter() - t0, "publish_cpu_s": time.thread_time() - c0}
        elif op == "publish_small":
            p = producers[cmd["name"]]
            fn = _publisher(p, cmd.get("nowait", False))
            metas = [
                RecordMeta.for_tensor(f"{cmd['prefix']}{i}", small, [0], [1, 2, 3, 4], True) for i in range(cmd["n"])
            ]
            t0, c0 = time.perf_counter(), time.thread_time()
            for meta in metas:
                fn(meta, small)
            ans = {"publish_s": time.perf_counter() - t0, "publish_cpu_s": time.thread_time() - c0}
        elif op == "drain":  # wait until every record handed to publish is fetchable (a no-op if publish is sync)
            p = producers[cmd["name"]]
            flush = getattr(p, "flush", None)
            t0 = time.perf_counter()
            if flush is not None:
                flush(30.0)
            ans = {"drain_s": time.perf_counter() - t0}
        elif op == "zmq_echo":  # a bare ZeroMQ ROUTER with CURVE echoing every message: the round trip's floor
            ans = _zmq_echo()
        elif op == "stop":
            for p in producers.values():
                p.close()
            producers.clear()
        print(json.dumps(ans), file=chan, flush=True)


def _zmq_echo() -> dict[str, Any]:
    import threading

    import zmq

    public, secret = zmq.curve_keypair()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.curve_server = True
    sock.curve_secretkey = secret
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def echo() -> None:
        while True:
            sock.send_multipart(sock.recv_multipart())

    threading.Thread(target=echo, daemon=True).start()
    return {"endpoint": f"tcp://127.0.0.1:{port}", "key": public.decode()}


class BareZmq:
    """A DEALER with CURVE against the producer process's echo: one request/answer of a claim's size."""

    def __init__(self, info: dict[str, Any]) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.curve_serverkey = info["key"].encode()
        self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
        self.sock.connect(info["endpoint"])
        self.round_trip()

    def round_trip(self) -> None:
        self.sock.send_multipart([P.HEADER, b"r" * 16, b"x" * 64])
        self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close()


class Server:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def __call__(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("benchmark producer died")
        return dict(json.loads(line))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


# --- raw NIXL, same bytes -----------------------------------------------------------------------------------
class RawNixl:
    """A bare NIXL agent reading the producer's registered pool (metadata taken from the control-plane
    hello)."""

    def __init__(self, info: dict[str, Any], landing_bytes: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(
            f"raw-{os.getpid()}-{time.monotonic_ns()}",
            nixl_agent_config(backends=["UCX"], enable_prog_thread=False),
        )
        self.buf = torch.zeros(landing_bytes, dtype=torch.uint8)
        self.agent.register_memory([(self.buf.data_ptr(), landing_bytes, 0, "")], "DRAM")
        self.remote = self.agent.add_remote_agent(bytes(info["metadata"]))
        self.base = int(info["base"])

    def read(self, ranges: list[tuple[int, int, int]]) -> None:
        """``(remote_offset, local_offset, nbytes)`` in one request."""
        lb = self.buf.data_ptr()
        local = self.agent.get_xfer_descs([(lb + lo, n, 0) for _, lo, n in ranges], "DRAM")
        remote = self.agent.get_xfer_descs([(self.base + ro, n, 0) for ro, _, n in ranges], "DRAM")
        h = self.agent.initialize_xfer("READ", local, remote, self.remote, b"")
        state = self.agent.transfer(h)
        while state == "PROC":
            state = self.agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"raw READ ended {state}")
        h.release()


def _fastest_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    """The limit of a copy between warm buffers: the fastest of ``torch.copy_`` (its intra-op threads), one C
    ``memmove`` and ``memmove`` in 256 KiB chunks (cache-sized) of the same bytes, each timed once."""
    n = src.numel()
    d, s = dst.data_ptr(), src.data_ptr()

    def chunked() -> None:
        for at in range(0, n, 256 << 10):
            ctypes.memmove(d + at, s + at, min(256 << 10, n - at))

    return min(
        _timed(lambda: dst.copy_(src))[0],
        _timed(lambda: ctypes.memmove(d, s, n))[0],
        _timed(chunked)[0],
    )


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def bench_large(srv: Server, backend: str, size: int, iters: int) -> dict[str, float]:
    name = f"L{size}"
    ep = srv(op="start", name=name, backend=backend, num_slots=2 * (size // MiB) + 8, slot_bytes=MiB)
    c = ExportConsumer(ep["endpoint"], ep["token"])  # the defaults, as a user builds it
    raw = RawNixl(c.hello["transport"], size) if backend == "nixl" else None
    bare = BareZmq(srv(op="zmq_echo"))
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    keys = (
        "default",
        "seq",
        "overlap",
        "noverify",
        "nocopy",
        "raw",
        "claim",
        "ping",
        "zmq",
        "memcpy",
        "xxh3",
        "pub",
        "pubnw",
        "pubnw_cpu",
    )
    # releases that can verify while reading (opt-in: overlap_verification=True)
    overlap = getattr(consumer_mod, "OVERLAP_MIN_BYTES", None) if hasattr(c, "overlap_verification") else None
    t: dict[str, list[float]] = {k: [] for k in keys}
    prev = None
    for i in range(iters + 1):  # the first round pays connection wire-up
        pub = srv(op="publish_large", name=name, size=size, id=f"D{i}")["publish_s"]
        srv(op="drain", name=name)
        dt, rec = _timed(lambda: c.fetch(f"D{i}"))  # noqa: B023 - the default path, the previous record still alive
        prev = rec
        qsdt = None
        if backend == "nixl" and size >= getattr(consumer_mod, "OVERLAP_MIN_BYTES", size + 1):
            # the schedule before posted reads: one piece's READ after another, each awaited, then checksummed
            srv(op="publish_large", name=name, size=size, id=f"Q{i}")
            srv(op="drain", name=name)
            window, consumer_mod.READ_WINDOW = getattr(consumer_mod, "READ_WINDOW", 1), 1
            try:
                qsdt, rec = _timed(lambda: c.fetch(f"Q{i}"))  # noqa: B023
            finally:
                consumer_mod.READ_WINDOW = window
            prev = rec
        sdt = None
        if overlap is not None and size >= overlap:  # the same, checksumming piece k while piece k + 1 moves
            srv(op="publish_large", name=name, size=size, id=f"S{i}")
            srv(op="drain", name=name)
            c.overlap_verification = True
            try:
                sdt, rec = _timed(lambda: c.fetch(f"S{i}"))  # noqa: B023
            finally:
                c.overlap_verification = False
            prev = rec
        srv(op="publish_large", name=name, size=size, id=f"V{i}")  # the default path without verification
        srv(op="drain", name=name)
        c.verify_checksum = False
        try:
            vdt, rec = _timed(lambda: c.fetch(f"V{i}"))  # noqa: B023
        finally:
            c.verify_checksum = True
        prev = rec
        nw = srv(op="publish_large", name=name, size=size, id=f"Z{i}", nowait=True)
        srv(op="drain", name=name)
        zdt, z = _timed(lambda: c.fetch(f"Z{i}", copy=False))  # noqa: B023
        zdt += _timed(lambda: c.release(z))[0]  # noqa: B023
        pdt, _ = _timed(lambda: c._session.call(P.PingReq()))
        qdt, _ = _timed(bare.round_trip)
        if raw is not None:
            srv(op="publish_large", name=name, size=size, id=f"B{i}")
            srv(op="drain", name=name)
            cdt, claim = _timed(lambda: c.claim(f"B{i}"))  # noqa: B023
            rdt, _ = _timed(lambda: raw.read([(claim.offset, 0, claim.nbytes)]))  # noqa: B023
            c.abandon([claim])
        mdt = _fastest_copy(dst, src)
        xdt, _ = _timed(lambda: compute_checksum(src))
        if i:
            t["default"].append(dt)
            t["noverify"].append(vdt)
            if qsdt is not None:
                t["seq"].append(qsdt)
            if sdt is not None:
                t["overlap"].append(sdt)
            t["nocopy"].append(zdt)
            t["ping"].append(pdt)
            t["zmq"].append(qdt)
            t["memcpy"].append(mdt)
            t["xxh3"].append(xdt)
            t["pub"].append(pub)
            t["pubnw"].append(nw["publish_s"])
            t["pubnw_cpu"].append(nw["publish_cpu_s"])
            if raw is not None:
                t["raw"].append(rdt)
                t["claim"].append(cdt)
    del prev
    c.close()
    bare.close()
    return {k: med(v) for k, v in t.items() if v}


def bench_fetch_batch(srv: Server, backend: str, size: int, iters: int) -> dict[str, float]:
    """``FETCH_BATCH`` records of ``size`` by id: ``fetch_batch`` and one ``fetch`` each, against their limit."""
    name = f"F{size}"
    ep = srv(op="start", name=name, backend=backend, num_slots=3 * FETCH_BATCH + 8, slot_bytes=size + (64 << 10))
    c = ExportConsumer(ep["endpoint"], ep["token"])  # the defaults
    if not hasattr(c, "fetch_batch"):  # a tree from before fetch_batch
        c.close()
        return {}
    raw = RawNixl(c.hello["transport"], FETCH_BATCH * size) if backend == "nixl" else None
    src = torch.randint(0, 256, (FETCH_BATCH * size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t: dict[str, list[float]] = {"fb": [], "fbseq": [], "fblimit": []}
    prev: Any = None
    for i in range(iters + 1):
        ids = [f"G{i}-{j}" for j in range(FETCH_BATCH)]
        seq = [f"Q{i}-{j}" for j in range(FETCH_BATCH)]
        lim = [f"R{i}-{j}" for j in range(FETCH_BATCH)]
        for rid in ids + seq + (lim if raw is not None else []):
            srv(op="publish_large", name=name, size=size, id=rid)
        srv(op="drain", name=name)
        dt, got = _timed(lambda: c.fetch_batch(ids))  # noqa: B023
        if len(got) != 1 or len(getattr(got[0], "record_ids", ())) != FETCH_BATCH:
            raise RuntimeError(f"fetch_batch returned {got!r}")
        prev = got
        sdt, recs = _timed(lambda: [c.fetch(rid) for rid in seq])  # noqa: B023
        prev = recs
        if raw is not None:
            claims = [c.claim(rid) for rid in lim]
            ldt, _ = _timed(lambda: raw.read([(cl.offset, j * size, cl.nbytes) for j, cl in enumerate(claims)]))  # noqa: B023
            c.abandon(claims)
        else:
            ldt = _fastest_copy(dst, src)
        if i:
            t["fb"].append(dt)
            t["fbseq"].append(sdt)
            t["fblimit"].append(ldt)
    del prev
    c.close()
    return {k: med(v) for k, v in t.items() if v}


def bench_small(srv: Server, backend: str, n_small: int) -> dict[str, float]:
    out: dict[str, float] = {}
    ep = srv(op="start", name="S", backend=backend, num_slots=n_small + 64, slot_bytes=SMALL_SLOT)
    c = ExportConsumer(ep["endpoint"], ep["token"], landing_bytes=BATCH * SMALL_SLOT * 4, timeout_s=60)
    srv(op="publish_small", name="S", prefix="w", n=BATCH)
    srv(op="drain", name="S")
    for _ in c.iter_records(batch=BATCH, wait_s=0.5, idle_timeout_s=0.5):
        pass
    sync = srv(op="publish_small", name="S", prefix="s", n=n_small)
    out["publish_small_s"] = sync["publish_s"]
    for _ in c.iter_records(batch=BATCH, wait_s=0.5, idle_timeout_s=0.5):
        pass
    nw = srv(op="publish_small", name="S", prefix="n", n=n_small, nowait=True)
    out["publish_nowait_small_s"], out["publish_nowait_small_cpu_s"] = nw["publish_s"], nw["publish_cpu_s"]
    out["drain_small_s"] = srv(op="drain", name="S")["drain_s"]
    t0 = time.perf_counter()
    got = 0
    for _rec in c.iter_records(batch=BATCH, wait_s=1.0, idle_timeout_s=1.0):
        got += 1
        if got == n_small:
            break
    out["api_small_s"] = time.perf_counter() - t0
    if got != n_small:
        raise RuntimeError(f"streamed {got} of {n_small} small records")
    if hasattr(c, "iter_batches"):  # not in releases before the batch API (a benchmark of an older tree)
        srv(op="publish_small", name="S", prefix="b", n=n_small)
        srv(op="drain", name="S")
        t0 = time.perf_counter()
        got = 0
        for b in c.iter_batches(max_records=BATCH, wait_s=1.0, idle_timeout_s=1.0):
            got += len(b)
            if got == n_small:
                break
        out["api_batches_small_s"] = time.perf_counter() - t0
        if got != n_small:
            raise RuntimeError(f"streamed {got} of {n_small} small records in batches")
    slot_offsets = [i * SMALL_SLOT for i in range(n_small)]
    if backend == "nixl":
        raw = RawNixl(c.hello["transport"], BATCH * SMALL)
        raw.read([(0, 0, SMALL)])
        t0 = time.perf_counter()
        for b in range(0, n_small, BATCH):
            raw.read([(o, j * SMALL, SMALL) for j, o in enumerate(slot_offsets[b : b + BATCH])])
        out["raw_small_batched_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for o in slot_offsets:
            raw.read([(o, 0, SMALL)])
        out["raw_small_single_s"] = time.perf_counter() - t0
    c.close()
    src = torch.randint(0, 256, (n_small * SMALL_SLOT,), dtype=torch.uint8)
    dst = torch.empty(BATCH * SMALL, dtype=torch.uint8)
    t0 = time.perf_counter()
    for i, o in enumerate(slot_offsets):
        j = (i % BATCH) * SMALL
        dst[j : j + SMALL].copy_(src[o : o + SMALL])
    out["memcpy_small_loop_s"] = time.perf_counter() - t0
    sb, db = src.data_ptr(), dst.data_ptr()
    t0 = time.perf_counter()
    for i, o in enumerate(slot_offsets):
        ctypes.memmove(db + (i % BATCH) * SMALL, sb + o, SMALL)
    out["memmove_small_loop_s"] = time.perf_counter() - t0
    return out


def bench(
    backend: str, iters: int, n_small: int, sizes: tuple[int, ...] = SIZES, large_only: bool = False
) -> dict[str, float]:
    out: dict[str, float] = {}
    srv = Server()
    try:
        for size in sizes:
            n = iters * {64 * MiB: 1, 16 * MiB: 2}.get(size, 4)
            for k, v in bench_large(srv, backend, size, n).items():
                out[f"{k}_{size // MiB}"] = v
            srv(op="stop")
        if large_only:
            return out
        for k, v in bench_fetch_batch(srv, backend, 2 * MiB, max(3, iters // 2)).items():
            out[f"{k}_2"] = v
        srv(op="stop")
        out.update(bench_small(srv, backend, n_small))
        srv(op="stop")
    finally:
        srv.close()
    return out


def report(backend: str, r: dict[str, float], n_small: int, sizes: tuple[int, ...] = SIZES) -> None:
    def ms(label: str, secs: float, nbytes: int = 0) -> None:
        bw = f"{nbytes / secs / 1e9:6.2f} GB/s" if nbytes else " " * 11
        print(f"  {label:<58} {bw}  {secs * 1e3:8.3f} ms")

    def us(label: str, secs: float) -> None:
        print(f"  {label:<58} {secs / n_small * 1e6:8.2f} us/record")

    def ratio(label: str, limit: float, api: float, note: str = "") -> None:
        print(f"  RATIO {label:<64} {limit / api:6.3f}x {note}")

    print(f"\n=== backend: {backend} ===")
    lim = "raw NIXL READ" if backend == "nixl" else "memcpy"
    for size in sizes:
        m, s = size // MiB, f"_{size // MiB}"
        print(f"record of {m} MiB (medians):")
        ms("fetch() as a user calls it (defaults)", r["default" + s], size)
        if "seq" + s in r:
            ms("fetch(), pieces read one after another (READ_WINDOW=1)", r["seq" + s], size)
        if "overlap" + s in r:
            ms("fetch(), overlap_verification=True (opt-in)", r["overlap" + s], size)
        if "noverify" + s in r:
            ms("fetch() default, verify_checksum=False", r["noverify" + s], size)
        ms("fetch(copy=False) + release()", r["nocopy" + s], size)
        if "raw" + s in r:
            ms("LIMIT raw NIXL READ of the same bytes (bare agent)", r["raw" + s], size)
            ms("claim round trip alone", r["claim" + s])
        ms("ping round trip alone (control plane)", r["ping" + s])
        if "zmq" + s in r:
            ms("bare ZeroMQ round trip (CURVE, same processes)", r["zmq" + s])
        lim_label = ("LIMIT " if backend == "shm" else "") + "memcpy of the same size (warm, fastest of 3)"
        ms(lim_label, r["memcpy" + s], size)
        ms("xxh3_64 of the same size alone", r["xxh3" + s], size)
        ms("producer publish(), in the calling thread", r["pub" + s], size)
        if "pubnw" + s in r:
            ms("producer publish_nowait(), calling thread: wall", r["pubnw" + s])
            ms("producer publish_nowait(), calling thread: its CPU", r["pubnw_cpu" + s])
        limit = r["raw" + s] if backend == "nixl" else r["memcpy" + s]
        tgt = {64: "(target >= 0.95x)", 2: "(target >= 0.8x)"}.get(m, "") if backend == "nixl" else "(target >= 0.8x)"
        ratio(f"{m} MiB: fetch() default / {lim}", limit, r["default" + s], tgt)
        if "seq" + s in r:
            ratio(f"{m} MiB: fetch(), READ_WINDOW=1 / {lim}", limit, r["seq" + s])
        if "overlap" + s in r:
            ratio(f"{m} MiB: fetch(), overlap_verification=True / {lim}", limit, r["overlap" + s])
        if "noverify" + s in r:
            ratio(f"{m} MiB: fetch() default, verify_checksum=False / {lim}", limit, r["noverify" + s])
        ratio(f"{m} MiB: fetch(copy=False) / {lim}", limit, r["nocopy" + s])
    if "api_small_s" not in r:
        return
    if "fb_2" in r:
        nb = FETCH_BATCH * 2 * MiB
        print(f"{FETCH_BATCH} records of 2 MiB by id (medians):")
        ms(f"fetch_batch({FETCH_BATCH} ids), defaults", r["fb_2"], nb)
        ms(f"fetch() of each of the {FETCH_BATCH} ids", r["fbseq_2"], nb)
        label = "raw NIXL READ of the same ranges, one request" if backend == "nixl" else "memcpy of the same size"
        ms(f"LIMIT {label}", r["fblimit_2"], nb)
        ratio(f"{FETCH_BATCH} x 2 MiB: fetch_batch / {lim}", r["fblimit_2"], r["fb_2"], "(target >= 0.8x, 2 MiB)")
        ratio(f"{FETCH_BATCH} x 2 MiB: fetch() each / {lim}", r["fblimit_2"], r["fbseq_2"])
    print(f"{n_small} small records of {SMALL} B:")
    us(f"API iter_records (batches of {BATCH}, defaults)", r["api_small_s"])
    if "api_batches_small_s" in r:
        us(f"API iter_batches (max_records={BATCH}, defaults)", r["api_batches_small_s"])
    if "raw_small_batched_s" in r:
        us(f"LIMIT raw NIXL, {BATCH} descriptors per request", r["raw_small_batched_s"])
        us("raw NIXL, one request per record", r["raw_small_single_s"])
    us("torch copy_, one per record", r["memcpy_small_loop_s"])
    us(("LIMIT " if backend == "shm" else "") + "C memmove, one per record", r["memmove_small_loop_s"])
    us("producer publish(), in the calling thread", r["publish_small_s"])
    us("producer publish_nowait(), calling thread: wall", r["publish_nowait_small_s"])
    us("producer publish_nowait(), calling thread: its CPU", r["publish_nowait_small_cpu_s"])
    us("producer publish_nowait(): then until all are fetchable", r["drain_small_s"])
    if "raw_small_batched_s" in r:
        if "api_batches_small_s" in r:
            ratio("small: iter_batches / raw NIXL (same batching)", r["raw_small_batched_s"],
                  r["api_batches_small_s"], "(target >= 0.9x)")  # fmt: skip
        ratio("small: iter_records / raw NIXL (same batching)", r["raw_small_batched_s"], r["api_small_s"])
        ratio("small: API / raw NIXL (one request per record)", r["raw_small_single_s"], r["api_small_s"])
    if "api_batches_small_s" in r:
        ratio("small: iter_batches / memmove (one per record)", r["memmove_small_loop_s"], r["api_batches_small_s"])
    ratio("small: iter_records / memmove (one per record)", r["memmove_small_loop_s"], r["api_small_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--small", type=int, default=10_000)
    ap.add_argument("--backends", default="nixl,shm")
    ap.add_argument("--json", help="also write the raw figures to this file")
    ap.add_argument("--sizes", default="64,16,2", help="large-record sizes in MiB (of 64, 16, 2)")
    ap.add_argument("--large-only", action="store_true", help="only the large-record cases")
    a = ap.parse_args()
    sizes = tuple(int(x) * MiB for x in a.sizes.split(","))
    if a.serve:
        serve()
        return
    results = {}
    for b in a.backends.split(","):
        if b == "nixl" and not nixl_available():
            print("nixl not importable: skipping the NIXL backend")
            continue
        results[b] = bench(b, a.iters, a.small, sizes, a.large_only)
        report(b, results[b], a.small, sizes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
