"""Where a small ``fetch(id)``'s time goes over UCX's TCP transport, producer and consumer (a probe, not a test).

    python benchmarks/probe_small_fetch.py [--n 300] [--reps 3] [--producers 2] [--configs default,...]
        [--modes ping,claim,fetch] [--gap-ms 0]
    python benchmarks/probe_small_fetch.py --bare [--n 300] [--gap-ms 0]     # the floor: ZeroMQ + CURVE alone
    python benchmarks/probe_small_fetch.py --bare-tcp [--n 300] [--gap-ms 0] # the plain channel's floor: bare TCP

One producer process per configuration (``ExportProducer(backend="nixl")`` over ``UCX_TLS=tcp``, as
``bench_vs_mooncake.py``'s "ours tcp" pair, ``--producers`` producers in it, the first holding the 64 KiB records)
and this process as the trainer consumer (the defaults: the answer to a fetch by id carries the bytes).  Per
request it stamps (``time.perf_counter_ns``, one clock for both processes): the consumer's send, the producer's
serving thread taking the request (``up``), its answer built (``handle``) and sent (``serve``), the consumer's
answer (``down``); and per configuration the CPU each producer thread used (``/proc/self/task``, 10 ms ticks).
Modes: ``ping`` (no lease), ``claim`` (the fetch's claim alone, its bytes in the answer), ``fetch`` (the whole
``fetch()``, the previous record kept alive).  ``--gap-ms``: a pause before each request (a lone request after an
idle spell).  Configurations (producer keyword arguments, ``--extra`` adds some) run alternately, ``--reps`` times
each.  ``PROBE_CPROFILE=1`` cProfiles the serving thread's work.  ``--bare``: a CURVE ``DEALER``/``ROUTER`` pair
between two Python processes and nothing else, answering with a few bytes and with 64 KiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from role_worker import Worker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
SIZE = 64 << 10


def _thread_cpu() -> dict[str, float]:
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        name = names.get(int(tid), comm)
        name = name.split("-")[0] if name.startswith("Thread") else name
        out[name] = out.get(name, 0.0) + (int(parts[11]) + int(parts[12])) / tick
    return out


def role_producer() -> None:
    import torch

    from vllm_hs_compat.core.records import RecordMeta
    from vllm_hs_compat.export import ExportProducer
    from vllm_hs_compat.export.control import ControlServer

    prods: list[ExportProducer] = []
    stamps: list[tuple[str, int]] = []
    cpu0: dict[str, float] = {}

    orig_one, orig_send = ControlServer._one, ControlServer._send

    def one(self: Any, frames: Any, direct: bool = False) -> None:
        stamps.append(("one", time.perf_counter_ns()))
        orig_one(self, frames, direct)

    def send(self: Any, route: Any, rid: bytes, rep: Any) -> None:
        stamps.append(("answered", time.perf_counter_ns()))
        orig_send(self, route, rid, rep)
        stamps.append(("sent", time.perf_counter_ns()))

    prof = None
    if os.environ.get("PROBE_CPROFILE"):  # the serving thread's own work per request, cProfiled
        import cProfile

        prof = cProfile.Profile()
        orig_direct = ControlServer._serve_direct

        def serve_direct(self: Any) -> None:
            prof.enable()
            try:
                orig_direct(self)
            finally:
                prof.disable()

        ControlServer._serve_direct = serve_direct  # type: ignore[method-assign]

    ControlServer._one = one  # type: ignore[method-assign]
    ControlServer._send = send  # type: ignore[method-assign]

    chan = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        ans: dict[str, Any] = {}
        if op == "exit":
            break
        if op == "start":
            kw = cmd.get("kw", {})
            for _i in range(cmd["producers"]):
                prods.append(
                    ExportProducer(
                        backend="nixl", num_slots=cmd["n"] * 4 + 64, slot_bytes=SIZE + 4096, lease_ttl_s=60, **kw
                    )
                )
            rows = torch.zeros(SIZE // 2048, 1, 1024, dtype=torch.bfloat16)
            for j in range(cmd["n"] * 4):
                prods[0].publish(RecordMeta.for_tensor(f"r{j}", rows, [0] * rows.shape[0], [1], True), rows)
            prods[0].flush(30.0)
            ans = {"endpoint": prods[0].endpoint, "token": prods[0].token}
        elif op == "cprofile" and prof is not None:
            import io
            import pstats

            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(cmd.get("sort", "tottime")).print_stats(30)
            ans = {"text": buf.getvalue()}
        elif op == "threads":
            import threading

            ans = {str(t.native_id): t.name for t in threading.enumerate()}
        elif op == "mark":
            stamps.clear()
            cpu0 = _thread_cpu()
        elif op == "collect":
            cpu1 = _thread_cpu()
            ans = {
                "stamps": list(stamps),
                "cpu": {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items() if v - cpu0.get(k, 0.0) > 0},
            }
        print(json.dumps(ans), file=chan, flush=True)
    for p in prods:
        p.close()


def role_bare_server() -> None:
    import zmq

    s = zmq.Context().socket(zmq.ROUTER)
    s.curve_server = True
    s.curve_secretkey = os.environ["PROBE_SECRET"].encode()
    port = s.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    big = os.urandom(SIZE + 64)
    while True:
        f = s.recv_multipart()
        if f[-1] == b"q":
            break
        s.send_multipart([f[0], f[1], big if f[-1] == b"big" else b"x"])


def role_bare_tcp_server() -> None:
    """A bare TCP server answering each 8-byte request with a few bytes or 64 KiB; it waits for requests as
    ``PROBE_WAIT`` says: ``recv`` (blocked in the read), ``select`` (``select.poll``, as the serving thread now
    waits) or ``zmq`` (``zmq.Poller`` on the raw descriptor beside a ZeroMQ socket, as it waited before)."""
    import select
    import socket

    import zmq

    how = os.environ["PROBE_WAIT"]
    ls = socket.create_server(("127.0.0.1", 0))
    print(ls.getsockname()[1], flush=True)
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    big, small = os.urandom(SIZE), b"x" * 8
    z = zmq.Context().socket(zmq.ROUTER)
    z.bind("tcp://127.0.0.1:*")
    zp = zmq.Poller()
    sp = select.poll()
    zp.register(c.fileno(), zmq.POLLIN)
    zp.register(z, zmq.POLLIN)
    sp.register(c.fileno(), select.POLLIN)
    sp.register(int(z.getsockopt(zmq.FD)), select.POLLIN)
    if how != "recv":
        c.setblocking(False)
    while True:
        if how == "zmq":
            zp.poll(200)
        elif how == "select":
            sp.poll(200)
        try:
            req = c.recv(64)
        except BlockingIOError:
            continue
        if not req or req.startswith(b"q"):
            break
        body = big if req.startswith(b"b") else small
        c.sendall(len(body).to_bytes(4, "little") + body)


def run_bare_tcp(a: argparse.Namespace) -> None:
    import socket
    import subprocess

    print("load", os.getloadavg())
    for how in ("recv", "select", "zmq"):
        env = {**os.environ, "PROBE_WAIT": how}
        srv = subprocess.Popen([sys.executable, __file__, "--role", "bare-tcp"], stdout=subprocess.PIPE, env=env)
        try:
            assert srv.stdout is not None
            c = socket.create_connection(("127.0.0.1", int(srv.stdout.readline())))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = bytearray(SIZE)
            for kind in (b"s", b"b"):
                ts = []
                for _ in range(a.n):
                    if a.gap_ms:
                        time.sleep(a.gap_ms / 1e3)
                    t0 = time.perf_counter_ns()
                    c.sendall(kind * 8)
                    n = int.from_bytes(c.recv(4, socket.MSG_WAITALL), "little")
                    got = 0
                    while got < n:
                        got += c.recv_into(memoryview(buf)[got:n], n - got)
                    ts.append((time.perf_counter_ns() - t0) / 1e3)
                answer = "small" if kind == b"s" else "64 KiB"
                print(f"bare TCP round trip, server waits in {how}, {answer} answer: median {_med(ts[5:]):.1f} us")
            c.sendall(b"q" * 8)
        finally:
            srv.wait(10)


def run_bare(a: argparse.Namespace) -> None:
    import subprocess

    import zmq

    public, secret = zmq.curve_keypair()
    env = {**os.environ, "PROBE_SECRET": secret.decode()}
    srv = subprocess.Popen([sys.executable, __file__, "--role", "bare"], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert srv.stdout is not None
        port = int(srv.stdout.readline())
        d = zmq.Context().socket(zmq.DEALER)
        d.curve_serverkey = public
        d.curve_publickey, d.curve_secretkey = zmq.curve_keypair()
        d.connect(f"tcp://127.0.0.1:{port}")
        print("load", os.getloadavg())
        for rep in range(a.reps):
            for kind in ("small", "big"):
                ts = []
                for _ in range(a.n):
                    if a.gap_ms:
                        time.sleep(a.gap_ms / 1e3)
                    t0 = time.perf_counter_ns()
                    d.send_multipart([b"h", kind.encode()])
                    d.recv_multipart()
                    ts.append((time.perf_counter_ns() - t0) / 1e3)
                print(f"bare CURVE round trip, {kind} answer, rep {rep}: median {_med(ts[5:]):.1f} us")
        d.send_multipart([b"h", b"q"])
    finally:
        srv.wait(10)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_config(name: str, kw: dict[str, Any], a: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from vllm_hs_compat.export import ExportConsumer
    from vllm_hs_compat.export import protocol as P

    w = Worker("producer", __file__, sys.executable, ROOT, TCP, log_dir / f"{name}.log")
    try:
        ep = w("start", producers=a.producers, n=a.n, kw=kw)
        os.environ.update(TCP)
        c = ExportConsumer(ep["endpoint"], ep["token"])
        out: dict[str, Any] = {}
        # warm-up
        for j in range(20):
            c.fetch(f"r{j}")
        c.settle_pending(5.0)
        for mi, mode in enumerate(a.modes.split(",")):
            keep = None
            w("mark")
            sends: list[int] = []
            recvs: list[int] = []
            totals: list[float] = []
            client = c._channel.client
            assert client is not None
            orig_call = client.call

            def call(
                req: Any, timeout_s: Any = None, rid: Any = None, _o: Any = orig_call, _s: Any = sends, _r: Any = recvs
            ) -> Any:
                _s.append(time.perf_counter_ns())
                try:
                    return _o(req, timeout_s, rid)
                finally:
                    _r.append(time.perf_counter_ns())

            client.call = call  # type: ignore[method-assign]
            claims: list[Any] = []
            t_all = time.perf_counter()
            for j in range(20, a.n):
                t0 = time.perf_counter_ns()
                if mode == "ping":
                    c._session.call(P.PingReq())
                elif mode == "claim":  # the fetch's claim alone (bytes in its answer), released after the loop
                    claims.append(c.claim(f"r{mi * a.n + j}"))
                else:
                    keep = c.fetch(f"r{mi * a.n + j}")
                totals.append((time.perf_counter_ns() - t0) / 1e3)
                if a.gap_ms:
                    time.sleep(a.gap_ms / 1e3)
            wall = time.perf_counter() - t_all
            client.call = orig_call  # type: ignore[method-assign]
            if claims:
                c.abandon(claims)
            got = w("collect")
            del keep
            c.settle_pending(5.0)
            ones = [t for k, t in got["stamps"] if k == "one"]
            sent = [t for k, t in got["stamps"] if k == "sent"]
            # the fetch is the first request after each consumer send (a posted release follows it)
            answered = [t for k, t in got["stamps"] if k == "answered"]
            up, serve, down, handle = [], [], [], []
            for s, r in zip(sends, recvs, strict=True):
                i1 = next((i for i, t in enumerate(ones) if t >= s), None)
                if i1 is None:
                    continue
                sd = next((t for t in sent if t >= ones[i1]), None)
                if sd is None or sd > r:
                    continue
                an = next((t for t in answered if t >= ones[i1]), None)
                if an is not None and an <= sd:
                    handle.append((an - ones[i1]) / 1e3)
                up.append((ones[i1] - s) / 1e3)
                serve.append((sd - ones[i1]) / 1e3)
                down.append((r - sd) / 1e3)
            n = a.n - 20
            out[mode] = {
                "total_us": _med(totals),
                "rtt_us": _med([(r - s) / 1e3 for s, r in zip(sends, recvs, strict=True)]),
                "up_us": _med(up),
                "serve_us": _med(serve),
                "handle_us": _med(handle),
                "down_us": _med(down),
                "producer_cpu_ms_per_op": {k: round(v * 1e3 / n, 3) for k, v in sorted(got["cpu"].items())},
                "producer_cpu_share": round(sum(got["cpu"].values()) / wall, 3),
            }
        c.close()
        return out
    finally:
        w.close()


CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "pump50us": {"claimed_poll_interval_s": 50e-6},
    "pumpslow": {"claimed_poll_interval_s": 2e-3, "poll_interval_s": 2e-3},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role")
    ap.add_argument("--bare", action="store_true", help="the floor: a bare ZeroMQ + CURVE round trip")
    ap.add_argument("--bare-tcp", action="store_true", help="the floor of the plain channel: a bare TCP round trip")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--gap-ms", type=float, default=0.0)
    ap.add_argument("--configs", default="default,pumpslow")
    ap.add_argument("--modes", default="ping,fetch")
    ap.add_argument("--extra", default="{}", help="JSON: more configurations name -> producer kwargs")
    a = ap.parse_args()
    if a.role == "producer":
        role_producer()
        return
    if a.role == "bare":
        role_bare_server()
        return
    if a.role == "bare-tcp":
        role_bare_tcp_server()
        return
    if a.bare:
        run_bare(a)
        return
    if a.bare_tcp:
        run_bare_tcp(a)
        return
    CONFIGS.update(json.loads(a.extra))
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "probe_small_fetch"
    log_dir.mkdir(exist_ok=True)
    names = a.configs.split(",")
    res: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
    print("load", os.getloadavg())
    for rep in range(a.reps):
        for k in names if rep % 2 == 0 else reversed(names):
            res[k].append(run_config(k, CONFIGS[k], a, log_dir))
    print("load", os.getloadavg())
    for k in names:
        for mode in a.modes.split(","):
            rows = [r[mode] for r in res[k]]
            f = {
                key: round(_med([r[key] for r in rows]), 1)
                for key in ("total_us", "rtt_us", "up_us", "serve_us", "handle_us", "down_us")
            }
            cpus: dict[str, list[float]] = {}
            for r in rows:
                for t, v in r["producer_cpu_ms_per_op"].items():
                    cpus.setdefault(t, []).append(v)
            print(f"{k:10s} {mode:5s} {f} cpu/op ms { ({t: round(_med(v), 3) for t, v in cpus.items()}) }")


if __name__ == "__main__":
    main()
