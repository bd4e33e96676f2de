"""One ``HiddenStatesDataset`` stream over one export endpoint vs two, side by side in one run (not a test).

UCX_NET_DEVICES=lo python benchmarks/bench_multi_endpoint.py [--records 1000] [--batch 8] [--reps 3]

Two producers (shared memory) run in two other processes (tests/export/hsx_peer.py).  Each repetition publishes
``--records`` small records (16 tokens x 4 planes x 64 bf16 = 8 KiB) and streams them three ways, in turn:

* ``one``: every record on producer A, ``from_export(A)``;
* ``all-on-one``: every record on A, ``from_export([A, B])`` (B empty: what the sweep costs);
* ``half``: the records alternate between A and B, ``from_export([A, B])``.

Printed per case: the time to the first record (opening the consumers), the rate after it, and this process's
CPU time for the rest (the stream's own cost; the producers' share of a small host's cores is not in it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, str(ROOT / "tests" / "export"))

from hsx_harness import Peer  # noqa: E402

from vllm_hs_compat.trainer import HiddenStatesDataset  # noqa: E402

TOKEN = "b" * 43


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n = args.records
    peers = [Peer(), Peer()]
    try:
        eps = [
            p.ok("producer", backend="shm", num_slots=n + 64, slot_bytes=16384, token=TOKEN)["endpoint"] for p in peers
        ]
        serial = 0
        for rep in range(args.reps):
            for case in ("one", "all-on-one", "half"):
                for i in range(n):
                    serial += 1
                    peer = peers[1] if case == "half" and i % 2 else peers[0]
                    peer.ok("publish", record_id=f"r{serial}", seed=i, tokens=16, planes=4, hidden=64)
                src = eps[0] if case == "one" else eps
                ds = HiddenStatesDataset.from_export(
                    src, TOKEN, wait_s=0.3, max_records=n, batch=args.batch, layout="planes"
                )
                t0 = time.perf_counter()
                it = iter(ds)
                next(it)
                t1, c1 = time.perf_counter(), time.process_time()
                got = 1 + sum(1 for _ in it)
                dt, dc = time.perf_counter() - t1, time.process_time() - c1
                if got != n:
                    raise SystemExit(f"{case}: {got} records of {n}")
                print(
                    f"rep {rep} {case:>10}: first record {t1 - t0:.3f} s, then {(n - 1) / dt:,.0f} records/s, "
                    f"CPU here {dc:.2f} s",
                    flush=True,
                )
    finally:
        for p in peers:
            p.close()


if __name__ == "__main__":
    main()
