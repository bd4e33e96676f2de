"""What the control plane's gate costs (not a test): control round trips through the gate against the same
requests served in-process by the control server of an earlier revision, side by side in one run.

UCX_NET_DEVICES=lo python benchmarks/bench_control_gate.py [--iters 2000] [--baseline-rev e1a3ae8]

The serving side runs in a second process (this script with ``--serve``): one ``ExportProducer`` (shm; its
control plane through its gate, the default) and, on a second port, the baseline revision's ``ControlServer``
(the public socket in the serving process, no gate) loaded from ``git show <rev>:vllm_hs_compat/export/
control.py`` and answering with the same producer's handler.  The client side runs here: one trainer consumer
per endpoint (and a third on the gate's endpoint that moves to the producer's direct socket, the trainer's path
past the gate), and per iteration, alternating the three: a ``ping``, a ``claim`` of one small record (its
``abandon`` untimed) and a ``fetch`` of another (claim + shm read + release).  Medians and 90th percentiles.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch  # noqa: E402

from vllm_hs_compat.core.records import RecordMeta  # noqa: E402
from vllm_hs_compat.export import ExportConsumer, ExportProducer  # noqa: E402
from vllm_hs_compat.export import protocol as P  # noqa: E402

TOKEN = "b" * 40
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _baseline_server_class(rev: str) -> Any:
    src = subprocess.run(
        ["git", "-C", ROOT, "show", f"{rev}:vllm_hs_compat/export/control.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="hsx-bench-"), "baseline_control.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("baseline_control", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["baseline_control"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.ControlServer


def serve(rev: str, n: int) -> None:
    p = ExportProducer(backend="shm", num_slots=8 * n + 64, slot_bytes=4096, token=TOKEN)
    old = _baseline_server_class(rev)(p._handle, TOKEN, producer=p.instance)
    rows = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    for prefix in ("gc", "gf", "dc", "df", "bc", "bf"):
        for i in range(n):
            p.publish(RecordMeta.for_tensor(f"{prefix}{i}", rows, [0], [1], True), rows)
    print(json.dumps({"gate": p.endpoint, "baseline": old.endpoint}), flush=True)
    sys.stdin.readline()
    old.close()
    p.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--baseline-rev", default="e1a3ae8")
    ap.add_argument("--serve", action="store_true")
    args = ap.parse_args()
    if args.serve:
        serve(args.baseline_rev, args.iters)
        return
    srv = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--iters", str(args.iters), "--baseline-rev", args.baseline_rev],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert srv.stdout is not None and srv.stdin is not None
    ends = json.loads(srv.stdout.readline())
    consumers = {
        k: ExportConsumer(ends[e], TOKEN, landing_bytes=1 << 20, timeout_s=30, direct=k == "direct")
        for k, e in (("gate", "gate"), ("direct", "gate"), ("baseline", "baseline"))
    }
    assert consumers["direct"].direct and not consumers["gate"].direct
    times: dict[str, list[float]] = {f"{k}_{op}": [] for k in consumers for op in ("ping", "claim", "fetch")}
    gate = int(consumers["gate"].remote_stats()["control_gate_pid"])
    cpu0, forwarded0 = _cpu_s(gate), consumers["gate"].remote_stats()["control_forwarded"]
    for i in range(args.iters):
        for k, c in consumers.items():
            t0 = time.perf_counter()
            c._session.call(P.PingReq())
            t1 = time.perf_counter()
            claim = c.claim(f"{k[0]}c{i}")
            t2 = time.perf_counter()
            c.abandon([claim])
            t3 = time.perf_counter()
            c.fetch(f"{k[0]}f{i}")
            t4 = time.perf_counter()
            times[f"{k}_ping"].append(t1 - t0)
            times[f"{k}_claim"].append(t2 - t1)
            times[f"{k}_fetch"].append(t4 - t3)
    cpu1, forwarded1 = _cpu_s(gate), consumers["gate"].remote_stats()["control_forwarded"]
    for c in consumers.values():
        c.close()
    srv.stdin.write("\n")
    srv.stdin.flush()
    srv.wait(30)
    print(f"{args.iters} iterations, alternating; microseconds, median (p90)")
    print(
        f"{'':8}{'in-process (' + args.baseline_rev + ')':>26}{'through the gate':>26}{'direct (trainer)':>26}"
        f"{'gate extra':>12}{'direct extra':>14}"
    )
    for op in ("ping", "claim", "fetch"):
        row = []
        for k in ("baseline", "gate", "direct"):
            xs = sorted(times[f"{k}_{op}"])
            row.append((statistics.median(xs) * 1e6, xs[int(0.9 * len(xs))] * 1e6))
        cells = "".join(f"{m:>16.0f} ({p90:>6.0f})" for m, p90 in row)
        print(f"{op:8}{cells}{row[1][0] - row[0][0]:>+12.0f}{row[2][0] - row[0][0]:>+14.0f}")
    per = (cpu1 - cpu0) / max(1, forwarded1 - forwarded0) * 1e6
    print(f"the gate's CPU time per request and its reply: {per:.0f} us ({forwarded1 - forwarded0} requests)")
    print(f"host load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
