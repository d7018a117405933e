"""Runners by device kind: the one place that decides how a batch reaches the model."""
from __future__ import annotations

import torch

from ..threads import cuda_wait
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
                          # auto with no worker count is the lone-worker choice; the handler
                          # resolves auto with its worker count before it gets here
                          sync=cuda_wait(getattr(config, "cuda_sync", "auto"), None, 1)[0],
                          spin_us=getattr(config, "cuda_spin_us", 0.0))
    return RUNNERS[device.type](model, spec)
