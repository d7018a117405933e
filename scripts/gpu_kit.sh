#!/usr/bin/env bash
# The kit a GPU machine without internet needs to run this project's GPU steps with real
# TorchServe: a trimmed Java runtime, torchserve and torch-model-archiver. The machine brings its
# own Python and CUDA torch; nothing else is installed there.
#
#   scripts/gpu_kit.sh [OUT]        on a machine with internet and a JDK 17 (jlink): writes OUT
#                                   (default .gpukit, git-ignored)
#   source .gpukit/kit_env.sh           on the GPU machine, from the repository root, before the
#                                   GPU command: unpacks the kit once and puts it on PATH
#
# TS_VERSION picks the TorchServe release (default 0.12.0, the one pyproject.toml pins).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpukit}
TS_VERSION=${TS_VERSION:-0.12.0}
PY=${PYTHON:-python3}
command -v jlink >/dev/null || { echo "gpu_kit.sh: jlink not found: install a JDK 17 (apt-get install openjdk-17-jdk-headless)" >&2; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$OUT" "$scratch/wheels" "$scratch/py" "$scratch/jar"

echo "== wheels: torchserve and torch-model-archiver $TS_VERSION (no dependencies: the GPU machine has torch)"
$PY -m pip download --quiet --no-deps --dest "$scratch/wheels" \
    "torchserve==$TS_VERSION" "torch-model-archiver==$TS_VERSION"
cp "$scratch"/wheels/torch_model_archiver-*.whl "$OUT/"

# The frontend jar is stored deflated inside the wheel; unpacked and packed again with xz it
# travels at a fraction of the size, and kit_env.sh zips it back into place.
$PY -m zipfile -e "$scratch"/wheels/torchserve-*.whl "$scratch/py"
jar=$scratch/py/ts/frontend/model-server.jar
$PY -m zipfile -e "$jar" "$scratch/jar"
rm "$jar"
XZ_OPT="-T0 -6" tar -C "$scratch/py" -cJf "$OUT/torchserve_py.txz" .
XZ_OPT="-T0 -6" tar -C "$scratch/jar" -cJf "$OUT/frontend_jar.txz" .

echo "== Java runtime: only the modules TorchServe's frontend loads (java.desktop for java.beans)"
jlink --strip-debug --no-man-pages --no-header-files --output "$scratch/jre" --add-modules \
    java.base,java.desktop,java.instrument,java.logging,java.management,java.naming,java.scripting,java.sql,java.xml,jdk.crypto.ec,jdk.management,jdk.unsupported
XZ_OPT="-T0 -6" tar -C "$scratch" -cJf "$OUT/jre.txz" jre

echo "== load generator: Debian's wrk and the libraries it links (bench/native_load.py, LOADGEN)"
if command -v apt-get >/dev/null; then
  (cd "$scratch" && apt-get download -q wrk libluajit-5.1-2 libssl3 >/dev/null 2>&1) || true
  mkdir -p "$OUT/loadgen/lib" "$scratch/deb"
  for d in "$scratch"/*.deb; do [ -e "$d" ] && dpkg -x "$d" "$scratch/deb"; done
  if [ -x "$scratch/deb/usr/bin/wrk" ]; then
    cp "$scratch/deb/usr/bin/wrk" "$OUT/loadgen/"
    cp -L "$scratch"/deb/usr/lib/x86_64-linux-gnu/{libluajit-5.1.so.2,libssl.so.3,libcrypto.so.3} "$OUT/loadgen/lib/"
    printf '#!/bin/sh\nd="$(cd "$(dirname "$0")" && pwd)"; t="$1"; shift\nLD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/$t" "$@"\n' \
      > "$OUT/loadgen/run"
    chmod +x "$OUT/loadgen/run"
  else
    echo "gpu_kit.sh: wrk not packed (apt-get download failed): the benchmarks' --load-generator native needs it" >&2
  fi
fi

cat > "$OUT/kit_env.sh" <<'ENV'
# Sourced on the GPU machine: unpack the kit once per machine, then put it on PATH/PYTHONPATH.
_kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_to=${TMPDIR:-/tmp}/torchserve_kit
if [ ! -x "$_to/jre/bin/java" ]; then
  mkdir -p "$_to/py" "$_to/jar" "$_to/bin"
  tar -xJf "$_kit/jre.txz" -C "$_to"
  tar -xJf "$_kit/torchserve_py.txz" -C "$_to/py"
  tar -xJf "$_kit/frontend_jar.txz" -C "$_to/jar"
  (cd "$_to/jar" && python3 -m zipfile -c "$_to/py/ts/frontend/model-server.jar" ./*)
  python3 -m pip install --quiet --no-index --no-deps --target "$_to/py" "$_kit"/torch_model_archiver-*.whl
  printf '#!/bin/sh\nexec python3 -m ts.model_server "$@"\n' > "$_to/bin/torchserve"
  printf '#!/bin/sh\nexec python3 -m model_archiver.model_packaging "$@"\n' > "$_to/bin/torch-model-archiver"
  chmod +x "$_to/bin/torchserve" "$_to/bin/torch-model-archiver"
fi
export JAVA_HOME="$_to/jre" PATH="$_to/bin:$_to/jre/bin:$PATH"
export PYTHONPATH="$_to/py${PYTHONPATH:+:$PYTHONPATH}"
[ -x "$_kit/loadgen/run" ] && export LOADGEN="$_kit/loadgen/run"  # wrk, for --load-generator native
# g++ 13 on the GPU image (which exports it as CXX=/opt/gcc/bin/g++) builds AOTInductor wrappers
# that crash at load (std::regex while parsing the device string); g++-12 works, so it replaces an
# inherited CXX. KIT_CXX picks another on purpose.
if [ -n "${KIT_CXX:-}" ]; then export CXX="$KIT_CXX"; elif command -v g++-12 >/dev/null; then export CXX=g++-12; fi
unset _kit _to
ENV
du -sh "$OUT"
echo "kit written to $OUT; on the GPU machine: source $OUT/kit_env.sh && <the GPU command>"
