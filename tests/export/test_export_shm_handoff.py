"""The shm pool without a name (issue 16, item 1): a producer killed with SIGKILL, its gate too, leaves nothing in the
shm directory; consumers in other processes get the pool's descriptor over the handoff socket, and only a peer the
control plane admitted as the trainer (same uid, the ``hello``'s key) gets it.  Real processes, real SIGKILLs, real
sockets; "another uid" is a child that drops to uid 65534 (needs root, skipped otherwise)."""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from hsx_harness import Peer
from hsx_testdata import digest, make_meta, make_rows

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import ExportConsumer, ExportProducer
from vllm_hs_compat.export import shm as S

MiB = 1 << 20
TOKEN = "shm-handoff-test-token-0123456789abcdef"
OTHER_UID = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


@pytest.fixture
def shm_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hsx-handoff-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _gone(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until ``pid`` no longer exists (reaped by its parent, or a zombie of one that is not ours)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} still alive after {timeout_s} s")


def _killed_serving(shm_dir: str, handoff: str) -> tuple[list[str], list[str], str]:
    """Start a producer in another process, fetch a record of it here, SIGKILL its gate and then it; the names
    left in ``shm_dir`` while it served and after, and the record's digest check."""
    peer = Peer()
    try:
        started = peer.ok(
            "producer", backend="shm", num_slots=2, slot_bytes=MiB, token=TOKEN, shm_dir=shm_dir, shm_handoff=handoff
        )
        peer.ok("publish", record_id="k", seed=3, tokens=9, planes=2, hidden=64)
        stats = peer.ok("pstats")["stats"]
        with ExportConsumer(started["endpoint"], TOKEN, backend="shm", shm_dir=shm_dir, direct=False) as c:
            got = digest(c.fetch("k").hidden_states)
        serving = sorted(os.listdir(shm_dir))
        gate = int(stats["control_gate_pid"])
        os.kill(gate, signal.SIGKILL)  # the gate first: nothing it could do on its way out may matter
        _gone(gate)
        producer_pid = peer.proc.pid
        peer.kill()
        _gone(producer_pid)
    finally:
        peer.close()
    return serving, sorted(os.listdir(shm_dir)), "ok" if got == digest(make_rows(3, 9, 2, 64)) else "mismatch"


def test_a_sigkilled_producer_and_gate_leave_nothing_in_the_shm_dir(shm_dir: str) -> None:
    serving, after, record = _killed_serving(shm_dir, "fd")
    assert record == "ok"  # a consumer in another process read the record through the handed-over descriptor
    assert serving == [] and after == []  # never a name, not even while serving
    assert not glob.glob("/dev/shm/hsx2-*-*.pool") or all(  # and nothing of it in the real /dev/shm either
        os.stat(p).st_uid != os.geteuid() or _locked(p) for p in glob.glob("/dev/shm/hsx2-*-*.pool")
    )


def _locked(path: str) -> bool:
    """Whether a named pool's owner is alive (another producer of this user, e.g. a parallel test run)."""

    fd = os.open(path, S.SAFE_OPEN_FLAGS)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def test_negative_control_a_named_pool_is_left_behind_by_the_same_kills(shm_dir: str) -> None:
    """The check can fail: the named pool (handoff "path", the earlier behaviour) outlives the same SIGKILLs."""
    serving, after, record = _killed_serving(shm_dir, "path")
    assert record == "ok"
    assert len(serving) == 1 and after == serving and after[0].startswith("hsx2-")
    # and the next producer's sweep still removes it (pools of earlier versions are swept in "fd" mode too)
    with ExportProducer(backend="shm", num_slots=1, slot_bytes=MiB, shm_dir=shm_dir) as p:
        assert p.stats()["shm_sweep_removed"] == 1
        assert os.listdir(shm_dir) == []


def test_the_descriptor_goes_only_to_a_peer_that_presents_the_hello_key(shm_dir: str) -> None:
    with ExportProducer(backend="shm", num_slots=2, slot_bytes=MiB, shm_dir=shm_dir, token=TOKEN) as p:
        info = p.transport.describe()
        rows = make_rows(5, 4, 2, 64)
        ticket = p.publish(make_meta("t", rows, 5), rows)
        # a ticket holder is admitted as a record principal: its hello carries no transport, so no socket, no key
        with ExportConsumer.from_params(ticket.kv_transfer_params(), token=None) as c:
            assert c.principal == "record" and c.hello["transport"] is None
            assert digest(c.fetch("t").hidden_states) == digest(rows)  # over inline reads, not the pool
        for bad in (b"", b"\0" * S.HANDOFF_KEY_BYTES, info["key"][:-1] + bytes([info["key"][-1] ^ 1])):
            with pytest.raises(E.AuthError, match="no pool descriptor"):
                S.receive_pool_fd(info["socket"], bad)
        assert p.stats()["shm_handoffs_refused"] == 3 and p.stats()["shm_handoffs"] == 0
        fd = S.receive_pool_fd(info["socket"], info["key"])  # positive control
        try:
            st = os.fstat(fd)
            assert st.st_nlink == 0 and st.st_size == p.pool.pool_bytes  # unnamed, the whole pool
            with pytest.raises(OSError):  # read-only: a consumer cannot write the pool even by mistake
                os.write(fd, b"x")
        finally:
            os.close(fd)
        # counted after the descriptor was sent: the consumer may hold it a moment before the producer's count moves
        deadline = time.monotonic() + 10
        while p.stats()["shm_handoffs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.stats()["shm_handoffs"] == 1


def _in_child_as_other_uid(fn: object) -> int:
    """Run ``fn()`` in a forked child under uid 65534; its exit status (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            code = 0 if fn() else 3  # type: ignore[operator]
        except BaseException:
            code = 2
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@needs_root
def test_a_peer_of_another_uid_gets_no_descriptor_even_with_the_key(shm_dir: str) -> None:
    with ExportProducer(backend="shm", num_slots=1, slot_bytes=MiB, shm_dir=shm_dir) as p:
        info = p.transport.describe()

        def steal() -> bool:
            try:
                fd = S.receive_pool_fd(info["socket"], info["key"])
            except E.UnsafePoolFileError:
                return True  # the consumer side also refuses a socket of another uid: it never sent the key
            os.close(fd)
            return False

        def steal_raw() -> bool:  # a hostile peer that skips the consumer's own check
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect("\0" + info["socket"])  # reachable: abstract sockets have no permission bits
            try:
                s.sendall(S.HANDOFF_MAGIC + info["key"])
                _, fds, _, _ = socket.recv_fds(s, 16, 1)
            except OSError:  # the producer closed the connection at once (reset, broken pipe)
                return True
            return not fds

        assert _in_child_as_other_uid(steal) == 0
        assert _in_child_as_other_uid(steal_raw) == 0
        assert p.stats()["shm_handoffs"] == 0 and p.stats()["shm_handoffs_refused"] >= 1


@needs_root
def test_a_consumer_sends_no_key_to_a_socket_of_another_uid(shm_dir: str) -> None:
    name = f"hsx2-squat-{os.getpid()}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: squats the name as uid 65534 and reports what it received
        os.close(r)
        os.setgid(OTHER_UID)
        os.setuid(OTHER_UID)
        s = socket.socket(socket.AF_UNIX)
        s.bind("\0" + name)
        s.listen(1)
        os.write(w, b"L")
        conn, _ = s.accept()
        conn.settimeout(2)
        try:
            got = conn.recv(64)
        except OSError:
            got = b""
        os.write(w, b"G" + got)
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"L"
    with pytest.raises(E.UnsafePoolFileError, match=f"uid {OTHER_UID}"):
        S.receive_pool_fd(name, b"k" * S.HANDOFF_KEY_BYTES)
    assert os.read(r, 100) == b"G"  # the squatter got nothing: the key was never sent
    os.waitpid(pid, 0)
    os.close(r)


def test_a_handed_over_descriptor_that_is_not_a_regular_file_is_refused(shm_dir: str) -> None:
    """A same-user impostor that answers with a pipe: the descriptor is checked with fstat before it is mapped."""
    name = f"hsx2-impostor-{os.getpid()}"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind("\0" + name)
    srv.listen(1)
    r, w = os.pipe()

    def answer() -> None:
        conn, _ = srv.accept()
        conn.recv(64)
        socket.send_fds(conn, [b"OK"], [r])
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    c = S.ShmConsumerTransport(MiB, shm_dir)
    try:
        with pytest.raises(E.UnsafePoolFileError, match="FIFO"):
            c.attach({"kind": "shm", "socket": name, "key": b"k" * S.HANDOFF_KEY_BYTES, "size": 4096})
    finally:
        c.close()
        t.join(5)
        srv.close()
        os.close(r)
        os.close(w)


def test_a_description_with_both_or_neither_way_is_refused(shm_dir: str) -> None:
    c = S.ShmConsumerTransport(MiB, shm_dir)
    try:
        for info in (
            {"kind": "shm", "size": 4096},
            {
                "kind": "shm",
                "size": 4096,
                "path": os.path.join(shm_dir, "hsx2-1-00000000.pool"),
                "socket": "x",
                "key": b"k",
            },
            {"kind": "shm", "size": 4096, "socket": "x"},
        ):
            with pytest.raises(E.DescriptorError):
                c.attach(info)
    finally:
        c.close()
