"""UCX settings for a raw NIXL READ over UCX's TCP transport, side by side (not a test).

    python benchmarks/probe_ucx_tcp.py "" "UCX_TCP_TX_SEG_SIZE=256k,UCX_TCP_RX_SEG_SIZE=256k" [REPS=6 in the env]

Each argument is one configuration: comma-separated ``KEY=VALUE`` environment settings ("" = UCX's defaults);
``P_KEY`` applies to the producer only, ``C_KEY`` to the consumer only; ``C_POLL=sleep`` makes the consumer poll as
the package's does (2 ms without pause, then 50 us sleeps) instead of spinning.  Every configuration gets its own
producer process (a NIXL agent with a 64 MiB registered buffer, progressed every 50 us as the producer's pump
does) and consumer process (NIXL agent, 64 MiB landing buffer); reads of 64 KiB, 1 MiB, 16 MiB and 64 MiB go to
each configuration in turn (order reversed every other repetition), so load drifts hit all of them alike; the
first repetition is dropped.  Printed: the median READ time per size and configuration.  ``UCX_TLS=tcp``,
``UCX_NET_DEVICES=lo`` unless given.  The package sets nothing here: the configurations are the environments.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

SIZES = (64 << 10, 1 << 20, 16 << 20, 64 << 20)
BUF = 64 << 20


def _side(env: dict[str, str], me: str, other: str) -> dict[str, str]:
    return {k[2:] if k.startswith(me) else k: v for k, v in env.items() if not k.startswith(other) and k != "C_POLL"}


def _producer(conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(_side(env, "P_", "C_"))
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("prod", nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
    buf = torch.ones(BUF, dtype=torch.uint8)
    agent.register_memory([(buf.data_ptr(), BUF, 0, "")], "DRAM")
    conn.send((bytes(agent.get_agent_metadata()), buf.data_ptr()))
    while not conn.poll(0):
        agent.get_new_notifs()  # progresses UCX, as the producer's pump does
        time.sleep(50e-6)


def _consumer(conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(_side(env, "C_", "P_"))
    sleepy = env.get("C_POLL") == "sleep"
    mine, theirs = mp.Pipe()
    prod = mp.Process(target=_producer, args=(theirs, env))
    prod.start()
    metadata, base = mine.recv()
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("cons", nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
    land = torch.zeros(BUF, dtype=torch.uint8)
    agent.register_memory([(land.data_ptr(), BUF, 0, "")], "DRAM")
    agent.add_remote_agent(metadata)
    conn.send("ready")
    while (size := conn.recv()) is not None:
        local = agent.get_xfer_descs([(land.data_ptr(), size, 0)], "DRAM")
        remote = agent.get_xfer_descs([(base, size, 0)], "DRAM")
        t0 = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, "prod", b"")
        state = agent.transfer(handle)
        spin_until = time.monotonic() + 2e-3
        while state == "PROC":
            state = agent.check_xfer_state(handle)
            if sleepy and state == "PROC" and time.monotonic() > spin_until:
                time.sleep(50e-6)
        dt = time.perf_counter() - t0
        handle.release()
        conn.send(dt if state == "DONE" else -1.0)
    mine.send("stop")
    prod.join()


def main() -> None:
    mp.set_start_method("spawn")
    base = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    configs = [dict(kv.split("=", 1) for kv in arg.split(",") if kv) for arg in sys.argv[1:]] or [{}]
    workers: list[tuple[dict[str, str], Connection, Any]] = []
    for cfg in configs:
        mine, theirs = mp.Pipe()
        proc = mp.Process(target=_consumer, args=(theirs, {**base, **cfg}))
        proc.start()
        mine.recv()
        workers.append((cfg, mine, proc))
    times: list[dict[int, list[float]]] = [{s: [] for s in SIZES} for _ in configs]
    reps = int(os.environ.get("REPS", "6"))
    for rep in range(reps + 1):
        for size in SIZES:
            for _ in range(3 if size <= (1 << 20) else 1):
                order = list(range(len(configs)))[:: -1 if rep % 2 else 1]
                for i in order:
                    workers[i][1].send(size)
                    dt = workers[i][1].recv()
                    if dt < 0:
                        raise SystemExit(f"a READ failed under {configs[i]}")
                    if rep:
                        times[i][size].append(dt)
    for i, (cfg, conn, proc) in enumerate(workers):
        conn.send(None)
        proc.join()
        medians = {s: round(statistics.median(v) * 1e3, 2) for s, v in times[i].items()}
        print(json.dumps({"config": cfg or "UCX defaults", "median_ms": medians}), flush=True)


if __name__ == "__main__":
    main()
