"""Records as files: ``<stem>.safetensors`` (``hidden_states`` ``[tokens, planes, hidden]`` and ``token_ids``)
beside ``<stem>.json`` (the :class:`RecordMeta` manifest: token ids, layer id of each plane, pre-norm flag, dtype,
shape, checksum, vLLM version, adapter, positions).  A record that will not exist leaves ``<stem>.error.json``.

Both files are written to a temporary name and renamed into place, manifest last: a reader that sees the
manifest sees a complete record.

Storage (``storage=``): ``"captured"`` (default) keeps the rows as vLLM wrote them (bf16 on most models), bit for
bit, under the record's own checksum.  ``"fp8_e4m3"`` stores ``hidden_states_fp8`` (float8 e4m3) and ``scales``
(float32 ``[tokens, planes]``, one per row: its absolute maximum / 448) -- about half the bytes of bf16 -- and the
manifest's ``storage`` entry says so, with a checksum of the stored bytes and the relative error measured when it
was written.  :func:`read_record` gives the rows back in the captured dtype either way; the record's own checksum
(of the captured bytes) cannot be checked after a lossy store, the stored bytes' checksum is.  A reader that does not
know a ``storage`` kind refuses the record by name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from vllm_hs_compat.core import finite
from vllm_hs_compat.core.checksums import compute_checksum
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.core.vocabulary import FILE_KEY
from vllm_hs_compat.errors import ChecksumMismatchError, ExportConfigError, RecordFailedError, RecordFormatError

PARAMS_KEY = FILE_KEY  # the kv_transfer_params key (core.vocabulary)
#: Storage kinds of a record's rows on disk (see the module docstring).
STORAGES: Final = ("captured", "fp8_e4m3")
#: Largest finite float8 e4m3 value: a row is scaled so that its absolute maximum lands on it.
FP8_MAX: Final = 448.0
#: Rows quantized at a time on a device (bytes of the captured rows): bounds the connector's device memory for it
#: (about ten times this at the peak, beside vLLM's share of the card).
FP8_PIECE_BYTES: Final = 16 << 20
#: The same on the host: a long record's float32 temporaries bounded; smaller pieces cost the host time (64 MiB of
#: bf16 in pieces of 8 MiB took 1.3x as long as in one, 2-core VM).
FP8_HOST_PIECE_BYTES: Final = 256 << 20
_cuda: Any = torch.cuda  # torch.cuda.Stream is untyped
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


def _tmp_name(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (recovery deletes what a kill leaves there)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _atomic_save(path: Path, tensors: dict[str, torch.Tensor], header: dict[str, str]) -> None:
    # safetensors writes the file straight from the tensors: building the whole file as bytes first (``save``) and
    # writing those copied every record twice, a quarter of the speed (docs/gpu.md, "Throughput")
    from safetensors.torch import save_file

    tmp = _tmp_name(path)
    save_file(tensors, str(tmp), metadata=header)
    os.replace(tmp, path)


def quantize_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[T, P, C]`` as float8 e4m3 with one float32 scale per ``(token, plane)`` row."""
    q, scales, _ = _quantize(rows)
    return q, scales


def _quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The row maxima are taken in the rows' own dtype (exact: |x| and max round nothing), the float32 copy is
    # made once and kept for the error: a third fewer passes over the rows than quantizing and measuring apart.
    amax = rows.abs().amax(dim=-1).float()
    # Divided by a tensor on the rows' device, never by a Python number: CUDA divides by a host scalar as a
    # multiplication by its float32 reciprocal (1/448 is inexact), the host divides -- the scales (and so the
    # bytes) of a GPU-quantized record differed from the host's by one ulp (seen on an H100).
    scales = torch.where(amax > 0, amax / amax.new_full((), FP8_MAX), torch.ones_like(amax))
    x = rows.float()
    return x.div(scales.unsqueeze(-1)).to(torch.float8_e4m3fn), scales, x


def quantize_fp8_measured(
    rows: torch.Tensor, *, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """:func:`quantize_fp8` and :func:`relative_error` of its :func:`dequantize_fp8` in ``rows``' dtype against
    ``rows``, in one go: ``(q, scales, worst, mean)`` (``q`` and ``scales`` where ``rows`` are).

    Piece by piece (:data:`FP8_PIECE_BYTES` on a GPU, :data:`FP8_HOST_PIECE_BYTES` on the host): every row's scale,
    bytes and error are those of the whole tensor at once.  ``device``: a CUDA device to do it on (each piece copied
    there on a stream of its own, the bytes and errors copied back) -- a GPU engine's rows otherwise cost a host core
    about 0.3 s per 64 MiB."""
    if rows.dim() < 2:
        raise RecordFormatError(f"fp8 storage quantizes rows [..., hidden]; found shape {list(rows.shape)}")
    flat = rows.reshape(-1, rows.shape[-1])
    n = int(flat.shape[0])
    q = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=rows.device)
    scales = torch.empty(n, dtype=torch.float32, device=rows.device)
    err = torch.empty(n, dtype=torch.float32, device=rows.device)
    target = torch.device(device) if device is not None else rows.device
    remote = target != rows.device
    piece_bytes = FP8_PIECE_BYTES if target.type == "cuda" else FP8_HOST_PIECE_BYTES
    per = max(1, piece_bytes // max(1, int(flat.shape[1]) * flat.element_size()))
    stream: Any = _cuda.Stream(target) if remote and target.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for lo in range(0, n, per):
            piece = flat[lo : lo + per].to(target) if remote else flat[lo : lo + per]
            pq, ps, x = _quantize(piece)
            pe = _row_errors(dequantize_fp8(pq, ps, rows.dtype), x)
            q[lo : lo + per].copy_(pq)
            scales[lo : lo + per].copy_(ps)
            err[lo : lo + per].copy_(pe)
    worst, mean = (float(err.max()), float(err.mean())) if n else (0.0, 0.0)
    return q.view(rows.shape), scales.view(rows.shape[:-1]), worst, mean


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`quantize_fp8`, in ``dtype``."""
    return (q.float() * scales.unsqueeze(-1)).to(dtype)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(max, mean) over rows of ``||approx - exact|| / ||exact||`` (rows of zeros count as 0)."""
    err = _row_errors(approx, exact)
    return float(err.max()) if err.numel() else 0.0, float(err.mean()) if err.numel() else 0.0


def _row_errors(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``||approx - exact|| / ||exact||`` per row (float32; rows of zeros count as 0)."""
    e = exact.float().flatten(0, -2)
    # the difference in a float32 temporary of this function's own (never the caller's tensor), subtracted in place
    d = approx.float() if approx.dtype != torch.float32 else approx.clone()
    d = d.flatten(0, -2).sub_(e)
    norm = torch.linalg.vector_norm(e, dim=-1)
    err: torch.Tensor = torch.linalg.vector_norm(d, dim=-1) / torch.where(norm > 0, norm, torch.ones_like(norm))
    return err


def write_record(
    directory: str | os.PathLike[str],
    record: CaptureRecord,
    *,
    storage: str = "captured",
    device: torch.device | None = None,
) -> Path:
    """Write ``record`` (its checksum is computed if missing) in ``storage`` (:data:`STORAGES`); returns the
    manifest path.  ``device``: where a compact storage quantizes (:func:`quantize_fp8_measured`)."""
    if storage not in STORAGES:
        raise ExportConfigError(f"record storage {storage!r}; expected one of {list(STORAGES)}")
    tensors_path, manifest_path, _ = record_paths(directory, record.meta.record_id)
    rows = record.hidden_states.detach().contiguous().cpu()
    meta = record.meta
    if not meta.has_token_ids:
        raise RecordFormatError(
            f"record {meta.record_id!r}: its metadata has no token ids (a descriptor's, see "
            "RecordMeta.without_token_ids); write the record with them"
        )
    if meta.checksum is None:
        meta = meta.with_checksum(compute_checksum(rows.view(torch.uint8).reshape(-1), meta.checksum_algorithm))
    token_ids = torch.tensor(meta.token_ids, dtype=torch.int64)
    header = {"record": json.dumps(meta.to_dict())}
    manifest: dict[str, Any] = {**meta.to_dict(), "tensors": tensors_path.name}
    if storage == "captured":
        tensors = {"hidden_states": rows, "token_ids": token_ids}
    else:
        q, scales, worst, mean = quantize_fp8_measured(rows, device=device)
        stored = _stored_checksum(q, scales, meta.checksum_algorithm)
        manifest["storage"] = {
            "kind": storage,
            "scales": "per_row",
            "checksum": stored,
            "checksum_algorithm": meta.checksum_algorithm,
            "rel_error_max": worst,
            "rel_error_mean": mean,
        }
        header["storage"] = json.dumps(manifest["storage"])
        tensors = {"hidden_states_fp8": q, "scales": scales, "token_ids": token_ids}
    _atomic_save(tensors_path, tensors, header)
    # compact: json's C encoder (indent= takes its pure-Python one: 4x the time for a record of 1,300 token ids,
    # held in the interpreter beside a GPU engine's thread, in every record's publisher)
    _atomic_write(manifest_path, json.dumps(manifest, separators=(",", ":")).encode())
    return manifest_path


def _stored_checksum(q: torch.Tensor, scales: torch.Tensor, algorithm: str) -> int:
    stored = torch.cat(
        [q.contiguous().view(torch.uint8).reshape(-1), scales.contiguous().view(torch.uint8).reshape(-1)]
    )
    return compute_checksum(stored, algorithm)


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
    name, meta, storage, tensors = _load(path)
    if storage is None:
        record = CaptureRecord(meta, tensors["hidden_states"])
        if verify_checksum:
            record.check()
        return record
    q, scales = _stored(name, meta, storage, tensors, verify_checksum)
    return CaptureRecord(meta, dequantize_fp8(q, scales, meta.torch_dtype))


@dataclass(frozen=True, slots=True)
class Verified:
    """A record's files checked (:func:`verify_record`): its metadata, and why its rows are not finite (None when
    they are)."""

    meta: RecordMeta
    non_finite: str | None


def verify_record(path: str | os.PathLike[str]) -> Verified:
    """:func:`read_record`'s checks (the files, the token ids, the checksum of the captured or stored bytes) and the
    NaN/Inf check of the rows, without giving the rows back: an fp8 record is checked on its stored bytes and scales
    (its rows are finite exactly when both are), not decoded -- only a failing one is, for the message.  Raises as
    :func:`read_record` does."""
    name, meta, storage, tensors = _load(path)
    if storage is None:
        record = CaptureRecord(meta, tensors["hidden_states"])
        record.check()
        return Verified(meta, finite.problem(record.hidden_states, start=meta.start, layer_ids=meta.layer_ids))
    q, scales = _stored(name, meta, storage, tensors, True)
    flags = finite.token_flags(q) & torch.isfinite(scales).all(dim=-1)
    if bool(flags.all()):
        return Verified(meta, None)
    rows = dequantize_fp8(q, scales, meta.torch_dtype)
    return Verified(meta, finite.problem(rows, flags, start=meta.start, layer_ids=meta.layer_ids))


def _load(path: str | os.PathLike[str]) -> tuple[str, RecordMeta, Any, dict[str, torch.Tensor]]:
    """A record's files read and their shape checked: ``(tensors file name, meta, storage entry or None,
    tensors)``."""
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
    storage = raw.pop("storage", None)
    meta = RecordMeta.from_dict(raw)
    tensors_path = manifest_path.with_name(str(tensors_name))
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError) as e:
        raise RecordFormatError(f"{tensors_path}: cannot read the record's tensors ({type(e).__name__}: {e})") from None
    if "token_ids" not in tensors or tuple(int(t) for t in tensors["token_ids"].tolist()) != meta.token_ids:
        raise RecordFormatError(f"{tensors_name}: token_ids missing or differ from the manifest's")
    if storage is None and "hidden_states" not in tensors:
        raise RecordFormatError(
            f"{tensors_name}: expected tensors 'hidden_states' and 'token_ids', found {sorted(tensors)}"
        )
    return str(tensors_name), meta, storage, tensors


def _stored(
    name: str, meta: RecordMeta, storage: Any, tensors: dict[str, torch.Tensor], verify_checksum: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A record stored in a compact kind: its stored bytes checked; ``(q, scales)``."""
    kind = storage.get("kind") if isinstance(storage, dict) else None
    if kind != "fp8_e4m3":
        raise RecordFormatError(
            f"{name}: the record is stored as {kind!r}, which this version cannot read (it reads {list(STORAGES)}); "
            "upgrade vllm-hs-compat"
        )
    q, scales = tensors.get("hidden_states_fp8"), tensors.get("scales")
    if q is None or scales is None or q.dtype != torch.float8_e4m3fn or tuple(q.shape) != meta.shape:
        raise RecordFormatError(
            f"{name}: an fp8_e4m3 record needs 'hidden_states_fp8' (float8_e4m3fn {list(meta.shape)}) and 'scales'; "
            f"found { {k: (str(v.dtype), list(v.shape)) for k, v in tensors.items()} }"
        )
    if tuple(scales.shape) != meta.shape[:2] or scales.dtype != torch.float32:
        raise RecordFormatError(f"{name}: 'scales' must be float32 {list(meta.shape[:2])}, found {list(scales.shape)}")
    if verify_checksum:
        algorithm = str(storage.get("checksum_algorithm", meta.checksum_algorithm))
        got = _stored_checksum(q, scales, algorithm)
        if got != storage.get("checksum"):
            raise ChecksumMismatchError(
                f"{name}: the stored fp8 bytes' checksum is {got:#x}, the manifest says {storage.get('checksum')!r}"
            )
    return q, scales


def iter_records(directory: str | os.PathLike[str], *, verify_checksum: bool = True) -> Iterator[CaptureRecord]:
    """Every complete record under ``directory`` (manifest order by name)."""
    for manifest in sorted(Path(directory).glob("*.json")):
        if manifest.name.endswith(".error.json") or manifest.name.startswith("."):
            continue
        yield read_record(manifest, verify_checksum=verify_checksum)
