"""Export benchmark (not a test): the API against raw NIXL READs of the same bytes and against memcpy.

UCX_NET_DEVICES=lo python benchmarks/bench_export.py [--iters 10] [--small 10000] [--backends nixl,shm]

The producer runs in a second process (this script with ``--serve``); the consumer side runs here.  Printed:

* large: one 64 MiB record per fetch (claim over the control plane + READ + checksum verify + release over the
  control plane), against one raw NIXL READ of the same 64 MiB of the producer's registered pool, a 64 MiB memcpy
  and the xxh3_64 checksum of 64 MiB alone;
* small: 10,000 records of 4 KiB streamed with ``iter_records`` (batches of 256), against raw NIXL READs of
  the same 10,000 ranges (256 descriptors per request, and one request per range), and memcpy of the same
  bytes.

Ratios are throughput ratios (higher is better for the first named).  Medians over ``--iters``.
"""

from __future__ import annotations

import argparse
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

MiB = 1 << 20
LARGE = 64 * MiB
SMALL = 4096
#: a small record's slot: its 4 KiB of rows and its token id (4 bytes), rounded up to 64
SMALL_SLOT = SMALL + 64
BATCH = 256


# --- producer process ---------------------------------------------------------------------------------------
def serve() -> None:
    chan = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # NIXL logs go to stderr
    producers: dict[str, ExportProducer] = {}
    big = torch.randint(0, 256, (LARGE,), dtype=torch.uint8).view(torch.bfloat16).view(8192, 4, 1024)
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
            t0 = time.perf_counter()
            p.publish(RecordMeta.for_tensor(cmd["id"], big, [0] * 8192, [1, 2, 3, 4], True), big)
            ans = {"publish_s": time.perf_counter() - t0}
        elif op == "publish_small":
            p = producers[cmd["name"]]
            t0 = time.perf_counter()
            for i in range(cmd["n"]):
                p.publish(RecordMeta.for_tensor(f"{cmd['prefix']}{i}", small, [0], [1, 2, 3, 4], True), small)
            ans = {"publish_s": time.perf_counter() - t0}
        elif op == "stop":
            for p in producers.values():
                p.close()
            producers.clear()
        print(json.dumps(ans), file=chan, flush=True)


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


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def gbps(nbytes: int, s: float) -> str:
    return f"{nbytes / s / 1e9:6.2f} GB/s"


def bench(backend: str, iters: int, n_small: int) -> dict[str, float]:
    out: dict[str, float] = {}
    srv = Server()
    try:
        # ---- large ----
        ep = srv(op="start", name="L", backend=backend, num_slots=80, slot_bytes=MiB)
        c = ExportConsumer(ep["endpoint"], ep["token"], landing_bytes=LARGE + MiB, timeout_s=60)
        raw = RawNixl(c.hello["transport"], LARGE) if backend == "nixl" else None
        api, pub, rt, cl = [], [], [], []
        # Interleaved, both on freshly published bytes: record A_i through the API, record B_i claimed through
        # the API (untimed) and then read with one bare NIXL READ (timed), then given back.
        for i in range(iters + 1):
            pub.append(srv(op="publish_large", name="L", id=f"A{i}")["publish_s"])
            t0 = time.perf_counter()
            rec = c.fetch(f"A{i}", copy=False)
            dt = time.perf_counter() - t0
            c.release(rec)
            if raw is not None:
                srv(op="publish_large", name="L", id=f"B{i}")
                t0 = time.perf_counter()
                claim = c.claim(f"B{i}")
                cdt = time.perf_counter() - t0
                t0 = time.perf_counter()
                raw.read([(claim.offset, 0, claim.nbytes)])
                rdt = time.perf_counter() - t0
                c.abandon([claim])
            if i:  # the first round pays connection wire-up
                api.append(dt)
                if raw is not None:
                    rt.append(rdt)
                    cl.append(cdt)
        out["api_large_s"] = med(api)
        c.verify_checksum = False
        nv = []
        for i in range(iters):
            srv(op="publish_large", name="L", id=f"N{i}")
            t0 = time.perf_counter()
            rec = c.fetch(f"N{i}", copy=False)
            nv.append(time.perf_counter() - t0)
            c.release(rec)
        c.verify_checksum = True
        out["api_large_noverify_s"] = med(nv)
        out["publish_large_s"] = med(pub[1:])
        if rt:
            out["raw_large_s"] = med(rt)
            out["claim_s"] = med(cl)
        land = c._transport.landing if c._transport is not None else None
        verify = []
        if land is not None:
            for _ in range(iters):
                t0 = time.perf_counter()
                compute_checksum(land[:LARGE])
                verify.append(time.perf_counter() - t0)
        out["verify_large_s"] = med(verify)
        c.close()
        src = torch.randint(0, 256, (LARGE,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in first
        mc, ck = [], []
        for _ in range(iters):  # interleaved: memcpy, then the checksum of the same bytes
            t0 = time.perf_counter()
            dst.copy_(src)
            mc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            compute_checksum(src)
            ck.append(time.perf_counter() - t0)
        out["memcpy_large_s"] = med(mc)
        out["xxh3_large_s"] = med(ck)

        # ---- small ----
        ep = srv(op="start", name="S", backend=backend, num_slots=n_small + 64, slot_bytes=SMALL_SLOT)
        c = ExportConsumer(ep["endpoint"], ep["token"], landing_bytes=BATCH * SMALL_SLOT * 4, timeout_s=60)
        warm = srv(op="publish_small", name="S", prefix="w", n=BATCH)
        for _ in c.iter_records(batch=BATCH, wait_s=0.5, idle_timeout_s=0.5):
            pass
        out["publish_small_s"] = srv(op="publish_small", name="S", prefix="s", n=n_small)["publish_s"]
        del warm
        t0 = time.perf_counter()
        got = 0
        for _rec in c.iter_records(batch=BATCH, wait_s=1.0, idle_timeout_s=1.0):
            got += 1
            if got == n_small:
                break
        out["api_small_s"] = time.perf_counter() - t0
        if got != n_small:
            raise RuntimeError(f"streamed {got} of {n_small} small records")
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
        big_dst = torch.empty_like(src[: n_small * SMALL])
        t0 = time.perf_counter()
        big_dst.copy_(src[: n_small * SMALL])
        out["memcpy_small_contig_s"] = time.perf_counter() - t0
        srv(op="stop")
    finally:
        srv.close()
    return out


def report(backend: str, r: dict[str, float], n_small: int) -> None:
    def line(label: str, nbytes: int, secs: float, unit: str = "ms") -> None:
        per = f"{secs * 1e3:8.2f} ms" if unit == "ms" else f"{secs / n_small * 1e6:8.1f} us/record"
        print(f"  {label:<44} {gbps(nbytes, secs)}  {per}")

    def ratio(label: str, num: float, den: float, note: str = "") -> None:
        print(f"  RATIO {label:<58} {num / den:6.3f}x {note}")

    print(f"\n=== backend: {backend} ===")
    print("large record, 64 MiB (medians):")
    line("API fetch (claim + READ + verify + release)", LARGE, r["api_large_s"])
    line("API fetch, verify_checksum=False", LARGE, r["api_large_noverify_s"])
    line("checksum verification alone (xxh3_64)", LARGE, r["verify_large_s"])
    if "raw_large_s" in r:
        line("raw NIXL READ of the same bytes", LARGE, r["raw_large_s"])
        print(f"  {'claim round trip alone (control plane)':<44} {'':>10}  {r['claim_s'] * 1e3:8.2f} ms")
    line("memcpy (torch copy_)", LARGE, r["memcpy_large_s"])
    line("xxh3_64 of the same bytes (interleaved with it)", LARGE, r["xxh3_large_s"])
    line("producer publish (copy into pool + checksum)", LARGE, r["publish_large_s"])
    if "raw_large_s" in r:
        ratio("large: API / raw NIXL", r["raw_large_s"], r["api_large_s"], "(target >= 0.95x)")
        ratio("large: API without checksum verification / raw NIXL", r["raw_large_s"], r["api_large_noverify_s"])
    ratio("large: API / memcpy", r["memcpy_large_s"], r["api_large_s"])
    ratio("checksum speed / memcpy speed (xxh3_64, 64 MiB)", r["memcpy_large_s"], r["xxh3_large_s"])
    nb = n_small * SMALL
    print(f"{n_small} small records of {SMALL} B:")
    line(f"API iter_records (batches of {BATCH})", nb, r["api_small_s"], "us")
    if "raw_small_batched_s" in r:
        line(f"raw NIXL, {BATCH} descriptors per request", nb, r["raw_small_batched_s"], "us")
        line("raw NIXL, one request per record", nb, r["raw_small_single_s"], "us")
    line("memcpy, one copy per record", nb, r["memcpy_small_loop_s"], "us")
    line("memcpy, one contiguous copy", nb, r["memcpy_small_contig_s"], "us")
    line("producer publish", nb, r["publish_small_s"], "us")
    if "raw_small_batched_s" in r:
        ratio("small: API / raw NIXL (same batching)", r["raw_small_batched_s"], r["api_small_s"])
        ratio("small: API / raw NIXL (one request per record)", r["raw_small_single_s"], r["api_small_s"])
    ratio("small: API / memcpy (one copy per record)", r["memcpy_small_loop_s"], r["api_small_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--small", type=int, default=10_000)
    ap.add_argument("--backends", default="nixl,shm")
    ap.add_argument("--json", help="also write the raw figures to this file")
    a = ap.parse_args()
    if a.serve:
        serve()
        return
    results = {}
    for b in a.backends.split(","):
        if b == "nixl" and not nixl_available():
            print("nixl not importable: skipping the NIXL backend")
            continue
        results[b] = bench(b, a.iters, a.small)
        report(b, results[b], a.small)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
