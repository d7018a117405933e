"""Compatibility rules: an artifact's build facts against this machine's (machine.py), decided
before any of the artifact's code runs. Each rule appends sentences with the fix to `fatal`
(the load fails, the worker never reports ready) or `warn` (served, logged).

Common to every kind: platform for native code, torch version. Kinds add their own (CPU ISA,
compute capability, TensorRT versions) in their `rules` method, from the helpers below.
"""
from __future__ import annotations

from handlers.artifact.device import Placement
from handlers.artifact.machine import ISA_FLAGS, Machine, cc_tuple, version_mm
from handlers.artifact.metadata import ArtifactSpec


def check(spec: ArtifactSpec, kind, placement: Placement, m: Machine, strict_versions: bool = False):
    """Returns (fatal problems, warnings) for `spec` of artifact kind `kind` on `placement`."""
    fatal, warn = [], []
    if kind.native:
        platform_rule(spec, m, fatal)
    kind.rules(spec, placement, m, fatal, warn)
    problem, fatal_too = torch_version_rule(spec, m, kind.native or strict_versions, strict_versions)
    if problem:
        (fatal if fatal_too else warn).append(problem)
    return fatal, warn


def platform_rule(spec: ArtifactSpec, m: Machine, fatal: list) -> None:
    if spec.platform and (spec.platform, spec.machine) != (m.platform, m.machine):
        fatal.append(f"built for {spec.platform}/{spec.machine}, this machine is {m.platform}/{m.machine}: "
                     "recompile on the target platform")


def torch_version_rule(spec, m: Machine, abi_bound: bool, strict: bool) -> tuple:
    """(the problem or "", whether it is fatal). Native code links libtorch's C++ ABI, which
    changes between minor releases: a different major.minor is fatal where `abi_bound` (a native
    artifact, or strict_versions); any other difference only where `strict`."""
    msg = f"built with torch {spec.torch_version}, this worker has torch {m.torch_version}"
    if version_mm(spec.torch_version) != version_mm(m.torch_version):
        if abi_bound:
            return (msg + ": native artifacts link torch's C++ ABI; recompile with the serving torch "
                    "or install the torch it was built with"), True
        return msg, False
    if spec.torch_version != m.torch_version:
        return msg, strict
    return "", False


def cpu_isa_rule(spec: ArtifactSpec, placement: Placement, m: Machine, fatal: list, warn: list) -> None:
    """Generated CPU code that uses an extension this CPU lacks dies with SIGILL."""
    if placement.kind != "cpu" or not spec.cpu_isa:
        return
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


def cc_fix(m: Machine) -> str:
    return (f"recompile on a compute capability {m.compute_capability} GPU (or set "
            f"TORCH_CUDA_ARCH_LIST={m.compute_capability} where the backend honours it), or ship "
            "one variant per compute capability in the archive")


def cuda_kernel_rule(spec: ArtifactSpec, placement: Placement, m: Machine, fatal: list, warn: list) -> None:
    """CUDA kernels (cubins) load on the same major compute capability with an equal or higher
    minor; arch-specific targets (sm_90a) only on exactly their own."""
    if placement.kind != "cuda" or not spec.compute_capability or not m.compute_capability:
        return
    art, dev = cc_tuple(spec.compute_capability), cc_tuple(m.compute_capability)
    if art == dev:
        return
    if art[0] != dev[0] or dev[1] < art[1] or any(a.endswith("a") for a in spec.cuda_archs):
        archs = ", ".join(spec.cuda_archs) or "sm_" + spec.compute_capability.replace(".", "")
        fatal.append(f"kernels built for compute capability {spec.compute_capability} ({archs}) "
                     f"cannot run on the assigned GPU ({m.gpu_name}, compute capability "
                     f"{m.compute_capability}): 'no kernel image is available'. Fix: {cc_fix(m)}")
    else:
        warn.append(f"built for compute capability {spec.compute_capability}, running on "
                    f"{m.compute_capability} (binary compatible; recompile for best speed)")
