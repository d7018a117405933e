#!/usr/bin/env bash
# Run the whole test suite (sets the environment up first). GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh --pod-tests
# the README walk (tests/test_readme_walk.py) runs the README's commands in a fresh clone
export README_WALK=${README_WALK:-1}
# On TEST_WORKERS processes (default 2; 0: this one alone). tests/conftest.py keeps each module,
# and every user of main_server, on one process and builds each artifact once for all of them.
workers=${TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
