"""Facts about this machine that decide what it can run: platform, torch, CPU ISA, the
assigned GPU's compute capability, installed TensorRT packages. Read, never judged here."""
from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Optional

from handlers.artifact.device import Placement

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


def package_version(pkg: str) -> Optional[str]:
    try:
        return importlib_metadata.version(pkg)
    except importlib_metadata.PackageNotFoundError:
        return None


def version_mm(version: str) -> tuple:
    """(major, minor) of a version string such as 2.13.0+cu128."""
    parts = version.split("+")[0].split(".")
    return tuple(int(p) for p in parts[:2] if p.isdigit())


def cc_tuple(cc: str) -> tuple:
    """(major, minor) of a compute capability written "9.0"."""
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def cc_from_digits(digits: str) -> str:
    """"90" (AOTI_COMPUTE_CAPABILITY, sm_90) -> "9.0"."""
    return f"{digits[:-1]}.{digits[-1]}"


def this_machine(placement: Optional[Placement] = None) -> Machine:
    import torch

    cc = name = None
    if placement is not None and placement.kind == "cuda":
        major, minor = torch.cuda.get_device_capability(placement.index)
        cc, name = f"{major}.{minor}", torch.cuda.get_device_name(placement.index)
    return Machine(sys.platform, platform.machine(), torch.__version__, cpu_flags(), cc, name,
                   {p: package_version(p) for p in ("tensorrt", "torch_tensorrt")})


def describe_machine(gpu_id) -> str:
    """This machine in one line, for error messages; never raises."""
    try:
        import torch

        if gpu_id is not None and torch.cuda.is_available() and gpu_id < torch.cuda.device_count():
            return this_machine(Placement("cuda", gpu_id)).describe()
        return this_machine().describe()
    except Exception as e:  # describing the machine must not hide the real error
        return f"(could not read machine facts: {e})"
