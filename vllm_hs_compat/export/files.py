"""Records as files: ``<stem>.safetensors`` (``hidden_states`` ``[tokens, planes, hidden]`` and ``token_ids``)
beside ``<stem>.json`` (the :class:`RecordMeta` manifest: token ids, layer id of each plane, pre-norm flag, dtype,
shape, checksum, vLLM version, adapter, positions).  A record that will not exist leaves ``<stem>.error.json``.

Both files are written to a temporary name and renamed into place, manifest last: a reader that sees the
manifest sees a complete record.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vllm_hs_compat.core.records import CaptureRecord, RecordMeta, compute_checksum
from vllm_hs_compat.core.vocabulary import FILE_KEY
from vllm_hs_compat.errors import ExportConfigError, RecordFailedError, RecordFormatError

PARAMS_KEY = FILE_KEY  # the kv_transfer_params key (core.vocabulary)
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def record_stem(record_id: str) -> str:
    """A file name for ``record_id``: the id itself when it is file-name safe, else a sanitised form plus a
    short hash (so two ids never share a file)."""
    safe = _SAFE.sub("_", record_id)[:180]
    if safe == record_id and not safe.startswith("."):
        return safe
    return f"{safe.lstrip('.')}-{hashlib.sha1(record_id.encode()).hexdigest()[:10]}"


def record_paths(directory: str | os.PathLike[str], record_id: str) -> tuple[Path, Path, Path]:
    """``(tensors, manifest, error)`` paths of ``record_id`` under ``directory``."""
    d = Path(directory)
    stem = record_stem(record_id)
    return d / f"{stem}.safetensors", d / f"{stem}.json", d / f"{stem}.error.json"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_record(directory: str | os.PathLike[str], record: CaptureRecord) -> Path:
    """Write ``record`` (its checksum is computed if missing); returns the manifest path."""
    from safetensors.torch import save

    tensors_path, manifest_path, _ = record_paths(directory, record.meta.request_id)
    rows = record.hidden_states.detach().contiguous().cpu()
    meta = record.meta
    if meta.checksum is None:
        meta = meta.with_checksum(compute_checksum(rows.view(torch.uint8).reshape(-1), meta.checksum_algorithm))
    token_ids = torch.tensor(meta.token_ids, dtype=torch.int64)
    blob = save({"hidden_states": rows, "token_ids": token_ids}, metadata={"record": json.dumps(meta.to_dict())})
    _atomic_write(tensors_path, blob)
    manifest = {**meta.to_dict(), "tensors": tensors_path.name}
    _atomic_write(manifest_path, json.dumps(manifest, indent=1).encode())
    return manifest_path


def write_failure(directory: str | os.PathLike[str], record_id: str, reason: str, message: str) -> Path:
    """Leave ``<stem>.error.json`` saying why ``record_id`` will not exist."""
    _, _, error_path = record_paths(directory, record_id)
    _atomic_write(error_path, json.dumps({"record_id": record_id, "reason": reason, "message": message}).encode())
    return error_path


def read_record(path: str | os.PathLike[str], *, verify_checksum: bool = True) -> CaptureRecord:
    """Read a record from its manifest (``.json``), tensor (``.safetensors``) or error (``.error.json``) path and
    verify it.

    Raises :class:`RecordFailedError` when only the error file exists, :class:`RecordFormatError` (or its
    checksum subclass) when the files are damaged."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    stem = p.name.removesuffix(".error.json") if p.name.endswith(".error.json") else p.name
    stem = stem.removesuffix(".json").removesuffix(".safetensors")
    manifest_path, error_path = p.with_name(f"{stem}.json"), p.with_name(f"{stem}.error.json")
    if not manifest_path.exists():
        if error_path.exists():
            info = json.loads(error_path.read_text())
            raise RecordFailedError(
                f"record {info.get('record_id')!r} failed: {info.get('reason')}: {info.get('message')}"
            )
        raise ExportConfigError(f"no record manifest at {manifest_path}")
    try:
        raw: dict[str, Any] = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise RecordFormatError(f"{manifest_path}: manifest is not JSON ({e})") from None
    tensors_name = raw.pop("tensors", f"{stem}.safetensors")
    meta = RecordMeta.from_dict(raw)
    tensors_path = manifest_path.with_name(str(tensors_name))
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError) as e:
        raise RecordFormatError(f"{tensors_path}: cannot read the record's tensors ({type(e).__name__}: {e})") from None
    if "hidden_states" not in tensors or "token_ids" not in tensors:
        raise RecordFormatError(
            f"{tensors_name}: expected tensors 'hidden_states' and 'token_ids', found {sorted(tensors)}"
        )
    if tuple(int(t) for t in tensors["token_ids"].tolist()) != meta.token_ids:
        raise RecordFormatError(f"{tensors_name}: token_ids differ from the manifest's")
    record = CaptureRecord(meta, tensors["hidden_states"])
    if verify_checksum:
        record.check()
    return record


def iter_records(directory: str | os.PathLike[str], *, verify_checksum: bool = True) -> Iterator[CaptureRecord]:
    """Every complete record under ``directory`` (manifest order by name)."""
    for manifest in sorted(Path(directory).glob("*.json")):
        if manifest.name.endswith(".error.json") or manifest.name.startswith("."):
            continue
        yield read_record(manifest, verify_checksum=verify_checksum)
