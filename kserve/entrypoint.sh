#!/bin/sh
# The serving image's entrypoint (kserve/Dockerfile): the pod (pod/start.py) -- TorchServe on
# loopback with the storage KServe mounts at $MODEL_ROOT, nginx on $HTTP_PORT (REST), the gRPC
# bridge on $GRPC_PORT and the status process -- until SIGTERM.
set -eu
cd "$(dirname "$0")/.."
exec "${POD_PYTHON:-python3}" -m pod.start
