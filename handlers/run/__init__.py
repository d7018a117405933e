"""Runners by device kind: the one place that decides how a batch reaches the model."""
from __future__ import annotations

import dataclasses

import torch

from handlers.batch import PadPlan
from handlers.config import HandlerConfig
from handlers.errors import ConfigError
from handlers.run.base import Runner
from handlers.run.cpu import CpuRunner
from handlers.run.cuda import CudaRunner, cuda_wait


def runner_for(model, spec, device: torch.device, config=None) -> Runner:
    """The runner for `device`'s kind; `config` (HandlerConfig; None: the defaults) tunes the
    CUDA one and says whether requests are padded along named dimensions (handler.pad)."""
    config = config or HandlerConfig()
    runner = _runner(model, spec, device, config)
    try:
        runner.pad = PadPlan.of(spec, config.pad or None, config.pad_buckets)
    except ValueError as e:
        raise ConfigError(f"{e}. Fix the archive's model-config.yaml (cs-archive --handler-option).") from None
    return runner


def _runner(model, spec, device: torch.device, config: HandlerConfig) -> Runner:
    if device.type == "cuda":
        return CudaRunner(model, spec, device, dataclasses.replace(config, cuda_sync=cuda_wait(config.cuda_sync)))
    return CpuRunner(model, spec)
