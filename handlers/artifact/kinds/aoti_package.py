"""AOTInductor package (`.pt2` from aoti_compile_and_package): native code for one device kind,
loaded with aoti_load_package on the worker's device. The package's own metadata (read from the
zip without loading anything) wins over artifact.json."""
from __future__ import annotations

import contextlib
import json
import os
import zipfile

from handlers.artifact.device import Placement
from handlers.artifact.kinds.base import ArtifactKind, LoadedModel
from handlers.artifact.machine import cc_from_digits
from handlers.artifact.metadata import ArtifactSpec
from handlers.artifact.rules import cpu_isa_rule, cuda_kernel_rule
from handlers.errors import IncompatibleArtifact, LoadError


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


def skip_isa_probe_builds():
    """aoti_load_package compares the package's metadata with inductor's description of this
    machine, only to log a warning on a difference. To name this machine's CPU ISA, inductor
    compiles a probe library per SIMD extension (AVX512, VNNI, BF16, AMX, AMX-FP16) and imports
    torch in a fresh Python to dlopen each: 40-100 s per worker process on the GPU image
    (measured, docs/results), paid again by every worker and by the crash-safe probe. The
    rules (rules.py) have already compared device kind, compute capability and the CPU flags
    the package needs with this machine and fail the load on a real mismatch, so inductor's
    comparison is replaced by an empty one for the duration of the call."""
    from unittest import mock

    from torch._inductor import codecache

    if not hasattr(codecache, "get_device_information"):
        return contextlib.nullcontext()
    return mock.patch.object(codecache, "get_device_information", lambda device_type: {})


def load_aoti_package(spec: ArtifactSpec, placement: Placement, kind_name: str,
                      single_threaded: bool = False) -> LoadedModel:
    """single_threaded: aoti_load_package's run_single_threaded, the runner without the model
    container's per-call thread pool handoff, which a CUDA graph capture needs."""
    from torch._inductor import aoti_load_package

    kwargs = {"device_index": placement.index} if placement.kind == "cuda" else {}
    if single_threaded:
        kwargs["run_single_threaded"] = True
    try:
        with skip_isa_probe_builds():
            fn = aoti_load_package(spec.artifact_path, **kwargs)
    except Exception as e:  # torch raises RuntimeError with the C++ message
        raise LoadError(f"aoti_load_package failed for {spec.artifact} on {placement}: {e}") from e
    meta = fn.get_metadata() if hasattr(fn, "get_metadata") else {}
    built_for = meta.get("AOTI_DEVICE_KEY")
    if built_for and built_for != placement.kind:
        raise IncompatibleArtifact(f"{spec.artifact} was compiled for {built_for} "
                                   f"(AOTI_DEVICE_KEY) but this worker serves on {placement}")
    return LoadedModel(fn, spec, placement.torch_device, kind_name)


class AotiPackage(ArtifactKind):
    name = "aoti"
    compile_needs = ("cxx",)

    def refine(self, spec: ArtifactSpec) -> ArtifactSpec:
        meta = package_metadata(spec.artifact_path)
        dev = meta.get("AOTI_DEVICE_KEY")
        if dev and dev != spec.device:
            raise IncompatibleArtifact(f"{spec.artifact} was compiled for {dev} (package metadata) but "
                                       f"artifact.json says {spec.device}: rebuild the archive")
        facts = {}
        cc = meta.get("AOTI_COMPUTE_CAPABILITY")
        if dev == "cuda" and cc:
            facts["compute_capability"] = cc_from_digits(cc)
            facts["cuda_archs"] = tuple(a for a in spec.cuda_archs if a.startswith(f"sm_{cc}")) or (f"sm_{cc}",)
        if dev == "cpu" and "AOTI_CPU_ISA" in meta:
            facts["cpu_isa"] = meta["AOTI_CPU_ISA"] or None
        for key, field in (("AOTI_PLATFORM", "platform"), ("AOTI_MACHINE", "machine")):
            if meta.get(key):
                facts[field] = meta[key]
        return ArtifactSpec(**{**spec.__dict__, **facts}) if facts else spec

    def rules(self, spec, placement, m, fatal, warn):
        cpu_isa_rule(spec, placement, m, fatal, warn)
        cuda_kernel_rule(spec, placement, m, fatal, warn)

    graph_capturable = True

    def load(self, spec, placement, config=None):
        # One request at a time per worker: the single-threaded runner serves both plain calls
        # and CUDA graph capture.
        graphs = placement.kind == "cuda" and config is not None and config.cuda_graphs != "off"
        return load_aoti_package(spec, placement, "aoti_package", single_threaded=graphs)

    def compile(self, ep, inputs, path, options) -> dict:
        from torch._inductor import aoti_compile_and_package

        aoti_compile_and_package(ep, package_path=path)
        return {}


KIND = AotiPackage()
