"""Where the time of a small-record stream goes (a benchmark, not a test): ``iter_batches`` over 4 KiB records,
per phase, and the producer's per-record lease work alone.

    UCX_NET_DEVICES=lo python benchmarks/breakdown_small.py [--backend nixl|shm] [--records 10000] [--repeats 3]

The consumer's phases are timed by wrapping its own methods (control calls, descriptor decoding, the transfer,
everything else); the producer runs in a second process (``bench_export.py --serve``), so its share shows up
inside the control calls.  The producer's lease work (claim, release, the release message's decoding) is then
timed alone, in this process, on a pool of the same records.  Over NIXL the floor of any verified, leased
stream at this batching is measured too, piece by piece (a bare agent's READ, one control round trip per batch,
two checksums and two packing copies per record).  Prints microseconds per record (RATIO rows: ratios).
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_export as B  # noqa: E402
import torch  # noqa: E402

from vllm_hs_compat.core.records import RecordMeta, checksum_function  # noqa: E402
from vllm_hs_compat.export import ExportConsumer  # noqa: E402
from vllm_hs_compat.export import protocol as P  # noqa: E402
from vllm_hs_compat.export.pool import LeasePool  # noqa: E402


def _wrap(obj: Any, name: str, key: str, acc: dict[str, float]) -> None:
    f: Callable[..., Any] = getattr(obj, name)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(obj, name, timed)


def consumer_phases(backend: str, n: int, repeats: int) -> list[dict[str, float]]:
    srv = B.Server()
    try:
        ep = srv(op="start", name="S", backend=backend, num_slots=n + 64, slot_bytes=B.SMALL_SLOT)
        c = ExportConsumer(ep["endpoint"], ep["token"], landing_bytes=B.BATCH * B.SMALL_SLOT * 4, timeout_s=60)
        acc: dict[str, float] = collections.defaultdict(float)
        _wrap(c._session, "call", "control calls (claim + release round trips, producer work included)", acc)
        assert c._landing.transport is not None
        _wrap(c._landing.transport, "read", "transfer (transport.read)", acc)
        _wrap(P, "decode_descriptors", "descriptor decoding", acc)
        runs = []
        for rep in range(repeats + 1):  # the first pass warms up
            srv(op="publish_small", name="S", prefix=f"s{rep}-", n=n)
            srv(op="drain", name="S")
            acc.clear()
            t0 = time.perf_counter()
            got = 0
            for b in c.iter_batches(max_records=B.BATCH, wait_s=1.0, idle_timeout_s=1.0):
                got += len(b)
                if got == n:
                    break
            total = time.perf_counter() - t0
            if got != n:
                raise RuntimeError(f"streamed {got} of {n} records")
            if rep:
                row = {k: v / n * 1e6 for k, v in acc.items()}
                row["everything else (consumer Python: checks, packing, checksums)"] = total / n * 1e6 - sum(
                    row.values()
                )
                row["TOTAL iter_batches"] = total / n * 1e6
                runs.append(row)
        if backend == "nixl":
            for row, floor in zip(runs, floor_phases(c, n, len(runs)), strict=True):
                row.update(floor)
                read = floor["FLOOR raw NIXL READ (bare agent, one request per batch)"]
                row["RATIO raw READ / TOTAL iter_batches (bench_export's ratio)"] = read / row["TOTAL iter_batches"]
        c.close()
        return runs
    finally:
        srv.close()


def floor_phases(c: ExportConsumer, n: int, repeats: int) -> list[dict[str, float]]:
    """The floor of any verified, leased stream of these records at this batching, measured piece by piece in
    this process: a bare agent's NIXL READ of each batch's ranges (one request), one control round trip per
    batch (a ping), and per record the two checksums (rows, token id) and the two copies that pack it."""
    digest = checksum_function("xxh3_64")
    raw = B.RawNixl(c.hello["transport"], B.BATCH * B.SMALL_SLOT)
    packed = bytearray(B.BATCH * B.SMALL)
    ids = bytearray(B.BATCH * 4)
    out = []
    for _ in range(repeats):
        t_read = t_ping = t_sum = t_copy = 0.0
        for b in range(0, n, B.BATCH):
            k = min(B.BATCH, n - b)
            t0 = time.perf_counter()
            raw.read([((b + j) * B.SMALL_SLOT, j * B.SMALL_SLOT, B.SMALL_SLOT) for j in range(k)])
            t1 = time.perf_counter()
            c._session.call(P.PingReq())
            t2 = time.perf_counter()
            land = memoryview(raw.buf.numpy())
            for j in range(k):
                at = j * B.SMALL_SLOT
                digest(land[at : at + B.SMALL])
                digest(land[at + B.SMALL : at + B.SMALL + 4])
            t3 = time.perf_counter()
            for j in range(k):
                at = j * B.SMALL_SLOT
                packed[j * B.SMALL : (j + 1) * B.SMALL] = land[at : at + B.SMALL]
                ids[4 * j : 4 * j + 4] = land[at + B.SMALL : at + B.SMALL + 4]
            t4 = time.perf_counter()
            t_read, t_ping, t_sum, t_copy = t_read + t1 - t0, t_ping + t2 - t1, t_sum + t3 - t2, t_copy + t4 - t3
        row = {
            "FLOOR raw NIXL READ (bare agent, one request per batch)": t_read / n * 1e6,
            "FLOOR one control round trip per batch (ping)": t_ping / n * 1e6,
            "FLOOR two checksums per record": t_sum / n * 1e6,
            "FLOOR two packing copies per record": t_copy / n * 1e6,
        }
        row["FLOOR total"] = sum(row.values())
        row["RATIO raw READ / floor (the best any verified stream can do here)"] = (
            row["FLOOR raw NIXL READ (bare agent, one request per batch)"] / row["FLOOR total"]
        )
        out.append(row)
    return out


def producer_leases(n: int) -> dict[str, float]:
    gc.collect()  # start from a clean heap: a full collection inside a timed loop was 10x its figure once
    pool = LeasePool(n + 64, B.SMALL_SLOT, lease_ttl_s=60, ready_ttl_s=None)
    rows = torch.zeros(1, 4, 512, dtype=torch.bfloat16)
    meta = RecordMeta.for_tensor("x", rows, [0], [1, 2, 3, 4], True).with_checksum(5)
    for i in range(n):
        pool.publish(pool.allocate(f"r{i}", B.SMALL_SLOT - 60), meta, b"x" * 290)
    t0 = time.perf_counter()
    claimed = [
        pool.claim_next(B.BATCH, 1 << 40, 0.0, budget=1 << 24, cost=lambda lease: len(lease.wire) + 8)
        for _ in range(-(-n // B.BATCH))
    ]
    t1 = time.perf_counter()
    bodies = [
        P.encode(P.ReleaseReq([P.ReleaseItem(lease.lease_id, lease.nonce, "delivered") for lease in g]))
        for g in claimed
    ]
    t2 = time.perf_counter()
    reqs = [P.decode_request(body) for body in bodies]
    t3 = time.perf_counter()
    for req in reqs:
        assert isinstance(req, P.ReleaseReq)
        pool.settle_many([(i.lease, i.nonce, i.outcome) for i in req.leases])
    t4 = time.perf_counter()
    return {
        "producer: claim (pool.claim_next)": (t1 - t0) / n * 1e6,
        "producer: release message decoding": (t3 - t2) / n * 1e6,
        "producer: release (pool.settle_many)": (t4 - t3) / n * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="nixl", choices=["nixl", "shm"])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    runs = consumer_phases(a.backend, a.records, a.repeats)
    print(f"{a.backend}: {a.records} records of {B.SMALL} B, iter_batches(max_records={B.BATCH}), us/record")
    print(f"  {'phase':<72} {'min':>7} {'median':>7} {'max':>7}")
    for key in runs[0]:
        xs = [r[key] for r in runs]
        print(f"  {key:<72} {min(xs):7.2f} {statistics.median(xs):7.2f} {max(xs):7.2f}")
    for key, v in producer_leases(a.records).items():
        print(f"  {key:<72} {v:7.2f}")


if __name__ == "__main__":
    main()
