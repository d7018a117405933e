#!/usr/bin/env bash
# Run the whole test suite (sets the environment up first). GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
# the README walk (tests/test_readme_walk.py) runs the README's commands in a fresh clone
export README_WALK=${README_WALK:-1}
exec .venv/bin/python -m pytest "$@"
