"""torch.export program (`torch.export.save`): a graph plus tensors, relocatable to the worker's
device with move_to_device_pass (relocate.py checks that nothing stayed behind)."""
from __future__ import annotations

import torch

from handlers.artifact import cache
from handlers.artifact.decoder import by_keyword
from handlers.artifact.kinds.base import ArtifactKind, LoadedModel
from handlers.artifact.program_file import load_on_cpu
from handlers.artifact.relocate import relocate
from handlers.artifact.state import check_program
from handlers.errors import LoadError


class ExportedProgram(ArtifactKind):
    name = "export"
    native = False
    graph_capturable = True  # .module() runs eager aten kernels
    checks_state_at_load = True  # load() reads the graph (artifact/state.py)
    compile_needs = ()
    not_shared = None

    def load(self, spec, placement, config=None, weights=None):
        ep = self._program(spec)
        # the graph itself says whether it writes state between calls (artifact/state.py)
        state = check_program(ep, spec.artifact, spec.extra.get("state"))
        # a cache left out of the file (artifact/cache.py): zeros made on the device, so relocating moves none
        cache.materialize(ep, cache.read(spec), state.mutated, placement.torch_device, spec.artifact)
        if weights is not None:
            adopt(ep, weights.tensors)  # already on the device: relocating them below moves nothing
        ep = relocate(ep, placement.torch_device)
        module, names = ep.module(), list(ep.graph_signature.user_inputs)
        if by_keyword(ep):
            # exported with keyword inputs only (transformers' exports): the module checks
            # that they come by name
            return LoadedModel(lambda *t: module(**dict(zip(names, t))), spec, placement.torch_device,
                               "exported_program")
        return LoadedModel(module, spec, placement.torch_device, "exported_program")

    def held_weights(self, spec, placement, keep, library=None):
        return keep(read_only(self._program(spec)))  # copied from the host straight into the packed allocation

    @staticmethod
    def _program(spec):
        """The program with its tensors on the CPU, whatever device it was exported on (the
        worker relocates it: program_file.py)."""
        try:
            return load_on_cpu(spec.artifact_path)[0]
        except Exception as e:
            raise LoadError(f"torch.export.load failed for {spec.artifact}: {e}. The file may be "
                            f"corrupt or saved by an incompatible torch (built with {spec.torch_version}, "
                            f"this is {torch.__version__}).") from e

    def compile(self, ep, inputs, path, options) -> dict:
        torch.export.save(ep, path)
        return {}


def read_only(ep) -> dict:
    """{name: tensor} of the program's parameters, buffers and tensor constants that its graph
    never writes (a buffer it mutates stays with each worker): "state:NAME" for `ep.state_dict`,
    "constant:NAME" for `ep.constants`."""
    written = set(ep.graph_signature.buffers_to_mutate.values())
    out = {f"state:{k}": v for k, v in ep.state_dict.items() if k not in written and isinstance(v, torch.Tensor)}
    out.update({f"constant:{k}": v for k, v in ep.constants.items()
                if k not in written and isinstance(v, torch.Tensor)})
    return out


def adopt(ep, weights: dict) -> None:
    """The program's read-only tensors replaced by the held ones of the same names (a parameter
    stays a parameter). Raises LoadError naming a tensor the shared copy lacks or holds with another
    shape or dtype."""
    for name, mine in read_only(ep).items():
        held = weights.get(name)
        if held is None or held.shape != mine.shape or held.dtype != mine.dtype:
            found = "nothing" if held is None else f"{held.dtype} {list(held.shape)}"
            raise LoadError(f"the held weights hold {found} for {name}, the program has "
                            f"{mine.dtype} {list(mine.shape)}")
        where, key = name.split(":", 1)
        if where == "state":
            ep.state_dict[key] = (torch.nn.Parameter(held, requires_grad=False)
                                  if isinstance(mine, torch.nn.Parameter) else held)
        else:
            ep.constants[key] = held


KIND = ExportedProgram()
