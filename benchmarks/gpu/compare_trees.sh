#!/usr/bin/env bash
# Several source trees of this package benchmarked one after the other on ONE GPU host with the same vLLM (what
# separates a change from a host: docs/gpu.md, "Two trees side by side").  Each tree is a folder holding the
# package and benchmarks/gpu (a checkout, or `git archive REV vllm_hs_compat benchmarks tests/gpu tests/e2e examples
# pyproject.toml` unpacked); its own run_gpu.sh puts it first on PYTHONPATH, so vLLM's plugin entry point and the
# connector's module path import that tree's package.
#
#     bash benchmarks/gpu/compare_trees.sh OUT SHAPE NAME=TREE[:VARIANTS] ...
#
#   SHAPE     8b or 1b (run_gpu.sh's bench-8b / bench-1b)
#   NAME      the run's name: OUT/NAME/ holds run_gpu.sh's files, OUT/bench-NAME.json its bench.json
#   VARIANTS  bench_gpu.py --variants (default: capture); give the first run generate,capture for the ratio
#
# Runs in the order given (alternate the trees, A B A B, to see the host drift); at the end every run's rows go
# into bench_gpu.py's table (OUT/compare.log), each variant named NAME:VARIANT.  NEED (seconds, default 100): a
# run is skipped when less than that is left before CALL_END.
set -uo pipefail
OUT=${1:?OUT}
SHAPE=${2:?SHAPE}
shift 2
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for spec in "$@"; do
    name=${spec%%=*}
    rest=${spec#*=}
    tree=${rest%%:*}
    variants=capture
    [ "$rest" != "$tree" ] && variants=${rest#*:}
    if [ -n "${CALL_END:-}" ] && [ $((CALL_END - $(date +%s))) -lt "${NEED:-100}" ]; then
        echo "compare_trees.sh: $name skipped, $((CALL_END - $(date +%s))) s left" | tee -a "$OUT/compare.log"
        continue
    fi
    t0=$(date +%s)
    (cd "$tree" && BENCH_ARGS="--variants $variants" bash benchmarks/gpu/run_gpu.sh "$OUT/$name" "bench-$SHAPE" \
        >"$OUT/$name.out" 2>&1)
    cp "$OUT/$name/bench.json" "$OUT/bench-$name.json" 2>/dev/null
    echo "compare_trees.sh: $name done in $(($(date +%s) - t0)) s" | tee -a "$OUT/compare.log"
done
# every run's rows in bench_gpu.py's own table, each variant named after its run (`generate` is plain vLLM, the
# same whichever tree ran it: every run's "x gen" is against it)
"$PY" - "$HERE" "$OUT" "$@" <<'PY' | tee -a "$OUT/compare.log"
import json
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
from bench_gpu import table  # noqa: E402

rows = []
for spec in sys.argv[3:]:
    name = spec.split("=", 1)[0]
    path = Path(sys.argv[2]) / f"bench-{name}.json"
    for r in json.loads(path.read_text()) if path.exists() else []:
        if r.get("variant") != "generate":
            r["variant"] = f"{name}:{r.get('variant')}"
        rows.append(r)
print("\n".join(table(rows)))
PY
