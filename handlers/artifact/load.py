"""Load a chosen artifact onto the worker's device, with the loader of its kind (kinds/).

The artifact's integrity was checked when its variant was opened (variants.open_variant)."""
from __future__ import annotations

from handlers.artifact.device import Placement, use_device
from handlers.artifact.kinds import LoadedModel, kind_of
from handlers.artifact.metadata import ArtifactSpec


def load_artifact(spec: ArtifactSpec, placement: Placement, config=None, weights=None) -> LoadedModel:
    """`weights`: the GPU's held weights (handlers/weights), read in place; None: the artifact's own."""
    use_device(placement)
    kind = kind_of(spec)
    if weights is None:  # a kind written before sharing existed takes (spec, placement, config)
        return kind.load(spec, placement, config)
    return kind.load(spec, placement, config, weights)
