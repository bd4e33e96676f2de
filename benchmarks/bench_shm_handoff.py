"""shm read speed: the pool reached by its file (handoff "path") against its handed-over descriptor ("fd").

PYTHONPATH=. python benchmarks/bench_shm_handoff.py [--mib 64] [--reps 30]

Two producers in this process, one per handoff, each with one record of ``--mib`` MiB; one consumer transport per
producer.  Interleaved, per repetition: the transport copy of the whole record into the landing buffer (``read``,
one memmove) and the verified copy (``read_checked``, xxh3 per 1 MiB chunk), then a fresh attach (the handoff's
socket round trip, or the file's open + fstat + mmap).  Medians and the 10th/90th percentiles, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.export import ExportProducer
from vllm_hs_compat.export.shm import ShmConsumerTransport

MiB = 1 << 20


def _q(xs: list[float]) -> str:
    xs = sorted(xs)
    at = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return f"median {statistics.median(xs) * 1e3:8.3f}  p10 {at(0.1) * 1e3:8.3f}  p90 {at(0.9) * 1e3:8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    n = a.mib * MiB
    rows = torch.randint(0, 256, (n,), dtype=torch.uint8).view(torch.bfloat16).view(n // 2 // 1024, 1, 1024)
    meta = RecordMeta.for_tensor("r", rows, [1] * rows.shape[0], (1,), pre_norm=True, vllm_version="-", adapter="-")
    d = tempfile.mkdtemp(dir="/dev/shm")
    sides = {}
    for handoff in ("path", "fd"):
        p = ExportProducer(backend="shm", num_slots=1, slot_bytes=n + MiB, shm_dir=d, shm_handoff=handoff)
        p.publish(meta, rows)
        lease = p.pool._by_record["r"]
        t = ShmConsumerTransport(n + MiB, d)
        t.attach(p.transport.describe())
        sides[handoff] = (p, t, lease.offset)
    times: dict[str, list[float]] = {f"{k} {h}": [] for h in sides for k in ("read", "read_checked", "attach")}
    for _ in range(a.reps):
        for h, (p, t, off) in sides.items():
            t0 = time.perf_counter()
            t.read([(off, 0, n)], time.monotonic() + 60)
            times[f"read {h}"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            t.read_checked([(off, 0, n, n)], "xxh3_64", time.monotonic() + 60)
            times[f"read_checked {h}"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            t.attach(p.transport.describe())
            times[f"attach {h}"].append(time.perf_counter() - t0)
    for k, v in times.items():
        print(f"{k:22s} {_q(v)}  ms")
    for p, t, _ in sides.values():
        t.close()
        p.close()


if __name__ == "__main__":
    main()
