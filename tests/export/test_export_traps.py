"""Local traps (issue 15, items 4 and 5): names planted in the shared-memory directory and token files someone else
could have read or planted.  Real files, a real producer start over shm, real FIFOs, sockets and links; "another
user's file" is a file chowned to uid 65534 (needs root, skipped otherwise)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import ExportProducer
from vllm_hs_compat.export import credentials as C
from vllm_hs_compat.export import shm as S

MiB = 1 << 20
OTHER_UID = 65534  # nobody
PLANTED = "planted-token-chosen-by-someone-else"
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="chown to another uid needs root")


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A directory of our own on the tmpfs (never the real /dev/shm: nothing is planted there)."""
    d = tempfile.mkdtemp(prefix="hsx-traps-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _release_fifo_later(path: str, after_s: float) -> threading.Timer:
    """A watchdog: opens ``path`` for writing after ``after_s``, which releases a reader blocked in open(); a
    regression fails its test instead of hanging the suite."""

    def release() -> None:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader waiting (ENXIO) or the FIFO is gone

    t = threading.Timer(after_s, release)
    t.daemon = True
    t.start()
    return t


def _blocks(fn: Callable[[], object], fifo: str, for_s: float = 0.5) -> bool:
    """Whether ``fn`` is still running after ``for_s`` (then the FIFO is opened for writing to release it)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(for_s)
    blocked = t.is_alive()
    _release_fifo_later(fifo, 0.0)
    t.join(5)
    assert not t.is_alive(), "the blocked open was not released"
    return blocked


def _plant(shm_dir: str, kind: str) -> str:
    """A name matching the pool-file pattern that is not this user's regular file."""
    path = os.path.join(shm_dir, f"hsx2-4-{kind.encode().hex():0<16}.pool")
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        victim = os.path.join(shm_dir, "victim")  # this user's file, unlocked: a followed link would unlink it
        Path(victim).write_bytes(b"precious")
        os.symlink(victim, path)
    elif kind == "dir":
        os.mkdir(path, 0o700)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()
    elif kind == "other-uid":
        Path(path).write_bytes(b"x" * 4096)
        os.chown(path, OTHER_UID, OTHER_UID)
    return path


def _snapshot(path: str) -> tuple[int, int, int]:
    st = os.lstat(path)
    return st.st_ino, st.st_mode, st.st_uid


TRAPS = ["fifo", "symlink", "dir", "socket", pytest.param("other-uid", marks=needs_root)]


# --- the shared-memory directory --------------------------------------------------------------------------------
def test_a_fifo_under_the_pool_name_blocks_a_plain_open() -> None:
    """Negative control: the trap is real.  The sweep's old open (``O_RDONLY | O_NOFOLLOW``) of a FIFO waits for a
    writer, forever."""
    d = tempfile.mkdtemp(prefix="hsx-traps-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        fifo = _plant(d, "fifo")
        assert _blocks(lambda: os.close(os.open(fifo, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)), fifo)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("kind", TRAPS)
def test_a_planted_name_neither_blocks_nor_is_touched_by_the_producer_start(shm_dir: str, kind: str) -> None:
    path = _plant(shm_dir, kind)
    before = _snapshot(path)
    if kind == "fifo":
        _release_fifo_later(path, 5.0)  # a regression fails here instead of hanging
    t0 = time.monotonic()
    with ExportProducer(backend="shm", num_slots=1, slot_bytes=MiB, shm_dir=shm_dir, shm_handoff="path") as p:
        took = time.monotonic() - t0
        sweep = p.transport.sweep
        counted = (p.stats()["shm_sweep_removed"], p.stats()["shm_sweep_skipped"])
        own = os.path.basename(p.transport.describe()["path"])
    assert counted == (0, 1)  # what the operator sees in the producer's stats
    assert took < 1.0, f"producer start took {took:.2f} s with a {kind} in the shm directory"
    assert (sweep.removed, sweep.skipped) == (0, 1)
    assert _snapshot(path) == before  # left untouched: not unlinked, not replaced
    if kind == "symlink":
        assert Path(shm_dir, "victim").read_bytes() == b"precious"
    assert own not in os.listdir(shm_dir)  # the producer's own pool went at close


@needs_root
def test_the_sweep_checks_are_what_protect(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the ownership/type check disabled and the old open flags, the same start blocks on
    the FIFO (until the watchdog writes) and unlinks another user's file."""
    fifo, other = _plant(shm_dir, "fifo"), _plant(shm_dir, "other-uid")
    monkeypatch.setattr(S, "_untrusted", lambda st: None)
    monkeypatch.setattr(S, "SAFE_OPEN_FLAGS", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    assert _blocks(lambda: S._sweep_dead(shm_dir), fifo)
    assert not os.path.exists(other)


def test_a_dead_producers_pool_is_still_swept(shm_dir: str) -> None:
    """Positive control: this user's unlocked pool file under the pattern is removed, next to a planted FIFO."""
    stale = os.path.join(shm_dir, "hsx2-7-00000000000000ee.pool")
    Path(stale).write_bytes(b"\0" * 4096)
    os.chmod(stale, 0o600)
    fifo = _plant(shm_dir, "fifo")
    with ExportProducer(backend="shm", num_slots=1, slot_bytes=MiB, shm_dir=shm_dir) as p:
        assert (p.transport.sweep.removed, p.transport.sweep.skipped) == (1, 1)
    assert not os.path.exists(stale) and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_the_pool_file_is_created_0600_and_mapped_by_a_consumer(shm_dir: str) -> None:
    with ExportProducer(backend="shm", num_slots=1, slot_bytes=MiB, shm_dir=shm_dir, shm_handoff="path") as p:
        info = p.transport.describe()
        st = os.lstat(info["path"])
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        c = S.ShmConsumerTransport(MiB, shm_dir)
        try:
            c.attach(info)  # positive control for the refusals below
        finally:
            c.close()


@pytest.mark.parametrize("kind", TRAPS)
def test_the_consumer_refuses_to_map_a_planted_pool_file(shm_dir: str, kind: str) -> None:
    path = _plant(shm_dir, kind)
    if kind == "fifo":
        _release_fifo_later(path, 5.0)
    c = S.ShmConsumerTransport(MiB, shm_dir)
    t0 = time.monotonic()
    try:
        with pytest.raises(E.UnsafePoolFileError) as err:
            c.attach({"kind": "shm", "path": path, "size": 4096, "pid": 4})
    finally:
        c.close()
    assert time.monotonic() - t0 < 1.0
    expected = {
        "fifo": "FIFO",
        "symlink": "symbolic link",
        "dir": "directory",
        "socket": "socket",
        "other-uid": f"uid {OTHER_UID}",
    }
    assert path in str(err.value) and expected[kind] in str(err.value), str(err.value)


# --- token files ------------------------------------------------------------------------------------------------
@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(C.TOKEN_ENV, raising=False)
    monkeypatch.delenv(C.TOKEN_FILE_ENV, raising=False)


def _token_file(tmp_path: Path, mode: int = 0o600, dir_mode: int = 0o700, text: str = PLANTED) -> Path:
    d = tmp_path / "d"
    d.mkdir(exist_ok=True)
    os.chmod(d, dir_mode)
    f = d / "export.token"
    f.write_text(text + "\n")
    os.chmod(f, mode)
    return f


def _refused(f: Path, *needles: str) -> None:
    for call in (C.load_or_create_token, C.read_token):
        with pytest.raises(E.UnsafeTokenFileError) as err:
            call(f)
        msg = str(err.value)
        assert str(f) in msg and all(n in msg for n in needles), msg
        assert PLANTED not in msg


@pytest.mark.usefixtures("no_env")
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606])
def test_a_token_file_others_can_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    f = _token_file(tmp_path, mode)
    _refused(f, f"mode {mode:04o}", f"owner uid {os.geteuid()}", f"chmod 600 {f}", C.TOKEN_ENV)
    assert f.read_text().strip() == PLANTED  # refused, not rewritten


@needs_root
@pytest.mark.usefixtures("no_env")
def test_a_token_file_of_another_user_is_refused(tmp_path: Path) -> None:
    f = _token_file(tmp_path)
    os.chown(f, OTHER_UID, OTHER_UID)
    _refused(f, f"owned by uid {OTHER_UID}", "mode 0600", f"delete {f}")


@pytest.mark.usefixtures("no_env")
@pytest.mark.parametrize(
    ("dir_mode", "dir_owner", "needle"),
    [
        pytest.param(0o770, (None, OTHER_UID), f"writable by group {OTHER_UID}", marks=needs_root),
        (0o777, (None, None), "writable by others"),
        (0o773, (None, None), "writable by others"),
        pytest.param(0o755, (OTHER_UID, OTHER_UID), f"owned by uid {OTHER_UID}", marks=needs_root),
    ],
)
def test_a_token_file_in_a_directory_others_can_write_is_refused(
    tmp_path: Path, dir_mode: int, dir_owner: tuple[int | None, int | None], needle: str
) -> None:
    f = _token_file(tmp_path, dir_mode=dir_mode)
    if dir_owner != (None, None):
        os.chown(f.parent, dir_owner[0] if dir_owner[0] is not None else -1, dir_owner[1] or -1)
    _refused(f, needle, str(f.parent), f"chmod go-w {f.parent}")
    _refused(f.parent / "absent.token", needle)  # nor is a new one created there
    assert not (f.parent / "absent.token").exists()


@pytest.mark.usefixtures("no_env")
@pytest.mark.parametrize("kind", ["symlink", "fifo", "dir", "socket"])
def test_a_token_file_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    good = _token_file(tmp_path)  # this user's own valid token file: a link to it is still refused
    f = good.parent / "link.token"
    if kind == "symlink":
        f.symlink_to(good)
    elif kind == "fifo":
        os.mkfifo(f, 0o600)
        _release_fifo_later(str(f), 5.0)
    elif kind == "dir":
        f.mkdir(mode=0o700)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(f))
        s.close()
    t0 = time.monotonic()
    _refused(f, {"symlink": "symbolic link", "fifo": "a FIFO", "dir": "a directory", "socket": "a socket"}[kind])
    assert time.monotonic() - t0 < 1.0


@pytest.mark.usefixtures("no_env")
@pytest.mark.parametrize(("mode", "dir_mode"), [(0o600, 0o700), (0o400, 0o700), (0o600, 0o755), (0o600, 0o1777)])
def test_a_private_token_file_is_read(tmp_path: Path, mode: int, dir_mode: int) -> None:
    f = _token_file(tmp_path, mode, dir_mode)
    assert C.read_token(f) == PLANTED
    assert C.load_or_create_token(f) == (PLANTED, f)


@pytest.mark.usefixtures("no_env")
def test_the_checks_are_what_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the checks disabled, the planted 0644 token is adopted silently (the old
    behaviour), so the refusals above come from the checks."""
    monkeypatch.setattr(C, "_check_token_fd", lambda fd, file: None)
    monkeypatch.setattr(C, "_check_token_dir", lambda dfd, d, file: None)
    f = _token_file(tmp_path, 0o644, 0o777)
    assert C.load_or_create_token(f) == (PLANTED, f)


@pytest.mark.usefixtures("no_env")
def test_a_created_token_file_is_0600_in_a_0700_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    old = os.umask(0o002)  # a permissive umask: the directory and file modes must not depend on it
    try:
        token, f = C.load_or_create_token()
    finally:
        os.umask(old)
    assert f == tmp_path / ".cache" / "vllm-hs-compat" / "export.token"
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600 and stat.S_IMODE(os.stat(f.parent).st_mode) == 0o700
    assert C.read_token() == token and C.load_or_create_token() == (token, f)
    assert sorted(os.listdir(f.parent)) == ["export.token"]  # no temporary left behind


@pytest.mark.usefixtures("no_env")
def test_producers_starting_together_share_one_whole_token(tmp_path: Path) -> None:
    """DP ranks create the token file at the same moment: each gets the same complete token, never an empty
    file."""
    f = tmp_path / "shared" / "export.token"
    barrier = threading.Barrier(8)
    got: list[object] = []

    def start() -> None:
        barrier.wait()
        try:
            got.append(C.load_or_create_token(f)[0])
        except Exception as e:  # noqa: BLE001 - recorded and asserted on below
            got.append(e)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 8 and len(set(got)) == 1 and isinstance(got[0], str), got


@pytest.mark.usefixtures("no_env")
def test_the_environment_token_needs_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _token_file(tmp_path, 0o644)  # would be refused, but the variable comes first
    monkeypatch.setenv(C.TOKEN_ENV, "e" * 32)
    assert C.load_or_create_token(f) == ("e" * 32, None) and C.read_token() == "e" * 32
