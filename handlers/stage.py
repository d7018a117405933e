"""Host staging buffers: reused across requests, grown when a larger batch arrives.

On a CUDA worker they are pinned (page-locked) so host-to-device and device-to-host copies
run asynchronously on the worker's stream; BRIEF.md measured 0.71 ms pinned against 3.38 ms
pageable for a 38.5 MB batch. On a CPU worker they are ordinary memory.
"""
from __future__ import annotations

import torch


class StagingBuffers:
    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._bufs = {}  # name -> flat 1-D tensor
        self.grows = 0  # how often a buffer was (re)allocated: for tests and the load log

    def view(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` backed by the buffer for `name`, reallocated only when the
        buffer is too small or of another dtype."""
        count = 1
        for d in shape:
            count *= int(d)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < count:
            # Grow geometrically so a slowly rising batch size does not reallocate every time.
            size = max(count, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0)
            buf = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
            self._bufs[name] = buf
            self.grows += 1
        return buf[:count].view(tuple(shape))

    def stage(self, name: str, parts, run_rows: int) -> torch.Tensor:
        """Concatenate request row-blocks `parts` into the buffer, zero-padding to `run_rows`."""
        first = parts[0]
        rows = sum(p.shape[0] for p in parts)
        out = self.view(name, (run_rows,) + tuple(first.shape[1:]), first.dtype)
        if len(parts) == 1:
            out[:rows].copy_(parts[0])
        else:
            torch.cat(parts, out=out[:rows])
        if run_rows > rows:
            out[rows:].zero_()
        return out

    def upload(self, name: str, parts, run_rows: int, device: torch.device, piece_bytes: int) -> torch.Tensor:
        """Stage request row-blocks `parts` and copy them to a new tensor on `device`, piece by
        piece: while piece k travels to the GPU (non-blocking, on the caller's current stream),
        the host copies piece k+1 into pinned memory. The request bytes TorchServe hands us are
        pageable, so this host copy cannot be skipped; pipelining can hide the upload behind it
        where memory bandwidth allows (on the H100 VM it did not: docs/results), so piece_bytes
        defaults to 0, one piece. Padding rows are zeroed on the device. Call it with the
        worker's stream current; pinned regions are rewritten only after the caller has waited
        for that stream (the Executor synchronizes on an event after every call)."""
        first = parts[0]
        row_shape = tuple(first.shape[1:])
        host = self.view(name, (run_rows,) + row_shape, first.dtype)
        dev = torch.empty((run_rows,) + row_shape, dtype=first.dtype, device=device)
        row_bytes = max(1, host[:1].numel() * host.element_size())
        step = max(1, piece_bytes // row_bytes) if piece_bytes > 0 else max(1, run_rows)
        at = sent = 0
        for part in parts:
            n = part.shape[0]
            a = 0
            while a < n:
                # Fill up to the next piece boundary, then send everything not yet sent.
                b = min(n, a + step - (at - sent))
                host[at:at + b - a].copy_(part[a:b])
                at += b - a
                a = b
                if at - sent >= step:
                    dev[sent:at].copy_(host[sent:at], non_blocking=True)
                    sent = at
        if at > sent:
            dev[sent:at].copy_(host[sent:at], non_blocking=True)
        if run_rows > at:
            dev[at:].zero_()
        return dev

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())
