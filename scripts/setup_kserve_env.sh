#!/bin/sh
# The standard clients the pod's tests call it with (tests/test_pod.py): the kserve SDK's REST and
# gRPC clients and tritonclient (http and grpc). They pin protobuf/grpcio versions that differ
# from the test venv's, so they live in their own venv, .venv-kserve (git-ignored). Exact
# versions; re-run after changing them.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv-kserve/bin/python ] || "$PY" -m venv .venv-kserve
.venv-kserve/bin/python -m pip install -q "kserve==0.21.0" "httpx>=0.27" "tritonclient[grpc,http]>=2.40"
touch .venv-kserve/.installed
