"""``vllm-hs-compat verify --model PATH [--layers 2,16,29,32]``: which HF hidden state does each captured plane
really hold?

Peers broke on two silent convention errors: an off-by-one in the last layer's id, and pre- versus post-norm
for the last layer.  This runs a few prompts through vLLM (``extract_hidden_states`` + the capture connector, file
sink) and through transformers with the same weights, and for every plane prints the HF ``hidden_states`` index
it matches, whether that is before or after the final norm, and the error (max relative L2 per row, max abs).

The convention (docs/cli.md): layer id ``k < num_hidden_layers`` is HF ``hidden_states[k]``; layer id
``num_hidden_layers`` is the last decoder layer's output BEFORE the final norm (HF's last ``hidden_states`` entry
is after it).  Exit status 0 when every plane matches its convention within tolerance, 1 when one does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_hs_compat.errors import HsCompatError, ModelConfigError, ToolError

PROMPTS = (
    "The quick brown fox jumps over the lazy dog, and then it runs back across the field to",
    "In 1905 Albert Einstein published four papers that changed physics. The first of them explained",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
)


def register(sub: Any) -> None:
    p = sub.add_parser("verify", help="check which HF hidden state each captured plane holds (pre/post norm)")
    p.add_argument("--model", required=True, help="local model folder (or a hub id already in the HF cache)")
    p.add_argument(
        "--layers",
        default=None,
        help="comma-separated layer ids (default: EAGLE-3's 2, L/2, L-3 and L = num_hidden_layers)",
    )
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: three built in)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's auxiliary layers (vLLM's default ``(2, L // 2, L - 3)``) plus the base plane ``L``, within
    ``[1, L]``, ascending and distinct."""
    ids = {2, num_layers // 2, num_layers - 3, num_layers}
    return sorted(k for k in ids if 1 <= k <= num_layers)


def parse_layers(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ToolError(f"--layers takes comma-separated integers, found {text!r}") from None
    if not ids or len(set(ids)) != len(ids):
        raise ToolError(f"--layers needs distinct layer ids, found {text!r}")
    return ids


@dataclass
class Candidate:
    label: str  # "hidden_states[7]" or "final norm input"
    index: int | None  # HF hidden_states index (None: the final norm's input)
    norm: str  # "pre-norm" / "post-norm"
    max_rel: float
    max_abs: float


@dataclass
class PlaneReport:
    layer_id: int
    expected: str
    best: Candidate
    runner_up: Candidate | None
    ok: bool
    note: str


def candidates(planes: Any) -> list[tuple[str, int | None, str, torch.Tensor]]:
    """What a plane may hold: every HF ``hidden_states[j]`` and the final norm's input."""
    n = planes.num_layers
    out: list[tuple[str, int | None, str, torch.Tensor]] = [
        (f"hidden_states[{j}]", j, "post-norm" if j == n else "pre-norm", h) for j, h in enumerate(planes.hidden_states)
    ]
    if planes.pre_norm is not None:
        out.append(("final norm input", None, "pre-norm", planes.pre_norm))
    return out


def expected_label(layer_id: int, num_layers: int) -> str:
    return "final norm input" if layer_id == num_layers else f"hidden_states[{layer_id}]"


def analyse(records: Sequence[tuple[Sequence[int], Sequence[int], torch.Tensor]], hf_model: Any) -> list[PlaneReport]:
    """``records``: ``(token_ids, layer_ids, rows [T, P, C])`` each; planes compared by the records' own layer
    ids.  For every layer id: the candidate with the smallest worst-row error over all records."""
    from vllm_hs_compat.reference.forward import ROW_TOL, hf_planes, plane_error

    num_layers = int(hf_model.config.num_hidden_layers)
    errs: dict[int, dict[str, list[Any]]] = {}
    meta: dict[str, tuple[int | None, str]] = {}
    nonfinite: dict[int, int] = {}
    for token_ids, layer_ids, rows in records:
        planes = hf_planes(hf_model, token_ids)
        for p, k in enumerate(layer_ids):
            nonfinite[int(k)] = nonfinite.get(int(k), 0) + int((~torch.isfinite(rows[:, p].float())).sum())
            for label, index, norm, ref in candidates(planes):
                meta[label] = (index, norm)
                e = plane_error(rows[:, p].to(ref.device), ref)
                errs.setdefault(int(k), {}).setdefault(label, []).append(e)
    reports = []
    for k in sorted(errs):
        scored = []
        for label, es in errs[k].items():
            index, norm = meta[label]
            scored.append(Candidate(label, index, norm, max(e.max_rel for e in es), max(e.max_abs for e in es)))
        scored.sort(key=lambda c: c.max_rel)
        best, second = scored[0], (scored[1] if len(scored) > 1 else None)
        want = expected_label(k, num_layers)
        ok = best.label == want and best.max_rel <= ROW_TOL and not nonfinite.get(k)
        if nonfinite.get(k):
            note = f"NON-FINITE: {nonfinite[k]} NaN/Inf values (the record must not be used)"
        elif ok:
            note = "ok"
        elif best.max_rel > ROW_TOL:
            note = f"matches nothing within {ROW_TOL} (closest: {best.label})"
        elif best.index is not None and k < num_layers and best.index == k + 1:
            note = "OFF BY ONE: holds the next layer's output"
        elif best.index is not None and best.index == k - 1:
            note = "OFF BY ONE: holds the previous layer's output"
        elif best.norm == "post-norm" and k == num_layers:
            note = "POST-NORM: the final norm was applied"
        elif best.label == "final norm input" and k != num_layers:
            note = f"holds the last layer's output, expected {want}"
        else:
            note = f"holds {best.label}, expected {want}"
        reports.append(PlaneReport(k, want, best, second, ok, note))
    return reports


def _capture(args: argparse.Namespace, model: str, layers: list[int], prompts: list[list[int]]) -> list[Any]:
    from vllm_hs_compat.adapters.engine_api import sampling_params
    from vllm_hs_compat.connector import flush
    from vllm_hs_compat.demo.engine import build_llm, shutdown
    from vllm_hs_compat.export.files import iter_records

    with tempfile.TemporaryDirectory(prefix="hs-verify-") as d:
        extra = {"capture": "prompt", "sink": "file", "file": {"path": d}}
        kwargs: dict[str, Any] = {"tensor_parallel_size": args.tensor_parallel_size}
        if args.trust_remote_code:
            kwargs["trust_remote_code"] = True
        from vllm_hs_compat.demo.engine import has_gpu

        if has_gpu():
            kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
        llm = build_llm(
            model,
            layers,
            extra,
            max_model_len=args.max_model_len,
            max_num_seqs=8,
            max_num_batched_tokens=None,
            dtype=args.dtype,
            **kwargs,
        )
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling_params(max_tokens=1, temperature=0.0), use_tqdm=False
        )
        failed = [
            o.kv_transfer_params
            for o in outs
            if (o.kv_transfer_params or {}).get("hs_record", {}).get("status") != "queued"
        ]
        flush(llm, timeout_s=300.0)
        shutdown(llm)
        del llm
        gc.collect()
        if failed:
            raise ToolError(f"{len(failed)} request(s) produced no record: {failed[:2]}")
        lost = [json.loads(p.read_text()) for p in sorted(Path(d).glob("*.error.json"))]
        if lost:  # a record the connector refused (e.g. non_finite: NaN/Inf rows) is named, never skipped
            shown = "; ".join(f"{e.get('reason')}: {e.get('message')}" for e in lost[:2])
            raise ToolError(f"{len(lost)} of {len(prompts)} records failed in the connector: {shown}")
        records = list(iter_records(d))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return records


def _num_layers(model: str, trust_remote_code: bool) -> int:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError for a bad folder
        raise ModelConfigError(f"cannot read the config of {model!r}: {exc}") from exc
    cfg = getattr(cfg, "text_config", cfg)
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ModelConfigError(f"{model!r}: the config has no integer num_hidden_layers")
    return n


def run(args: argparse.Namespace) -> int:
    from vllm_hs_compat.commands import stdout_to_stderr
    from vllm_hs_compat.demo.engine import prepare_env

    prepare_env()
    try:
        with stdout_to_stderr(True):
            report = _verify(args)
    except HsCompatError as exc:
        print(f"verify failed: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0 if report["ok"] else 1


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from vllm_hs_compat.adapters import get_adapter, installed_vllm_version
    from vllm_hs_compat.reference.forward import ROW_TOL, load_hf

    num_layers = _num_layers(args.model, args.trust_remote_code)
    layers = parse_layers(args.layers) if args.layers else default_layers(num_layers)
    adapter = get_adapter()
    lo, hi = adapter.layer_id_bounds(num_layers)
    bad = [k for k in layers if not lo <= k <= hi]
    if bad:
        raise ToolError(f"layer ids {bad} outside [{lo}, {hi}], what vLLM {adapter.version} can capture")
    tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    prompts = [list(tok(p)["input_ids"]) for p in (args.prompt or PROMPTS)]
    recs = _capture(args, args.model, layers, prompts)
    if len(recs) != len(prompts):
        raise ToolError(f"{len(recs)} records for {len(prompts)} prompts")
    dtype = recs[0].hidden_states.dtype
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = load_hf(args.model, dtype, device)
    reports = analyse([(r.meta.token_ids, r.meta.layer_ids, r.hidden_states) for r in recs], hf)
    return {
        "model": args.model,
        "vllm": installed_vllm_version(),
        "adapter": adapter.name,
        "num_hidden_layers": num_layers,
        "layers": layers,
        "prompts": len(prompts),
        "tokens": sum(len(p) for p in prompts),
        "tolerance": ROW_TOL,
        "planes": [asdict(r) for r in reports],
        "ok": all(r.ok for r in reports),
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        f"vLLM {report['vllm']} (adapter {report['adapter']}), {report['model']}: "
        f"{report['num_hidden_layers']} layers, {report['prompts']} prompts, {report['tokens']} tokens",
        f"{'layer id':>8}  {'matches HF':<20} {'norm':<9} {'max rel':>8} {'max abs':>9}  {'next best':<28} verdict",
    ]
    for p in report["planes"]:
        b, r = p["best"], p["runner_up"]
        nxt = f"{r['label']} ({r['max_rel']:.3f})" if r else "-"
        lines.append(
            f"{p['layer_id']:>8}  {b['label']:<20} {b['norm']:<9} {b['max_rel']:>8.4f} {b['max_abs']:>9.4f}  "
            f"{nxt:<28} {p['note']}"
        )
    lines.append(
        f"RESULT: {'ok' if report['ok'] else 'MISMATCH'} -- layer id k < {report['num_hidden_layers']} must be HF "
        f"hidden_states[k], id {report['num_hidden_layers']} the final norm's input (tolerance {report['tolerance']})"
    )
    return "\n".join(lines)
