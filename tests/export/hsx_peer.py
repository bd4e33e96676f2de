"""The second process of the export tests: a producer or consumer driven by JSON lines on stdin.

Each stdin line is one command ``{"cmd": ..., ...}``; each answer is one stdout line.  Only JSON crosses the
pipe (nothing is unpickled).
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any
from unittest import mock

os.environ.setdefault("UCX_NET_DEVICES", "lo")
# The JSON channel is the original stdout; everything else printed to fd 1 (NIXL's log lines) goes to stderr.
CHANNEL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hsx_testdata import digest, make_meta, make_rows  # noqa: E402

from vllm_hs_compat.core.records import CaptureRecord  # noqa: E402
from vllm_hs_compat.errors import HsCompatError  # noqa: E402
from vllm_hs_compat.export import Claim, ExportConsumer, ExportProducer  # noqa: E402

producer: ExportProducer | None = None
consumer: ExportConsumer | None = None
claims: list[Claim] = []


def summary(res: CaptureRecord | HsCompatError, brief: bool = False) -> dict[str, Any]:
    if isinstance(res, CaptureRecord) and brief:  # long records: digests instead of the token ids
        return {
            "ok": True,
            "record_id": res.meta.record_id,
            "sha256": digest(res.hidden_states),
            "ids_sha256": hashlib.sha256(array.array("I", res.meta.token_ids).tobytes()).hexdigest(),
        }
    if isinstance(res, CaptureRecord):
        return {
            "ok": True,
            "record_id": res.meta.record_id,
            "sha256": digest(res.hidden_states),
            "shape": list(res.hidden_states.shape),
            "meta": res.meta.to_dict(),
        }
    return {"ok": False, "error": type(res).__name__, "message": str(res)}


def handle(cmd: dict[str, Any]) -> dict[str, Any]:
    global producer, consumer
    op = cmd.pop("cmd")
    if op == "producer":
        fake_pid = cmd.pop("fake_pid", None)
        if fake_pid is None:
            producer = ExportProducer(**cmd)
        else:  # as if this process had pid ``fake_pid`` in its own namespace (names its pool file with it)
            with mock.patch("os.getpid", return_value=fake_pid):
                producer = ExportProducer(**cmd)
        path = producer.transport.describe().get("path")
        return {
            "endpoint": producer.endpoint,
            "direct": producer.direct_endpoint,
            "plain": producer.plain_endpoint,
            "token": producer.token,
            "instance": producer.instance,
            "path": path,
        }
    if op == "close_producer":
        if producer is not None:
            producer.close()
            producer = None
        return {}
    if op == "rss":
        with open("/proc/self/status") as f:
            st = dict(line.split(":", 1) for line in f if ":" in line)
        return {"rss_mib": int(st["VmRSS"].split()[0]) / 1024, "threads": int(st["Threads"])}
    if op == "publish":
        if producer is None:
            raise RuntimeError("no producer")
        rows = make_rows(cmd["seed"], cmd["tokens"], cmd["planes"], cmd["hidden"], cmd.get("dtype", "bfloat16"))
        ticket = producer.publish(make_meta(cmd["record_id"], rows, cmd["seed"]), rows)
        return {"params": ticket.kv_transfer_params()}
    if op == "pstats":
        if producer is None:
            raise RuntimeError("no producer")
        return {"stats": producer.stats(), "endpoint": producer.endpoint}
    if op == "consumer":
        if consumer is not None:
            consumer.close()
        consumer = ExportConsumer(**cmd)
        return {"producer": consumer.producer}
    if op == "ticket_consumer":  # a client holding only its ticket (no token in this process's environment)
        if consumer is not None:
            consumer.close()
        consumer = ExportConsumer.from_params(cmd.pop("params"), **cmd)
        return {"producer": consumer.producer, "principal": consumer.principal, "hello": consumer.hello}
    if consumer is None:
        raise RuntimeError("no consumer")
    if op == "fetch":
        out = []
        for rid in cmd["ids"]:
            try:
                out.append(summary(consumer.fetch(rid, copy=cmd.get("copy", True))))
            except HsCompatError as e:
                out.append(summary(e))
        return {"results": out}
    if op == "iter":
        out = []
        kw = {"batch": cmd["batch"]} if "batch" in cmd else {"batch": 16} if not cmd.get("default_batch") else {}
        stream = consumer.iter_records(wait_s=cmd.get("wait_s", 0.2), idle_timeout_s=cmd["idle_s"], **kw)
        while len(out) < cmd.get("max", 1 << 30):
            try:
                out.append(summary(next(stream), cmd.get("brief", False)))
            except StopIteration:
                break
            except HsCompatError as e:
                out.append(summary(e))
        return {"results": out}
    if op == "remote_stats":
        try:
            return {"stats": consumer.remote_stats()}
        except HsCompatError as e:
            return summary(e)
    if op == "claim":
        new = [consumer.claim(rid) for rid in cmd["ids"]]
        claims.extend(new)
        return {"n": len(new)}
    if op == "claim_next":  # lease a batch and hold it (a trainer about to be killed)
        new = consumer.claim_next(cmd["n"], wait_s=cmd.get("wait_s", 0.5))
        claims.extend(new)
        return {"n": len(new)}
    if op == "read_slowly":  # read held claims one at a time, pausing between them (a slow trainer)
        out = []
        while claims:
            (res,) = consumer.read([claims.pop(0)])
            out.append(summary(res))
            print(json.dumps({"progress": len(out)}), file=CHANNEL, flush=True)
            time.sleep(cmd["pause_s"])
        return {"results": out}
    if op == "read_forever":  # keep one claimed record's bytes in flight until killed
        c = claims[0]
        transport = consumer._landing.transport
        if transport is None:
            raise RuntimeError("no transport")
        print(json.dumps({"progress": "looping"}), file=CHANNEL, flush=True)
        while True:
            transport.read([(c.offset, 0, c.nbytes)], time.monotonic() + 30)
    if op == "cstats":
        return {"stats": consumer.stats()}
    raise ValueError(f"unknown command {op!r}")


def main() -> None:
    print(json.dumps({"ready": os.getpid()}), file=CHANNEL, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            ans = {"ok": True, **handle(json.loads(line))}
        except Exception as e:
            ans = {"ok": False, "error": type(e).__name__, "message": str(e), "tb": traceback.format_exc()}
        print(json.dumps(ans), file=CHANNEL, flush=True)
    for obj in (consumer, producer):
        if obj is not None:
            obj.close()


if __name__ == "__main__":
    main()
