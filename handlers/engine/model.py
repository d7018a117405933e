"""Any callable model as the engine runs it (step 1: no compiled artifact needed).

The engine runs a `handlers.run.base.Runner`: the runner the worker uses today, which splits a
list of requests into calls the model accepts (rows up to the spec's batch_max, groups of equal
shape) and gives every request its own rows back. `module_runner` puts a torch.nn.Module (or
any callable of tensors) behind the CPU runner, with the artifact spec the runner reads.
Step 2 hands the engine the runner the worker builds from its artifact instead (runner_for).
"""
from __future__ import annotations

import torch

from handlers.artifact.metadata import ArtifactSpec, TensorSpec
from handlers.dtypes import dtype_name
from handlers.run.cpu import CpuRunner


class DictOutputs:
    """The runners call `model(*inputs)` and read a dict of outputs (what LoadedModel returns);
    a module returning a tensor or a tuple gets its outputs named here."""

    def __init__(self, module, output_names):
        self.module, self.output_names = module, tuple(output_names)

    def __call__(self, *inputs) -> dict:
        out = self.module(*inputs)
        if isinstance(out, dict):
            return out
        out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        return dict(zip(self.output_names, out))


def module_spec(inputs: dict, outputs: dict, batch_max: int, batch_min: int = 1) -> ArtifactSpec:
    """An artifact spec for a plain module: `inputs`/`outputs` map names to (dtype, shape after
    the batch dimension)."""
    def specs(d):
        return tuple(TensorSpec(n, dtype_name(dt), (None,) + tuple(shape)) for n, (dt, shape) in d.items())

    return ArtifactSpec(backend="module", artifact="", sha256="", device="cpu", inputs=specs(inputs),
                        outputs=specs(outputs), output_structure="dict", batch_min=batch_min,
                        batch_max=batch_max, torch_version=torch.__version__)


def module_runner(module, inputs: dict, outputs: dict, batch_max: int) -> CpuRunner:
    """The CPU runner around `module` (see module_spec for `inputs` and `outputs`)."""
    return CpuRunner(DictOutputs(module, outputs), module_spec(inputs, outputs, batch_max))
