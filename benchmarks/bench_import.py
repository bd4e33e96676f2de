"""Import benchmark (not a test): what ``import vllm_hs_compat`` (with ``api`` and ``export``) costs over torch.

python benchmarks/bench_import.py [--runs 9] [--src DIR]

Each run is a fresh interpreter that imports torch, then the package; printed: min / median / max over the runs
of the time the package took after torch, then the same plus the first use of the export classes (which loads
ZeroMQ and msgspec), and whether any vLLM module was imported (never: the adapters import vLLM on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CODE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import vllm_hs_compat, vllm_hs_compat.api, vllm_hs_compat.export
t2 = time.perf_counter()
vllm = any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
from vllm_hs_compat.export import ExportConsumer, ExportProducer, ExportTicket
t3 = time.perf_counter()
vllm = vllm or any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
print(json.dumps({"torch": t1 - t0, "package": t2 - t1, "with_export_classes": t3 - t1, "vllm_imported": vllm}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--src", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": a.src}
    rows = []
    for _ in range(a.runs):
        out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, cwd="/", check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for key, label in (
        ("torch", "import torch"),
        ("package", "import vllm_hs_compat + .api + .export, over torch"),
        ("with_export_classes", "... and first use of ExportConsumer/ExportProducer/ExportTicket"),
    ):
        xs = sorted(r[key] * 1e3 for r in rows)
        print(f"{label:<66} min {xs[0]:7.1f}  median {statistics.median(xs):7.1f}  max {xs[-1]:7.1f} ms")
    print(f"vLLM module imported: {any(r['vllm_imported'] for r in rows)} (runs: {a.runs})")


if __name__ == "__main__":
    main()
