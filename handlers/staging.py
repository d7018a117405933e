"""Staging buffers: reused across requests, grown when a larger batch arrives.

Host buffers on a CPU worker are ordinary memory. The CUDA runner keeps pinned (page-locked)
host buffers, so host-to-device and device-to-host copies run asynchronously on its stream
(pageable memory makes them synchronous and slower: docs/results), and device buffers, so
inputs land at the same addresses on every call of a batch size.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


class StagingBuffers:
    def __init__(self, pinned: bool = False, device: Optional[torch.device] = None):
        self.pinned = pinned
        self.device = device  # None: host memory
        self._bufs = {}  # name -> flat 1-D tensor
        self.grows = 0  # how often a buffer was (re)allocated: for tests, the load log, view caches

    def view(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` backed by the buffer for `name`, reallocated only when the
        buffer is too small or of another dtype."""
        count = math.prod(int(d) for d in shape)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < count:
            # Grow geometrically so a slowly rising batch size does not reallocate every time.
            size = max(count, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0)
            if self.device is None:
                buf = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
            else:
                buf = torch.empty(size, dtype=dtype, device=self.device)
            self._bufs[name] = buf
            self.grows += 1
        return buf[:count].view(tuple(shape))

    def stage(self, name: str, parts, run_rows: int) -> torch.Tensor:
        """Concatenate request row-blocks `parts` into the buffer, zero-padding to `run_rows`."""
        first = parts[0]
        out = self.view(name, (run_rows,) + tuple(first.shape[1:]), first.dtype)
        rows = concat_into(out, parts)
        if run_rows > rows:
            out[rows:].zero_()
        return out

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def concat_into(out: torch.Tensor, parts) -> int:
    """Request row-blocks `parts` into the first rows of `out` by one op (one torch.cat of eight
    one-row requests took 3 us on the CI CPU against 19 us for eight copies); returns the rows
    written. Blocks of `out`'s dtype only, except a single block, which copy_ converts."""
    if len(parts) == 1:
        rows = parts[0].shape[0]
        out[:rows].copy_(parts[0])
    else:
        rows = sum(p.shape[0] for p in parts)
        torch.cat(parts, out=out[:rows])
    return rows
