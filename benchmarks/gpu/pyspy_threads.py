"""Where each thread's time goes in a py-spy recording (``bench_gpu.py --pyspy``; docs/gpu.md).

Reads py-spy's raw output of ``py-spy record --native --idle --threads`` (one line per distinct stack: its frames,
root first, and how many samples had it) and sorts each thread's samples by what its innermost frames were doing:

* ``python``  -- a Python frame innermost: the thread holds the interpreter and runs bytecode;
* ``gil``     -- Python frames, then only the interpreter's and libc's native frames ending in a condition-variable
  wait: the interpreter's lock (CPython's ``take_gil`` waits on a condition variable; its own symbol is stripped);
* ``lock``    -- a semaphore wait: ``threading.Lock``, ``Queue.get``, ``Event.wait``, multiprocessing's locks;
* ``cuda``    -- a frame of the CUDA driver or runtime inside: a launch, a copy's issue or a wait for the device;
* ``io``      -- a file system call (write, read, open, fsync, rename, ...); ``sleep``, ``poll`` likewise;
* ``native:LIB`` -- anything else, named by the innermost frame's library (torch's CPU code, numpy, ...).

    python benchmarks/gpu/pyspy_threads.py OUT/1b-capture.pyspy.txt [--rate 50] [--top 6]

Threads of one pool (``capture-check_0``, ``hs-compat-publish-2``) are summed under the pool's name.  The samples
are wall time: a thread idle in a wait is counted as much as one running.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

_PY = re.compile(r"\((?:.*\.py|<[^>]+>):\d+\)$")  # "func (file.py:12)", "<module> (<frozen x>:3)"
_LIB = re.compile(r"\(([^()]*)\)$")
_GIL = re.compile(r"gil|RestoreThread|SuspendAttach", re.IGNORECASE)  # take_gil, PyGILState_*, pyo3's re-attach
_SEMAPHORE = ("sem_wait", "sem_timedwait", "sem_clockwait")  # threading's locks (multiprocessing's: semaphore.c)
_SLEEP = ("sleep",)  # nanosleep, clock_nanosleep, time.sleep
_POLL = ("poll", "select", "recv", "accept", "waitpid", "wait4")  # epoll_wait, pselect, os.waitpid
_IO = ("write", "pwrite", "writev", "read", "pread", "open", "fsync", "fdatasync", "rename", "unlink", "close",
       "ftruncate", "fallocate", "mmap", "munmap", "madvise", "copy_file_range", "sendfile", "syncfs")  # fmt: skip


def _lib(frame: str) -> str:
    m = _LIB.search(frame)
    return m.group(1) if m else ""


def _name(frame: str) -> str:
    return frame.split(" (", 1)[0].lstrip("_")


def _interp(frame: str) -> bool:
    """A frame of the interpreter itself (its library, its binary, or a Python frame)."""
    lib = _lib(frame)
    return bool(_PY.search(frame)) or lib.startswith(("libpython", "python")) or bool(_GIL.search(_name(frame)))


def classify(frames: list[str]) -> tuple[str, str]:
    """(category, the innermost Python frame) of one sample's frames, root first."""
    last = max((i for i, f in enumerate(frames) if _PY.search(f)), default=-1)
    where = frames[last] if last >= 0 else "(no Python frame)"
    tail = frames[last:] if last >= 0 else frames
    names = [_name(f) for f in tail]
    libs = [_lib(f) for f in tail]
    if len(tail) <= 1 and last >= 0:
        return "python", where
    for i in range(1, len(tail)):  # a condition wait called by the interpreter or a GIL re-take: the GIL
        if names[i].startswith("pthread_cond") and _interp(tail[i - 1]):
            return "gil", where
    waits = zip(names, libs, strict=True)
    if any("acquire_lock" in n or n.startswith(_SEMAPHORE) or "semaphore" in x for n, x in waits):
        return "lock", where
    if any("libcuda" in x or "libcudart" in x for x in libs):
        return "cuda", where
    for cat, keys in (("sleep", _SLEEP), ("poll", _POLL)):
        if any(k in n for n in names[1:] for k in keys):
            return cat, where
    if any(n.rstrip("64").startswith(_IO) and x.startswith("libc") for n, x in zip(names, libs, strict=True)):
        return "io", where
    inner = next((f for f in reversed(tail[1:]) if not _lib(f).startswith(("libc", "libpthread"))), tail[-1])
    if _interp(inner):
        return "python", where
    return f"native:{_lib(inner).split('.so')[0] or '?'}", where


def _thread(parts: list[str]) -> tuple[str, int]:
    """(process/thread label, index of the first frame) of one stack: a pool's threads share one label."""
    procs: list[str] = []
    for i, p in enumerate(parts):
        if p.startswith("process "):
            procs.append(p.split(":", 1)[0])
            continue
        if p.startswith("thread ("):
            name = p.split(":", 1)[1].strip() if ":" in p else "(unnamed)"
            name = re.sub(r"[-_]\d+$", "", name)
            return " / ".join([*procs[1:], name]) if procs else name, i + 1
    return "(no thread)", 0


def summarize(path: Path, rate: float, top: int) -> list[str]:
    per: dict[str, Counter[str]] = defaultdict(Counter)
    spots: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        label, first = _thread(parts)
        cat, where = classify(parts[first:])
        per[label][cat] += int(count)
        spots[label][(cat, where)] += int(count)
    lines = []
    for label, cats in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(cats.values())
        share = ", ".join(f"{c} {n / total:.0%}" for c, n in cats.most_common() if n / total >= 0.01)
        lines.append(f"{label}: {total / rate:.1f} s sampled -- {share}")
        for (cat, where), n in spots[label].most_common(top):
            lines.append(f"    {n / rate:6.2f} s  {cat:<12} {where}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--rate", type=float, default=50.0, help="the recording's samples per second")
    ap.add_argument("--top", type=int, default=6, help="innermost Python frames listed per thread")
    a = ap.parse_args(argv)
    print("\n".join(summarize(a.raw, a.rate, a.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
