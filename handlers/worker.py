"""What one TorchServe worker holds once it has started: the loaded artifact and everything the
request pipeline reads (handlers/startup.py builds it once; handlers/pipeline.py uses it per
batch), and the worker's health, the one state every request consults first."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from handlers.admission import Limits
from handlers.artifact.metadata import ArtifactSpec
from handlers.config import HandlerConfig
from handlers.errors import ModelLoadFailed, ServingError
from handlers.faults import WorkerRestarting
from handlers.torchserve.stage_timings import StageTimes

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Worker:
    config: HandlerConfig
    spec: ArtifactSpec
    limits: Limits
    model: Any  # the loaded artifact (handlers/artifact/kinds: .loader names how it was loaded)
    runner: Any  # handlers/run: runs a list of requests' tensors, returns their outputs
    device: Any  # torch.device
    stages: StageTimes  # emits through TorchServe's metrics


class Health:
    """loading -> ready | load_failed; ready -> broken (a sticky device fault: the worker is
    exiting, handlers/faults.py). Every state but ready answers each request with its refusal."""

    def __init__(self):
        self.state, self.reason = "loading", None

    def ready(self) -> None:
        self.state, self.reason = "ready", None

    def load_failed(self, model_name: str, message: str) -> None:
        self.state, self.reason = "load_failed", f"model {model_name!r} failed to load: {message}"

    def broken(self, reason: str) -> None:
        self.state, self.reason = "broken", reason

    def refusal(self) -> Optional[ServingError]:
        """The error every request gets in this state, or None when the worker serves."""
        if self.state == "load_failed":
            return ModelLoadFailed(self.reason)
        if self.state == "broken":
            return WorkerRestarting(f"this worker hit a device fault and is restarting: {self.reason}")
        if self.state == "loading":  # TorchServe sends requests only after initialize returns
            return ServingError("this worker has not finished loading its model")
        return None

    def describe(self) -> dict:
        """`GET /models/NAME?customized=true` shows this (handlers/ts_entry.py)."""
        return {"ready": self.state == "ready", "state": self.state,
                "load_error": self.reason if self.state == "load_failed" else None,
                "device_fault": self.reason if self.state == "broken" else None}
