"""Write docs/compatibility.md from the reports of a `nox -s vllm` run.

Usage: python3 ci/compat_report.py REPORTS_DIR OUTPUT_MD
Reads reports/junit-<release>.xml (pytest) and reports/doctor-<release>.json (vllm-hs-compat doctor --json).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from packaging.version import Version


def main(reports: Path, out: Path) -> int:
    rows = []
    for junit in sorted(reports.glob("junit-*.xml"), key=lambda p: Version(p.stem.split("-", 1)[1])):
        release = junit.stem.split("-", 1)[1]
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is None:
            continue
        total = int(suite.get("tests", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        passed = total - failed - skipped
        stamp = suite.get("timestamp", "")[:10] or dt.date.fromtimestamp(junit.stat().st_mtime).isoformat()
        secs = float(suite.get("time", 0.0))
        doctor_path = reports / f"doctor-{release}.json"
        adapter, probes = "?", "?"
        if doctor_path.exists():
            text = doctor_path.read_text()
            doc = json.loads(text[text.find("{") :])  # tolerate log lines written before the report
            adapter = doc.get("adapter", "?")
            plist = doc.get("probes", [])
            probes = f"{sum(p['ok'] for p in plist)}/{len(plist)}"
        result = "pass" if failed == 0 and passed > 0 else "FAIL"
        cells = [release, adapter, probes, passed, failed, skipped, f"{secs:.0f} s", result, stamp]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    if not rows:
        print(f"no junit reports under {reports}; run `nox -s vllm` first", file=sys.stderr)
        return 1
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=out.parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    text = [
        "# Compatibility matrix",
        "",
        "Each row is one nox session: vLLM's upstream wheel of that release installed onto the CPU torch",
        "(without its CUDA stack), then `tests/vllm` run against vLLM's own grouping, scheduler-config",
        "flattening, view allocation, slot mapping and cache writer (dense, MLA and hybrid+HMA verifiers,",
        "kernel-split views, LBHNC on 0.29+), read back through this package from the worker and scheduler",
        "views and compared bit for bit. Probes: feature probes that confirmed the adapter (`vllm-hs-compat doctor`).",
        "",
        "Regenerate: `scripts/test --full` (or `nox -s vllm` then `nox -s compat_report`).",
        f"Generated at commit `{commit}` on {dt.date.today().isoformat()}.",
        "",
        "| vLLM | adapter | probes ok | passed | failed | skipped | pytest time | result | date |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    out.write_text("\n".join(text))
    print(f"wrote {out} ({len(rows)} releases)")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
