"""A trainer reads a capture tree through its index: ``HiddenStatesDataset.from_capture`` yields exactly the
indexed records, each with its own loss mask and sample id; a record file the index does not name (a capture still
running, or killed before indexing it) is not read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from store_driver import LAYERS, RUN_CONFIG, hidden_states, token_ids  # noqa: E402

from vllm_hs_compat import errors as E  # noqa: E402
from vllm_hs_compat.capture.store import CaptureStore, SampleInfo  # noqa: E402
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta, RecordSample  # noqa: E402
from vllm_hs_compat.export import files  # noqa: E402
from vllm_hs_compat.trainer import HiddenStatesDataset  # noqa: E402


def _stage(store: CaptureStore, i: int) -> tuple[SampleInfo, Path]:
    ids = token_ids(i)
    spans = ((1, len(ids)),)  # the first token is not trained
    meta = RecordMeta.for_tensor(
        f"req-{i}",
        hidden_states(i, len(ids)),
        ids,
        LAYERS,
        pre_norm=True,
        num_prompt_tokens=len(ids),
        sample=RecordSample(sample_id=f"s{i}", source=f"rows.jsonl:{i}", loss_mask_spans=spans),
    )
    manifest = files.write_record(store.staging_dir(), CaptureRecord(meta, hidden_states(i, len(ids))))
    info = SampleInfo(f"s{i}", f"rows.jsonl:{i}", len(ids), None, input_ids=ids)  # the count must come from the record
    return info, manifest


def test_from_capture_reads_the_indexed_records_with_their_masks(tmp_path: Path) -> None:
    out = tmp_path / "tree"
    with pytest.raises(E.DatasetConfigError, match="indexes no captured record"):
        with CaptureStore(out, run_config=RUN_CONFIG) as store:
            pass
        HiddenStatesDataset.from_capture(out)
    with CaptureStore(out, run_config=RUN_CONFIG, records_per_shard=2) as store:
        for i in range(5):
            info, manifest = _stage(store, i)
            assert store.adopt(info, manifest).status == "ok"
    # a record file in a shard that no index part names: never read (negative control below shows from_files would)
    stray = out / "shard-0-00009"
    stray.mkdir()
    ids = token_ids(7)
    rows = hidden_states(7, len(ids))
    files.write_record(stray, CaptureRecord(RecordMeta.for_tensor("s7", rows, ids, LAYERS, pre_norm=True), rows))
    # the index counts the rows the record's own mask trains
    from vllm_hs_compat.capture.store import read_index

    assert {r["sample_id"]: r["loss_tokens"] for r in read_index(out).to_pylist()} == {
        f"s{i}": len(token_ids(i)) - 1 for i in range(5)
    }
    items = list(HiddenStatesDataset.from_capture(out, layout="planes"))
    assert sorted(it["sample_id"] for it in items) == [f"s{i}" for i in range(5)]
    for it in items:
        n = len(token_ids(int(it["sample_id"][1:])))
        assert it["loss_mask"].tolist() == [0] + [1] * (n - 1)
        assert it["loss_mask_from"] == "record"
    everything = list(HiddenStatesDataset.from_files(sorted(out.glob("shard-*")), layout="planes"))
    assert len(everything) == 6  # the stray record is there for a reader that ignores the index
