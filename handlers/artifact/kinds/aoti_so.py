"""Bare AOTInductor shared library: the format before `.pt2` packages (a wrapper `.so` plus a
directory of cubins on CUDA), run by the container runner of the device kind it was compiled
for. cs-compile --bare-so extracts one from a package."""
from __future__ import annotations

import glob
import os

from handlers.artifact.kinds import aoti_runner
from handlers.artifact.kinds.base import ArtifactKind, LoadedModel
from handlers.artifact.rules import cpu_isa_rule, cuda_kernel_rule
from handlers.errors import LoadError


class AotiSharedLibrary(ArtifactKind):
    name = "aoti_so"
    zipped = False
    compile_needs = None  # produced by extracting a package (compiled_serving/bare_so.py)

    def rules(self, spec, placement, m, fatal, warn):
        cpu_isa_rule(spec, placement, m, fatal, warn)
        cuda_kernel_rule(spec, placement, m, fatal, warn)

    not_shared = None
    load_copies_weights = True  # the container fills its own constants before the swap

    def load(self, spec, placement, config=None, weights=None):
        runner = self._runner(spec, placement)
        if weights is not None:
            aoti_runner.adopt(runner, weights.tensors)
            aoti_runner.smoke(runner, spec, placement)
        return LoadedModel(runner.run, spec, placement.torch_device,
                           "aoti_so" + (", held weights" if weights is not None else ""), flat_outputs=True)

    def held_weights(self, spec, placement, keep, library=None):
        runner = self._runner(spec, placement)
        return keep(aoti_runner.constants(runner))  # views of the runner's copy: kept before it is freed

    @staticmethod
    def _runner(spec, placement):
        cubin_dir = ""
        if placement.kind == "cuda":
            cubin_dir = os.path.join(spec.variant_dir, spec.extra.get("cubin_dir", "cubin"))
            if not glob.glob(os.path.join(cubin_dir, "*.cubin")):
                raise LoadError(f"{spec.artifact} is a CUDA AOTInductor library but {cubin_dir} "
                                "holds no .cubin files; archive its kernel directory beside it")
        return aoti_runner.new_runner(spec.artifact_path, placement, cubin_dir)


KIND = AotiSharedLibrary()
