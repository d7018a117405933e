"""torch.export program (`torch.export.save`): a graph plus tensors, relocatable to the worker's
device with move_to_device_pass (relocate.py checks that nothing stayed behind)."""
from __future__ import annotations

import torch

from handlers.artifact.decoder import by_keyword
from handlers.artifact.kinds.base import ArtifactKind, LoadedModel
from handlers.artifact.relocate import relocate
from handlers.artifact.state import check_program
from handlers.errors import LoadError


class ExportedProgram(ArtifactKind):
    name = "export"
    native = False
    graph_capturable = True  # .module() runs eager aten kernels
    checks_state_at_load = True  # load() reads the graph (artifact/state.py)
    compile_needs = ()

    def load(self, spec, placement, config=None):
        try:
            ep = torch.export.load(spec.artifact_path)
        except Exception as e:
            raise LoadError(f"torch.export.load failed for {spec.artifact}: {e}. The file may be "
                            f"corrupt or saved by an incompatible torch (built with {spec.torch_version}, "
                            f"this is {torch.__version__}).") from e
        # the graph itself says whether it writes state between calls (artifact/state.py)
        check_program(ep, spec.artifact, spec.extra.get("state"))
        ep = relocate(ep, placement.torch_device)
        module, names = ep.module(), list(ep.graph_signature.user_inputs)
        if by_keyword(ep):
            # exported with keyword inputs only (transformers' exports): the module checks
            # that they come by name
            return LoadedModel(lambda *t: module(**dict(zip(names, t))), spec, placement.torch_device,
                               "exported_program")
        return LoadedModel(module, spec, placement.torch_device, "exported_program")

    def compile(self, ep, inputs, path, options) -> dict:
        torch.export.save(ep, path)
        return {}


KIND = ExportedProgram()
