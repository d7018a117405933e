"""The engine's GPU steps: a step's jobs run from and into the workers' arenas, with no host
copy, one wait per step, and the next step launched while the device runs this one.

Each worker's arena is registered with CUDA once, at connect (cudaHostRegister), so a copy from
an input block to the device and from the device into an output block is DMA on the engine's
stream, asynchronous to the host. A step's jobs are planned into replays of the runner's
captured CUDA graphs: jobs padded to a shared bucket where the runner's cost model says one
replay is cheaper (batch.PadPlan.targets, as the runner pads a batch), jobs of one shape
together, at most the largest bucket's rows per replay. Per replay, each job's rows go straight
into the graph's inputs (the rest filled with the input's pad value, as padding would fill it),
the graph replays, and each job's rows of the outputs, cut back to the job's own lengths, go
into a new block of its worker's arena. One event is recorded after the last copy of the step;
the step is answered once it has passed (`Flight.done`), so no worker reads an output block
before its bytes are there and no input block is freed while a copy may still read it.

The stream runs the steps in launch order, and every step's output blocks are its own, so a
step may be launched while the previous one runs (Engine keeps up to DEPTH in flight). A step
this path cannot plan (a shape without a graph, a job over the largest bucket) runs through the
runner's own call instead (Engine.run, waited for). The plan and the copies are device-agnostic:
tests/test_engine_device.py runs them on the CPU against the runner's own call, with replays
that call the model on the graph's buffers.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from handlers.errors import ServingError

logger = logging.getLogger(__name__)
DEPTH = 2  # steps in flight: one on the device, one launched behind it
MAX_VIEWS = 8192  # row views of the graphs' tensors kept (_rows): a few MiB at most
_current = threading.local()  # per thread, the stream a DeviceSteps last made current there (_use_stream)


@dataclass(eq=False)
class Replay:
    bucket: object  # handlers/run/graphs.GraphBucket: inputs, outputs, graph
    parts: list  # (job, first row in the bucket, rows)


@dataclass(eq=False)
class Flight:
    """A launched step: per job its output refs (or the ServingError it is answered with), the
    event after its last copy, and the tensors its copies read and write (kept until it passed)."""

    jobs: list
    outs: dict
    event: object
    keep: list = field(default_factory=list)
    start: object = None  # an event before its first copy (DeviceSteps.timing: the GPU's busy time)
    replays: int = 0
    device_ms: float = 0.0  # its replays' measured times (the graphs' capture-time replay_ms), summed
    due: float = 0.0  # time.perf_counter() the device is expected to finish it (Engine._launch sets it)

    def done(self) -> bool:
        return self.event.query()


class DeviceSteps:
    """`runner`: a CudaRunner with captured graphs (or, in tests, anything with the same
    graphs, pad, call_cost_ms and spec); `stream`/`new_event`: the CUDA stream and event
    factory (None and a CPU event in tests)."""

    def __init__(self, runner, stream=None, new_event: Optional[Callable] = None):
        self.graphs, self.pad, self.cost = runner.graphs, runner.pad, runner.call_cost_ms
        self.names = list(runner.spec.input_names)
        self.largest = max(self.graphs.sizes)
        self.stream = stream
        self.new_event = new_event or torch.cuda.Event
        self.registered = {}  # id(arena) -> base pointer, for cudaHostUnregister
        self._events = []  # events of landed steps, recorded again by later ones (not with `timing`)
        # id(a graph's input) -> the first row from which it holds its pad value throughout, as the
        # steps left it (unknown: the whole input); Engine.run's call writes the same inputs: forget()
        self._pad_from = {}
        self._views = {}  # (id(tensor), a, n) -> tensor[a:a + n] (_rows)
        # a benchmark's aid (handlers/engine/sampler.py): each step's events time the device, and
        # `busy_ms` sums how long it ran the steps (replays and copies), `replays` how many
        self.timing, self.busy_ms, self.replays, self._last = False, 0.0, 0, None

    @classmethod
    def for_runner(cls, runner) -> Optional["DeviceSteps"]:
        """The steps of a CUDA runner with graphs; None for any other (its own call serves)."""
        if getattr(runner, "graphs", None) is None or not runner.graphs.sizes or not hasattr(runner, "stream"):
            return None
        # the weights were uploaded on the runner's producer stream: waited for once here, so the
        # steps need no per-call wait (nothing else queues work on it after the load)
        runner.producer.synchronize()
        return cls(runner, runner.stream)

    # --- arenas: on the loop's thread only (Engine.connect/disconnect there, handlers/engine/serve.py),
    # so a stream synchronize before unpinning covers every copy queued for that arena ---

    def register(self, arena) -> None:
        """Pins the arena's mapping for DMA (once per worker); where CUDA refuses, the copies
        still run, staged through the driver's own buffers (slower, never wrong)."""
        if self.stream is None or arena.base is None:
            return
        ptr = arena.base.data_ptr()
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, arena.size, 0))
        if rc == 0:
            self.registered[id(arena)] = ptr
        else:
            logger.warning("the arena of a worker could not be pinned (cudaError %d): its copies are staged", rc)

    def unregister(self, arena) -> None:
        """Before the arena is unmapped: waits for the device (a launched step may still copy from
        or into it), then unpins it."""
        ptr = self.registered.pop(id(arena), None)
        if ptr is not None:
            self.stream.synchronize()
            torch.cuda.cudart().cudaHostUnregister(ptr)

    # --- steps ---

    def plan(self, jobs: list) -> Optional[list]:
        """The step's replays, or None where some job has no graph to replay."""
        rows = [j.rows for j in jobs]
        if self.pad is not None:
            targets = self.pad.targets([self.pad.sizes(j.inputs) for j in jobs], rows, self.cost)
        else:
            targets = [{}] * len(jobs)
        groups = {}
        for job, target in zip(jobs, targets):
            groups.setdefault(self._row_shapes(job, target), []).append(job)
        replays = []
        for shapes, members in groups.items():
            chunk, n = [], 0
            for job in members:
                if job.rows > self.largest:
                    return None
                if n + job.rows > self.largest:
                    replays.append(self._replay(shapes, chunk))
                    chunk, n = [], 0
                chunk.append(job)
                n += job.rows
            replays.append(self._replay(shapes, chunk))
        return None if any(r is None for r in replays) else replays

    def _row_shapes(self, job, target: dict) -> tuple:
        shapes = []
        for name in self.names:
            shape = list(job.inputs[name].shape[1:])
            for n, axis, dim in (self.pad.in_axes if self.pad is not None else ()):
                if n == name:
                    shape[axis - 1] = target[dim]
            shapes.append(tuple(shape))
        return tuple(shapes)

    def _replay(self, shapes: tuple, chunk: list) -> Optional[Replay]:
        bucket = self.graphs.for_shape(sum(j.rows for j in chunk), shapes)
        if bucket is None:
            return None
        parts, at = [], 0
        for job in chunk:
            parts.append((job, at, job.rows))
            at += job.rows
        return Replay(bucket, parts)

    def launch(self, replays: list, alloc: Callable, free: Callable) -> Flight:
        """Queues the step on the stream; returns at once. `alloc(job, name, dtype, shape)` gives
        (ref, writable view) in the job's arena or raises ServingError (that job alone is answered
        with it); `free(job, ref)` returns a block. Where queueing fails, every block it took is
        returned once the device is idle, and the error is raised."""
        flight = Flight([job for r in replays for job, _, _ in r.parts], {}, None, replays=len(replays),
                        device_ms=sum(getattr(r.bucket, "replay_ms", None) or 0.0 for r in replays))
        try:
            self._use_stream()
            if self.timing:
                flight.start = self.new_event(enable_timing=True)
                flight.start.record(self.stream)
            for r in replays:
                self._upload(r, flight.keep)
                r.bucket.graph.replay()
                for job, a, n in r.parts:
                    flight.outs[job] = self._download(r.bucket, job, a, n, alloc, free, flight.keep)
            flight.event = self._event()
            flight.event.record(self.stream)
        except BaseException:
            self.forget()  # a fill may or may not have been queued
            if self.stream is not None:
                self.stream.synchronize()
            for job, refs in flight.outs.items():
                for ref in refs if isinstance(refs, tuple) else ():
                    free(job, ref)
            raise
        return flight

    def landed(self, flight: Flight) -> None:
        """Counts a finished step (its event, passed, is recorded again by a later step); with
        `timing`, the device's time on it: from its start, or from the previous step's end where
        that was later (the stream ran them back to back)."""
        self.replays += flight.replays
        if self.timing and flight.start is not None:
            ms = flight.start.elapsed_time(flight.event)
            if self._last is not None:
                ms = min(ms, self._last.elapsed_time(flight.event))
            self.busy_ms += ms
            self._last = flight.event
        elif not self.timing:
            self._events.append(flight.event)

    def forget(self) -> None:
        """The graphs' inputs were written by another call (the runner's own): nothing is known
        of their pad rows any more."""
        self._pad_from.clear()

    def _event(self):
        """An event for a step's end: one a landed step passed (re-recording an event that has
        completed is CUDA's documented reuse), else a new one."""
        if self.timing:
            return self.new_event(enable_timing=True)
        return self._events.pop() if self._events else self.new_event()

    def _use_stream(self) -> None:
        """Makes `stream` the current stream of the launching thread where another DeviceSteps did
        not last (PyTorch's current stream is per thread; the runner's own call on that thread
        enters and leaves its stream with a context, which restores this one): a context per step
        cost the loop its enter and exit each time."""
        if self.stream is not None and getattr(_current, "stream", None) is not self.stream:
            torch.cuda.set_stream(self.stream)
            _current.stream = self.stream

    def _upload(self, r: Replay, keep: list) -> None:
        rows = sum(n for _, _, n in r.parts)
        for name, dev in zip(self.names, r.bucket.inputs):
            srcs = [job.inputs[name] for job, _, _ in r.parts]
            self._pad_rows(name, dev, rows, any(s.shape[1:] != dev.shape[1:] for s in srcs))
            for (job, a, n), src in zip(r.parts, srcs):
                dst = self._rows(dev, a, n)
                if src.shape[1:] != dst.shape[1:]:  # a job padded on the device: its own lengths first
                    dst = dst[(slice(None),) + tuple(slice(0, k) for k in src.shape[1:])]
                dst.copy_(src, non_blocking=True)
                keep.append(src)

    def _rows(self, t, a: int, n: int):
        """t[a:a + n] of a graph's input or output, made once per (tensor, a, n) (a slice cost
        the loop 4 us on an H200 host, two per job; the graphs' tensors live as long as the
        engine, and so may views of them)."""
        key = (id(t), a, n)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            view = self._views[key] = t[a:a + n]
        return view

    def _pad_rows(self, name: str, dev, rows: int, padded: bool) -> None:
        """Fills what the step's jobs do not write with the input's pad value, as the runner's
        padding would: all of it where a job is padded on the device, else the rows from `rows`
        on, of which those that held the pad value since an earlier step are left as they are
        (a fill is one more launch per step: steady steps of one size launch none)."""
        value = self.pad.values.get(name, 0) if self.pad is not None else 0
        known = self._pad_from.get(id(dev), dev.shape[0] + 1)  # unknown: row 0 on may differ
        if padded:
            dev.fill_(value)
        elif rows < min(known, dev.shape[0]):
            dev[rows:known].fill_(value)
        self._pad_from[id(dev)] = rows

    def _download(self, bucket, job, a: int, n: int, alloc: Callable, free: Callable, keep: list):
        """The job's rows of each output, cut to its own lengths, copied into new blocks of its
        arena: their refs, or the ServingError the job is answered with (its arena is full)."""
        own = self.pad.sizes(job.inputs) if self.pad is not None else {}
        refs = []
        try:
            for name, out in bucket.outputs.items():
                o = self._rows(out, a, n)
                for oname, axis, dim in (self.pad.out_axes if self.pad is not None else ()):
                    if oname == name and o.shape[axis] != own[dim]:
                        o = o.narrow(axis, 0, own[dim])
                ref, view = alloc(job, name, o.dtype, tuple(o.shape))
                refs.append(ref)
                if o.numel():
                    view.copy_(o, non_blocking=True)
                keep.append(view)
        except BaseException as e:
            for ref in refs:
                free(job, ref)
            if isinstance(e, ServingError):
                return e.with_traceback(None)  # its frames hold arena views: kept, they would keep the arena mapped
            raise
        return tuple(refs)
