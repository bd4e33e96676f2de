"""What the trainers' own runs did with the package's files (run_trainers_h200.sh, step 4).

speculators: its TensorBoard scalars (``--logger tensorboard``): steps, ``train/loss`` and ``train/full_acc_<k>``
(the draft's top-1 agreement with the verifier at TTT step k) first -> last, its per-epoch validation, its
``train/error_records`` (samples it skipped: a cached file whose token ids differ from its Arrow row, a missing file),
and the tokens each epoch trained on (``tokens_per_s * step_ms``, summed) against the rows written.  The swapped
negative control must show skipped records.  SpecForge: the ``step N: {...}`` lines its trainer prints, against
``epochs * ceil(files / batch_size)`` optimizer steps.

    python3 report.py --data DATA --work WORK --logs OUT --json OUT/report.json
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard run under ``logdir``: tag -> [(step, value)], in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out[tag] += [(e.step, e.value) for e in acc.Scalars(tag)]
    return {k: sorted(v) for k, v in out.items()}


def first_last(values: list[float], k: int = 5) -> dict[str, float]:
    return {
        "first": values[0],
        "last": values[-1],
        f"mean_first_{k}": sum(values[:k]) / len(values[:k]),
        f"mean_last_{k}": sum(values[-k:]) / len(values[-k:]),
    }


def speculators_run(logdir: Path, rows: list[dict[str, Any]], log: Path, ratio: float = 0.9) -> dict[str, Any]:
    s = scalars(logdir)
    if "train/loss" not in s:
        return {"error": f"no train/loss scalar under {logdir}", "tags": sorted(s)}
    steps = [st for st, _ in s["train/loss"]]
    split = int(len(rows) * ratio)  # ArrowDataset's own split expression
    out: dict[str, Any] = {
        "steps": len(steps),
        "loss": first_last([v for _, v in s["train/loss"]]),
        "tags": sorted(s),
    }
    for tag in sorted(s):
        if re.fullmatch(r"train/full_acc_\d+", tag):
            out[tag.split("/", 1)[1]] = first_last([v for _, v in s[tag]])
    out["error_records"] = sum(v for _, v in s.get("train/error_records", []))
    # tokens per epoch: profile's tokens_per_s * step_ms = the non-padding tokens of the batch (after shift_batch)
    epoch_of = dict(s.get("epoch", []))
    prof = dict(s.get("profile/step_ms", []))
    tokens: dict[int, float] = defaultdict(float)
    for st, tps in s.get("profile/tokens_per_s", []):
        tokens[int(epoch_of.get(st, -1))] += tps * prof.get(st, 0.0) / 1000.0
    out["epochs"] = len(tokens)
    out["tokens_per_epoch_seen"] = sorted({round(v) for v in tokens.values()})
    out["written"] = {
        "rows": len(rows),
        "train_rows": split,
        "val_rows": len(rows) - split,
        "train_tokens_after_shift": sum(len(r["input_ids"]) - 1 for r in rows[:split]),
    }
    val = {tag.split("/", 1)[1]: [v for _, v in s[tag]] for tag in s if tag.startswith("val/")}
    out["val"] = {k: {"first_epoch": v[0], "last_epoch": v[-1]} for k, v in sorted(val.items())}
    text = log.read_text(errors="replace") if log.exists() else ""
    out["token_mismatch_warnings"] = text.count("don't")  # speculators: "Loaded token ids ... don't match input ids"
    out["rc"] = _rc(text)
    return out


def specforge_run(log: Path, files: int, cfg: dict[str, Any]) -> dict[str, Any]:
    text = log.read_text(errors="replace") if log.exists() else ""
    metrics: list[tuple[int, dict[str, Any]]] = []
    for m in re.finditer(r"^step (\d+): (\{.*\})$", text, re.M):
        try:
            metrics.append((int(m.group(1)), ast.literal_eval(m.group(2))))
        except (ValueError, SyntaxError):
            continue
    out: dict[str, Any] = {"rc": _rc(text), "logged_steps": len(metrics)}
    epochs, batch = int(cfg.get("num_epochs", 1)), int(cfg.get("batch_size", 1))
    out["expected_steps"] = epochs * math.ceil(files / batch)
    out["files_written"] = files
    if not metrics:
        return out
    out["last_step"] = metrics[-1][0]
    out["keys"] = sorted(metrics[0][1])
    for key in metrics[0][1]:
        vals = [m.get(key) for _, m in metrics]
        if all(isinstance(v, (int, float)) for v in vals) and not key.startswith("perf/") and key != "lr":
            out[key] = first_last([float(v) for v in vals])
        elif all(isinstance(v, list) and v for v in vals) and not key.startswith("perf/"):
            out[key] = {"first": vals[0], "last": vals[-1]}
    return out


def _rc(text: str) -> int | None:
    m = re.findall(r"rc=(\d+) after", text)
    return int(m[-1]) if m else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--logs", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    written = json.loads((args.data / "written.json").read_text())
    rows = [json.loads(line) for line in (args.data / "speculators" / "rows.jsonl").read_text().splitlines() if line]
    stage = Path(__file__).resolve().parent
    import yaml

    forge_cfg = yaml.safe_load((stage / "specforge_run.yaml").read_text())["training"]
    files = len(list((args.data / "specforge").rglob("*.ckpt")))
    report = {
        "written": {k: v for k, v in written["written"].items() if k != "lengths"},
        "speculators": speculators_run(args.work / "spec" / "logs", rows, args.logs / "speculators.log"),
        "speculators_swapped_control": speculators_run(
            args.work / "swap" / "logs", rows, args.logs / "speculators_swapped.log"
        ),
        "specforge": specforge_run(args.logs / "specforge.log", files, forge_cfg),
    }
    args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))

    sp, sw, sf = report["speculators"], report["speculators_swapped_control"], report["specforge"]
    ok = (
        sp.get("rc") == 0
        and sp.get("error_records") == 0
        and sp.get("tokens_per_epoch_seen") == [sp["written"]["train_tokens_after_shift"]]
        and sp["loss"]["mean_last_5"] < sp["loss"]["mean_first_5"]
        and sw.get("error_records", 0) > 0
        and sf.get("rc") == 0
        and sf.get("last_step") == sf.get("expected_steps")
        and sf.get("loss", {}).get("mean_last_5", 1e9) < sf.get("loss", {}).get("mean_first_5", 0)
    )
    print("VERDICT:", "ok" if ok else "NOT OK (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
