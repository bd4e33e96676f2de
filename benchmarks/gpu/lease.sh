#!/usr/bin/env bash
# One call of a lent GPU host after the payload's parts were stashed (docs/gpu.md, "Carrying vLLM to a GPU host"):
# the steps a lease runs, each timed, with what comes back gathered under $OUT/r (a host returns only what the call
# leaves under $OUT).  Run from the repository root of the call's copy of the working tree:
#
#     bash benchmarks/gpu/lease.sh SECONDS STEP...
#
#   SECONDS   what the call may take (the host's limit per call, less a margin): every step is cut to what is left
#   install   join the stashed parts with .gpu/part2 and install them (install.sh install); py-spy comes with them
#   1b, 8b    compare_trees.sh for that shape with the specs in $SPECS (default: this tree's generate, capture and
#             capture_procs, then capture_procs and capture again: the last lease's question, docs/gpu.md)
#   prof1b, prof8b   the shape's $PROF_VARIANTS (default capture) recorded by py-spy (bench_gpu.py --pyspy); each
#             thread's time by what it waited on or ran (pyspy_threads.py) -> r/SHAPE-VARIANT.pyspy.summary.txt
#   gpu-tests tests/gpu, this tree first on PYTHONPATH                      -> r/gpu-tests.log
#
# Trees other than the installed one: unpack them first (TREES="name=path.tar.gz ...": each into /root/trees/name,
# name usable in SPECS as /root/trees/name).  r/lease.log has each step's time and exit status.
set -uo pipefail
T0=$(date +%s)
BUDGET=${1:?SECONDS}
shift
export CALL_END=$((T0 + BUDGET)) NEED=${NEED:-90}
export PYTHONPATH=/root/hs-gpu-site${PYTHONPATH:+:$PYTHONPATH} PATH=/root/hs-gpu-site/bin:$PATH
SRC=${SRC:-/root/hs-gpu-src}
R=${OUT:?OUT: the folder the host returns}/r
mkdir -p "$R"
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$R/lease.log"; }
for spec in ${TREES:-}; do
    name=${spec%%=*}
    mkdir -p "/root/trees/$name" && tar -xzf "${spec#*=}" -C "/root/trees/$name" && log "tree $name unpacked"
done
for step in "$@"; do
    case $step in
    install)
        bash .gpu/part2/install.sh install .gpu/part2 >"$R/install.log" 2>&1
        log "install rc=$?"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$R/gpu.txt" 2>&1
        ;;
    1b | 8b)
        # shellcheck disable=SC2086  # SPECS is a list
        bash "$SRC/benchmarks/gpu/compare_trees.sh" "/root/cmp-$step" "$step" \
            ${SPECS:-new=$SRC:generate,capture,capture_procs new2=$SRC:capture_procs,capture} >"$R/cmp-$step.out" 2>&1
        log "$step rc=$?"
        cp "/root/cmp-$step/compare.log" "$R/compare-$step.log"
        tar -czf "$R/cmp-$step.tar.gz" -C /root "cmp-$step"
        ;;
    prof1b | prof8b)
        shape=${step#prof}
        spy=$(command -v py-spy) || { log "$step: no py-spy on PATH (the payload carries it)"; continue; }
        bench=/root/hs-gpu-work/bench
        rm -f "$bench/$shape"-*.pyspy.txt
        (cd "$SRC" && BENCH_ARGS="--variants ${PROF_VARIANTS:-capture} --pyspy $spy" \
            bash benchmarks/gpu/run_gpu.sh "/root/prof-$shape" "bench-$shape" >"$R/prof-$shape.out" 2>&1)
        log "$step rc=$?"
        for f in "$bench/$shape"-*.pyspy.txt; do
            [ -f "$f" ] || continue
            b=$(basename "$f" .txt)
            python3 "$SRC/benchmarks/gpu/pyspy_threads.py" "$f" --top 8 >"$R/$b.summary.txt" 2>&1
            gzip -c "$f" >"/root/prof-$shape/$b.txt.gz"
        done
        tar -czf "$R/prof-$shape.tar.gz" -C /root "prof-$shape"
        ;;
    gpu-tests)
        PYTHONPATH=.:$PYTHONPATH timeout $((CALL_END - $(date +%s) - 10)) python3 -m pytest -q tests/gpu \
            >"$R/gpu-tests.log" 2>&1
        log "gpu-tests rc=$?"
        ;;
    *)
        log "unknown step $step" ;;
    esac
done
log "end"
