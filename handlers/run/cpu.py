"""CPU runner: plain calls on staged host buffers; no CUDA API is touched."""
from __future__ import annotations

from handlers.run.base import Runner
from handlers.staging import StagingBuffers


class CpuRunner(Runner):
    def __init__(self, model, spec):
        super().__init__(model, spec)
        self.inputs = StagingBuffers()

    def call(self, parts: dict, run_rows: int) -> dict:
        staged = [self.inputs.stage(n, parts[n], run_rows) for n in self.spec.input_names]
        return {k: v.contiguous() for k, v in self.model(*staged).items()}

    def prepare(self, config, kind) -> str:
        return "CPU: no CUDA graphs"

