"""The loops users write, against a raw transfer of the same bytes measured in the same run (not a test).

UCX_NET_DEVICES=lo python benchmarks/bench_user_loops.py [--reps 8] [--size-mib 64] [--backends nixl,shm]
    [--small 10000] [--small-reps 2] [--loader-records 6] [--skip loader,small] [--json F]

``benchmarks/bench_export.py`` times ``fetch()`` with at most the previous record alive and nothing else going on.
A trainer does more: it keeps a few records (a batch being assembled, a prefetch queue, a record still in the
optimizer step), it looks at every record before it asks for the next, it reads through a ``DataLoader`` with
workers.  This benchmark times those loops, all of them side by side in one run: every repetition runs one step
of each case in turn (interleaved), each case with its own consumer, so one case's kept records never crowd
another's landing space.  The producer is a second process (``bench_export.py --serve``).

Cases (large records, ``--size-mib``, default 64 MiB):

* ``default K=k``: ``rec = c.fetch(id)`` with every default (``copy=True``), the record's tensor checked (shape, a
  read of one byte per page) before the next fetch, the last ``k`` records kept alive in a deque (``K=0``: the
  record is dropped before the next fetch; ``K=1`` is the plain ``for`` loop, where the loop variable still holds
  the previous record while the next is fetched);
* ``copy=False K=k``: ``fetch(id, copy=False)``, the same check, ``release()`` when the record leaves the deque;
* ``no-verify K=1``: the default with ``verify_checksum=False`` (what the checksum costs in this loop);
* ``LIMIT``: NIXL: one READ of the same record's bytes (claimed by a consumer, then abandoned) by a bare agent into a
  warm registered buffer; shm: a memcpy of the same size between warm buffers (fastest of torch ``copy_``, one
  ``memmove``, ``memmove`` in 256 KiB chunks).

Steady state: each case first runs ``k + 2`` untimed steps.  Each step publishes one record (not timed) and
times the fetch alone.  Printed: min / median / max per case, the ratio of medians to the limit (throughput,
higher is better; 1.0 is the limit) and the ratio of the minimums (on a loaded host the closest to each path's
own cost: the medians there mostly measure who else got the cores).

DataLoader (``--loader-records`` records of ``--size-mib``): ``DataLoader(HiddenStatesDataset.from_export(...,
layout="planes"), batch_size=None, num_workers=2)`` (prefetch_factor 2, default), and the same dataset iterated in
this process (``num_workers=0``).  The records are published first; the time runs from the first item to the last
(worker start-up excluded), so the ratio is ``(n - 1) x`` the limit's time over it.

Small records (``--small`` records of 4 KiB, ``--small-reps`` times): ``iter_records(batch=256)`` and
``iter_batches(max_records=256)`` against raw NIXL READs of the same ranges, 256 descriptors per request (NIXL)
or one C ``memmove`` per record (shm), from ``bench_export.bench_small``.

The machine's load average is printed at the start and end of each section: figures taken under load are marked
so; compare ratios (both sides of a ratio were measured interleaved), not absolute times.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_export as BE  # noqa: E402
import torch  # noqa: E402

from vllm_hs_compat.export import ExportConsumer, nixl_available  # noqa: E402

MiB = 1 << 20


def load() -> str:
    a, b, c = os.getloadavg()
    return f"load average {a:.2f} {b:.2f} {c:.2f} (cpus {os.cpu_count()})"


def check(rec: Any, nbytes: int) -> int:
    """What a careful loop does with a record before it asks for the next: shape, and one byte of every page
    (a record whose memory is not mapped, or was handed out twice, would show here or crash)."""
    t = rec.hidden_states
    if t.numel() * t.element_size() != nbytes:
        raise RuntimeError(f"record {rec.meta.record_id}: {t.numel() * t.element_size()} bytes, expected {nbytes}")
    return int(t.reshape(-1).view(torch.uint8)[::4096].sum())


class Case:
    """One loop: its own consumer, its own kept records."""

    def __init__(self, label: str, c: ExportConsumer, keep: int, copy: bool) -> None:
        self.label, self.c, self.keep, self.copy = label, c, keep, copy
        self.kept: collections.deque[Any] = collections.deque()
        self.times: list[float] = []
        self.errors: list[str] = []

    def step(self, rid: str, nbytes: int, timed: bool) -> None:
        c = self.c
        if self.keep == 0:  # drop what the loop kept before the next fetch
            self._drop(len(self.kept))
        t0 = time.perf_counter()
        try:
            rec = c.fetch(rid, copy=self.copy)
        except Exception as e:  # noqa: BLE001 - a loop that cannot go on is a figure too
            self.errors.append(f"{type(e).__name__}: {str(e)[:120]}")
            return
        dt = time.perf_counter() - t0
        if timed:
            self.times.append(dt)
        check(rec, nbytes)
        self.kept.append(rec)
        del rec
        self._drop(max(0, len(self.kept) - max(self.keep, 1)))

    def _drop(self, n: int) -> None:
        for _ in range(n):
            old = self.kept.popleft()
            if not self.copy:
                self.c.release(old)
            del old

    def close(self) -> None:
        self._drop(len(self.kept))
        self.c.close()


def bench_large(srv: BE.Server, backend: str, size: int, reps: int, only: set[str] | None = None) -> dict[str, Any]:
    ep = srv(op="start", name="U", backend=backend, num_slots=2 * (size // MiB) + 8, slot_bytes=MiB)

    def consumer(**kw: Any) -> ExportConsumer:
        return ExportConsumer(ep["endpoint"], ep["token"], **kw)

    cases = [Case(f"default K={k}", consumer(), k, True) for k in (0, 1, 2, 8)]
    cases += [Case(f"copy=False K={k}", consumer(), k, False) for k in (0, 2)]
    cases.append(Case("no-verify K=1", consumer(verify_checksum=False), 1, True))
    if only:
        for case in [c for c in cases if c.label not in only]:
            case.close()
        cases = [c for c in cases if c.label in only]
    claimer = consumer()
    raw = BE.RawNixl(claimer.hello["transport"], size) if backend == "nixl" else None
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    limit: list[float] = []
    seq = 0

    def publish() -> str:
        nonlocal seq
        seq += 1
        rid = f"u{seq}"
        srv(op="publish_large", name="U", size=size, id=rid)
        srv(op="drain", name="U")
        return rid

    def limit_step(timed: bool) -> None:
        if raw is not None:
            rid = publish()
            claim = claimer.claim(rid)
            t0 = time.perf_counter()
            raw.read([(claim.offset, 0, claim.nbytes)])
            dt = time.perf_counter() - t0
            claimer.abandon([claim])
        else:
            dt = BE._fastest_copy(dst, src)
        if timed:
            limit.append(dt)

    for case in cases:  # warm up: the steady state of each loop (its kept records in place)
        for _ in range(case.keep + 2):
            case.step(publish(), size, False)
    limit_step(False)
    for r in range(reps):
        order = cases[r % len(cases) :] + cases[: r % len(cases)]  # rotate who goes first
        for case in order:
            case.step(publish(), size, True)
            limit_step(True)
    out: dict[str, Any] = {"limit": limit}
    for case in cases:
        out[case.label] = {"times": case.times, "errors": case.errors, "stats": case.c.stats()}
        case.close()
    claimer.close()
    srv(op="stop")
    return out


class FreshTensors(torch.utils.data.IterableDataset[dict[str, Any]]):
    """The DataLoader's own floor: ``n`` fresh tensors of ``nbytes`` split over the workers, nothing read."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.n, self.nbytes = n, nbytes

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        k, w = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(k, self.n, w):
            yield {"record_id": str(i), "hidden_states": torch.ones(self.nbytes, dtype=torch.uint8)}


def _loader(ep: dict[str, Any] | None, backend: str, n: int, workers: int, size: int) -> tuple[float, int]:
    from torch.utils.data import DataLoader

    from vllm_hs_compat.trainer import HiddenStatesDataset

    ds: Any = FreshTensors(n, size)
    if ep is not None:
        ds = HiddenStatesDataset.from_export(
            ep["endpoint"],
            ep["token"],
            max_records=n,
            wait_s=10.0,
            layout="planes",
            consumer_kwargs={"backend": backend},
        )
    it: Any = iter(DataLoader(ds, batch_size=None, num_workers=workers)) if workers else iter(ds)
    first = next(it)
    del first
    t0 = time.perf_counter()
    got = 1
    for item in it:
        int(item["hidden_states"].reshape(-1).view(torch.uint8)[::4096].sum())
        got += 1
        del item
    return time.perf_counter() - t0, got


def bench_loader(srv: BE.Server, backend: str, size: int, n: int, reps: int, limit_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {k: [] for k in ("workers=2", "workers=0", "fresh tensors, workers=2")}
    for r in range(reps):  # interleaved: each repetition runs every case once
        for key in out:
            workers = 0 if key == "workers=0" else 2
            ep = None
            if not key.startswith("fresh"):
                name = f"D{workers}{r}"
                slots = (n + 1) * (size // MiB) + 8
                ep = srv(op="start", name=name, backend=backend, num_slots=slots, slot_bytes=MiB)
                for i in range(n):
                    srv(op="publish_large", name=name, size=size, id=f"{name}-{i}")
                srv(op="drain", name=name)
            dt, got = _loader(ep, backend, n, workers, size)
            if got != n:
                raise RuntimeError(f"DataLoader gave {got} of {n} records")
            out[key].append(dt / (n - 1))
            if ep is not None:
                srv(op="stop")
            gc.collect()
    out["limit_s"] = limit_s
    return out


def summary(xs: list[float]) -> tuple[float, float, float]:
    return min(xs), statistics.median(xs), max(xs)


def report_large(backend: str, size: int, r: dict[str, Any]) -> None:
    lim_label = "raw NIXL READ (bare agent)" if backend == "nixl" else "memcpy (warm, fastest of 3)"
    lim = statistics.median(r["limit"])
    reps = len(next(v["times"] for k, v in r.items() if k != "limit"))
    print(f"record of {size // MiB} MiB, {reps} interleaved repetitions: min / median / max ms, GB/s at the median")
    lo, md, hi = summary(r["limit"])
    label = "LIMIT " + lim_label
    print(f"  {label:<40} {lo * 1e3:8.2f} / {md * 1e3:8.2f} / {hi * 1e3:8.2f}  {size / lim / 1e9:6.2f} GB/s")
    for label, v in r.items():
        if label == "limit":
            continue
        if not v["times"]:
            print(f"  {label:<40} failed: {v['errors'][:1]}")
            continue
        lo, md, hi = summary(v["times"])
        errs = f"  ({len(v['errors'])} failed: {v['errors'][0]})" if v["errors"] else ""
        print(f"  {label:<40} {lo * 1e3:8.2f} / {md * 1e3:8.2f} / {hi * 1e3:8.2f}  {size / md / 1e9:6.2f} GB/s"
              f"  RATIO {lim / md:5.3f}x  (of mins {min(r['limit']) / lo:5.3f}x){errs}")  # fmt: skip


def bench_small_ab(srv: BE.Server, backend: str, n: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """``iter_records`` over ``n`` small records with the record path of before (each record read, verified and
    copied on its own: forced by making every claim look like mixed schemas) and of now (one batch, split),
    and ``iter_batches``, interleaved in one consumer: (wall, this process's CPU) us per record."""
    from vllm_hs_compat.export import consumer

    cm = getattr(consumer, "streams", consumer)  # where iter_records finds _same_schema (one module in older trees)
    ep = srv(op="start", name="A", backend=backend, num_slots=n + 64, slot_bytes=BE.SMALL_SLOT)
    c = ExportConsumer(ep["endpoint"], ep["token"], landing_bytes=BE.BATCH * BE.SMALL_SLOT * 4, timeout_s=60)
    real = cm._same_schema
    out: dict[str, list[tuple[float, float]]] = {"records, path before": [], "records, now": [], "batches": []}
    for r in range(rounds + 1):  # the first round warms up
        for mode in out:
            srv(op="publish_small", name="A", prefix=f"{r}{mode[:9]}", n=n)
            srv(op="drain", name="A")
            if mode == "records, path before":
                cm._same_schema = lambda a, b: False  # type: ignore[assignment]
            t0, p0, got = time.perf_counter(), time.process_time(), 0
            try:
                if mode == "batches":
                    for b in c.iter_batches(max_records=BE.BATCH, wait_s=1.0, idle_timeout_s=1.0):
                        got += len(b)
                        if got >= n:
                            break
                else:
                    for _rec in c.iter_records(batch=BE.BATCH, wait_s=1.0, idle_timeout_s=1.0):
                        got += 1
                        if got >= n:
                            break
            finally:
                cm._same_schema = real
            if got != n:
                raise RuntimeError(f"{mode}: {got} of {n} records")
            if r:
                out[mode].append(((time.perf_counter() - t0) / n * 1e6, (time.process_time() - p0) / n * 1e6))
    c.close()
    srv(op="stop")
    return out


def report_small(backend: str, runs: list[dict[str, float]], n: int) -> None:
    lim_key = "raw_small_batched_s" if backend == "nixl" else "memmove_small_loop_s"
    lim_label = "raw NIXL, 256 per request" if backend == "nixl" else "memmove, one per record"
    lim = statistics.median([run[lim_key] / n * 1e6 for run in runs])
    print(f"{n} records of 4 KiB, {len(runs)} runs: us per record min / median / max")
    for label, key in (
        ("LIMIT " + lim_label, lim_key),
        ("iter_records(batch=256)", "api_small_s"),
        ("iter_batches(max_records=256)", "api_batches_small_s"),
    ):
        lo, md, hi = summary([run[key] / n * 1e6 for run in runs])
        rs = "" if key == lim_key else f"  RATIO {lim / md:5.3f}x"
        print(f"  {label:<40} {lo:8.2f} / {md:8.2f} / {hi:8.2f}{rs}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--size-mib", type=int, default=64, choices=[m // MiB for m in BE.SIZES])
    ap.add_argument("--backends", default="nixl,shm")
    ap.add_argument("--small", type=int, default=10_000)
    ap.add_argument("--small-reps", type=int, default=2)
    ap.add_argument("--loader-records", type=int, default=6)
    ap.add_argument("--loader-reps", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: large, loader, small")
    ap.add_argument("--cases", default="", help="comma list of large-record loops to run (default: all)")
    ap.add_argument("--json", help="also write the raw figures to this file")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    size = a.size_mib * MiB
    results: dict[str, Any] = {"load_start": os.getloadavg()}
    print(f"bench_user_loops: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {load()}")
    for backend in a.backends.split(","):
        if backend == "nixl" and not nixl_available():
            print("nixl not importable: skipping the NIXL backend")
            continue
        res: dict[str, Any] = {}
        print(f"\n=== backend: {backend} === {load()}")
        srv = BE.Server()
        try:
            limit_s = 0.0
            if "large" not in skip:
                only = {x.strip() for x in a.cases.split(",") if x.strip()} or None
                res["large"] = bench_large(srv, backend, size, a.reps, only)
                report_large(backend, size, res["large"])
                limit_s = statistics.median(res["large"]["limit"])
                print(f"  ({load()})")
            if "loader" not in skip and limit_s:
                res["loader"] = bench_loader(srv, backend, size, a.loader_records, a.loader_reps, limit_s)
                print(f"DataLoader over {a.loader_records} records of {size // MiB} MiB (ms per item, first to last;"
                      " RATIO: to the limit above)")  # fmt: skip
                for k in ("workers=2", "workers=0", "fresh tensors, workers=2"):
                    lo, md, hi = summary(res["loader"][k])
                    label = ("FLOOR DataLoader IPC: " if k.startswith("fresh") else "HiddenStatesDataset ") + k
                    print(f"  {label:<48} {lo * 1e3:8.2f} / {md * 1e3:8.2f} / {hi * 1e3:8.2f}"
                          f"  RATIO {limit_s / md:5.3f}x")  # fmt: skip
                print(f"  ({load()})")
            if "small" not in skip:
                runs = []
                for _ in range(a.small_reps):
                    runs.append(BE.bench_small(srv, backend, a.small))
                    srv(op="stop")
                res["small"] = runs
                report_small(backend, runs, a.small)
                from vllm_hs_compat.export import consumer as cm

                if hasattr(getattr(cm, "streams", cm), "_records_of"):  # both record paths: compare them in one run
                    ab = bench_small_ab(srv, backend, a.small // 2, 3)
                    res["small_ab"] = ab
                    print(f"{a.small // 2} records of 4 KiB, both iter_records paths and iter_batches interleaved in"
                          " one consumer, 3 rounds:")  # fmt: skip
                    print("  us per record, min / median / max (wall; this process's CPU)")
                    for mode, xs in ab.items():
                        w = summary([x[0] for x in xs])
                        u = summary([x[1] for x in xs])
                        print(f"  {mode:<40} {w[0]:6.1f} / {w[1]:6.1f} / {w[2]:6.1f}   CPU {u[0]:6.1f} / {u[1]:6.1f} / "
                              f"{u[2]:6.1f}")  # fmt: skip
                print(f"  ({load()})")
        finally:
            srv.close()
        results[backend] = res
    results["load_end"] = os.getloadavg()
    print(f"\nend: {load()}  (figures measured under this load; compare ratios)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
