"""The worker's own CUDA stream, made in one place for every runner that owns one (run/cuda.py,
run/decoder.py, run/slots.py, run/lanes.py: the batch's, and each lane its own): everything a
worker runs on a GPU goes on it, nothing of a request on the default stream.
"""
from __future__ import annotations

from typing import Optional

import torch


def worker_stream(device: torch.device, priority: int) -> Optional["torch.cuda.Stream"]:
    """A new stream on `device` at `priority` (handler.stream_priority; a lower number is a higher priority), or
    None on a device other than CUDA (a CPU runner makes no CUDA call)."""
    return torch.cuda.Stream(device=device, priority=priority) if device.type == "cuda" else None
