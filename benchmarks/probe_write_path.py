"""Where a captured record's bytes go on their way to disk, per stage, on this host (docs/gpu.md, "Throughput").

    python benchmarks/probe_write_path.py DIR [DIR ...] [--records 16] [--tokens 2048]

For each folder: N records of ``tokens x 4 x 4096`` bf16 (an 8B verifier's 4 captured planes; 64 MiB each at 2,048
tokens), each to a new file, measured stage by stage on the same rows --

* ``sink``       -- the connector's file sink as it writes a record (``export.files.write_record``, checksum given,
                    as the connector gives it);
* ``save_file``  -- safetensors' ``save_file`` of the same tensors and header to a temporary name, then renamed:
                    the bytes written once, straight from the tensor;
* ``adopt``      -- the capture store adopting the sink's records (read back, checksum, token ids, NaN/Inf check,
                    moved into a shard), then ``close`` (the index part made durable: syncfs);

and prints GB/s of each against the engine's byte rate a user would need to keep up with.  A benchmark, not a
test: it checks nothing but that every record was adopted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    a = ap.parse_args()
    from safetensors.torch import save_file

    from vllm_hs_compat.capture.rows import SampleInfo
    from vllm_hs_compat.capture.store import CaptureStore
    from vllm_hs_compat.core.checksums import compute_checksum
    from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
    from vllm_hs_compat.export import files

    rows = torch.randn(a.tokens, 4, 4096).to(torch.bfloat16)
    ids = list(range(3, 3 + a.tokens))
    base = RecordMeta.for_tensor("r", rows, ids, [2, 16, 29, 32], pre_norm=True)
    base = base.with_checksum(compute_checksum(rows.view(torch.uint8).reshape(-1), base.checksum_algorithm))
    gb = a.records * rows.numel() * rows.element_size() / 1e9
    for d in map(Path, a.dirs):
        work = d / f"probe-write-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        res: dict[str, float] = {}
        # save_file: the bytes once, from the tensor
        (work / "plain").mkdir(parents=True)
        t = time.perf_counter()
        for i in range(a.records):
            tmp = work / "plain" / f".r{i}.tmp"
            save_file(
                {"hidden_states": rows, "token_ids": torch.tensor(ids)},
                str(tmp),
                {"record": json.dumps(base.to_dict())},
            )
            os.replace(tmp, work / "plain" / f"r{i}.safetensors")
        res["save_file"] = time.perf_counter() - t
        shutil.rmtree(work / "plain")
        # the sink, then the store adopting what it wrote
        store = CaptureStore(work / "tree", run_config={"probe": 1})
        stage = store.staging_dir()
        stage.mkdir(parents=True, exist_ok=True)
        manifests = []
        t = time.perf_counter()
        for i in range(a.records):
            meta = RecordMeta.from_dict({**base.to_dict(), "request_id": f"r{i}", "sample_id": f"r{i}"})
            manifests.append(files.write_record(stage, CaptureRecord(meta, rows)))
        res["sink"] = time.perf_counter() - t
        t = time.perf_counter()
        for i, m in enumerate(manifests):
            row = store.adopt(SampleInfo(f"r{i}", "probe", a.tokens, input_ids=tuple(ids)), m)
            if row.status != "ok":
                raise SystemExit(f"record {i} not adopted: {row.reason}: {row.message}")
        res["adopt"] = time.perf_counter() - t
        t = time.perf_counter()
        store.close()
        res["close (syncfs)"] = time.perf_counter() - t
        shutil.rmtree(work, ignore_errors=True)
        line = "  ".join(f"{k} {gb / v:.2f} GB/s ({v:.2f} s)" for k, v in res.items())
        print(f"{d}: {a.records} records, {gb:.2f} GB: {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
