#!/usr/bin/env bash
# The lone-request capture figures in one device call (from the repository root, on the GPU host):
# tests/gpu, the lone-read probe, three `bench_gather.py --only host --no-step` runs timing BASE ("before",
# default main at 44716fd, copied as vhc_before) beside this tree, and their summary.  Seven files land in
# OUT (default benchmarks/results/capture_h200_lone_2026-12-01): tests.log, probe.json/.log, run1-3.json, host.log.
#
#     bash benchmarks/run_lone_h200.sh [BASE]          # about 3 minutes on an H200
set -uo pipefail
BASE=${1:-44716fd}
OUT=${OUT:-benchmarks/results/capture_h200_lone_2026-12-01}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1  # the lone read is the default; tests/gpu run both paths either way
PY=${PYTHON:-python3}
BEFORE="$(mktemp -d)"
git archive "$BASE" vllm_hs_compat | tar -x -C "$BEFORE" && mv "$BEFORE/vllm_hs_compat" "$BEFORE/vhc_before" || exit 2
rc=0
"$PY" -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" || rc=1
"$PY" benchmarks/probe_lone_read.py --json "$OUT/probe.json" 2>&1 | tee "$OUT/probe.log" || rc=1
for i in 1 2 3; do
    "$PY" benchmarks/bench_gather.py --only host --no-step --before "$BEFORE" --json "$OUT/run$i.json" 2>&1 \
        | tee -a "$OUT/host.log" || rc=1
done
"$PY" benchmarks/summarize_capture.py "$OUT"/run*.json 2>&1 | tee -a "$OUT/host.log"
exit $rc
