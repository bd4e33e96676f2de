"""Embedded default transport: the pool is a file in ``/dev/shm`` mapped by the producer (read-write) and by
same-host consumers (read-only).  Slots, leases and releases follow the same protocol as NIXL (releases travel
over the control plane on both).

Why a plain file and not ``multiprocessing.shared_memory``: on Python 3.11 every process that *attaches* to
a ``SharedMemory`` registers it with its resource tracker, which unlinks the segment when that process
exits, so a trainer finishing would delete the producer's pool.  A file opened with ``os.open`` + ``mmap``
is never tracked. Files are created ``0600`` (same user only) and named ``hsx2-<pid>-<instance>.pool``.

Ownership survives containers: the producer holds an exclusive ``flock`` on its file for as long as it lives
(the lock is taken on a temporary name, before the file is renamed into place, so it is never visible
unlocked).  The kernel drops the lock when the process dies, SIGKILL included.  On start a producer removes the
files whose lock it can take: their owner is dead.  Anyone can create names in ``/dev/shm``, so the sweep (and a
consumer's attach) opens only this user's regular files: never through a link, never blocking on a FIFO (see
:data:`SAFE_OPEN_FLAGS`); anything else under the pattern is left alone and counted.  The pid in the name is
for people only; it is never used to decide liveness, because DP ranks in sibling containers that share
``/dev/shm`` live in other pid namespaces, where a live producer's pid means nothing (or another process).
The ``hsx2-`` prefix keeps producers of the earlier release (``hsx-<pid>-...``, no lock) and this one out of
each other's sweeps.

That named file is handoff ``"path"``.  The default, handoff ``"fd"``, never gives the pool a name: it is created
``O_TMPFILE`` in the shm directory (counted against that tmpfs, as the named file was; ``memfd_create`` where the
directory cannot make unnamed files), so the kernel frees it when the last process holding it goes, SIGKILL of
everyone included, and nothing is left for a sweep.  A consumer gets a read-only descriptor of it over an abstract
Unix socket (no file either; gone with the producer), after proving it is this user (``SO_PEERCRED``) and that
the control plane admitted it as the trainer (the ``key`` only the trainer's ``hello`` carries, over CURVE); the
consumer checks the socket's owner before it sends the key and the descriptor (``fstat``) before it maps it.
See docs/export.md, "Shared memory".
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.checksums import ChecksumState, byte_view
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.transport import REGION_SHIFT, LandingRegions, host_buffer

log = logging.getLogger(__name__)

DEFAULT_SHM_DIR: Final = "/dev/shm"
#: A verified copy (``read_checked``) goes in pieces of this many bytes, each checksummed right after its copy
#: while it is still in cache (quiet 2-vCPU VM, 64 MiB: 8.2 ms this way against 9.9 ms for the copy, then a
#: checksum pass; the copy alone 5.2 ms).
COPY_CHUNK_BYTES: Final = 1 << 20
#: Ranges (and pieces) up to this size are copied by a buffer slice assignment (one C memcpy, no tensor op);
#: larger ones by ``ctypes.memmove`` (one C memmove without the GIL).  Not torch's ``copy_``: its intra-op
#: threads wait for each other at every copy, and on a busy host (a trainer's, or the 2-vCPU VM at load 4) a
#: 64 MiB copy in 4 MiB pieces took 230-350 ms that way against 14-30 ms single-threaded.
SMALL_COPY_BYTES: Final = 64 << 10
_NAME_RE: Final = re.compile(r"^hsx2-(\d+)-([0-9a-f]{8,64})\.pool$")
_TMP_RE: Final = re.compile(r"^\.hsx2-([0-9a-f]{8,64})\.tmp$")


#: How every name in the shm directory is opened: never through a link, never blocking (opening a FIFO for
#: reading waits for a writer, forever), never inherited by a child.  What opens is then checked on the open
#: descriptor (:func:`_untrusted`), so swapping the name between the check and the use gains nothing.
SAFE_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return f"file of type {stat.S_IFMT(mode):#o}"


def _untrusted(st: os.stat_result) -> str | None:
    """Why a file in the shm directory is not one of this user's pool files (None when it may be one): it must
    be a regular file owned by the effective uid."""
    if not stat.S_ISREG(st.st_mode):
        return f"a {_kind(st.st_mode)}, not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    return None


@dataclasses.dataclass
class SweepResult:
    """What a start-up sweep did: pool files of dead producers removed, names it left alone because they are not
    this user's regular files (FIFOs, links, directories, sockets, other users' files: counted, never opened
    for blocking, followed or unlinked)."""

    removed: int = 0
    skipped: int = 0


def _sweep_dead(shm_dir: str) -> SweepResult:
    """Remove pool files whose owner is dead: this user's regular files whose ``flock`` can be taken."""
    out = SweepResult()
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return out
    for name in names:
        if not (_NAME_RE.match(name) or _TMP_RE.match(name)):
            continue
        path = os.path.join(shm_dir, name)
        try:  # a first look without opening: FIFOs, devices, links and others' files are never opened at all
            why = _untrusted(os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            continue
        except OSError as e:
            why = f"not inspectable ({e.strerror})"
        if why is None:
            try:
                fd = os.open(path, SAFE_OPEN_FLAGS)
            except FileNotFoundError:
                continue  # gone already
            except OSError as e:  # swapped for a link (ELOOP), a socket (ENXIO), unreadable (EACCES)
                why = f"not openable ({e.strerror})"
        if why is not None:
            out.skipped += 1
            log.debug("stale-pool sweep: left %s alone: %s", path, why)
            continue
        try:
            why = _untrusted(os.fstat(fd))  # the name may have been swapped after the first look
            if why is not None:
                out.skipped += 1
                log.debug("stale-pool sweep: left %s alone: %s", path, why)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # locked: its producer is alive, in whatever pid namespace
            # The lock is ours, so its owner is gone.  Unlink only if the name still points at this file.
            try:
                st, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
                if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                    os.unlink(path)
                    out.removed += 1
            except OSError:
                pass
        finally:
            os.close(fd)
    return out


#: How consumers reach the pool: ``"fd"`` (an unnamed file, its descriptor handed over a Unix socket; nothing is
#: ever left in the shm directory) or ``"path"`` (the named ``hsx2-<pid>-<instance>.pool`` file; consumers may run
#: in another network namespace that shares the directory).
SHM_HANDOFFS: Final = ("fd", "path")
#: What a consumer sends on the handoff socket: this magic, then the key of the trainer's ``hello``.
HANDOFF_MAGIC: Final = b"HSX2FD1\n"
HANDOFF_KEY_BYTES: Final = 32
#: How long the producer waits for a handoff connection's key (one that sends nothing is dropped after it).
HANDOFF_TIMEOUT_S: Final = 2.0
#: How long a consumer waits for its descriptor: longer than the producer's bound on each connection served before
#: it (connections are served one at a time).
HANDOFF_WAIT_S: Final = 10.0
_OK: Final = b"OK"
_CRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _peer_uid(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket (as the kernel recorded them)."""
    pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _unnamed_file(shm_dir: str, instance: str) -> tuple[int, str]:
    """A new read-write file with no name: ``O_TMPFILE`` in ``shm_dir`` (that tmpfs's size limit applies), else
    ``memfd_create``.  Returns the descriptor and how it was made (for the log)."""
    try:
        return os.open(shm_dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600), f"O_TMPFILE in {shm_dir}"
    except OSError as e:  # a filesystem without O_TMPFILE (EOPNOTSUPP), an old kernel (EISDIR/EINVAL)
        why = e.strerror
    fd = os.memfd_create(f"hsx2-{instance}", os.MFD_CLOEXEC)
    os.fchmod(fd, 0o600)
    return fd, f"memfd_create ({shm_dir} makes no unnamed files: {why}; the pool is not counted against it)"


class _Handoff:
    """The producer's end of the descriptor handoff: an abstract Unix socket served by one thread.

    A connection gets the read-only pool descriptor only if its peer runs as this user (``SO_PEERCRED``, checked
    before anything is read) and sends :data:`HANDOFF_MAGIC` + the key (compared in constant time); anything else
    is closed without an answer and counted.  One connection at a time, each bounded by
    :data:`HANDOFF_TIMEOUT_S`."""

    def __init__(self, fd: int, instance: str) -> None:
        self.key = secrets.token_bytes(HANDOFF_KEY_BYTES)
        self.name = f"hsx2-{instance}-{secrets.token_hex(8)}"
        self.counters = {"shm_handoffs": 0, "shm_handoffs_refused": 0}
        self._fd = fd
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind("\0" + self.name)
            self._sock.listen(64)
            self._sock.settimeout(0.25)
        except BaseException:
            self._sock.close()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hsx-shm-handoff", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)  # EMFILE and the like: try again later, never spin
                continue
            try:
                self._one(conn)
            except OSError as e:
                self.counters["shm_handoffs_refused"] += 1
                log.debug("shm handoff: connection failed: %s", e)
            finally:
                conn.close()

    def _one(self, conn: socket.socket) -> None:
        pid, uid = _peer_uid(conn)
        if uid != os.geteuid():
            self.counters["shm_handoffs_refused"] += 1
            log.info("shm handoff: refused pid %d of uid %d (this producer's uid is %d)", pid, uid, os.geteuid())
            return
        conn.settimeout(HANDOFF_TIMEOUT_S)
        want = len(HANDOFF_MAGIC) + HANDOFF_KEY_BYTES
        got = b""
        while len(got) < want:
            part = conn.recv(want - len(got))
            if not part:
                break
            got += part
        if len(got) != want or not secrets.compare_digest(got, HANDOFF_MAGIC + self.key):
            self.counters["shm_handoffs_refused"] += 1
            log.info("shm handoff: refused pid %d: it did not present this pool's key", pid)
            return
        socket.send_fds(conn, [_OK], [self._fd])
        self.counters["shm_handoffs"] += 1

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(5.0)
        self._sock.close()


def receive_pool_fd(name: str, key: bytes, timeout_s: float = HANDOFF_WAIT_S) -> int:
    """The pool descriptor from the producer's handoff socket ``name`` (abstract), presenting ``key``.

    Refuses (:class:`UnsafePoolFileError`) a socket held by another uid before sending the key; a socket that is
    gone is :class:`StaleMetadataError` (the producer exited, or this process is in another network namespace);
    a producer that answers without a descriptor is :class:`AuthError`."""
    where = f"shm handoff socket @{name}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout_s)
        try:
            s.connect("\0" + name)
        except (FileNotFoundError, ConnectionRefusedError):
            raise E.StaleMetadataError(
                f"{where} is gone: the producer exited or restarted (reconnect for fresh metadata), or this "
                "consumer runs in another network namespace than the producer (abstract Unix sockets are per "
                "namespace: share the producer's, or start it with shm_handoff='path')"
            ) from None
        pid, uid = _peer_uid(s)
        if uid != os.geteuid():
            raise E.UnsafePoolFileError(
                f"{where} is held by pid {pid} of uid {uid}, not by this process's uid {os.geteuid()}: refusing "
                "to send it the key (someone else may have bound the name)"
            )
        s.sendall(HANDOFF_MAGIC + key)
        s.shutdown(socket.SHUT_WR)  # all it sends: a short key is refused at once, not after a timeout
        msg, fds, flags, _ = socket.recv_fds(s, 16, 1)
        if msg != _OK or len(fds) != 1 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise E.AuthError(
                f"{where} (pid {pid}) handed over no pool descriptor: the key was refused (a key from another "
                "producer instance: reconnect for fresh metadata) or the handoff failed"
            )
        return fds[0]
    except TimeoutError:
        raise E.ExportTimeoutError(f"{where} did not answer within {timeout_s} s") from None
    finally:
        s.close()


def _tensor_over(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only maps: torch warns the tensor is not writable; we never write
        return torch.frombuffer(mm, dtype=torch.uint8)


class ShmProducerTransport:
    kind = "shm"

    def __init__(self, pool_bytes: int, instance: str, shm_dir: str = DEFAULT_SHM_DIR, handoff: str = "fd") -> None:
        """``handoff``: how consumers reach the pool (:data:`SHM_HANDOFFS`)."""
        if handoff not in SHM_HANDOFFS:
            raise E.ExportConfigError(f"shm_handoff must be one of {SHM_HANDOFFS}, found {handoff!r}")
        if not os.path.isdir(shm_dir):
            raise E.TransportUnavailableError(
                f"shared-memory directory {shm_dir!r} does not exist; pass shm_dir= an existing tmpfs directory"
            )
        self.handoff = handoff
        self.sweep = _sweep_dead(shm_dir)  # also in "fd" mode: named pools of producers of earlier versions
        if self.sweep.removed:
            log.info("removed %d pool file(s) left by dead producers in %s", self.sweep.removed, shm_dir)
        if self.sweep.skipped:
            log.info(
                "left %d name(s) in %s alone that look like pool files but are not this user's regular files "
                "(debug log names them)",
                self.sweep.skipped,
                shm_dir,
            )
        self.pool_bytes = pool_bytes
        st = os.statvfs(shm_dir)
        free = st.f_bavail * st.f_frsize
        if pool_bytes > free:
            raise E.TransportUnavailableError(
                f"{shm_dir} has {free} bytes free, the pool needs {pool_bytes}; shrink num_slots/slot_bytes, "
                "enlarge the tmpfs (Docker: --shm-size) or pass shm_dir="
            )
        self.path = ""
        self._handoff: _Handoff | None = None
        self._ro_fd = -1
        if handoff == "fd":
            fd, how = _unnamed_file(shm_dir, instance)
            try:
                self._mm = self._reserve(fd, pool_bytes, shm_dir)
                # consumers get a read-only descriptor: they cannot write the pool even by mistake
                self._ro_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
                self._handoff = _Handoff(self._ro_fd, instance)
            except BaseException:
                if self._ro_fd >= 0:
                    os.close(self._ro_fd)
                os.close(fd)
                raise
            log.debug("shm pool: %d bytes, unnamed (%s), handed over on @%s", pool_bytes, how, self._handoff.name)
            self._lock_fd = fd
            self.buffer = _tensor_over(self._mm)
            return
        self.path = os.path.join(shm_dir, f"hsx2-{os.getpid()}-{instance}.pool")
        tmp = os.path.join(shm_dir, f".hsx2-{instance}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until close() or death: the liveness proof
            self._mm = self._reserve(fd, pool_bytes, shm_dir)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            for p in (tmp, self.path):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            raise
        self._lock_fd = fd
        self.buffer = _tensor_over(self._mm)

    @staticmethod
    def _reserve(fd: int, pool_bytes: int, shm_dir: str) -> mmap.mmap:
        """Reserve the pages now, then map them: a sparse tmpfs file that cannot be backed later would kill the
        serving process with SIGBUS on first write instead of failing here with a named error."""
        try:
            os.posix_fallocate(fd, 0, pool_bytes)
        except OSError as e:
            raise E.TransportUnavailableError(
                f"cannot reserve {pool_bytes} bytes in {shm_dir}: {e}; shrink the pool or enlarge the tmpfs "
                "(Docker: --shm-size)"
            ) from None
        return mmap.mmap(fd, pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def describe(self) -> dict[str, Any]:
        """What a same-host consumer needs (only ever sent in the trainer's ``hello``): the handoff socket and its
        key, or the file; the size and the owner's pid (for people)."""
        out: dict[str, Any] = {"kind": self.kind, "size": self.pool_bytes, "pid": os.getpid()}
        if self._handoff is not None:
            out.update(socket=self._handoff.name, key=self._handoff.key)
        else:
            out["path"] = self.path
        return out

    @property
    def counters(self) -> dict[str, int]:
        """Descriptor handoffs served and refused (handoff ``"fd"``)."""
        return dict(self._handoff.counters) if self._handoff is not None else {}

    def poll_notifications(self) -> list[bytes]:
        """None on this transport."""
        return []

    def close(self) -> None:
        """Stop the handoff, unmap, unlink (a named pool), then drop the lock."""
        if self._handoff is not None:
            self._handoff.close()
            self._handoff = None
        self.buffer = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:
            log.warning("pool views still alive at close; the mapping is left to the garbage collector")
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        for attr in ("_ro_fd", "_lock_fd"):
            fd = getattr(self, attr)
            setattr(self, attr, -1)
            if fd >= 0:
                os.close(fd)


class ShmConsumerTransport:
    """Maps a same-host producer's pool read-only and copies claimed ranges into the landing buffer."""

    kind = "shm"

    def __init__(self, landing_bytes: int, shm_dir: str = DEFAULT_SHM_DIR) -> None:
        self.landing = host_buffer(landing_bytes)
        self.regions = LandingRegions(self.landing)
        self._local_views: dict[int, tuple[int, memoryview]] = {}
        self._shm_dir = os.path.realpath(shm_dir)
        self._mm: mmap.mmap | None = None
        self._remote: torch.Tensor | None = None
        self._size = 0
        self._view_key = (0, 0)
        self._view_cache = (memoryview(b""), memoryview(b""))

    def attach(self, info: Mapping[str, Any] | P.ShmInfo | P.NixlInfo) -> None:
        """Map the pool ``info`` (the producer's ``describe()``) names; forgets any earlier producer."""
        desc = P.convert_transport(info)
        if not isinstance(desc, P.ShmInfo):
            raise E.TransportUnavailableError("producer offers transport 'nixl', this is shm")
        if bool(desc.path) == bool(desc.socket) or bool(desc.socket) != bool(desc.key):
            raise E.DescriptorError(
                "the shm transport description names neither or both of a pool file and a handoff socket (or a "
                "socket without its key); a producer sends exactly one"
            )
        if desc.socket:
            self.detach()
            fd = receive_pool_fd(desc.socket, desc.key)
            self._map(fd, desc.size, f"the pool handed over on @{desc.socket}")
            return
        path, size = desc.path, desc.size
        # The directory may be reached through links (``/dev/shm`` often is one); the name itself never is.
        real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        if os.path.dirname(real) != self._shm_dir or not _NAME_RE.match(os.path.basename(real)):
            raise E.DescriptorError(
                f"producer names pool file {path!r}, expected an hsx2-<pid>-<id>.pool file in "
                f"{self._shm_dir}; "
                "refusing to map it (pass shm_dir= if the producer uses another directory)"
            )
        self.detach()
        try:
            fd = os.open(real, SAFE_OPEN_FLAGS)
        except FileNotFoundError:
            raise E.StaleMetadataError(
                f"pool file {real} is gone: the producer restarted or exited; reconnect for fresh metadata"
            ) from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):  # a symbolic link, a socket
                kind = "a symbolic link" if e.errno == errno.ELOOP else "a socket"
                raise E.UnsafePoolFileError(
                    f"pool file {real} is {kind}, not a regular file: refusing to map it (someone else may have "
                    "planted it; a producer's pool is a regular file it creates itself)"
                ) from None
            raise E.TransportUnavailableError(
                f"cannot open pool file {real}: {e}; producer and consumer must run as the same user on one host"
            ) from None
        self._map(fd, size, f"pool file {real}")

    def _map(self, fd: int, size: int, what: str) -> None:
        """Map ``fd`` read-only after checking it on the descriptor (a regular file of this uid, large enough);
        closes ``fd``."""
        try:
            st = os.fstat(fd)
            why = _untrusted(st)
            if why is not None:
                raise E.UnsafePoolFileError(
                    f"{what} is {why}: refusing to map it; a producer's pool is a regular file owned "
                    "by the user both producer and consumer run as (someone else may have planted this one)"
                )
            if st.st_size < size:
                raise E.StaleMetadataError(f"{what} has {st.st_size} bytes, producer says {size}")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._remote = _tensor_over(self._mm)
        self._size = size

    def detach(self) -> None:
        self._remote = None
        self._view_key = (0, 0)  # the views address the map that is about to go
        self._view_cache = (memoryview(b""), memoryview(b""))
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None

    def _check(self, items: Sequence[tuple[int, ...]]) -> torch.Tensor:
        remote = self._remote
        if remote is None:
            raise E.StaleMetadataError("no producer attached; call attach() first")
        cap = self.landing.numel()
        for roff, loff, n, *_ in items:
            if roff < 0 or n < 0 or roff + n > self._size or loff < 0:
                raise E.DescriptorError(
                    f"range remote[{roff}:{roff + n}] -> landing[{loff}:{loff + n}] is outside the pool "
                    f"({self._size} bytes) or the landing buffer ({cap} bytes)"
                )
            if loff + n > cap:
                self.regions.locate(loff, n)  # another landing region, or DescriptorError
        return remote

    def add_region(self, buf: torch.Tensor) -> int:
        """Make ``buf`` a landing region (see ``transport.REGION_SHIFT``); its region number."""
        return self.regions.add(buf)

    def drop_region(self, k: int) -> None:
        self.regions.drop(k)
        self._local_views.pop(k, None)

    def _local(self, loff: int, n: int) -> tuple[torch.Tensor, memoryview, int]:
        """The landing region holding ``[loff, loff + n)`` (checked by :meth:`_check`): its tensor, a byte view
        of it (kept per region) and the range's offset in it."""
        buf, lo = self.regions.locate(loff, n)
        k = loff >> REGION_SHIFT
        key = buf.data_ptr()
        got = self._local_views.get(k)
        if got is None or got[0] != key:
            got = (key, byte_view(buf))
            self._local_views[k] = got
        return buf, got[1], lo

    def read(self, items: Sequence[tuple[int, int, int]], deadline: float) -> None:
        """Copy ``(remote_offset, local_offset, nbytes)`` ranges; each is checked against both buffers first."""
        remote = self._check(items)
        lv, rv = self._views(remote)
        cap = self.landing.numel()
        for roff, loff, n in items:
            if time.monotonic() > deadline:
                raise E.ExportTimeoutError("shared-memory copy ran past its deadline")
            buf, view = self.landing, lv
            if loff + n > cap:  # another landing region
                buf, view, loff = self._local(loff, n)
            if n <= SMALL_COPY_BYTES:  # a buffer slice copy: one C memcpy, no tensor op
                view[loff : loff + n] = rv[roff : roff + n]
            else:  # one memmove, the GIL released (both ranges were checked above)
                ctypes.memmove(buf.data_ptr() + loff, remote.data_ptr() + roff, n)

    def _views(self, remote: torch.Tensor) -> tuple[memoryview, memoryview]:
        key = (self.landing.data_ptr(), remote.data_ptr())
        if self._view_key != key:
            self._view_cache = (byte_view(self.landing), byte_view(remote))
            self._view_key = key
        return self._view_cache

    def read_checked(self, items: Sequence[tuple[int, int, int, int]], algorithm: str, deadline: float) -> list[int]:
        """:meth:`read` of ``(remote_offset, local_offset, nbytes, checked_bytes)`` ranges that also returns, per
        range, the checksum of its first ``checked_bytes`` bytes as copied, computed chunk by chunk right after
        each chunk's copy, while the chunk is still in cache (see ``COPY_CHUNK_BYTES``)."""
        for _, _, n, checked in items:
            if not 0 <= checked <= n:
                raise E.DescriptorError(f"checksum over {checked} bytes of a {n}-byte range")
        remote = self._check(items)
        lv, rv = self._views(remote)
        cap = self.landing.numel()
        out: list[int] = []
        for roff, loff, n, checked in items:
            buf, view = self.landing, lv
            if loff + n > cap:  # another landing region
                buf, view, loff = self._local(loff, n)
            state = ChecksumState(algorithm, checked)
            dst, src = buf.data_ptr() + loff, remote.data_ptr() + roff
            for at in range(0, n, COPY_CHUNK_BYTES):
                if time.monotonic() > deadline:
                    raise E.ExportTimeoutError("shared-memory copy ran past its deadline")
                m = min(COPY_CHUNK_BYTES, n - at)
                if m <= SMALL_COPY_BYTES:
                    view[loff + at : loff + at + m] = rv[roff + at : roff + at + m]
                else:
                    ctypes.memmove(dst + at, src + at, m)
                if at < checked:
                    state.update_bytes(view[loff + at : loff + min(at + m, checked)])
            out.append(state.digest())
        return out

    def close(self) -> None:
        self.detach()
