"""AOTInductor package (`.pt2` from aoti_compile_and_package): native code for one device kind,
loaded on the worker's device by the loader torch's aoti_load_package wraps. The package's own metadata (read from the
zip without loading anything) wins over artifact.json."""
from __future__ import annotations

import json
import os
import tempfile
import zipfile

from handlers.artifact.device import Placement
from handlers.artifact.kinds import aoti_constants, aoti_runner
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


def load_aoti_package(spec: ArtifactSpec, placement: Placement, kind_name: str,
                      single_threaded: bool = False) -> LoadedModel:
    """The package's compiled model through the loader torch's `aoti_load_package` wraps
    (`torch._C._aoti.AOTIModelPackageLoader`, the path torch itself takes for packages without
    a PT2 archive index), called with the flat input tensors and returning the flat outputs,
    as torch's `AOTICompiledModel` does (torch/export/pt2_archive/_package.py: leaves in, `boxed_run`,
    leaves out). Two costs of going through torch's wrapper are gone: importing `torch._inductor`
    (4.2 s of a worker's start on the H100 machine, `git show 1c58aef:docs/results/start_study_resnet50_fp16_h100.md`;
    it pulls in dynamo and sympy, which serving never uses) with its CPU ISA probe builds (a
    library per SIMD extension compiled and dlopened in a child Python, only to log a warning;
    rules.py has already compared the CPU flags the package needs with this machine), and the
    call spec parsed again on every call. The outputs' names come from artifact.json in the
    package's flattened order, as before.

    A package whose constants are outside its library (cs-export-lm's: its weights in data/weights/,
    its KV cache in none) has them read and allocated into the loader before anything runs
    (aoti_constants.py); one whose library holds them loads as it always did.

    single_threaded: the runner without the model container's per-call thread pool handoff,
    which a CUDA graph capture needs."""
    import torch

    index = placement.index if placement.kind == "cuda" and placement.index is not None else -1
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(spec.artifact_path, "model", single_threaded, 1, index)
    except Exception as e:  # torch raises RuntimeError with the C++ message
        raise LoadError(f"loading the AOTInductor package {spec.artifact} on {placement} failed: {e}") from e
    meta = loader.get_metadata()
    built_for = meta.get("AOTI_DEVICE_KEY")
    if built_for and built_for != placement.kind:
        raise IncompatibleArtifact(f"{spec.artifact} was compiled for {built_for} "
                                   f"(AOTI_DEVICE_KEY) but this worker serves on {placement}")
    if not aoti_constants.outside(spec.artifact_path):  # the library holds its constants, the cache among them
        aoti_constants.refuse_record(spec)
        return LoadedModel(loader.run, spec, placement.torch_device, kind_name, flat_outputs=True)
    held = aoti_constants.supply(loader, spec, placement)  # the loader reads these tensors: the call keeps them

    def run(inputs, _held=held):
        return loader.run(inputs)
    return LoadedModel(run, spec, placement.torch_device, f"{kind_name}, weights read and cache allocated at load",
                       flat_outputs=True)


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
    not_shared = None
    load_copies_weights = True  # the container fills its own constants before the swap

    def load(self, spec, placement, config=None, weights=None):
        # One request at a time per worker: the single-threaded runner serves both plain calls
        # and CUDA graph capture.
        graphs = placement.kind == "cuda" and config is not None and config.cuda_graphs != "off"
        if weights is None:
            return load_aoti_package(spec, placement, "aoti_package", single_threaded=graphs)
        runner, how = self._held(spec, placement, graphs, weights.tensors, weights.library)
        return LoadedModel(runner.run, spec, placement.torch_device, how, flat_outputs=True)

    def _held(self, spec, placement, graphs, weights, library=None) -> tuple:
        """(a runner reading `weights`, how it was loaded): the single-threaded runner where CUDA
        graphs want it, else (or where that one fails its first call) the container's threaded
        run, whose graphs the capture check keeps or refuses on their answers (run/graphs.py).
        `library`: the library unpacked once for every held load (shared_library), else this load unpacks its own."""
        errors = []
        for single in dict.fromkeys((graphs, False)):
            runner = self._runner(spec, placement, single, library)
            try:
                aoti_runner.adopt(runner, weights)
                aoti_runner.smoke(runner, spec, placement)
            except LoadError as e:
                errors.append(f"{'single-threaded' if single else 'threaded'} runner: {e}")
                continue
            return runner, "aoti_package, held weights" + ("" if single == graphs else
                                                           f", threaded runner ({errors[-1]})")
        raise LoadError("; ".join(errors))

    def shared_library(self, spec, dest):
        return aoti_runner.package_library(spec.artifact_path, dest)

    def held_weights(self, spec, placement, keep, library=None):
        runner = self._runner(spec, placement, library=library)
        return keep(aoti_runner.constants(runner))  # views of the runner's copy: kept before it is freed

    @staticmethod
    def _runner(spec, placement, single_threaded=False, library=None):
        """The package's library under the container runner: `library` ((wrapper .so, kernel
        directory) unpacked once for every held load, read-only to this load), else extracted into this
        process's scratch directory (TMPDIR, removed when the process is gone:
        handlers/torchserve/scratch.py)."""
        so, kernels = library or aoti_runner.package_library(spec.artifact_path, tempfile.mkdtemp(prefix="aoti-"))
        return aoti_runner.new_runner(so, placement, kernels, single_threaded)

    def compile(self, ep, inputs, path, options) -> dict:
        from torch._inductor import aoti_compile_and_package

        aoti_compile_and_package(ep, package_path=path)
        return {}


KIND = AotiPackage()
