#!/usr/bin/env bash
# Run the whole test suite (sets the environment up first). GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
