"""A step's inputs uploaded on a stream of their own, so the copy engine moves the next step's
bytes while the device still runs the step before (handlers/engine/device.py).

Launched on the engine's stream, a step's host-to-device copies run after the replay before them
and before its own: with ResNet-50's 602 KB inputs they were part of every step's device time (an
H200 busy 0.88-0.98 of each second at 64 clients, docs/results/engine_r50_fp16_h200_s80.json). A
step whose inputs reach `min_bytes` copies them here instead, into a staging buffer on the device
(one per step in flight: handlers/engine/device.DEPTH), on the upload stream; the engine's stream
waits for that copy and moves the bytes from staging into the graph's inputs (a device-to-device
copy, at the device's own bandwidth). Two events keep the order:
- `uploaded[slot]`, recorded after a step's copies on the upload stream: the engine's stream
  waits for it before reading the staging buffer;
- `read[slot]`, recorded on the engine's stream after the step's last copy out of staging: the
  upload stream waits for it before it writes that buffer again, two steps later.
Smaller steps copy straight from the arena on the engine's stream, as before: each staged input
costs one more copy's launch on the host (the engine's loop, which bounds the MLP's steps).

Without a stream (the CPU tests), the same buffers and views, with plain copies in order.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

ALIGN = 256  # bytes: CUDA's allocation alignment, which any dtype's view may start at
MIN_BYTES = 1 << 20  # a step's input bytes from which its uploads go on the upload stream
SLACK_INPUTS = 256  # staged inputs of one step whose alignment the buffer has room for, beside its bytes


class Uploads:
    """`device`: where the staging buffers live; `stream`: the engine's stream (None on the CPU);
    `capacity`: the most input bytes one step can hold (the largest graph's inputs);
    `slots`: buffers, one per step in flight."""

    def __init__(self, device, stream, capacity: int, slots: int, new_event: Optional[Callable] = None,
                 min_bytes: int = MIN_BYTES):
        self.device, self.stream, self.min_bytes = device, stream, min_bytes
        self.capacity = capacity + ALIGN * SLACK_INPUTS  # each staged input starts aligned: room for the rounding
        self.upload = torch.cuda.Stream(device=stream.device) if stream is not None else None
        new_event = new_event or torch.cuda.Event
        self.uploaded = [new_event() for _ in range(slots)] if stream is not None else [None] * slots
        self.read = [None] * slots  # recorded once a step read its buffer (none before the first)
        self._new_event = new_event
        self._buffers: list = [None] * slots  # made at the first staged step: most models never stage
        self._typed: list = [None] * slots  # per slot {dtype: its buffer viewed as that dtype}
        self._slot = 0
        self.staged = 0  # steps staged (a benchmark's and the tests' count)

    def wanted(self, srcs: list) -> bool:
        """Whether a step with these input blocks stages them: their bytes reach min_bytes, and
        fit a buffer once each is aligned."""
        sizes = [s.nbytes for s in srcs]
        return sum(sizes) >= self.min_bytes and sum(-(-n // ALIGN) * ALIGN for n in sizes) <= self.capacity

    def stage(self, srcs: list) -> dict:
        """Queues the copies of `srcs` (arena views) into the next slot's buffer on the upload
        stream and makes the engine's stream wait for them: {id(src): the device view of its
        bytes}. `done()` must follow once the step's copies out of staging are queued. Called
        with the engine's stream current (handlers/engine/device.py _use_stream), which it
        leaves current."""
        slot = self._slot
        if self._buffers[slot] is None:
            self._buffers[slot] = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
            self._typed[slot] = {}
        if self.upload is not None:
            torch.cuda.set_stream(self.upload)  # not a context: its enter and exit cost 18 us a step
            if self.read[slot] is not None:
                self.upload.wait_event(self.read[slot])  # the step two back has read this buffer
        views, at = {}, 0
        try:
            for src in srcs:
                view = self._view(slot, src.dtype, src.shape, at)
                view.copy_(src, non_blocking=True)
                views[id(src)] = view
                at += -(-src.nbytes // ALIGN) * ALIGN
            if self.upload is not None:
                self.uploaded[slot].record(self.upload)
        finally:
            if self.upload is not None:
                torch.cuda.set_stream(self.stream)
        if self.upload is not None:
            self.stream.wait_event(self.uploaded[slot])
        self.staged += 1
        return views

    def _view(self, slot: int, dtype, shape, at: int):
        """The slot's buffer from byte `at` as a contiguous tensor of `dtype` and `shape`."""
        typed = self._typed[slot].get(dtype)
        if typed is None:
            typed = self._typed[slot][dtype] = self._buffers[slot][:self.capacity // dtype.itemsize * dtype.itemsize].view(dtype)
        strides, n = [], 1
        for d in reversed(shape):
            strides.append(n)
            n *= d
        return typed.as_strided(tuple(shape), tuple(reversed(strides)), at // dtype.itemsize)

    def done(self) -> None:
        """The step's copies out of the slot's buffer are queued on the engine's stream: the next
        step to write that buffer waits for them; the next step stages into the other slot."""
        slot = self._slot
        if self.stream is not None:
            if self.read[slot] is None:
                self.read[slot] = self._new_event()
            self.read[slot].record(self.stream)
        self._slot = (slot + 1) % len(self._buffers)

    def synchronize(self) -> None:
        if self.upload is not None:
            self.upload.synchronize()
