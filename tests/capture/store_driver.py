"""A capture run against a real output tree, for the store's kill-and-resume and two-rank tests.

It does what ``vllm-hs-compat capture`` does around the engine: for each owned sample that is not done, a record
made of random tensors is written into ``store.staging_dir()`` with ``export.files.write_record`` (as the
connector's file sink would), then ``store.adopt`` moves it into the tree.  Run as a script
(``python tests/capture/store_driver.py --out DIR [--kill POINT:N] [--unsafe] ...``) or call :func:`run` in a
process of one's own (the tests fork it from a forkserver that has imported torch once)."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

from vllm_hs_compat.capture import durable
from vllm_hs_compat.capture.store import CaptureStore, SampleInfo, Summary
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.export import files

RUN_CONFIG = {"model": "tiny-llama", "layers": [1, 2], "mode": "prompt", "template": "abc123"}
LAYERS = (1, 2)
HIDDEN = 8


def sample_id(i: int) -> str:
    return f"s{i:04d}"


def token_ids(i: int) -> tuple[int, ...]:
    """The ids the engine is given for sample ``i`` (3..9 tokens)."""
    g = random.Random(i)
    return tuple(g.randrange(1, 32000) for _ in range(3 + i % 7))


def hidden_states(i: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, len(LAYERS), HIDDEN, generator=g).to(torch.bfloat16)


def stage(staging: Path, i: int, *, wrong_ids: bool = False) -> tuple[SampleInfo, Path]:
    """Write sample ``i``'s record into ``staging`` under an engine-style request id; return the sample's info
    and the manifest.  ``wrong_ids``: the engine ran other ids than the sample's (a tokenizer mismatch)."""
    ids = token_ids(i)
    ran = tuple(t + 1 for t in ids) if wrong_ids else ids
    meta = RecordMeta(
        record_id=f"req-{os.getpid()}-{i}",
        token_ids=ran,
        layer_ids=LAYERS,
        pre_norm=True,
        dtype="bfloat16",
        shape=(len(ran), len(LAYERS), HIDDEN),
        num_prompt_tokens=len(ran),
    )
    manifest = files.write_record(staging, CaptureRecord(meta, hidden_states(i, len(ran))))
    info = SampleInfo(
        sample_id=sample_id(i),
        source=f"data.jsonl:{i}",
        num_tokens=len(ids),
        loss_tokens=len(ids) // 2,
        metadata={"i": i},
        input_ids=ids,
    )
    return info, manifest


def run(
    out: str,
    *,
    samples: int = 20,
    rank: int = 0,
    world_size: int = 1,
    per_shard: int = 5,
    kill: tuple[str, int] | None = None,
    unsafe: bool = False,
    mismatch: frozenset[int] = frozenset(),
    delay: float = 0.0,
) -> Summary:
    """One capture run over samples ``0..samples-1``; ``kill``/``unsafe`` set the store's test hooks
    (capture/durable.py) in this process; ``mismatch``: samples whose engine ids differ from the data's; ``delay``:
    seconds between samples."""
    durable._KILL_AT = kill
    durable._UNSAFE = unsafe
    torch.set_num_threads(1)
    with CaptureStore(
        out, run_config=RUN_CONFIG, rank=rank, world_size=world_size, records_per_shard=per_shard
    ) as store:
        for i in range(samples):
            sid = sample_id(i)
            store.note_rows(read=1)
            if not store.owns(sid):
                continue
            if store.done(sid):
                store.note_rows(skipped=1)
                continue
            info, manifest = stage(store.staging_dir(), i, wrong_ids=i in mismatch)
            store.adopt(info, manifest)
            if delay:
                time.sleep(delay)
        return store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--per-shard", type=int, default=5)
    ap.add_argument("--kill", default=None, help="POINT:N (see durable._KILL_AT)")
    ap.add_argument("--unsafe", action="store_true")
    ap.add_argument("--mismatch", default="", help="comma-separated sample numbers")
    ap.add_argument("--delay", type=float, default=0.0)
    a = ap.parse_args(argv)
    kill = None
    if a.kill:
        point, n = a.kill.rsplit(":", 1)
        kill = (point, int(n))
    summary = run(
        a.out,
        samples=a.samples,
        rank=a.rank,
        world_size=a.world_size,
        per_shard=a.per_shard,
        kill=kill,
        unsafe=a.unsafe,
        mismatch=frozenset(int(x) for x in a.mismatch.split(",") if x),
        delay=a.delay,
    )
    print(summary.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
