"""The trainer's side of the export, in a process of its own.

    python e2e_consumer.py ARGS.json

``ARGS.json``: ``tickets`` (the finished requests' ``kv_transfer_params``), ``token_file`` (the trainer credential
the serving worker wrote; tickets never carry it), ``out_dir``, ``producer_pid``.  Fetches every ticket's record through
``vllm_hs_compat.export.ExportConsumer`` over shared memory (checksums verified by the consumer), then drains the
producer's stream for anything it published beyond the tickets, and writes each record as
``<n>.safetensors`` (``hidden_states``) + ``<n>.json`` (its self-describing metadata) plus ``summary.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main(path: str) -> int:
    from safetensors.torch import save_file

    from vllm_hs_compat.export import ExportConsumer
    from vllm_hs_compat.export.control import read_token

    args = json.loads(Path(path).read_text())
    out = Path(args["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"pid": os.getpid(), "producer_pid": args.get("producer_pid"), "fetched": [], "extra": []}
    if args.get("producer_pid") is not None and args["producer_pid"] == os.getpid():
        raise SystemExit("the consumer must not run in the producer's process")
    # The credential is never in the ticket: the trainer reads the token file the serving worker wrote.
    token = read_token(args["token_file"])
    consumers: dict[tuple[str, str], ExportConsumer] = {}
    t0 = time.monotonic()
    n = 0
    for ticket in args["tickets"]:
        entry = ticket["hs_export"]
        endpoint = entry["endpoint"]
        key = (endpoint, entry.get("producer", ""))
        if key not in consumers:
            consumers[key] = ExportConsumer.from_params(ticket, token=token, backend="shm", timeout_s=30.0)
        rec = consumers[key].fetch(entry["record_id"], timeout_s=60.0, wait_s=60.0)
        save_file({"hidden_states": rec.hidden_states.contiguous()}, str(out / f"{n}.safetensors"))
        meta = rec.meta.to_dict()
        (out / f"{n}.json").write_text(json.dumps({"record_id": entry["record_id"], "meta": meta}))
        summary["fetched"].append({"n": n, "record_id": entry["record_id"], "endpoint": endpoint})
        n += 1
    # Anything published beyond the tickets (a second writer, a duplicate) is still in the producer's pool.
    for c in consumers.values():
        for rec in c.iter_records(wait_s=0.5, idle_timeout_s=2.0):
            summary["extra"].append({"record_id": rec.meta.record_id, "tokens": int(rec.hidden_states.shape[0])})
        summary.setdefault("counters", []).append(dict(c.counters))
        transport = c.hello.get("transport", {})
        # The shm transport names the pool file and the pid of the process that owns it: the producer.
        summary.setdefault("transports", []).append(
            {"kind": transport.get("kind"), "pid": transport.get("pid"), "path": transport.get("path")}
        )
        c.close()
    summary["seconds"] = time.monotonic() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "fetched"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
