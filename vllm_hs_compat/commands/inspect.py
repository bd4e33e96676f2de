"""``vllm-hs-compat inspect PATH|TICKET``: one record's manifest and per-plane statistics.

``PATH``: a file-sink record (its ``.json`` manifest or its ``.safetensors``), or a capture tree (the folder
``vllm-hs-compat capture --out`` made: its records, tokens and failed rows by reason from the index, and each failed
row's source, sample id, reason and message).  ``TICKET``: a response's
``kv_transfer_params`` (JSON text, or a file holding it; a whole response with a ``kv_transfer_params`` key, or
the bare ``hs_export`` entry, work too).  An ``hs_file`` ticket names its manifest; an ``hs_export`` ticket is
fetched through the export with the trainer token if this host has it, else with the ticket's own capability.
Fetching through the export *takes* the record: the producer hands each record out once, so a trainer
streaming the same producer will not see it.

Statistics per plane (layer id): mean, std (population), min, max, absmax over the finite values, and the NaN
and Inf counts; plus the token count, layer ids, whether the checksum matches, and what the record was made for
(schema 2: sample id, source, loss-mask spans with the number of trained rows, user metadata).

Exit codes: 0 the record was read, its checksum matches (or it carries none) and every value is finite (a tree:
every row of its index is ok); 1 the checksum does not match, a value is NaN or Inf (``non_finite``: the record must
not be used), or the record cannot be read (damaged, failed at the server, not found) (a tree: some rows failed);
2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hs_compat.commands import progress, stdout_to_stderr
from vllm_hs_compat.errors import HsCompatError, RecordFormatError

if TYPE_CHECKING:  # torch is imported when a record is read, not for ``vllm-hs-compat --help``
    import torch

    from vllm_hs_compat.core.records import CaptureRecord

EXIT_OK = 0
EXIT_BAD_RECORD = 1
CHUNK_ROWS = 4096


def register(sub: Any) -> None:
    """Add ``inspect`` to the ``vllm-hs-compat`` subparsers."""
    p = sub.add_parser(
        "inspect",
        help="a record's manifest and per-plane statistics (file-sink record or export ticket)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="PATH|TICKET", help="record .json/.safetensors, or kv_transfer_params JSON")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.add_argument("--wait", type=float, default=10.0, help="seconds to wait for an exported record (default 10)")
    p.add_argument("--tokens", type=int, default=16, help="token ids to show in the text report (default 16)")
    p.add_argument(
        "--failures", type=int, default=20, help="a capture tree: failed rows to list in the text report (default 20)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The ``inspect`` command: print the report; return the exit code."""
    if _is_tree(args.target):
        return _run_tree(args)
    with stdout_to_stderr(True):  # NIXL logs to stdout
        try:
            record, source = load(args.target, wait_s=args.wait)
        except HsCompatError as exc:
            report = {"ok": False, "error": type(exc).__name__, "message": str(exc), "target": args.target}
            record = None
    if record is None:
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(f"cannot read the record: {report['error']}: {report['message']}")
        return EXIT_BAD_RECORD
    report = describe(record, source)
    print(json.dumps(report, indent=2) if args.json else "\n".join(text_lines(report, args.tokens)))
    return EXIT_OK if report["ok"] else EXIT_BAD_RECORD


# --- loading ----------------------------------------------------------------------------------------------------
def _as_params(obj: Any) -> dict[str, Any] | None:
    """``kv_transfer_params`` from a ticket-like JSON value, or None when it is not a ticket."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("kv_transfer_params"), dict):
        obj = obj["kv_transfer_params"]
    if "hs_export" in obj or "hs_file" in obj:
        return dict(obj)
    if "endpoint" in obj and "record_id" in obj:  # the bare hs_export entry
        return {"hs_export": obj}
    return None


def load(target: str, wait_s: float = 10.0) -> tuple[CaptureRecord, dict[str, Any]]:
    """The record ``target`` names, read without checksum verification (the report checks it), and where it came
    from.  Raises the named error that kept it from being read."""
    from vllm_hs_compat.export.files import read_record

    text = target.strip()
    params: dict[str, Any] | None = None
    path = Path(target)
    if text.startswith("{"):
        try:
            params = _as_params(json.loads(text))
        except json.JSONDecodeError as e:
            raise RecordFormatError(f"the ticket is not JSON ({e})") from None
        if params is None:
            raise RecordFormatError("the JSON given holds no hs_export or hs_file ticket")
    elif not path.exists():
        raise RecordFormatError(f"{target}: no such file, and not a JSON ticket")
    elif path.suffix == ".json" and not path.name.endswith(".error.json"):
        try:
            params = _as_params(json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            params = None  # read_record names the damage
    if params is None:
        return read_record(path, verify_checksum=False), {"kind": "file", "path": str(path)}
    if "hs_file" in params and "hs_export" not in params:
        manifest = params["hs_file"].get("manifest") if isinstance(params["hs_file"], dict) else None
        if not isinstance(manifest, str):
            raise RecordFormatError("the hs_file ticket names no manifest path")
        return read_record(manifest, verify_checksum=False), {"kind": "file", "path": manifest}
    return _fetch(params, wait_s)


def _fetch(params: dict[str, Any], wait_s: float) -> tuple[CaptureRecord, dict[str, Any]]:
    from vllm_hs_compat.export.consumer import ExportConsumer
    from vllm_hs_compat.export.protocol import ExportTicket

    ticket = ExportTicket.parse(params)
    progress(f"fetching record {ticket.record_id!r} from {ticket.endpoint} (this takes it from the producer) ...")
    with ExportConsumer.from_params(params, verify_checksum=False) as consumer:
        record = consumer.fetch(ticket.record_id, wait_s=wait_s)
        principal = consumer.principal
    return record, {"kind": "export", "endpoint": ticket.endpoint, "principal": principal}


# --- statistics ---------------------------------------------------------------------------------------------
def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def plane_stats(hidden_states: torch.Tensor, layer_ids: tuple[int, ...]) -> list[dict[str, Any]]:
    """Per plane of ``[T, P, C]``: mean, std, min, max, absmax over the finite values (``None`` when there are
    none), NaN and Inf counts.  Reads ``CHUNK_ROWS`` rows at a time in float64 (chunks merged with Chan's
    formula), so a long record never needs a float64 copy of itself."""
    import torch

    t, p, _ = hidden_states.shape
    out = []
    for i in range(p):
        n, mean, m2 = 0, 0.0, 0.0
        lo, hi = math.inf, -math.inf
        nans = infs = 0
        for s in range(0, t, CHUNK_ROWS):
            x = hidden_states[s : s + CHUNK_ROWS, i].to(torch.float64).reshape(-1)
            isnan, isinf = torch.isnan(x), torch.isinf(x)
            nans += int(isnan.sum())
            infs += int(isinf.sum())
            f = x[~(isnan | isinf)]
            k = int(f.numel())
            if k == 0:
                continue
            cmean = float(f.mean())
            cm2 = float(((f - cmean) ** 2).sum())
            delta, total = cmean - mean, n + k
            mean += delta * k / total
            m2 += cm2 + delta * delta * n * k / total
            n = total
            lo, hi = min(lo, float(f.min())), max(hi, float(f.max()))
        finite = n > 0
        out.append(
            {
                "plane": i,
                "layer_id": layer_ids[i],
                "mean": mean if finite else None,
                "std": math.sqrt(m2 / n) if finite else None,
                "min": _num(lo),
                "max": _num(hi),
                "absmax": max(abs(lo), abs(hi)) if finite else None,
                "finite": n,
                "nan": nans,
                "inf": infs,
            }
        )
    return out


def describe(record: CaptureRecord, source: dict[str, Any]) -> dict[str, Any]:
    """The JSON report of ``record``: ``manifest`` (its metadata), ``tokens``, ``layer_ids``, ``checksum``
    (``algorithm``, ``expected``, ``computed``, ``ok``: None when the record carries none), ``planes``
    (:func:`plane_stats`), ``loss_mask_tokens`` (rows in the record's own loss mask; None when it carries none),
    ``ok``."""
    import torch

    from vllm_hs_compat.core.checksums import compute_checksum

    meta = record.meta
    hs = record.hidden_states
    checksum: dict[str, Any] = {"algorithm": meta.checksum_algorithm, "expected": meta.checksum}
    shape_ok = tuple(hs.shape) == meta.shape and hs.dtype == meta.torch_dtype
    if meta.checksum is not None and shape_ok:
        got = compute_checksum(hs.detach().contiguous().cpu().view(torch.uint8).reshape(-1), meta.checksum_algorithm)
        checksum.update(computed=got, ok=got == meta.checksum)
    else:
        checksum.update(computed=None, ok=None if shape_ok else False)
    planes = plane_stats(hs, meta.layer_ids)
    nonfinite = sum(p["nan"] + p["inf"] for p in planes)
    return {
        "source": source,
        "record_id": meta.record_id,
        "manifest": meta.to_dict(),
        "tokens": meta.shape[0],
        "layer_ids": list(meta.layer_ids),
        "checksum": checksum,
        "nonfinite": nonfinite,
        "loss_mask_tokens": None if meta.loss_mask_spans is None else sum(b - a for a, b in meta.loss_mask_spans),
        "planes": planes,
        # a checksum is of whatever was captured: NaN/Inf rows verify like any others and are never ok
        "ok": checksum["ok"] is not False and nonfinite == 0,
    }


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _sample_lines(report: dict[str, Any]) -> list[str]:
    """What the record was made for (schema 2's sample fields), in words."""
    m = report["manifest"]
    if m["schema_version"] < 2:
        return [f"  sample: none (a schema-{m['schema_version']} record carries no sample fields)"]
    who = f"{m['sample_id']!r}" if m["sample_id"] else "(no id given)"
    lines = [f"  sample {who}  source {m['source'] or '(not given)'}"]
    spans = m["loss_mask_spans"]
    if spans is None:
        lines.append("  loss mask: none given (trainers use their default: all rows under loss_mask='auto')")
    else:
        shown = ", ".join(f"[{a}, {b})" for a, b in spans[:8]) + (
            f", ... ({len(spans)} spans)" if len(spans) > 8 else ""
        )
        lines.append(f"  loss mask: {report['loss_mask_tokens']} of {report['tokens']} rows trained: {shown or 'none'}")
    if m["metadata"]:
        text = json.dumps(m["metadata"], sort_keys=True, ensure_ascii=False)
        lines.append(f"  metadata {text if len(text) <= 200 else text[:200] + ' ...'}")
    return lines


def text_lines(report: dict[str, Any], show_tokens: int = 16) -> list[str]:
    """The human-readable form of :func:`describe`'s report."""
    m = report["manifest"]
    src = report["source"]
    where = src.get("path") or f"{src.get('endpoint')} as {src.get('principal')}"
    ids = m["token_ids"]
    shown = ", ".join(map(str, ids[:show_tokens])) + (f", ... ({len(ids)} in all)" if len(ids) > show_tokens else "")
    ck = report["checksum"]
    if ck["ok"] is None:
        ck_line = "none recorded"
    elif ck["ok"]:
        ck_line = f"{ck['algorithm']} {ck['expected']:#018x} ok"
    elif ck["computed"] is None:
        ck_line = "FAILED (the tensor's shape or dtype differs from the manifest)"
    else:
        ck_line = f"{ck['algorithm']} MISMATCH: manifest {ck['expected']:#018x}, bytes {ck['computed']:#018x}"
    lines = [
        f"record {report['record_id']!r}  ({src['kind']}: {where})",
        f"  shape {m['shape']} (tokens, planes, hidden)  dtype {m['dtype']}  pre_norm {m['pre_norm']}",
        f"  tokens {report['tokens']}  start {m['start']}  prompt tokens {m['num_prompt_tokens']}",
        f"  layer ids {report['layer_ids']} (plane i = i-th smallest; the last is the base hidden)",
        f"  vLLM {m['vllm_version'] or '?'}  adapter {m['adapter'] or '?'}  schema {m['schema_version']}",
        f"  checksum {ck_line}",
        *_sample_lines(report),
        f"  token ids [{shown}]",
        f"  {'plane':>5} {'layer':>5} {'mean':>11} {'std':>11} {'min':>11} {'max':>11} {'absmax':>11} {'nan':>6} "
        f"{'inf':>6}",
    ]
    for p in report["planes"]:
        lines.append(
            f"  {p['plane']:>5} {p['layer_id']:>5} {_fmt(p['mean']):>11} {_fmt(p['std']):>11} {_fmt(p['min']):>11} "
            f"{_fmt(p['max']):>11} {_fmt(p['absmax']):>11} {p['nan']:>6} {p['inf']:>6}"
        )
    if report["checksum"]["ok"] is False:
        lines.append("RESULT: checksum FAILED")
    elif report["nonfinite"]:
        from vllm_hs_compat.core.finite import CAUSES

        bad = [p["layer_id"] for p in report["planes"] if p["nan"] or p["inf"]]
        lines.append(
            f"RESULT: non_finite -- {report['nonfinite']} NaN/Inf value(s) in layer ids {bad}: this record must not be "
            f"used ({CAUSES})"
        )
    else:
        lines.append("RESULT: ok")
    return lines


# --- a capture tree -------------------------------------------------------------------------------------------
def _is_tree(target: str) -> bool:
    """True when ``target`` is a folder holding a capture tree's ``run.json`` (never for a JSON ticket)."""
    if target.lstrip().startswith("{"):
        return False
    try:
        return (Path(target) / "run.json").is_file()
    except (OSError, ValueError):
        return False


def tree_report(tree: str | Path) -> dict[str, Any]:
    """A capture tree's totals from its index (records, tokens, bytes, failed rows by reason), its run settings,
    and every failed row (``sample_id``, ``source``, ``reason``, ``message``, ``tokens``, ``rank``)."""
    from vllm_hs_compat.capture.index import failed_rows as read_failed
    from vllm_hs_compat.capture.summary import read_summary

    root = Path(tree)
    summary = read_summary(root)
    failed = read_failed(root)
    return {
        "tree": str(root),
        "run_config": json.loads((root / "run.json").read_text()).get("run_config"),
        "records": summary.tree_records,
        "tokens": summary.tree_tokens,
        "loss_tokens": summary.tree_loss_tokens,
        "bytes": summary.tree_bytes,
        "failed_by_reason": summary.tree_failed,
        "failed": failed,
        "ok": not failed,
    }


def tree_lines(report: dict[str, Any], limit: int) -> list[str]:
    """The human-readable form of :func:`tree_report`: totals, failed rows by reason, the first ``limit`` failed
    rows."""
    by = report["failed_by_reason"]
    lines = [
        f"capture tree {report['tree']}",
        f"  {report['records']} records, {report['tokens']} tokens ({report['loss_tokens']} in loss masks), "
        f"{report['bytes']} bytes",
        f"  failed rows: {len(report['failed'])}"
        + (f" ({', '.join(f'{k} {v}' for k, v in sorted(by.items(), key=lambda kv: -kv[1]))})" if by else ""),
    ]
    for row in report["failed"][:limit]:
        who = f"{row['sample_id']!r}" if row["sample_id"] else "(no id)"
        lines.append(f"  {row['source']}  {who}  {row['reason']}: {row['message']}")
    if len(report["failed"]) > limit:
        lines.append(f"  ... {len(report['failed']) - limit} more (--failures N, or --json for all)")
    lines.append("RESULT: ok" if report["ok"] else f"RESULT: {len(report['failed'])} row(s) failed")
    return lines


def _run_tree(args: argparse.Namespace) -> int:
    try:
        report = tree_report(args.target)
    except (HsCompatError, OSError, ValueError) as exc:
        message = {"ok": False, "error": type(exc).__name__, "message": str(exc), "target": args.target}
        print(json.dumps(message, indent=2) if args.json else f"cannot read the tree: {message['message']}")
        return EXIT_BAD_RECORD
    print(json.dumps(report, indent=2) if args.json else "\n".join(tree_lines(report, args.failures)))
    return EXIT_OK if report["ok"] else EXIT_BAD_RECORD
