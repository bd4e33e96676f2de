"""Files a kill leaves whole: atomic writes, fsync and syncfs, the rank lock, and the store's test hooks.

Everything the capture tree writes that a reader may trust goes through here: :func:`write_atomic` (a temporary
name in the same folder, renamed into place; fsynced first when asked), :func:`fsync_path` and :func:`syncfs` (the
record files an index part names reach the disk before the part), and :class:`RankLock` (``index/rank-R.lock``,
held with flock while a rank runs).

The test hooks live here too, so that one switch turns the whole tree's safety off: ``_KILL_AT`` kills this
process at a named point, ``_UNSAFE`` writes in place and skips recovery (the negative control of the kill-and-resume
tests).  Only tests/capture/store_driver.py sets them, in its own process.

Pure Python (the standard library only).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections import Counter
from pathlib import Path

# --- test hooks (tests/capture/store_driver.py sets them in its own process; nothing else does) ----------------
#: ``(point, n)``: SIGKILL this process the n-th time ``point`` is reached (points: "adopt.after_tensors",
#: "adopt.after_manifest", "adopt.after_journal", "index.mid_write", "index.before_rename").
_KILL_AT: tuple[str, int] | None = None
#: True turns the safety off (index parts and manifests written in place, no recovery at start): the negative
#: control of the kill-and-resume test, which must then find duplicates or half records.
_UNSAFE: bool = False
_hits: Counter[str] = Counter()


def point(name: str) -> None:
    """A named point of the store's writes: where ``_KILL_AT`` kills this process (a no-op otherwise)."""
    if _KILL_AT is not None and _KILL_AT[0] == name:
        _hits[name] += 1
        if _hits[name] >= _KILL_AT[1]:
            os.kill(os.getpid(), signal.SIGKILL)


def unsafe() -> bool:
    """True while a test has turned the safety off (``_UNSAFE``)."""
    return _UNSAFE


# --- writes -------------------------------------------------------------------------------------------------------
def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file or a folder by its path (quietly nothing where it cannot be opened, or the file system refuses
    fsync on folders)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def syncfs(path: Path) -> bool:
    """Flush the file system holding ``path`` (Linux ``syncfs``: one call instead of an fsync per record file,
    measured 450 ms against 2.2 s for 500 files of 64 KiB); False where it is not available."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return bool(fn(fd) == 0)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, tag: str, durable: bool = False) -> None:
    """Write ``data`` to ``path`` through the temporary name ``.<name>.<tag>.tmp`` in the same folder (fsynced
    first when ``durable``).  ``tag`` names the writer (``rank-R``): only that rank writes, and cleans, its
    temporary files."""
    if _UNSAFE:
        path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.{tag}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_path(path.parent, directory=True)


class RankLock:
    """``index/rank-R.lock`` held with flock while a rank runs (or while another process recovers its leftovers).
    Where the file system has no flock, nothing is held and ``works`` is False."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.works = True

    def acquire(self) -> bool:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                self.works = False
                return True
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def holder(self) -> str:
        with contextlib.suppress(OSError):
            return self.path.read_text().strip() or "?"
        return "?"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None
