#!/usr/bin/env bash
# The drafter trainers' OWN training commands on files this package wrote (docs/trainers.md, "train" rows).
#
#   stage (here, on a CPU machine, from the repository root):
#       bash benchmarks/gpu_trainers/run_trainers_h200.sh stage [STAGE_DIR]
#     makes the tiny verifier, writes its records through the package (FileSink, then `vllm-hs-compat convert`)
#     in the `speculators` and `specforge-eagle3` formats (prepare.py), downloads the trainers' wheels (py3.12) and
#     copies this folder's scripts, all into STAGE_DIR (default .gpurun, git-ignored; about 25 MiB).
#
#   run (on the GPU host, from the folder holding STAGE_DIR; needs python3 with torch/CUDA, transformers, triton,
#   pyarrow, pandas, tensorboard, accelerate, aiohttp; everything else comes as wheels, --no-deps, offline):
#       OUT=/some/dir bash STAGE_DIR/run_trainers_h200.sh run [STAGE_DIR]
#     1. speculators 0.9.0: `speculators train --data-path ... --target-layer-ids 1 2 3 --on-missing raise` (6 epochs;
#        --loss-implementation eager: its default fused Triton loss fails to trace under torch 2.11 / Triton 3.6 with
#        "ListVariable(length=21) is already tracked for mutation", before any data matters)
#     2. SpecForge 0.2.0: `specforge train --config specforge_run.yaml data.hidden_states_path=... model....` (2 epochs)
#     3. negative control: the speculators command, 1 epoch, on a copy whose hs_0/hs_1 files are swapped
#     4. report.py: steps, loss and accuracy first -> last, samples/tokens loaded against what was written.
#   Logs and report.json land in OUT.  About 4 minutes on one H200, machine start excluded.
set -uo pipefail
cmd=${1:-}
STAGE=${2:-.gpurun}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ "$cmd" = stage ]; then
    PY=${PYTHON:-python3}
    rm -rf "$STAGE" && mkdir -p "$STAGE/whl" || exit 2
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PY" "$HERE/prepare.py" --out "$STAGE/data" || exit 1
    cp "$HERE"/run_trainers_h200.sh "$HERE"/report.py "$HERE"/specforge_run.yaml "$STAGE/" || exit 2
    # The trainers and what their imported modules need that the GPU image lacks (pinned as run here).
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$STAGE/whl" \
        speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0 datasets==5.1.0 dill==0.4.1 \
        multiprocess==0.70.19 loguru==0.7.3 openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
        pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
        typing_extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 || exit 2
    du -sh "$STAGE"
    exit 0
fi
[ "$cmd" = run ] || { echo "usage: $0 stage|run [STAGE_DIR]" >&2; exit 2; }

OUT=${OUT:-/tmp/trainers_out}
START=$(date +%s)
BUDGET=${BUDGET:-300}  # seconds: a retry or the negative control starts only while the run is inside this
left() { echo $((BUDGET - ($(date +%s) - START))); }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false COLUMNS=160
SITE=/tmp/trainer_site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$STAGE"/whl/*.whl || exit 3
export PYTHONPATH=$SITE
{
    nvidia-smi -L
    python3 -c 'import torch, transformers, triton, speculators, specforge, datasets, pydantic; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__, "triton", triton.__version__, "pydantic", pydantic.VERSION, "datasets", datasets.__version__)'
} 2>&1 | tee "$OUT/env.log"

W=/tmp/trainers_work
rm -rf "$W" && mkdir -p "$W" && cp -r "$STAGE/data" "$W/data" || exit 2  # the trainers write beside their data
D=$W/data
SPEC=("$SITE/bin/speculators")
[ -x "${SPEC[0]}" ] || SPEC=(python3 -m speculators)
FORGE=("$SITE/bin/specforge")
[ -x "${FORGE[0]}" ] || FORGE=(python3 -m specforge.cli)

rc=0
# 1. speculators, the command `vllm-hs-compat convert` printed, plus run-size flags.
t0=$(date +%s)
set -x
timeout 180 "${SPEC[@]}" train --data-path "$D/speculators" --verifier-name-or-path "$D/verifier" \
    --target-layer-ids 1 2 3 --on-missing raise --loss-implementation eager --epochs 6 --total-seq-len 512 --num-workers 2 --prefetch-factor 2 \
    --save-path "$W/spec/ckpt" --logger tensorboard --log-dir "$W/spec/logs" --run-name ours \
    >"$OUT/speculators.log" 2>&1
r=$?
echo "speculators rc=$r after $(($(date +%s) - t0)) s" | tee -a "$OUT/speculators.log"
if [ $r -ne 0 ] && [ "$(left)" -gt 150 ]; then  # one retry on sdpa attention instead of flex
    mv "$OUT/speculators.log" "$OUT/speculators_flex.log" && rm -rf "$W/spec" && t0=$(date +%s)
    timeout "$(left)" "${SPEC[@]}" train --data-path "$D/speculators" --verifier-name-or-path "$D/verifier" \
        --target-layer-ids 1 2 3 --on-missing raise --loss-implementation eager --draft-attn-impl sdpa --epochs 6 \
        --total-seq-len 512 --num-workers 2 --prefetch-factor 2 --save-path "$W/spec/ckpt" --logger tensorboard \
        --log-dir "$W/spec/logs" --run-name ours >"$OUT/speculators.log" 2>&1
    echo "speculators (sdpa) rc=$? after $(($(date +%s) - t0)) s" | tee -a "$OUT/speculators.log"
fi
set +x

# 2. SpecForge: its one entry point, offline EAGLE-3 over the converted folder.
t0=$(date +%s)
set -x
timeout 150 "${FORGE[@]}" train --config "$STAGE/specforge_run.yaml" data.hidden_states_path="$D/specforge" \
    model.target_model_path="$D/verifier" "model.aux_hidden_state_layer_ids=[0,1,2]" \
    model.lm_head_key=model.embed_tokens.weight model.draft_model_config="$D/specforge_draft.json" \
    output_dir="$W/forge" \
    >"$OUT/specforge.log" 2>&1
r=$?
echo "specforge rc=$r after $(($(date +%s) - t0)) s" | tee -a "$OUT/specforge.log"
if [ $r -ne 0 ] && [ "$(left)" -gt 100 ]; then  # one retry on sdpa attention instead of flex
    mv "$OUT/specforge.log" "$OUT/specforge_flex.log" && rm -rf "$W/forge" && t0=$(date +%s)
    timeout "$(left)" "${FORGE[@]}" train --config "$STAGE/specforge_run.yaml" data.hidden_states_path="$D/specforge" \
        model.target_model_path="$D/verifier" "model.aux_hidden_state_layer_ids=[0,1,2]" \
        model.lm_head_key=model.embed_tokens.weight model.draft_model_config="$D/specforge_draft.json" \
        training.attention_backend=sdpa output_dir="$W/forge" >"$OUT/specforge.log" 2>&1
    echo "specforge (sdpa) rc=$? after $(($(date +%s) - t0)) s" | tee -a "$OUT/specforge.log"
fi
set +x

# 3. negative control: row i <-> hs_i broken (hs_0 and hs_1 swapped) in a copy; speculators' own token-id check.
if [ "$(left)" -gt 60 ]; then
cp -r "$D/speculators" "$W/swapped" && H=$W/swapped/hidden_states
mv "$H/hs_0.safetensors" "$H/tmp" && mv "$H/hs_1.safetensors" "$H/hs_0.safetensors" && mv "$H/tmp" "$H/hs_1.safetensors"
t0=$(date +%s)
timeout "$(left)" "${SPEC[@]}" train --data-path "$W/swapped" --verifier-name-or-path "$D/verifier" --target-layer-ids 1 2 3 \
    --on-missing raise --loss-implementation eager --epochs 1 --total-seq-len 512 --num-workers 2 --prefetch-factor 2 \
    --save-path "$W/swap/ckpt" --logger tensorboard --log-dir "$W/swap/logs" --run-name swapped \
    >"$OUT/speculators_swapped.log" 2>&1
echo "speculators (swapped) rc=$? after $(($(date +%s) - t0)) s" | tee -a "$OUT/speculators_swapped.log"
else
    echo "negative control skipped: $(left) s of BUDGET=$BUDGET left" | tee "$OUT/speculators_swapped.log"
fi


python3 "$STAGE/report.py" --data "$D" --work "$W" --logs "$OUT" --json "$OUT/report.json" 2>&1 | tee "$OUT/report.txt"
rc=${PIPESTATUS[0]}
ls -R "$W/spec/ckpt" "$W/forge" 2>/dev/null | head -40 >>"$OUT/env.log"
exit "$rc"
