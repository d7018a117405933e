"""What every artifact kind declares, behind one small interface (see README, "Adding an
artifact kind"). A kind module subclasses ArtifactKind and the registry (kinds/__init__.py)
lists one instance of it."""
from __future__ import annotations

import torch

from handlers.artifact.device import Placement
from handlers.artifact.machine import Machine
from handlers.artifact.metadata import ArtifactSpec
from handlers.errors import LoadError


class LoadedModel:
    """A callable taking the artifact's inputs positionally and returning {output name: tensor}."""

    def __init__(self, fn, spec: ArtifactSpec, device: torch.device, loader: str, flat_outputs=False):
        self._fn = fn
        self.spec = spec
        self.device = device
        self.loader = loader  # how it was loaded (for the load log), e.g. "aoti_package"
        self._flat = flat_outputs

    def __call__(self, *tensors):
        out = self._fn(list(tensors)) if self._flat else self._fn(*tensors)
        leaves = torch.utils._pytree.tree_leaves(out)
        names = self.spec.output_names
        if len(leaves) != len(names):
            raise LoadError(f"model returned {len(leaves)} output tensor(s), artifact.json names "
                            f"{len(names)} ({', '.join(names)})")
        return dict(zip(names, leaves))


class ArtifactKind:
    name = ""  # artifact.json's "backend" value
    # Native: compiled code for one device kind, linked against libtorch's C++ ABI (platform and
    # torch major.minor must match). Otherwise relocatable: a graph plus tensors that can move
    # to another device kind after compilation.
    native = True
    # Its loaded callable launches plain CUDA kernels that a CUDA graph can record (run/graphs.py).
    graph_capturable = False
    zipped = True  # the artifact is a .pt2 zip archive (integrity check looks for its directory)
    # Its load reads the program's graph for state written between calls (artifact/state.py).
    # Otherwise artifact.json must record that check (extra.state, written by cs-import and
    # cs-compile from the program), or the worker refuses to load it.
    checks_state_at_load = False
    # What cs-compile needs to produce it: "cxx" (a C++ compiler for a wrapper),
    # "torch_tensorrt"; None when compile.py does not produce it directly.
    compile_needs: tuple = None
    # Why loads of this kind cannot read one shared copy of the weights (the engine's lanes,
    # handlers/run/lanes.py; handlers/weights/pack.py), or None when they can: `held_weights`
    # gives the tensors to pack and `load(..., weights=...)` reads them in place.
    not_shared = "its loader cannot take weights it does not own"
    # Its load with held weights allocates a copy of its own for a moment (the AOTInductor
    # container fills its constants from the library before they are swapped out): the lanes'
    # count leaves room for it (handlers/run/lanes.py).
    load_copies_weights = False

    @property
    def relocatable(self) -> bool:
        return not self.native

    def claims(self, spec: ArtifactSpec) -> bool:
        """True when the files of `spec` (declared as another kind) actually hold this kind."""
        return False

    def adopt(self, spec: ArtifactSpec) -> ArtifactSpec:
        """`spec` relabelled as this kind (after `claims`)."""
        return ArtifactSpec(**{**spec.__dict__, "backend": self.name})

    def refine(self, spec: ArtifactSpec) -> ArtifactSpec:
        """`spec` with the build facts read from the artifact's own files (they win)."""
        return spec

    def requirements(self, spec: ArtifactSpec) -> list:
        """Problems that stop this kind anywhere on this machine (e.g. a missing package),
        named before placement is decided."""
        return []

    def rules(self, spec: ArtifactSpec, placement: Placement, m: Machine, fatal: list, warn: list) -> None:
        """Compatibility rules beyond the common ones (rules.py)."""

    def load(self, spec: ArtifactSpec, placement: Placement, config=None, weights=None) -> LoadedModel:
        """The artifact loaded on `placement`; given `weights` (handlers/run/lanes.py Shared:
        `.tensors`, {name: tensor} as `held_weights` named them, and `.library`, what
        `shared_library` unpacked), the model reads those in place instead of its own copy."""
        raise NotImplementedError

    def shared_library(self, spec: ArtifactSpec, dest: str):
        """Files unpacked once into `dest` for every held load (an AOTInductor package's wrapper
        library: extracting its embedded weights takes each load seconds), or None where a load
        needs none."""
        return None

    def held_weights(self, spec: ArtifactSpec, placement: Placement, keep, library=None) -> dict:
        """keep({name: tensor}) of every weight the model reads and never writes, called while
        those tensors are alive: `keep` copies them onto the placement's device, into one
        allocation per dtype, and returns the copies (what every held load reads). `library`: what
        `shared_library` unpacked, for this read of the weights."""
        raise NotImplementedError(f"{self.name} artifacts do not share weights: {self.not_shared}")

    def compile(self, ep, inputs, path: str, options) -> dict:
        """Write the artifact for exported program `ep` to `path`; returns artifact.json `extra`."""
        raise NotImplementedError(f"cs-compile does not produce {self.name} artifacts")
