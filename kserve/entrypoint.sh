#!/bin/sh
# The serving image's entrypoint (kserve/Dockerfile): TorchServe 0.12 in the foreground on the
# storage KServe mounts at $MODEL_ROOT (default /mnt/models; `python -m scripts.kserve` writes
# its config/ and model-store/).
#
# The storage's config.properties names /mnt/models (paths) and a loopback inference address
# (meant for a wrapper in front of TorchServe). This script writes the config TorchServe runs
# with into $RUNTIME_DIR: /mnt/models replaced by $MODEL_ROOT, the inference API on
# 0.0.0.0:$HTTP_PORT (the containerPort of kserve/servingruntime.yaml). Everything else --
# loopback management and metrics, no model API, allowed_urls, size limits -- is the storage's.
# scripts/cluster_probe.py (the pod's probes) reads the same file.
set -eu
MODEL_ROOT="${MODEL_ROOT:-/mnt/models}"
RUNTIME_DIR="${RUNTIME_DIR:-/tmp/torchserve}"
HTTP_PORT="${HTTP_PORT:-8080}"
src="$MODEL_ROOT/config/config.properties"
if [ ! -r "$src" ]; then
    echo "entrypoint: $src is missing: upload the storage/ that 'python -m scripts.kserve' wrote to the storageUri" >&2
    exit 2
fi
mkdir -p "$RUNTIME_DIR/tmp"
sed -e "s#/mnt/models#$MODEL_ROOT#g" \
    -e "s#^inference_address=.*#inference_address=http://0.0.0.0:$HTTP_PORT#" \
    "$src" > "$RUNTIME_DIR/config.properties"
# TorchServe's pid file, worker sockets and logs/ go under the runtime directory (the pod's
# root filesystem may be read-only; /tmp is an emptyDir-like writable path).
export TMPDIR="$RUNTIME_DIR/tmp"
cd "$RUNTIME_DIR"
exec torchserve --start --foreground --ncs \
    --model-store="$MODEL_ROOT/model-store" --ts-config="$RUNTIME_DIR/config.properties"
