"""What a worker's start loaded (handlers/startup.py builds it once) and every batch reads
(handlers/pipeline.py): the artifact, its runner and the settings they were made with."""
from __future__ import annotations

import dataclasses
from typing import Any

from handlers.admission import Limits
from handlers.artifact.metadata import ArtifactSpec
from handlers.config import HandlerConfig
from handlers.torchserve.stage_timings import StageTimes


@dataclasses.dataclass
class Loaded:
    config: HandlerConfig
    spec: ArtifactSpec
    limits: Limits
    model: Any  # the loaded artifact (handlers/artifact/kinds: .loader names how it was loaded)
    runner: Any  # handlers/run: runs a list of requests' tensors, returns their outputs
    device: Any  # torch.device
    stages: StageTimes  # emits through TorchServe's metrics
    # a decoder's generation (handlers/generating.py); None: a model served in batches (pipeline.py)
    generation: Any = None
    # the GPU's held weights the model reads in place (handlers/weights/attach.py HeldWeights),
    # kept for the worker's life; None: the model holds its own copy
    weights: Any = None
