"""Run the selected nox sessions in N concurrent streams (``scripts/test --full`` runs the release matrix in two).

    python ci/nox_streams.py --jobs 2 -s lint vllm [-- PYTEST ARGS]

A vLLM release session is one process at a time, mostly on one core (venv creation and wheel linking, then pytest
with torch on one thread), so on the 2-core CI machine two sessions side by side take about the time of one.  The
sessions (as ``nox -l --json`` lists them for the selection) are dealt to the streams longest first by a rough cost
(era boundaries run twice the schedules; releases with both model runners, 0.29-0.33, run both scheduler modes).
Each stream is one ``nox -s ...`` process, its lines prefixed with the stream's number and the seconds since the
start.  Every session runs whatever another stream does; the exit status is 1 when any stream failed.  ``--jobs 1``
is one plain ``nox`` over the selection.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

#: Releases from here on run both scheduler modes (V1 and Model Runner V2) in tests/vllm: twice the schedules...
V2_FROM = (0, 29)
#: ... until Model Runner V1 was deleted (0.34): one mode again.
V1_UNTIL = (0, 34)


def _release(call_spec: dict[str, object]) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(call_spec.get("release", "")).split("."))
    except ValueError:
        return ()


def cost(entry: dict[str, object]) -> float:
    """A rough relative cost, for balancing only (a wrong guess costs wall time, never a session)."""
    spec = entry.get("call_spec")
    if not isinstance(spec, dict) or "release" not in spec:
        return 1.0
    tags = entry.get("tags")
    schedules = 2.0 if isinstance(tags, list) and "boundary" in tags else 1.0
    modes = 2.0 if V2_FROM <= _release(spec) < V1_UNTIL else 1.0
    return 1.0 + schedules * modes


def deal(entries: list[dict[str, object]], jobs: int) -> list[list[str]]:
    """Longest first onto the least loaded stream; each stream keeps the listed order."""
    order = {str(e["session"]): i for i, e in enumerate(entries)}
    loads = [0.0] * jobs
    streams: list[list[str]] = [[] for _ in range(jobs)]
    for e in sorted(entries, key=cost, reverse=True):
        k = loads.index(min(loads))
        loads[k] += cost(e)
        streams[k].append(str(e["session"]))
    return [sorted(s, key=order.__getitem__) for s in streams if s]


def _pump(k: int, proc: subprocess.Popen[str], lock: threading.Lock, t0: float) -> None:
    """Each line of stream ``k`` with the seconds since the streams started (the log's per-session timings)."""
    for line in proc.stdout or ():
        with lock:
            sys.stdout.write(f"[stream {k} {time.monotonic() - t0:5.0f}s] {line}")
            sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--nox", default="nox")
    args, selection = ap.parse_known_args(argv)
    posargs: list[str] = []
    if "--" in selection:  # `... -s vllm -- --durations=30`: pytest arguments for every session
        cut = selection.index("--")
        selection, posargs = selection[:cut], selection[cut:]
    listed = subprocess.run([args.nox, "-l", "--json", *selection], capture_output=True, text=True, check=False)
    if listed.returncode != 0:
        sys.stderr.write(listed.stdout + listed.stderr)
        return listed.returncode or 1
    entries = json.loads(listed.stdout)
    if not entries:
        print(f"nox_streams: no session matches {selection}", file=sys.stderr)
        return 1
    if args.jobs <= 1:
        return subprocess.run([args.nox, *selection, *posargs], check=False).returncode
    streams = deal(entries, args.jobs)
    lock = threading.Lock()
    procs = []
    t0 = time.monotonic()
    for k, names in enumerate(streams, 1):
        with lock:
            print(f"[stream {k}] nox -s {' '.join(names)}", flush=True)
        proc = subprocess.Popen(
            [args.nox, "-s", *names, *posargs], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        pump = threading.Thread(target=_pump, args=(k, proc, lock, t0), daemon=True)
        pump.start()
        procs.append((k, proc, pump))
    failed = []
    for k, proc, pump in procs:
        rc = proc.wait()
        pump.join()
        with lock:
            print(f"[stream {k}] exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(k)
    if failed:
        print(f"nox_streams: stream(s) {failed} failed (each stream's own nox summary above names the sessions)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
