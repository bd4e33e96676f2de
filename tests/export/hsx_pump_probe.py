"""A process of the pump tests: a NIXL producer and its consumer over UCX's TCP transport (a two-sided READ: the
producer's pump must progress UCX to answer it).  Prints one JSON line of timings and CPU figures.

    UCX_TLS=tcp UCX_NET_DEVICES=lo python hsx_pump_probe.py [--deaf]

``--deaf``: the negative control -- the pump's wake event ignores ``set()``, as before a claim woke the pump.
``--inline-as-read``: the negative control of the inline case -- a lease whose bytes went in its claim's answer
counts as one a READ may come for, and the claim wakes the pump as one answered without its bytes (as before).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
CHANNEL = os.fdopen(os.dup(1), "w", buffering=1)  # NIXL's log lines go to stderr
os.dup2(2, 1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hsx_testdata import make_meta, make_rows  # noqa: E402

from vllm_hs_compat.export import ExportConsumer, ExportProducer  # noqa: E402
from vllm_hs_compat.export import protocol as P  # noqa: E402
from vllm_hs_compat.export.producer import HOT_S  # noqa: E402

IDLE_POLL_S = 1.5  # the idle pump waits this long unless woken: a READ it does not answer waits for it


class _Deaf(threading.Event):
    def set(self) -> None:
        pass


def cpu_s() -> float:
    with open(f"/proc/{os.getpid()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_over(window_s: float) -> float:
    c0, t0 = cpu_s(), time.monotonic()
    time.sleep(window_s)
    return (cpu_s() - c0) / (time.monotonic() - t0)


def main() -> None:
    deaf = "--deaf" in sys.argv
    inline_as_read = "--inline-as-read" in sys.argv
    rows = [make_rows(i, 4, 2, 256) for i in range(4)]  # 4 KiB records
    out: dict[str, float] = {}
    p = ExportProducer(backend="nixl", num_slots=8, slot_bytes=64 << 10, idle_poll_interval_s=IDLE_POLL_S)
    if deaf:
        p._wake = _Deaf()
    if inline_as_read:
        p.pool.mark_inline = lambda ids: None  # type: ignore[method-assign]
        handle = p._handle

        def old_handle(req: Any, call: Any) -> Any:
            rep = handle(req, call)
            if isinstance(rep, P.FetchReply) and rep.records:
                p._wake_pump(claimed=True)
            return rep

        p._server._handler = old_handle
    # inline_bytes=0: the record comes by READ, which only the pump answers (a small record would otherwise come in
    # the claim's answer, with no READ for the pump to answer)
    c = ExportConsumer(p.endpoint, p.token, landing_bytes=1 << 20, timeout_s=2 * IDLE_POLL_S + 5, inline_bytes=0)
    try:
        for i, r in enumerate(rows):
            p.publish(make_meta(f"r{i}", r), r)
        c.fetch("r0")  # wire-up
        time.sleep(HOT_S + 0.3)  # no request for longer than the hot window: the pump waits idle
        t0 = time.perf_counter()
        c.fetch("r1")
        out["lone_fetch_s"] = time.perf_counter() - t0
        if not deaf:
            time.sleep(HOT_S + 0.2)
            out["idle_cpu"] = cpu_over(1.0)  # the pump waits; every lease was released
            held = c.claim("r2")  # a claimed lease, never released: the pump polls back to back
            out["claimed_cpu"] = cpu_over(0.5)
            c.abandon([held])
            # a small record fetched by id: its bytes come in the claim's answer, no READ follows, so the claimed
            # lease (held, not yet released) leaves the pump waiting
            c2 = ExportConsumer(p.endpoint, p.token, landing_bytes=1 << 20, timeout_s=5)
            try:
                time.sleep(HOT_S + 0.2)  # past the hot window of c2's hello and of the claim above
                inline = c2.claim("r3")
                if inline.inline is None:
                    raise RuntimeError("r3 did not come in its claim's answer")
                out["inline_claimed_cpu"] = cpu_over(0.5)
                c2.abandon([inline])
            finally:
                c2.close()
        out["pump_errors"] = p.stats()["pump_errors"]
    finally:
        if deaf:
            threading.Event.set(p._wake)  # let the pump leave its wait now, so close() need not wait for it
        c.close()
        p.close()
    print(json.dumps(out), file=CHANNEL, flush=True)


if __name__ == "__main__":
    main()
