"""Runners by device kind: the one place that decides how a batch reaches the model."""
from __future__ import annotations

import torch

from .base import Runner
from .cpu import CpuRunner
from .cuda import CudaRunner

RUNNERS = {"cpu": CpuRunner, "cuda": CudaRunner}


def runner_for(model, spec, device: torch.device, config=None) -> Runner:
    """The runner for `device`'s kind; `config` (HandlerConfig) tunes the CUDA one."""
    if device.type == "cuda":
        return CudaRunner(model, spec, device,
                          stream_priority=config.stream_priority if config else 0,
                          piece_bytes=int(config.staging_piece_mb * (1 << 20)) if config else 0,
                          sync=getattr(config, "cuda_sync", "spin"))
    return RUNNERS[device.type](model, spec)
