"""Compatibility: what an artifact was built for against what this worker has, decided before
any of the artifact's code runs, and a crash-safe trial load in a child process.

Fatal (the load fails, the worker never reports ready):
  - device kind the artifact cannot run on (see device.py)
  - platform / machine architecture differ (native code)
  - CUDA compute capability: a different major version, a lower minor version on the device,
    or an arch-specific target (sm_90a) on any other device (no kernel image would load)
  - CPU ISA: an instruction-set extension the artifact was built with that this CPU lacks
    (it would die with SIGILL)
  - torch major.minor differs for native artifacts (aoti, aoti_so, tensorrt): they link
    libtorch's C++ ABI
  - TensorRT missing, or a TensorRT major.minor other than the engine's
Warnings (served, logged): a higher minor compute capability on the same major (binary
compatible, maybe slower); any other torch version difference (fatal with strict_versions).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Optional

from .device import Placement, placement_for_worker
from .errors import IncompatibleArtifact, LoadError
from .load import verify_integrity
from .metadata import ArtifactSpec, find_variants, read_spec, sha256_file, write_spec

NATIVE = ("aoti", "aoti_so", "tensorrt")

# AOTI_CPU_ISA names -> /proc/cpuinfo flags the generated code needs.
ISA_FLAGS = {
    "AVX2": ("avx2", "fma"),
    "AVX512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "AVX512_VNNI": ("avx512_vnni",),
    "AVX512_BF16": ("avx512_bf16",),
    "AMX_TILE": ("amx_tile",),
    "AMX_BF16": ("amx_bf16",),
    "AMX_INT8": ("amx_int8",),
    "AMX_FP16": ("amx_fp16",),
    "NEON": ("asimd",),
    "SVE": ("sve",),
    "SVE256": ("sve",),
}


@dataclass
class Machine:
    platform: str
    machine: str
    torch_version: str
    cpu_flags: frozenset
    compute_capability: Optional[str] = None  # of the assigned GPU
    gpu_name: Optional[str] = None
    packages: dict = field(default_factory=dict)

    def describe(self) -> str:
        gpu = (f"{self.gpu_name} (compute capability {self.compute_capability})"
               if self.compute_capability else "no GPU assigned")
        return (f"{self.platform}/{self.machine}, torch {self.torch_version}, {gpu}, CPU ISA "
                f"{' '.join(sorted(self.isa_names())) or 'baseline'}")

    def isa_names(self):
        return {name for name, flags in ISA_FLAGS.items() if all(f in self.cpu_flags for f in flags)}


def cpu_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _version(pkg: str) -> Optional[str]:
    try:
        return importlib_metadata.version(pkg)
    except importlib_metadata.PackageNotFoundError:
        return None


def this_machine(placement: Optional[Placement] = None) -> Machine:
    import torch

    cc = name = None
    if placement is not None and placement.kind == "cuda":
        major, minor = torch.cuda.get_device_capability(placement.index)
        cc, name = f"{major}.{minor}", torch.cuda.get_device_name(placement.index)
    return Machine(sys.platform, platform.machine(), torch.__version__, cpu_flags(), cc, name,
                   {p: _version(p) for p in ("tensorrt", "torch_tensorrt")})


def package_metadata(path: str) -> dict:
    """AOTInductor metadata read from the .pt2 zip without loading (dlopen-ing) anything."""
    try:
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if name.endswith("wrapper_metadata.json") or name.endswith("/metadata.json") and "aotinductor" in name:
                    return json.loads(z.read(name))
    except (zipfile.BadZipFile, OSError, json.JSONDecodeError) as e:
        raise LoadError(f"cannot read AOTInductor metadata from {os.path.basename(path)}: {e}") from e
    return {}


def _mm(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    return tuple(int(p) for p in parts[:2] if p.isdigit())


def _cc_tuple(cc: str) -> tuple:
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def check(spec: ArtifactSpec, placement: Placement, m: Machine, strict_versions: bool = False):
    """Returns (fatal problems, warnings), each a list of sentences with the fix."""
    fatal, warn = [], []
    native = spec.backend in NATIVE
    if native and spec.platform and (spec.platform, spec.machine) != (m.platform, m.machine):
        fatal.append(f"built for {spec.platform}/{spec.machine}, this machine is {m.platform}/{m.machine}: "
                     "recompile on the target platform")
    if spec.backend in ("aoti", "aoti_so") and placement.kind == "cpu" and spec.cpu_isa:
        missing = []
        for token in spec.cpu_isa.split():
            flags = ISA_FLAGS.get(token.upper())
            if flags is None:
                warn.append(f"unknown CPU ISA token {token!r} in the artifact; not checked")
            elif not all(f in m.cpu_flags for f in flags):
                missing.append(token)
        if missing:
            fatal.append(f"built for CPU ISA {spec.cpu_isa}; this CPU lacks {' '.join(missing)} "
                         f"(it has {' '.join(sorted(m.isa_names())) or 'none of the tracked extensions'}) "
                         "and would die with an illegal instruction: recompile on a CPU of the serving "
                         "fleet's generation (or the oldest one in it)")
    if native and placement.kind == "cuda" and spec.compute_capability and m.compute_capability:
        art, dev = _cc_tuple(spec.compute_capability), _cc_tuple(m.compute_capability)
        arch_specific = any(a.endswith("a") for a in spec.cuda_archs)
        hw_compat = bool(spec.extra.get("hardware_compatible")) and spec.backend == "tensorrt"
        fix = (f"recompile on a compute capability {m.compute_capability} GPU (or set "
               f"TORCH_CUDA_ARCH_LIST={m.compute_capability} where the backend honours it), or ship "
               "one variant per compute capability in the archive")
        if spec.backend == "tensorrt" and hw_compat:
            if dev < (8, 0):
                fatal.append(f"hardware-compatible TensorRT engines need compute capability >= 8.0; "
                             f"this GPU is {m.compute_capability}")
        elif art == dev:
            pass
        elif spec.backend == "tensorrt":
            fatal.append(f"TensorRT engines were built for compute capability {spec.compute_capability}, "
                         f"the assigned GPU ({m.gpu_name}) is {m.compute_capability}: {fix}, or compile "
                         "with --hardware-compatible")
        elif art[0] != dev[0] or dev[1] < art[1] or arch_specific:
            fatal.append(f"kernels built for compute capability {spec.compute_capability} "
                         f"({', '.join(spec.cuda_archs) or 'sm_' + spec.compute_capability.replace('.', '')}) "
                         f"cannot run on the assigned GPU ({m.gpu_name}, compute capability "
                         f"{m.compute_capability}): 'no kernel image is available'. Fix: {fix}")
        else:
            warn.append(f"built for compute capability {spec.compute_capability}, running on "
                        f"{m.compute_capability} (binary compatible; recompile for best speed)")
    if _mm(spec.torch_version) != _mm(m.torch_version):
        msg = (f"built with torch {spec.torch_version}, this worker has torch {m.torch_version}")
        if native or strict_versions:
            fatal.append(msg + ": native artifacts link torch's C++ ABI; recompile with the serving torch "
                         "or install the torch it was built with")
        else:
            warn.append(msg)
    elif spec.torch_version != m.torch_version:
        (fatal if strict_versions else warn).append(
            f"built with torch {spec.torch_version}, this worker has torch {m.torch_version}")
    if spec.backend == "tensorrt":
        want_trt = spec.extra.get("tensorrt_version")
        if not m.packages.get("torch_tensorrt"):
            from .tensorrt import missing_package_message

            fatal.append(missing_package_message(spec))
        elif want_trt and m.packages.get("tensorrt") and _mm(want_trt) != _mm(m.packages["tensorrt"]):
            fatal.append(f"engines serialized with TensorRT {want_trt}, this worker has TensorRT "
                         f"{m.packages['tensorrt']}: rebuild the engines with this TensorRT or install "
                         f"tensorrt=={want_trt}")
    return fatal, warn


def reconcile(spec: ArtifactSpec) -> ArtifactSpec:
    """The artifact's own contents win over artifact.json: a graph that calls TensorRT engines
    is a Torch-TensorRT artifact whatever the metadata says, and for AOTI packages the build
    facts inside the package are authoritative (a disagreement fails the load)."""
    from .tensorrt import has_tensorrt_engines

    if spec.backend in ("export", "aoti") and has_tensorrt_engines(spec.artifact_path):
        spec = ArtifactSpec(**{**spec.__dict__, "backend": "tensorrt",
                               "extra": {"format": "aot_inductor" if spec.backend == "aoti" else "exported_program",
                                         **spec.extra}})
    if spec.backend != "aoti":
        return spec
    meta = package_metadata(spec.artifact_path)
    if not meta:
        return spec
    facts = {}
    dev = meta.get("AOTI_DEVICE_KEY")
    if dev and dev != spec.device:
        raise IncompatibleArtifact(f"{spec.artifact} was compiled for {dev} (package metadata) but "
                                   f"artifact.json says {spec.device}: rebuild the archive")
    cc = meta.get("AOTI_COMPUTE_CAPABILITY")
    if dev == "cuda" and cc:
        facts["compute_capability"] = f"{cc[:-1]}.{cc[-1]}"
        facts["cuda_archs"] = tuple(a for a in spec.cuda_archs if a.startswith(f"sm_{cc}")) or (f"sm_{cc}",)
    if dev == "cpu" and "AOTI_CPU_ISA" in meta:
        facts["cpu_isa"] = meta["AOTI_CPU_ISA"] or None
    if meta.get("AOTI_PLATFORM"):
        facts["platform"] = meta["AOTI_PLATFORM"]
    if meta.get("AOTI_MACHINE"):
        facts["machine"] = meta["AOTI_MACHINE"]
    return ArtifactSpec(**{**spec.__dict__, **facts})


def open_variant(directory: str) -> ArtifactSpec:
    """artifact.json, checked against the artifact's SHA-256 before anything inside the
    artifact is read, then reconciled with what the artifact itself says it is."""
    spec = read_spec(directory)
    verify_integrity(spec)
    return reconcile(spec)


def assess(spec: ArtifactSpec, gpu_id, device_type, strict_versions=False):
    """Where this worker would run the artifact and what stops it. Returns
    (placement or None, fatal problems, warnings)."""
    if spec.backend == "tensorrt" and not _version("torch_tensorrt"):
        # Named first: without the package nothing else about this artifact matters.
        from .tensorrt import missing_package_message

        return None, [missing_package_message(spec)], []
    try:
        placement = placement_for_worker(gpu_id, device_type, spec.device, spec.backend)
    except IncompatibleArtifact as e:
        return None, [str(e)], []
    fatal, warn = check(spec, placement, this_machine(placement), strict_versions)
    return placement, fatal, warn


def choose_variant(model_dir: str, gpu_id, config):
    """Pick the artifact variant that fits this worker. Returns (spec, placement, warnings)."""
    dirs = find_variants(model_dir)
    if config.variant:
        dirs = [d for d in dirs if os.path.basename(d) == config.variant]
        if not dirs:
            raise LoadError(f"handler.variant {config.variant!r} names no variant in the archive")
    if not dirs:
        raise LoadError(f"no artifact.json in {model_dir} or its variants/ directory: build the archive "
                        "with scripts/archive.py")
    tried, ok = [], []
    for d in dirs:
        spec = open_variant(d)
        label = os.path.relpath(d, model_dir)
        target = (f"{spec.backend}/{spec.device}"
                  + (f" cc {spec.compute_capability}" if spec.compute_capability else "")
                  + (f" ISA {spec.cpu_isa}" if spec.cpu_isa and spec.device == "cpu" else ""))
        placement, fatal, warn = assess(spec, gpu_id, config.device_type, config.strict_versions)
        if fatal:
            tried.append(f"[{label}: {target}] " + "; ".join(fatal))
            continue
        ok.append((bool(warn), len(ok), spec, placement, warn))  # exact fits first, then archive order
    if not ok:
        facts = this_machine_safe(gpu_id)
        raise IncompatibleArtifact("no artifact in this archive can run on this worker. This machine: "
                                   f"{facts}. " + " ".join(tried))
    ok.sort(key=lambda t: (t[0], t[1]))
    _, _, spec, placement, warn = ok[0]
    return spec, placement, warn


def this_machine_safe(gpu_id) -> str:
    try:
        import torch

        if gpu_id is not None and torch.cuda.is_available() and gpu_id < torch.cuda.device_count():
            return this_machine(Placement("cuda", gpu_id)).describe()
        return this_machine().describe()
    except Exception as e:  # describing the machine must not hide the real error
        return f"(could not read machine facts: {e})"


def crash_safe_probe(spec: ArtifactSpec, placement: Placement, config, budget=None) -> float:
    """Load the artifact and run one forward in a child process first. A segfault, abort or
    illegal instruction there becomes a LoadError here instead of a worker that TorchServe
    restarts in a loop. Costs one extra load and forward (and, on GPU, a second CUDA context
    for its duration). Returns the seconds it took."""
    t0 = time.perf_counter()
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = budget.child_env(os.environ) if budget is not None else dict(os.environ)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "handlers.probe", spec.variant_dir, placement.kind,
           str(placement.index if placement.index is not None else -1)]
    try:
        r = subprocess.run(cmd, env=env, cwd=pkg_parent, capture_output=True, text=True,
                           timeout=config.crash_safe_timeout_s)
    except subprocess.TimeoutExpired:
        raise LoadError(f"trial load of {spec.artifact} on {placement} did not finish within "
                        f"{config.crash_safe_timeout_s:.0f}s (handler.crash_safe_timeout_s)") from None
    if r.returncode < 0:
        try:
            sig = signal.Signals(-r.returncode).name
        except ValueError:
            sig = f"signal {-r.returncode}"
        hint = {
            "SIGSEGV": "a segmentation fault: typically an AOTInductor wrapper built with a toolchain "
                       "whose C++ runtime does not match (rebuild with CXX=g++-12, see README), a torch "
                       "version mismatch, or a corrupt library",
            "SIGILL": "an illegal instruction: the artifact uses CPU instructions this CPU lacks; "
                      "recompile on the serving CPU generation",
            "SIGABRT": "an abort in native code (see the stderr tail)",
            "SIGBUS": "a bus error: a truncated or corrupt shared library",
        }.get(sig, "a native crash")
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        raise LoadError(f"loading {spec.artifact} ({spec.backend}) on {placement} crashed the trial "
                        f"process with {sig}: {hint}. Last output: {tail or '(none)'}")
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        msg = next((ln.split("PROBE-ERROR: ", 1)[1] for ln in reversed(lines) if "PROBE-ERROR: " in ln),
                   "\n".join(lines[-5:]))
        raise LoadError(msg)
    return time.perf_counter() - t0


def extract_bare_so(spec: ArtifactSpec, dest: str) -> ArtifactSpec:
    """Write the package's wrapper library (and its cubins) as a bare aoti_so variant: the
    pre-package format users still carry (field report 000)."""
    os.makedirs(os.path.join(dest, "cubin"), exist_ok=True)
    so_name = None
    with zipfile.ZipFile(spec.artifact_path) as z:
        for name in z.namelist():
            base = os.path.basename(name)
            if name.endswith(".wrapper.so") or (name.endswith(".so") and "aotinductor" in name and so_name is None):
                with z.open(name) as src, open(os.path.join(dest, "model.so"), "wb") as out:
                    shutil.copyfileobj(src, out)
                so_name = base
            elif name.endswith(".cubin"):
                with z.open(name) as src, open(os.path.join(dest, "cubin", base), "wb") as out:
                    shutil.copyfileobj(src, out)
    if so_name is None:
        raise LoadError(f"{spec.artifact} holds no AOTInductor shared library to extract")
    so_path = os.path.join(dest, "model.so")
    bare = ArtifactSpec(**{**spec.__dict__, "backend": "aoti_so", "artifact": "model.so",
                           "sha256": sha256_file(so_path), "extra": {**spec.extra, "cubin_dir": "cubin"},
                           "variant_dir": dest})
    write_spec(bare, dest)
    return bare
