#!/usr/bin/env bash
# One command from a fresh clone: set up, compile the example classifier with AOTInductor for
# this machine's device, archive it, start real TorchServe (token auth on, loopback only) and
# print the answer to a real request.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
PY=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"
DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
ART=artifacts/classifier_aoti_$DEVICE
if [ ! -f "$ART/artifact.json" ]; then
  echo "== compiling the example classifier with AOTInductor for $DEVICE (about a minute on 2 CPU cores)"
  $PY -m scripts.compile --model examples/models.py:classifier --input image:4x3x32x32:float32 \
      --dynamic-batch 1:16 --backend aoti --device "$DEVICE" --out "$ART"
fi
echo "== archiving model_store/classifier.mar"
# Serving settings: the archive defaults (6 workers, batches of 8, 1 ms) are sized for one GPU;
# on a CPU-only machine one worker leaves the cores to that worker's threads.
WORKERS=$([ "$DEVICE" = cuda ] && echo 6 || echo 1)
$PY -m scripts.archive --artifact "$ART" --name classifier --workers "$WORKERS"
if torchserve --stop >/dev/null 2>&1; then sleep 2; fi
mkdir -p logs
echo "== starting TorchServe (config.properties: 127.0.0.1 only, token authorization on)"
torchserve --start --ncs --model-store model_store \
    --models classifier=classifier.mar --ts-config config.properties > logs/torchserve_console.log 2>&1
$PY -m scripts.client --model classifier --wait 180 --example image:2x3x32x32:float32 --check-eager \
    --factory examples/models.py:classifier
echo
echo "TorchServe is running. Keys: $PWD/key_file.json. Stop it with: .venv/bin/torchserve --stop"
