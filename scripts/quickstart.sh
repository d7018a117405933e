#!/usr/bin/env bash
# One command from a fresh clone: set up, compile the example classifier with AOTInductor for
# this machine's device, archive it, start real TorchServe (token auth on, loopback only) and
# print the answer to a real request.
#
#   scripts/quickstart.sh          set up, serve the example model, call it
#   scripts/quickstart.sh --stop   stop the TorchServe this script started (no other)
#   scripts/quickstart.sh --serve NAME [NAME ...]   restart it serving model_store/NAME.mar too, for
#                                  each NAME (also NAME,NAME) (README,
#                                  "Serve your own model")
set -euo pipefail
cd "$(dirname "$0")/.."
# `torchserve --stop` stops the server whose pid file is in the temp directory: with a temp
# directory of the quickstart's own, it finds only the server the quickstart started, never
# another TorchServe on the machine. TEMP is the frontend's (its java.io.tmpdir, where it unpacks
# every archive into models/<uuid> and never removes it, and puts the workers' sockets): the
# quickstart's own too, emptied of the last start's copies before each start.
STATE=${QUICKSTART_STATE:-$PWD/logs/quickstart}
mkdir -p "$STATE/tmp"
# (its workers' socket paths must fit 107 bytes: from a deep checkout TorchServe keeps its /tmp)
if [ $(( ${#STATE} + 20 )) -le 107 ]; then export TEMP="$STATE/tmp"; fi
fresh_temp() { rm -rf "$STATE/tmp/models"; }
# `torchserve --stop` also deletes key_file.json in the directory it runs in (TorchServe 0.12,
# ts/model_server.py): run from $STATE it deletes nobody's; the quickstart's own server (the default
# state) wrote its keys here, in the repository root, and only those go with it. (From the root,
# a stop with another QUICKSTART_STATE, as the test suite's, deleted a running quickstart's keys.)
stop_ours() {
  if [ -x .venv/bin/torchserve ] && [ -f "$STATE/tmp/.model_server.pid" ]; then
    (cd "$STATE" && TMPDIR="$STATE/tmp" "$OLDPWD/.venv/bin/torchserve" --stop) && sleep 2
    if [ "$STATE" = "$PWD/logs/quickstart" ]; then rm -f key_file.json; fi
  fi
  return 0
}
if [ "${1:-}" = "--stop" ]; then stop_ours; exit 0; fi
if [ "${1:-}" = "--serve" ]; then
  shift
  # names as separate words or comma-separated: --serve a b, --serve a,b
  names=$(printf '%s\n' "$@" | tr ',' '\n' | grep -v '^$' || true)
  if [ -z "$names" ]; then
    echo "usage: scripts/quickstart.sh --serve NAME [NAME ...] (serves model_store/NAME.mar for each)" >&2
    exit 2
  fi
  models=""
  for name in $names; do
    if [ ! -f "model_store/$name.mar" ]; then
      echo "no model_store/$name.mar: build it first with .venv/bin/cs-archive --name $name ..." >&2
      exit 1
    fi
    models="${models:+$models,}$name=$name.mar"
  done
  if [ -f model_store/classifier.mar ] && ! printf '%s\n' $names | grep -qx classifier; then
    models="classifier=classifier.mar,$models"
  fi
  stop_ours
  fresh_temp
  mkdir -p logs
  TMPDIR="$STATE/tmp" .venv/bin/torchserve --start --ncs --model-store model_store --models "$models" \
      --ts-config config.properties > logs/torchserve_console.log 2>&1
  echo "TorchServe is serving $models on 127.0.0.1:8080. Stop it with: scripts/quickstart.sh --stop"
  exit 0
fi
scripts/setup_env.sh
PY=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"
DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
ART=artifacts/classifier_aoti_$DEVICE
if [ ! -f "$ART/artifact.json" ]; then
  echo "== compiling the example classifier with AOTInductor for $DEVICE (about a minute on 2 CPU cores)"
  .venv/bin/cs-compile --model examples/models.py:classifier --input image:4x3x32x32:float32 \
      --dynamic-batch 1:16 --backend aoti --device "$DEVICE" --out "$ART"
fi
echo "== archiving model_store/classifier.mar"
# workers: the archive picks them from the artifact's device and this machine's cores, and says so
.venv/bin/cs-archive --artifact "$ART" --name classifier
stop_ours
fresh_temp
mkdir -p logs
echo "== starting TorchServe (config.properties: 127.0.0.1 only, token authorization on)"
TMPDIR="$STATE/tmp" torchserve --start --ncs --model-store model_store \
    --models classifier=classifier.mar --ts-config config.properties > logs/torchserve_console.log 2>&1
.venv/bin/cs-client --model classifier --wait 180 --example image:2x3x32x32:float32 --check-eager \
    --factory examples/models.py:classifier
echo
echo "TorchServe is running. Keys: $PWD/key_file.json. Stop it with: scripts/quickstart.sh --stop"
