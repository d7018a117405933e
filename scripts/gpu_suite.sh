#!/usr/bin/env bash
# GPU results: benchmark (ResNet-50 fp16 AOTI, handle() vs raw floor) and a soak through real
# TorchServe (fp16 and fp32, 1x3x2160x3840 inputs, several workers per GPU). Run on the GPU
# machine from the repository root after `source .gpukit/kit_env.sh`; writes into $RESULTS.
#   SKIP_BENCH=1        soak only          SKIP_SOAK=1   benchmark only
#   SOAK_MODELS="big32" soak a subset of r50, big16, big32 (only those are compiled and served)
# The 2160x3840 models are served with batchSize 1: their responses are ~50-100 MB per row and
# TorchServe 0.12 relays batched responses in quadratic time (archive.py warns).
#   SOAK_OUT / BENCH_OUT   results file names (default $RESULTS/soak.json, $RESULTS/bench_resnet50_fp16.json)
# Each results file records this script's invocation (RESULTS_VIA) before the command it ran.
set -euo pipefail
via="bash scripts/gpu_suite.sh"
for v in WORK SOAK_REQUESTS SOAK_MODELS SKIP_SOAK SKIP_BENCH SOAK_OUT BENCH_OUT RESULTS; do
  [ -n "${!v:-}" ] && via="$v=${!v} $via"
done
export RESULTS_VIA="$via"
RESULTS=${RESULTS:-docs/results}
SOAK_OUT=${SOAK_OUT:-$RESULTS/soak.json}
BENCH_OUT=${BENCH_OUT:-$RESULTS/bench_resnet50_fp16.json}
W=${WORK:-/tmp/gpu_suite}
mkdir -p "$RESULTS" "$W/store"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
MODELS=${SOAK_MODELS:-r50 big16 big32}
[ "${SKIP_BENCH:-0}" != 1 ] && MODELS="$MODELS r50"

# name -> compile arguments, archive arguments, soak spec (FILE:FACTORY:CxHxW:MAXROWS:DTYPE)
declare -A COMPILE=(
  [r50]="--model examples/models.py:resnet50 --input image:8x3x224x224:float32 --dynamic-batch 1:64 --backend aoti --precision fp16"
  [big16]="--model examples/models.py:big_conv --input image:2x3x2160x3840:float32 --dynamic-batch 1:2 --backend aoti --precision fp16"
  [big32]="--model examples/models.py:big_conv --input image:2x3x2160x3840:float32 --dynamic-batch 1:2 --backend export"
)
declare -A BATCH=([r50]="--batch-size 8 --max-batch-delay 5" [big16]="--batch-size 1" [big32]="--batch-size 1")
declare -A SOAK=([r50]="examples/models.py:resnet50:3x224x224:4:float16"
                 [big16]="examples/models.py:big_conv:3x2160x3840:1:float16"
                 [big32]="examples/models.py:big_conv:3x2160x3840:1:float32")
for m in $(echo $MODELS | tr ' ' '\n' | sort -u); do
  [ -n "${COMPILE[$m]:-}" ] || { echo "unknown model $m (r50, big16, big32)"; exit 2; }
  [ -f "$W/$m/artifact.json" ] || $PY -m compiled_serving.compile ${COMPILE[$m]} --device cuda --out "$W/$m"
done

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  $PY -m bench.bench --artifact "$W/r50" --batch-sizes 1,8,64 --iters 30 --load-profile --profile-handle \
      --out "$BENCH_OUT"
fi
[ "${SKIP_SOAK:-0}" = 1 ] && exit 0

SERVE=${SOAK_MODELS:-r50 big16 big32}
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
models_arg="" soak_args=() n=0
for m in $SERVE; do
  $PY -m compiled_serving.archive --artifact "$W/$m" --name "$m" --out "$W/store" --workers $((2 * NGPU)) ${BATCH[$m]}
  models_arg="${models_arg:+$models_arg,}$m=$m.mar"
  soak_args+=(--model "$m=${SOAK[$m]}")
  n=$((n + 2 * NGPU))
done
cd "$W"
sed "s#^model_store=.*#model_store=$W/store#" "$OLDPWD/config.properties" > config.properties
torchserve --start --ncs --model-store "$W/store" --models "$models_arg" --ts-config config.properties
cd "$OLDPWD"
# the worker log with its rolled parts (log4j2.xml rolls it at midnight and at 100 MB)
model_log() { ls -tr "$W"/logs/model_log.*.log.gz "$W"/logs/model_log.log 2>/dev/null | xargs -r zcat -f; }
for i in $(seq 1 300); do
  k=$(model_log | grep -c "loaded .* artifact" || true)
  [ "${k:-0}" -ge "$n" ] && break; sleep 2
done
model_log | grep "loaded .* artifact" | sed 's/.*MODEL_LOG - //' | cut -c1-200 | tee "$RESULTS/worker_placement.txt" \
  || { tail -40 "$W/logs/ts_log.log" "$W/logs/model_log.log"; torchserve --stop; exit 1; }
$PY -m bench.soak --key-file "$W/key_file.json" --concurrency 24 --requests ${SOAK_REQUESTS:-120} \
    "${soak_args[@]}" --out "$SOAK_OUT" || rc=$?
torchserve --stop || true
model_log > "$RESULTS/soak_model_log.txt" || true
exit ${rc:-0}
