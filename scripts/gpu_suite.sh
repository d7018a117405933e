#!/usr/bin/env bash
# GPU results: benchmark (ResNet-50 fp16 AOTI, handle() vs raw floor) and a soak through real
# TorchServe (fp16 and fp32, 1x3x2160x3840 inputs, several workers per GPU). Run on the GPU
# machine from the repository root after `source .gpukit/kit_env.sh`; writes into $RESULTS.
# The 2160x3840 models are served with batchSize 1: their responses are ~50-100 MB per row and
# TorchServe 0.12 relays batched responses in quadratic time (archive.py warns).
set -euo pipefail
RESULTS=${RESULTS:-docs/results}
W=${WORK:-/tmp/gpu_suite}
mkdir -p "$RESULTS" "$W/store"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
[ -f "$W/r50/artifact.json" ] || $PY scripts/compile.py --model examples/models.py:resnet50 \
    --input image:8x3x224x224:float32 --dynamic-batch 1:64 --backend aoti --device cuda --precision fp16 --out "$W/r50"
[ -f "$W/big16/artifact.json" ] || $PY scripts/compile.py --model examples/models.py:big_conv \
    --input image:2x3x2160x3840:float32 --dynamic-batch 1:2 --backend aoti --device cuda --precision fp16 --out "$W/big16"
[ -f "$W/big32/artifact.json" ] || $PY scripts/compile.py --model examples/models.py:big_conv \
    --input image:2x3x2160x3840:float32 --dynamic-batch 1:2 --backend export --device cuda --out "$W/big32"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  $PY scripts/bench.py --artifact "$W/r50" --batch-sizes 1,8,64 --iters 30 --load-profile --profile-handle \
      --out "$RESULTS/bench_resnet50_fp16.json"
fi
[ "${SKIP_SOAK:-0}" = 1 ] && exit 0
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
$PY scripts/archive.py --artifact "$W/r50" --name r50 --out "$W/store" --workers $((2 * NGPU)) --batch-size 8 --max-batch-delay 5
$PY scripts/archive.py --artifact "$W/big16" --name big16 --out "$W/store" --workers $((2 * NGPU)) --batch-size 1
$PY scripts/archive.py --artifact "$W/big32" --name big32 --out "$W/store" --workers $((2 * NGPU)) --batch-size 1
cd "$W"
sed "s#^model_store=.*#model_store=$W/store#" "$OLDPWD/config.properties" > config.properties
torchserve --start --ncs --model-store "$W/store" --models r50=r50.mar,big16=big16.mar,big32=big32.mar --ts-config config.properties
cd "$OLDPWD"
for i in $(seq 1 300); do
  n=$(grep -c "loaded .* artifact" "$W/logs/model_log.log" 2>/dev/null || true)
  [ "${n:-0}" -ge $((6 * NGPU)) ] && break; sleep 2
done
grep "loaded .* artifact" "$W/logs/model_log.log" | sed 's/.*MODEL_LOG - //' | cut -c1-200 | tee "$RESULTS/worker_placement.txt" \
  || { tail -40 "$W/logs/ts_log.log" "$W/logs/model_log.log"; torchserve --stop; exit 1; }
$PY scripts/soak.py --key-file "$W/key_file.json" --concurrency 24 --requests ${SOAK_REQUESTS:-120} \
    --model r50=examples/models.py:resnet50:3x224x224:4:float16 \
    --model big16=examples/models.py:big_conv:3x2160x3840:1:float16 \
    --model big32=examples/models.py:big_conv:3x2160x3840:1:float32 --out "$RESULTS/soak.json" || rc=$?
torchserve --stop || true
cp "$W/logs/model_log.log" "$RESULTS/soak_model_log.txt" 2>/dev/null || true
exit ${rc:-0}
