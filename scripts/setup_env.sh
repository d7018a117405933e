#!/usr/bin/env bash
# Idempotent environment setup from the project's own files: a virtual environment in .venv
# with pinned packages, a Java 17 runtime for TorchServe's frontend if `java` is missing, and, with
# --pod-tests (scripts/test.sh), nginx for the KServe pod's tests if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating the virtual environment .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml requirements-cpu.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  # a fresh machine takes a minute or two here: say what is happening
  echo "setup: installing into .venv: pip"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    # No NVIDIA driver: take torch's CPU build instead of the multi-GB CUDA one.
    echo "setup: installing into .venv: torch's CPU build (requirements-cpu.txt)"
    .venv/bin/python -m pip install -q -r requirements-cpu.txt 2>&1 | grep -v "^WARNING: Location" || true
  fi
  # The dependencies declared in pyproject.toml (the project itself is installed below, the
  # handler package never: a model archive can only ever run the copy it carries).
  .venv/bin/python - > .venv/requirements.txt <<'PYEOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))
PYEOF
  echo "setup: installing into .venv: TorchServe, the tools and the test packages of pyproject.toml"
  .venv/bin/python -m pip install -q -r .venv/requirements.txt 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, ts, model_archiver, yaml, grpc, pytest, safetensors, hypothesis, matplotlib, tritonclient.http, jsonschema, transformers, openai, jinja2" \
    || { echo "setup: package installation failed" >&2; exit 1; }
  rm -f .venv/.installed-*; touch "$stamp"
  echo "setup: .venv is ready"
fi
# The build side's console commands (pyproject.toml's [project.scripts]: cs-compile, cs-archive, ...):
# an editable install of this checkout's build package (compiled_serving) and the handler package
# it reads, without their dependencies (installed above). A TorchServe worker still imports the
# handler copy its archive carries: the model's directory is on its PYTHONPATH, which comes first.
venv_py="$PWD/.venv/bin/python"
if ! (cd / && "$venv_py" -c "import compiled_serving, handlers" 2>/dev/null) || [ ! -x .venv/bin/cs-archive ]; then
  echo "setup: installing the console commands (cs-compile, cs-archive, ...) into .venv"
  .venv/bin/python -c "import setuptools" 2>/dev/null || .venv/bin/python -m pip install -q "setuptools>=64"
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . > .venv/editable-install.log 2>&1 \
    && [ -x .venv/bin/cs-archive ] \
    || { cat .venv/editable-install.log >&2; echo "setup: installing the console commands failed" >&2; exit 1; }
fi
# TorchServe's workers forked from a warm process that has imported torch (compiled_serving/prefork.py:
# a killed worker is back about TorchServe's 1 s back-off later): the hook's one line in this
# environment's site-packages, which site reads at every interpreter start; the line imports the
# module only in a process running TorchServe's worker (CS_PREFORK=off in TorchServe's environment
# turns it off)
site_dir=$("$venv_py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
pth_line=$(cd / && "$venv_py" -m compiled_serving.prefork --pth)
if [ "$(cat "$site_dir/cs_prefork.pth" 2>/dev/null)" != "$pth_line" ]; then
  printf '%s\n' "$pth_line" > "$site_dir/cs_prefork.pth"
fi
# apt-get waits up to 5 minutes for another apt (unattended upgrades, another install) to let go
# of its lock, and a failure says what to do rather than apt's message alone.
apt_install() {
  local what=$1; shift
  echo "setup: installing $what through apt-get (waits for another apt holding its lock, up to 5 minutes)"
  if ! { apt-get -o DPkg::Lock::Timeout=300 update -qq \
         && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "$@" >/dev/null; }; then
    echo "setup: installing $what ($*) with apt-get failed (above). If another apt or dpkg is running," \
         "wait for it and run this again; or install $* yourself." >&2
    exit 1
  fi
}
if ! command -v java >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt_install "a Java 17 runtime for TorchServe's frontend" openjdk-17-jre-headless
  else
    echo "setup: TorchServe needs Java 17 on PATH: install openjdk-17-jre-headless (or set JAVA_HOME)" >&2
    exit 1
  fi
fi
# nginx only for the KServe pod's tests (tests/test_pod.py, tests/test_cluster_runtime.py run the pod
# as its image does, with the distribution's nginx in front of TorchServe: pod/nginx.py): the test
# command asks for it (scripts/test.sh: --pod-tests); serving needs none. NGINX names another binary.
if [ "${1:-}" = "--pod-tests" ] && ! command -v "${NGINX:-nginx}" >/dev/null 2>&1 \
    && { [ -n "${NGINX:-}" ] || [ ! -x /usr/sbin/nginx ]; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt_install "nginx for the KServe pod's tests" nginx
  else
    echo "setup: the KServe pod's tests need nginx: install it (apt-get install nginx) or set NGINX=/path/to/nginx" >&2
    exit 1
  fi
fi
