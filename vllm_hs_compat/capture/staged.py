"""A staged record checked against the sample it was captured for, before the store adopts it.

The connector's file sink leaves ``<stem>.safetensors`` + ``<stem>.json`` (a record) or ``<stem>.error.json`` (the
connector's failure) in the rank's staging folder.  :func:`check_staged` reads them and says either
:class:`Staged` (the record is the sample's, whole and finite) or :class:`Refused` (the reason and message of the
failed row, and the staged files to delete).  Checked, in order: the record is there (else the connector's own
reason, or "missing_record"), it reads and its checksum verifies ("bad_record"), ``start == 0`` ("partial_record"),
it was made for this sample ("wrong_sample"), its token ids are the sample's ("tokenizer_mismatch"), and its rows
hold no NaN/Inf ("non_finite").

Pure Python + torch (through export/files.py and core/finite.py); never vLLM.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.core.vocabulary import REASON_NON_FINITE
from vllm_hs_compat.errors import CaptureStoreError, ExportConfigError, RecordFailedError, RecordFormatError
from vllm_hs_compat.export import files

from .rows import SampleInfo


@dataclass(frozen=True, slots=True)
class Staged:
    """A staged record that is its sample's: ready to move into a shard."""

    meta: RecordMeta
    manifest: dict[str, Any]
    """Its manifest as read (JSON)."""
    manifest_path: Path
    tensors_path: Path
    """The tensors file its manifest names."""
    error_path: Path
    """Where the connector would have written its failure (deleted with the staged record)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A staged record (or its absence) that fails its sample: the failed row's reason and message, and the staged
    files to delete."""

    reason: str
    message: str
    files: list[Path]


def record_files(path: Path) -> tuple[Path, Path, Path]:
    """The tensors, manifest and error files of the staged record ``path`` names (any of the three)."""
    name = path.name
    for suffix in (".error.json", ".safetensors", ".json"):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            break
    else:
        stem = name
    return path.with_name(f"{stem}.safetensors"), path.with_name(f"{stem}.json"), path.with_name(f"{stem}.error.json")


def check_sample(sample: SampleInfo, manifest: str | os.PathLike[str]) -> Staged | Refused:
    """:meth:`CaptureStore.check`: the staged record at ``manifest`` checked against ``sample`` and the ids its
    engine was given (``sample.input_ids``); reads the record, changes nothing, so it runs in any thread or process
    (adoption's checks ahead)."""
    if sample.input_ids is None:
        raise CaptureStoreError(
            f"sample {sample.key!r}: adopt needs SampleInfo.input_ids (the ids given to the engine) to check the "
            "record's token ids; build it with SampleInfo.of(sample)"
        )
    return check_staged(sample, Path(manifest), sample.input_ids)


def check_staged(sample: SampleInfo, manifest: Path, input_ids: tuple[int, ...]) -> Staged | Refused:
    """The staged record at ``manifest`` checked against ``sample``, whose engine was given ``input_ids`` (see the
    module docstring)."""
    tensors_path, manifest_path, error_path = record_files(manifest)
    staged = [tensors_path, manifest_path, error_path]
    if not manifest_path.exists():
        if error_path.exists():
            try:
                info = json.loads(error_path.read_text())
                reason, message = str(info.get("reason") or "capture_failed"), str(info.get("message") or "")
            except (OSError, ValueError):
                reason, message = "capture_failed", f"unreadable error file {error_path.name}"
            return Refused(reason, message, staged)
        return Refused("missing_record", f"no record at {manifest_path}", staged)
    try:
        # checked without decoding the rows (an fp8 record's NaN/Inf on its stored bytes and scales)
        verified = files.verify_record(manifest_path)
        raw = json.loads(manifest_path.read_text())
    except (RecordFormatError, RecordFailedError, ExportConfigError, OSError, ValueError) as e:
        return Refused("bad_record", f"{type(e).__name__}: {e}", staged)
    meta = verified.meta
    tensors_path = manifest_path.with_name(str(raw.get("tensors", tensors_path.name)))
    staged[0] = tensors_path
    if meta.start != 0:
        return Refused(
            "partial_record",
            f"the record starts at position {meta.start}, not 0: it does not hold the whole sequence (prefix "
            "caching shared the first positions?); capture with the connector's whole-sequence mode",
            staged,
        )
    recorded_id = str(getattr(meta, "sample_id", "") or "")  # schema 2 records say which sample they are
    if recorded_id and sample.sample_id and recorded_id != sample.sample_id:
        return Refused(
            "wrong_sample",
            f"the record at {manifest_path.name} was made for sample {recorded_id!r}, not {sample.sample_id!r}: "
            "the request that made it carried another sample's id",
            staged,
        )
    problem = token_problem(meta.token_ids, meta.num_prompt_tokens, input_ids)
    if problem is not None:
        return Refused("tokenizer_mismatch", problem, staged)
    if verified.non_finite is not None:  # a checksum is of whatever was captured: NaN rows verify like any others
        return Refused(REASON_NON_FINITE, f"{verified.non_finite} (found when adopting the record)", staged)
    return Staged(meta, raw, manifest_path, tensors_path, error_path)


def token_problem(got: tuple[int, ...], num_prompt: int, expected: tuple[int, ...]) -> str | None:
    """Why a record's token ids are not the sample's, or None when they are."""
    n = len(expected)
    head = got[:n]
    if head != expected:
        at = next((i for i, (a, b) in enumerate(zip(head, expected, strict=False)) if a != b), min(len(head), n))
        return (
            f"the engine ran {len(got)} token ids that differ from the sample's {n} at position {at} (engine "
            f"{list(got[at : at + 4])}, sample {list(expected[at : at + 4])}); the tokenizer or chat template used to "
            "tokenize the data is not the served model's: pass the model's own tokenizer/template"
        )
    if num_prompt and num_prompt != n:
        return (
            f"the engine's prompt had {num_prompt} tokens, the sample has {n}: the record is of another prompt that "
            "begins like this one"
        )
    if not num_prompt and len(got) != n:
        return (
            f"the record has {len(got)} token ids and does not say its prompt length; the sample has {n}: cannot "
            "tell which are the sample's"
        )
    return None
