"""Bare AOTInductor shared library: the format before `.pt2` packages (a wrapper `.so` plus a
directory of cubins on CUDA), run by the container runner of the device kind it was compiled
for. cs-compile --bare-so extracts one from a package."""
from __future__ import annotations

import glob
import os

import torch

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

    def load(self, spec, placement, config=None):
        runners = torch._C._aoti
        so = spec.artifact_path
        try:
            if placement.kind == "cuda":
                cubin_dir = os.path.join(spec.variant_dir, spec.extra.get("cubin_dir", "cubin"))
                if not glob.glob(os.path.join(cubin_dir, "*.cubin")):
                    raise LoadError(f"{spec.artifact} is a CUDA AOTInductor library but {cubin_dir} "
                                    "holds no .cubin files; archive its kernel directory beside it")
                runner = runners.AOTIModelContainerRunnerCuda(so, 1, str(placement), cubin_dir)
            else:
                runner = runners.AOTIModelContainerRunnerCpu(so, 1)
        except LoadError:
            raise
        except Exception as e:
            raise LoadError(f"the AOTInductor container runner failed to load {spec.artifact} on "
                            f"{placement}: {e}") from e
        return LoadedModel(runner.run, spec, placement.torch_device, "aoti_so", flat_outputs=True)


KIND = AotiSharedLibrary()
