"""Per-record costs of a record's metadata on its way: built at the connector (``for_tensor``), the producer's
checksum copy and descriptor encoding, the consumer's descriptor decoding (256 at once, and one), its claim checks
and the token ids attached after the read.

Runs on this tree and on one from before wire 4 (``MetaWire``, ``meta_to_wire``/``meta_from_wire``), so the two are
measured side by side: ``PYTHONPATH=<tree> python benchmarks/bench_record_meta.py [repeats]`` prints the best of
``repeats`` (default 15) runs of each step, in microseconds (docs/benchmarks.md, "Record metadata").
"""

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.consumer.claims import Claim

OLD = hasattr(P, "MetaWire")
ROWS = torch.zeros(16, 4, 64, dtype=torch.bfloat16)
IDS = list(range(16))


def build() -> RecordMeta:
    return RecordMeta.for_tensor(
        "req-000001", ROWS, IDS, [2, 5, 9, 14], True, vllm_version="0.32.0", adapter="v0_29", num_prompt_tokens=8
    )


META = build().with_checksum(123456789)
OFFSET, EXTENT = P.ids_layout(META.nbytes, 16)


def desc(i: int) -> Any:
    kw: dict[str, Any] = dict(
        lease=i + 1, nonce="ab" * 8, offset=0, nbytes=META.nbytes, ids_offset=OFFSET, extent=EXTENT, ids_checksum=7
    )
    if OLD:
        return P.RecordDesc(record_id="req-000001", producer="ab12", meta=P.meta_to_wire(META), **kw)  # type: ignore[attr-defined]
    return P.RecordDesc(producer="ab12", meta=META.without_token_ids(), **kw)


def best(f: Callable[[], object], n: int, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return min(out)


def main(repeats: int) -> None:
    raws = [P.encode(desc(i)) for i in range(256)]
    d0 = P.decode_descriptor(raws[0])
    c = Claim.from_desc(d0)
    tok = tuple(IDS)
    attach: Callable[[], object] = (
        (lambda: P.meta_from_wire(c.meta, tok)) if OLD else (lambda: c.meta.with_token_ids(tok))  # type: ignore[attr-defined]
    )
    rows: dict[str, float | int] = {
        "descriptor bytes": len(raws[0]),
        "for_tensor (connector)": best(build, 5000, repeats),
        "with_checksum (producer)": best(lambda: META.with_checksum(5), 5000, repeats),
        "descriptor built and encoded (producer)": best(lambda: P.encode(desc(0)), 5000, repeats),
        "decode, per record of 256 (batches)": best(lambda: P.decode_descriptors(raws), 50, repeats) / 256,
        "decode one descriptor (fetch)": best(lambda: P.decode_descriptor(raws[0]), 5000, repeats),
        "Claim.from_desc (fetch)": best(lambda: Claim.from_desc(d0), 5000, repeats),
        "token ids attached (fetch)": best(attach, 5000, repeats),
    }
    for k, v in rows.items():
        print(f"{k:42s} {v:8.2f}" if isinstance(v, float) else f"{k:42s} {v}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
