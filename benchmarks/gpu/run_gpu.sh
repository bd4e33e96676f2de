#!/usr/bin/env bash
# The GPU leg (docs/gpu.md): real vLLM GPU engines with the package's connector, each record paired with
# transformers, the demo, and the throughput benchmark.  Run from a checkout (or the payload's src folder) on a GPU
# host whose python3 imports vllm and this package -- installed the usual way, or by install.sh from the payload:
#
#     bash benchmarks/gpu/run_gpu.sh OUT STEP...      STEP: env | disk | probe | gpu-tests | e2e | demo | bench | bench-8b | bench-1b
#
#   env    nvidia-smi, versions, /dev/shm and disk                                   -> OUT/steps.log
#   e2e    tests/e2e/test_e2e_engine.py on the GPU: every case of the CPU suite (dense, hybrid, concurrent,
#          preempt, hybrid_preempt, prompt_output, overrides) plus gpu_defaults, with CUDA graphs and
#          torch.compile on, the in-tree example connector as control, the negative controls   -> OUT/e2e.log,
#          OUT/e2e-report.txt (every pairing matrix), OUT/e2e-junit.xml with JUNIT=1
#   disk   the host's write paths: dd of 4 GiB with fsync to WORK's disk, then benchmarks/probe_write_path.py (the
#          file sink, safetensors' save_file, adoption, syncfs) on WORK and /dev/shm          -> OUT/disk.txt
#   probe  benchmarks/probe_step_read.py: one engine step's batched read on the engine's thread (pinned allocation,
#          issue time, copy) for the 8B shape                                         -> OUT/step_read.json
#          and benchmarks/probe_pinned_reuse.py: one pinned buffer per step vs per record -> OUT/pinned_reuse.json
#   gpu-tests  tests/gpu (the row reader's stream-ordering races, fp8 quantized on the device, slot checks queued
#          without a wait)                                                             -> OUT/gpu-tests.log
#   demo   vllm-hs-compat demo end to end                                            -> OUT/demo.log, OUT/demo.json
#   bench  benchmarks/gpu/bench_gpu.py (8b then 1b, every variant)                  -> OUT/bench.json,
#          OUT/bench-STEP.log, OUT/bench-logs.tar.gz (bench-8b / bench-1b: one shape)
#
# Each step has its own time limit (E2E_S, DEMO_S, BENCH_S seconds), cut to what is left before CALL_END (epoch
# seconds; unset: no cut) -- a host that ends a call at a fixed time still gets every step's logs; a step that fails
# does not stop the next.
set -uo pipefail
OUT=${1:?OUT}
shift
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/root/hs-gpu-work}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
rc=0
# vLLM's CUDA sampler takes FlashInfer's top-k/top-p kernels unless told not to, and imports FlashInfer to decide
# (vllm/v1/sample/ops/topk_topp_sampler.py): without FlashInfer installed (the carried payload has none) every
# engine dies in its worker's init.  Where it is absent, vLLM's own switch picks its PyTorch sampler.
if [ -z "${VLLM_USE_FLASHINFER_SAMPLER:-}" ] && ! "$PY" -c 'import flashinfer' 2>/dev/null; then
    export VLLM_USE_FLASHINFER_SAMPLER=0
    echo "run_gpu.sh: no flashinfer here: VLLM_USE_FLASHINFER_SAMPLER=0" | tee -a "$OUT/steps.log"
fi
# cap SECONDS: SECONDS, or less where CALL_END comes first (10 s kept for the logs)
cap() {
    local want=$1
    if [ -n "${CALL_END:-}" ]; then
        local left=$((CALL_END - $(date +%s) - 10))
        [ "$left" -lt "$want" ] && want=$left
    fi
    [ "$want" -lt 1 ] && want=1
    echo "$want"
}
# limited SECONDS LOG CMD...: CMD in a process group of its own, its output to LOG (and the last lines here); past
# SECONDS the whole group gets SIGTERM, then SIGKILL -- engine processes a killed test started included, so the next
# step finds the card free.
limited() {
    local limit=$1 log=$2
    shift 2
    setsid "$@" >"$log" 2>&1 &
    local pid=$!
    (sleep "$limit" && kill -TERM -- "-$pid" 2>/dev/null && echo "run_gpu.sh: killed after $limit s" >>"$log" &&
        sleep 15 && kill -KILL -- "-$pid" 2>/dev/null) &
    local watcher=$!
    wait "$pid"
    local r=$?
    kill "$watcher" 2>/dev/null
    tail -n "${TAIL:-40}" "$log"
    return $r
}
for step in "$@"; do
    t0=$(date +%s)
    case "$step" in
    env)
        {
            nvidia-smi -L
            nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv
            "$PY" -c 'import sys, torch, triton, transformers, vllm, vllm_hs_compat, importlib.metadata as m; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "safetensors", m.version("safetensors"), "xxhash", m.version("xxhash"), "vllm", vllm.__version__, "vllm-hs-compat", m.version("vllm-hs-compat"), "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-")'
            df -h /dev/shm /tmp "$WORK" | sed 's/^/  /'
            nproc
            free -g | head -2
        } 2>&1 | tee -a "$OUT/steps.log"
        ;;
    disk)
        {
            echo "dd: 4 GiB to $WORK with conv=fsync"
            dd if=/dev/zero of="$WORK/dd.bin" bs=16M count=256 conv=fsync 2>&1 | tail -1
            rm -f "$WORK/dd.bin"
            timeout "$(cap 120)" "$PY" "$SRC/benchmarks/probe_write_path.py" "$WORK" /dev/shm --records 16
        } 2>&1 | tee -a "$OUT/disk.txt"
        ;;
    e2e)
        export HS_E2E_JOBS=${HS_E2E_JOBS:-3} HS_E2E_WORK="$WORK/e2e-runs" HS_E2E_REPORT="$OUT/e2e-report.txt"
        rm -rf "$HS_E2E_WORK"
        # -v: each test's verdict as it ends (a run killed at its limit prints no summary); every case's own logs
        # (engine, export consumer, result) come back in e2e-logs.tar.gz either way
        limited "$(cap "${E2E_S:-330}")" "$OUT/e2e.log" "$PY" -m pytest "$SRC/tests/e2e/test_e2e_engine.py" -v \
            -rfE --tb=short -p no:cacheprovider -k "${E2E_K:-not minimal_example}" \
            ${JUNIT:+--junitxml="$OUT/e2e-junit.xml"} || rc=1
        (cd "$HS_E2E_WORK" 2>/dev/null && find . -maxdepth 3 \( -name '*.log' -o -name 'result.json' -o -name 'summary.json' \) \
            -size -4M -print0 | tar -czf "$OUT/e2e-logs.tar.gz" --null -T -) 2>/dev/null
        ;;
    probe)
        limited "$(cap 90)" "$OUT/probe.log" "$PY" "$SRC/benchmarks/probe_step_read.py" --json "$OUT/step_read.json" || rc=1
        # one pinned buffer per step's read vs one per record: cudaHostAlloc on the engine's thread
        limited "$(cap 90)" "$OUT/probe-pinned.log" "$PY" "$SRC/benchmarks/probe_pinned_reuse.py" \
            --json "$OUT/pinned_reuse.json" || rc=1
        ;;
    gpu-tests)
        # tests/gpu: the row reader's stream-ordering races, its figures' paths, fp8 quantized on the device
        limited "$(cap "${GPU_TESTS_S:-240}")" "$OUT/gpu-tests.log" "$PY" -m pytest "$SRC/tests/gpu" -q -rfE \
            --tb=short -p no:cacheprovider || rc=1
        ;;
    demo)
        rm -rf "$WORK/demo"
        demo=("$PY" -m vllm_hs_compat.cli)
        command -v vllm-hs-compat >/dev/null && demo=(vllm-hs-compat)  # the installed console script
        limited "$(cap "${DEMO_S:-240}")" "$OUT/demo.log" "${demo[@]}" demo --out "$WORK/demo" || rc=1
        cp "$WORK/demo/summary.json" "$OUT/demo.json" 2>/dev/null
        ;;
    bench | bench-8b | bench-1b)
        models=8b,1b
        [ "$step" = bench-8b ] && models=8b
        [ "$step" = bench-1b ] && models=1b
        budget=$(($(cap $((${BENCH_S:-540} + 30))) - 30))
        TAIL=20
        # shellcheck disable=SC2086
        limited $((budget + 30)) "$OUT/bench-$step.log" "$PY" "$HERE/bench_gpu.py" --out "$WORK/bench" \
            --models "$models" --deadline "$budget" ${BENCH_ARGS:-} || rc=1
        cp "$WORK/bench/bench.json" "$OUT/bench.json" 2>/dev/null
        tar -czf "$OUT/bench-logs.tar.gz" -C "$WORK/bench" --exclude work . 2>/dev/null
        ;;
    *)
        echo "run_gpu.sh: unknown step $step" >&2
        rc=2
        ;;
    esac
    echo "run_gpu.sh: $step done in $(($(date +%s) - t0)) s (rc so far $rc)" | tee -a "$OUT/steps.log"
done
exit $rc
