"""Markdown tables (min / median / max over runs) from ``bench_gather.py --json`` files.

python benchmarks/summarize_capture.py benchmarks/results/capture_h200_2026-12-01/run*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def fmt(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f} / {max(values):.{digits}f}"


def main(paths: list[str]) -> None:
    ratios: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    limits: dict[tuple[str, str], list[float]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for r in json.load(f):
                key = (r["kind"], r["case"])
                if r["kind"] == "issue":
                    ratios[key][r["variant"]].append(r["us_per_request"])
                    continue
                ratios[key][r["variant"]].append(r["ratio_median"])
                if r["variant"] == "before" or not limits[key] or len(limits[key]) < len(paths):
                    if r["variant"] in ("before", "after", "staged", "api") and len(limits[key]) < len(paths):
                        limits[key].append(r["bytes"] / r["limit_median_s"] / 1e9)
    for kind, title, variants in [
        ("gather", "Device gather vs a contiguous device copy", ["before", "after", "index_select"]),
        (
            "host",
            "One request to host vs a contiguous D2H",
            ["before", "api", "api-general", "staged", "direct", "floor"],
        ),  # noqa: E501
        ("step", "One step's batch to host vs one contiguous D2H", ["before", "staged", "direct"]),
        ("issue", "Host-side issue time per request (us)", ["before", "staged", "direct"]),
    ]:
        print(f"\n{title} ({len(paths)} runs: min / median / max of each run's median ratio)\n")
        head = "| case | limit GB/s | " + " | ".join(variants) + " |"
        if kind == "issue":
            head = "| case | " + " | ".join(variants) + " |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for (k, case), per in ratios.items():
            if k != kind:
                continue
            cells = [fmt(per[v], 1 if kind == "issue" else 2) if v in per else "-" for v in variants]
            if kind == "issue":
                print(f"| {case} | " + " | ".join(cells) + " |")
            else:
                print(f"| {case} | {statistics.median(limits[(k, case)]):.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
