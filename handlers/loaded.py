"""What a worker's start loaded (handlers/startup.py builds it once) and every batch reads
(handlers/pipeline.py): the artifact, its runner and the settings they were made with."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from handlers.admission import Limits
from handlers.artifact.metadata import ArtifactSpec
from handlers.config import HandlerConfig
from handlers.torchserve.stage_timings import StageTimes

if TYPE_CHECKING:  # types only: a worker imports the runner its model needs, not every kind
    import torch

    from handlers.continuous import Continuous
    from handlers.generating import Generation
    from handlers.run.base import Runner
    from handlers.run.decoder import DecoderRunner
    from handlers.run.slots import SlotRunner


@dataclasses.dataclass
class Loaded:
    config: HandlerConfig
    spec: ArtifactSpec
    limits: Limits
    model: Any  # the loaded artifact (handlers/artifact/kinds: .loader names how it was loaded)
    # a stateless model's runs a list of requests' tensors and returns their outputs (handlers/run);
    # a decoder's runs its steps for its generation
    runner: Runner | DecoderRunner | SlotRunner
    device: torch.device
    stages: StageTimes  # emits through TorchServe's metrics
    # a decoder's generation (handlers/generating.py); None: a model served in batches (pipeline.py)
    generation: Optional[Generation | Continuous] = None
