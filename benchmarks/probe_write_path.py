"""Where a captured record's bytes go on their way to disk, per stage, on this host (docs/gpu.md, "Throughput").

    python benchmarks/probe_write_path.py DIR [DIR ...] [--records 16] [--tokens 2048]

For each folder: N records of ``tokens x 4 x 4096`` bf16 (an 8B verifier's 4 captured planes; 64 MiB each at 2,048
tokens), each to a new file, measured stage by stage on the same rows --

* ``sink``       -- the connector's file sink as it writes a record (``export.files.write_record``, checksum given,
                    as the connector gives it);
* ``save_file``  -- safetensors' ``save_file`` of the same tensors and header to a temporary name, then renamed:
                    the bytes written once, straight from the tensor;
* ``bytes+write`` -- the same file built whole as bytes (safetensors' ``save``), then written: how the sink wrote
                    before 2026-12-06;
* ``adopt``      -- the capture store adopting the sink's records (read back, checksum, token ids, NaN/Inf check,
                    moved into a shard) through the capture's own ``Batches.adopt_batch``, each record checked
                    when adopted; ``adopt (checked ahead)`` the same with the capture's default threads checking
                    the next records while one is adopted (``batches.CHECK_THREADS``); then ``close`` (the index
                    part made durable: syncfs);

and prints GB/s of each against the engine's byte rate a user would need to keep up with.  A benchmark, not a
test: it checks nothing but that every record was adopted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`'s SIGTERM runs the cleanup below
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    a = ap.parse_args()
    from safetensors.torch import save, save_file

    from vllm_hs_compat.capture import batches
    from vllm_hs_compat.capture.rows import SampleInfo
    from vllm_hs_compat.capture.staged import record_files
    from vllm_hs_compat.capture.store import CaptureStore
    from vllm_hs_compat.core.checksums import compute_checksum
    from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
    from vllm_hs_compat.export import files

    default_threads = batches.CHECK_THREADS  # the capture's own default on this host
    rows = torch.randn(a.tokens, 4, 4096).to(torch.bfloat16)
    ids = list(range(3, 3 + a.tokens))
    base = RecordMeta.for_tensor("r", rows, ids, [2, 16, 29, 32], pre_norm=True)
    base = base.with_checksum(compute_checksum(rows.view(torch.uint8).reshape(-1), base.checksum_algorithm))
    gb = a.records * rows.numel() * rows.element_size() / 1e9
    one = rows.numel() * rows.element_size() / 1e9
    tensors = {"hidden_states": rows, "token_ids": torch.tensor(ids)}
    header = {"record": json.dumps(base.to_dict())}

    def via_save_file(path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), header)
        os.replace(tmp, path)

    def via_bytes(path: Path) -> None:  # how the sink wrote before: the whole file built as bytes, then written
        tmp = path.with_name(f".{path.name}.tmp")
        blob = save(tensors, header)
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)

    def via_sink(path: Path, i: int) -> list[Path]:
        meta = RecordMeta.from_dict({**base.to_dict(), "request_id": f"r{i}", "sample_id": f"r{i}"})
        manifest = files.write_record(path, CaptureRecord(meta, rows))
        return [manifest, manifest.with_suffix(".safetensors")]

    for d in map(Path, a.dirs):
        work = d / f"probe-write-{os.getpid()}"
        try:
            shutil.rmtree(work, ignore_errors=True)
            (work / "plain").mkdir(parents=True)
            # 1. the writers side by side: per record, each in turn (each first as often as the others), each file
            #    deleted once written, so that none pays for the others' pages
            each: dict[str, list[float]] = {"sink": [], "save_file": [], "bytes+write": []}
            for i in range(a.records):
                order = list(each)[i % 3 :] + list(each)[: i % 3]
                for name in order:
                    t = time.perf_counter()
                    if name == "sink":
                        made = via_sink(work / "plain", i)
                    else:
                        made = [work / "plain" / f"{name}-{i}.safetensors"]
                        (via_save_file if name == "save_file" else via_bytes)(made[0])
                    each[name].append(time.perf_counter() - t)
                    for f in made:
                        f.unlink()
            res = {k: one / statistics.median(v) for k, v in each.items()}
            # 2. the store adopting the sink's records (read back, checksum, token ids, NaN/Inf, moved into a shard)
            #    through the capture's own path (Batches.adopt_batch), each record checked when it is adopted, then
            #    with the capture's default threads checking ahead; then closing (the index part made durable:
            #    syncfs of the folder's file system)
            #    Each way twice, in the order A B B A, so that neither gains from going first or last.
            adopt_s: dict[str, list[float]] = {"adopt": [], "adopt (checked ahead)": []}
            ways = (("adopt", 1), ("adopt (checked ahead)", default_threads))
            for n, (name, threads) in enumerate((*ways, *reversed(ways))):
                store = CaptureStore(work / f"tree-{n}", run_config={"probe": 1})
                stage = store.staging_dir()
                stage.mkdir(parents=True, exist_ok=True)
                outcomes = []
                for i in range(a.records):
                    m = via_sink(stage, i)[0]
                    info = SampleInfo(f"r{i}", "probe", a.tokens, input_ids=tuple(ids))
                    _, manifest, error = record_files(m)
                    outcomes.append(batches.Outcome(info, info, {"manifest": str(manifest), "error": str(error)}))
                work_ = batches.Batches(
                    argparse.Namespace(retries=0, max_consecutive_failures=a.records + 1),
                    capture="prompt",
                    storage="captured",
                    store=store,
                    llm=None,
                    note_row=lambda row: None,
                    check_threads=threads,
                )
                t = time.perf_counter()
                work_.adopt_batch(outcomes, time.monotonic() + 60, threading.Event())
                adopt_s[name].append(time.perf_counter() - t)
                if store.run_summary().captured != a.records:
                    raise SystemExit(f"{name}: {store.run_summary().captured} of {a.records} records adopted")
                t = time.perf_counter()
                store.close()
                res["close (syncfs)"] = gb / (time.perf_counter() - t)
                shutil.rmtree(work / f"tree-{n}", ignore_errors=True)
            res.update({name: gb / statistics.mean(v) for name, v in adopt_s.items()})
            line = "  ".join(f"{k} {v:.2f}" for k, v in res.items())
            print(
                f"{d}: {a.records} records of {one * 1e3:.0f} MB, GB/s (writes: median per record): {line}; "
                f"sink / save_file {res['sink'] / res['save_file']:.2f}x, bytes+write / save_file "
                f"{res['bytes+write'] / res['save_file']:.2f}x, adopt checked ahead / one by one "
                f"{res['adopt (checked ahead)'] / res['adopt']:.2f}x ({default_threads} threads)",
                flush=True,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)  # a probe stopped by its time limit leaves nothing either
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
