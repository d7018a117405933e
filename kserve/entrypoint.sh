#!/bin/sh
# The serving image's entrypoint (kserve/Dockerfile): TorchServe 0.12 in the foreground on the
# storage KServe mounts at $MODEL_ROOT (default /mnt/models; `python -m scripts.kserve` writes
# its config/ and model-store/).
#
# The storage's config.properties names /mnt/models (paths) and a loopback inference address
# (meant for the front door in front of TorchServe). This script writes the config TorchServe
# runs with into $RUNTIME_DIR: /mnt/models replaced by $MODEL_ROOT and, with FRONT_DOOR_PYTHON
# set (the image sets it), the front door on $HTTP_PORT (the containerPort of
# kserve/servingruntime.yaml) and $GRPC_PORT; without it, TorchServe's own inference API on
# 0.0.0.0:$HTTP_PORT. Everything else -- loopback management and metrics, no model API,
# allowed_urls, size limits -- is the storage's.
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
# TorchServe's pid file, worker sockets and logs/ go under the runtime directory (the pod's
# root filesystem may be read-only; /tmp is an emptyDir-like writable path).
export TMPDIR="$RUNTIME_DIR/tmp"
rm -f "$RUNTIME_DIR/front_door"

if [ -n "${FRONT_DOOR_PYTHON:-}" ]; then
    # The front door (scripts/front_door.py, the kserve SDK in its own Python, which the image
    # sets as FRONT_DOOR_PYTHON): KServe's v1/v2 REST routes, metadata, ready/health and OIP gRPC
    # on $HTTP_PORT / $GRPC_PORT, forwarding to TorchServe on the storage's loopback inference
    # address. TorchServe keeps every setting of the storage's config.
    GRPC_PORT="${GRPC_PORT:-8081}"
    sed -e "s#/mnt/models#$MODEL_ROOT#g" "$src" > "$RUNTIME_DIR/config.properties"
    serve_home=$(cd "$(dirname "$0")/.." && pwd)
    cd "$RUNTIME_DIR"
    torchserve --start --ncs --model-store="$MODEL_ROOT/model-store" --ts-config="$RUNTIME_DIR/config.properties"
    # Graceful, in order: the front door finishes the requests it holds, then TorchServe stops
    # its workers (`torchserve --stop` returns once the frontend process is gone).
    stop() {
        if [ -n "${door:-}" ]; then kill -TERM "$door" 2>/dev/null || true; wait "$door" 2>/dev/null || true; fi
        torchserve --stop >/dev/null 2>&1 || true
    }
    trap 'stop; exit 143' TERM INT
    cd "$serve_home"
    "$FRONT_DOOR_PYTHON" -m scripts.front_door --ts-config "$RUNTIME_DIR/config.properties" \
        --model-store "$MODEL_ROOT/model-store" --http_port "$HTTP_PORT" --grpc_port "$GRPC_PORT" &
    door=$!
    # the readiness probe (scripts/cluster_probe.py) also asks the front door
    echo "http://127.0.0.1:$HTTP_PORT" > "$RUNTIME_DIR/front_door"
    rc=0
    wait "$door" || rc=$?
    stop
    exit "$rc"
fi

sed -e "s#/mnt/models#$MODEL_ROOT#g" \
    -e "s#^inference_address=.*#inference_address=http://0.0.0.0:$HTTP_PORT#" \
    "$src" > "$RUNTIME_DIR/config.properties"
cd "$RUNTIME_DIR"
exec torchserve --start --foreground --ncs \
    --model-store="$MODEL_ROOT/model-store" --ts-config="$RUNTIME_DIR/config.properties"
