"""GPU-direct export probe: can a trainer process READ a producer's pool that lives in device memory (VRAM) over
NIXL/UCX, with no host copy?  Two processes on one GPU (the only shape a one-GPU machine allows).

Not a test and not library code: it prints what worked, the bandwidth of each READ and, from the same run, the
limits it compares with (a device-to-device copy and a device-to-host copy of the same bytes in one process).

    UCX_NET_DEVICES=lo python benchmarks/probe_gpu_direct.py --mib 1024 --reps 5
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch

NIXL = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")


def _api() -> Any:
    errors = []
    for name in NIXL:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise SystemExit("no NIXL: " + "; ".join(errors))


def _wait(agent: Any, handle: Any, deadline_s: float) -> str:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        state = agent.check_xfer_state(handle)
        if state != "PROC":
            return str(state)
    return "TIMEOUT"


def producer(conn: Any, nbytes: int) -> None:
    try:
        api = _api()
        agent = api.nixl_agent("producer", api.nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        pool = torch.empty(nbytes // 8, dtype=torch.int64, device="cuda")
        pool.random_()
        checksum = int(pool.sum())
        reg = agent.register_memory([(pool.data_ptr(), nbytes, 0, "")], "VRAM")
        conn.send({"meta": bytes(agent.get_agent_metadata()), "ptr": pool.data_ptr(), "checksum": checksum})
        while True:
            if conn.poll(0.001):
                msg = conn.recv()
                if msg == "done":
                    break
            agent.get_new_notifs()  # drives UCX progress for the consumer's connection
        agent.deregister_memory(reg)
        conn.send("bye")
    except Exception:
        conn.send({"error": traceback.format_exc()})


def consumer(info: dict[str, Any], nbytes: int, reps: int, landing_kind: str) -> list[float]:
    api = _api()
    agent = api.nixl_agent(
        f"consumer-{landing_kind}", api.nixl_agent_config(backends=["UCX"], enable_prog_thread=False)
    )
    if landing_kind == "VRAM":
        landing = torch.zeros(nbytes // 8, dtype=torch.int64, device="cuda")
    else:
        landing = torch.zeros(nbytes // 8, dtype=torch.int64, pin_memory=True)
    reg = agent.register_memory([(landing.data_ptr(), nbytes, 0, "")], landing_kind)
    remote = agent.add_remote_agent(info["meta"])
    local = agent.get_xfer_descs([(landing.data_ptr(), nbytes, 0)], landing_kind)
    far = agent.get_xfer_descs([(info["ptr"], nbytes, 0)], "VRAM")
    times = []
    for _ in range(reps + 1):
        landing.zero_()
        if landing.is_cuda:
            torch.cuda.synchronize()
        handle = agent.initialize_xfer("READ", local, far, remote, b"")
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        if state != "DONE":
            state = _wait(agent, handle, 60.0)
        dt = time.perf_counter() - t0
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"READ into {landing_kind} ended in state {state}")
        got = int(landing.sum()) if landing.is_cuda else int(landing.sum())
        if got != info["checksum"]:
            raise RuntimeError(f"READ into {landing_kind}: checksum {got} != producer's {info['checksum']}")
        times.append(dt)
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    return times[1:]


def _ipc_child(q: Any, r: Any) -> None:
    t = q.get()
    r.put(int(t.sum()))
    q.get()  # hold the tensor until the parent is done


def torch_cuda_ipc_works() -> str:
    """Does plain CUDA IPC (cudaIpcGetMemHandle / OpenMemHandle, what UCX's cuda_ipc transport uses) work
    between two processes here?  torch.multiprocessing shares CUDA tensors that way."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(q, r), daemon=True)
    p.start()
    t = torch.arange(1 << 20, dtype=torch.int64, device="cuda")
    q.put(t)
    try:
        got = r.get(timeout=60)
    except Exception as e:
        return f"no answer ({type(e).__name__})"
    finally:
        q.put(None)
        p.join(30)
    return "yes" if got == int(t.sum()) else f"wrong sum {got}"


def limits(nbytes: int, reps: int) -> dict[str, float]:
    a = torch.empty(nbytes // 8, dtype=torch.int64, device="cuda")
    b = torch.empty_like(a)
    h = torch.empty(nbytes // 8, dtype=torch.int64, pin_memory=True)
    out = {}
    for name, fn in (("device copy", lambda: b.copy_(a)), ("D2H copy", lambda: h.copy_(a, non_blocking=True))):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    nbytes = args.mib << 20
    print(f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')} UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')}")
    print(f"torch CUDA IPC between two processes: {torch_cuda_ipc_works()}", flush=True)
    lim = limits(nbytes, args.reps)
    for name, t in lim.items():
        print(f"limit {name:12s} {nbytes / t / 1e9:8.1f} GB/s ({args.mib} MiB, one process)", flush=True)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(child, nbytes), daemon=True)
    proc.start()
    if not parent.poll(120):
        raise SystemExit("producer did not start within 120 s")
    info = parent.recv()
    if "error" in info:
        print("producer failed:\n" + info["error"])
        sys.exit(1)
    status = 0
    for kind in ("VRAM", "DRAM"):
        try:
            ts = consumer(info, nbytes, args.reps, kind)
        except Exception:
            print(f"READ VRAM -> {kind}: FAILED\n{traceback.format_exc()}", flush=True)
            status = 1
            continue
        med = statistics.median(ts)
        ref = lim["device copy"] if kind == "VRAM" else lim["D2H copy"]
        print(
            f"READ producer VRAM -> consumer {kind}: {nbytes / med / 1e9:8.1f} GB/s median "
            f"(min {nbytes / max(ts) / 1e9:.1f}, max {nbytes / min(ts) / 1e9:.1f}) = {ref / med:4.2f}x "
            f"{'device copy' if kind == 'VRAM' else 'D2H copy'}; checksum ok",
            flush=True,
        )
    parent.send("done")
    parent.poll(30)
    proc.join(30)
    sys.exit(status)


if __name__ == "__main__":
    main()
