"""A started worker's health: the one state every request consults first (handlers/worker.py owns it)."""
from __future__ import annotations

from typing import Optional

from handlers.errors import ModelLoadFailed, ServingError
from handlers.faults import WorkerRestarting


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
