"""CUDA graphs per batch bucket, for the CUDA runner.

At small batch a compiled model waits on kernel launches: each call launches every kernel from
the CPU. A CUDA graph records those launches once and replays them with one call. Graphs are
bound to the addresses and shapes they were captured with, so each bucket (a batch size) owns
persistent device input tensors that requests are copied into, and output tensors that replay
overwrites; a batch is padded with zero rows to the smallest bucket that holds it. All buckets
share one memory pool (they are replayed one at a time, never concurrently, and every replay's
outputs are copied out before the next).

Named dynamic dimensions (a text's length): a graph replays one shape, so graphs are captured
only where the archive declares padding safe (handler.pad, batch.PadPlan): every call then
carries one of the plan's length buckets, and each (batch bucket, length bucket) pair gets a
graph of its own, smallest first, under the same memory cap. Calls of a shape without a graph
run the artifact's own call.

Policy (`cuda_graphs` in model-config.yaml): `off`; `on` (a capture or check failure fails the
load); `auto` (the default: capture, replay each bucket once against the plain call on a random
valid input, keep graphs only if every output matches bit for bit; otherwise log why and run
without). A capture that raises for one shape (a kernel that refuses to be captured at that
size) leaves that shape to plain calls, the others keep their graphs, and the load line names it.
"""
from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from handlers.artifact.metadata import is_mask
from handlers.batch import batch_sizes_in
from handlers.errors import LoadError
from handlers.faults import is_oom, is_sticky
from handlers.run.capture import GraphMismatch, capture_graph, mismatch

logger = logging.getLogger(__name__)
# Graphs per runner at most: each costs a warm-up call, a capture and a verifying replay at load
# (batch buckets x length buckets grows fast with several named dimensions), and a worker's
# start must stay well inside TorchServe's startup timeout.
MAX_GRAPHS = 64


def graph_buckets(batch_min: int, batch_max: int, configured=(), largest: int = 64) -> list:
    """Batch sizes to capture: `configured` if given (each inside [batch_min, batch_max]), else
    the powers of two in [batch_min, min(batch_max, largest)] plus both ends of that range, so
    every batch up to the largest bucket has one that holds it."""
    try:
        if configured:
            return batch_sizes_in(batch_min, batch_max, configured, "cuda_graph_batch_sizes")
        return batch_sizes_in(batch_min, min(batch_max, max(largest, batch_min)))
    except ValueError as e:
        raise LoadError(str(e)) from None


# A call's fixed host cost beside its GPU work (upload, launch, the wait, the copy-out), what
# padding texts of several length buckets into one call saves per call merged: on an H100 host
# under load, a batch of 8 of the MLP spent 0.272 ms copying in and launching and 0.162 ms waiting
# around a 0.0204 ms graph replay (docs/results/heavy_mlp_fp16_h100.json, 64 clients). A job sent to
# the engine costs its loop about as much (its copies, its answer: handlers/engine/device.py).
CALL_OVERHEAD_MS = 0.2


def bucket_for(rows: int, buckets: list) -> Optional[int]:
    """The smallest bucket holding `rows`, or None when rows exceed the largest."""
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


@dataclass
class GraphBucket:
    rows: int
    graph: torch.cuda.CUDAGraph
    inputs: list  # persistent device inputs, (rows, ...) each
    outputs: dict  # output name -> device tensor the replay overwrites
    sizes: tuple = ()  # the named-dimension sizes captured at, as sorted (name, size) pairs
    replay_ms: Optional[float] = None  # one replay's GPU time, timed at capture (named dimensions only)


def _static_inputs(spec, rows: int, device, sizes: Optional[dict] = None) -> list:
    return list(spec.example(rows, device, sizes).values())


def shape_key(inputs) -> tuple:
    """What a graph's inputs look like past the batch dimension, in the artifact's input order:
    per input its row shape (from tensors, or from the first row block of each input's parts)."""
    return tuple(tuple((t[0] if isinstance(t, list) else t).shape[1:]) for t in inputs)


def length_buckets(spec, pad) -> list:
    """The named-dimension sizes to capture at: every combination of the pad plan's buckets
    ([{}] without named dimensions or without a pad plan)."""
    if not spec.dims or pad is None:
        return [{}]
    combos = [{}]
    for dim, sizes in pad.buckets.items():
        combos = [{**c, dim: n} for c in combos for n in sizes]
    return combos


class Target(NamedTuple):
    """What a graph is captured of and where: the loaded model, its spec, the device and the
    worker's stream."""
    model: Any
    spec: Any
    device: Any
    stream: Any


def run_shape(target: Target, rows: int, sizes: Optional[dict] = None) -> None:
    """One plain call at `rows` rows (named dimensions at `sizes`) on the target's stream, waited for."""
    model, spec, device, stream = target
    inputs = _static_inputs(spec, rows, device, sizes)
    with torch.cuda.stream(stream):
        model(*inputs)
    if stream is not None:
        stream.synchronize()


def capture(target: Target, rows: int, pool, sizes: Optional[dict] = None) -> GraphBucket:
    """Capture one call of the target's model at `rows` rows (named dimensions at `sizes`) on its
    stream, warmed up on it first (run/capture.py)."""
    model, spec, device, stream = target
    inputs = _static_inputs(spec, rows, device, sizes)
    graph, outputs = capture_graph(lambda: model(*inputs), stream, pool=pool, device=device)
    return GraphBucket(rows, graph, inputs, outputs, tuple(sorted((sizes or {}).items())))


def replay_ms(bucket: GraphBucket, stream, n: int = 3) -> float:
    """One replay's GPU time (ms, the mean of `n` after one untimed), timed with CUDA events on
    `stream`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        bucket.graph.replay()
        start.record(stream)
        for _ in range(n):
            bucket.graph.replay()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / n


def random_valid(s, t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random values a request could hold for static input `t` of input spec `s` (None: unknown):
    inputs named like a mask all ones (a fully masked row is a case attention kernels handle
    badly), floats random normal, integers inside their value range (per column), else 0 or 1."""
    if s is not None and is_mask(s.name):
        return torch.ones(t.shape, dtype=t.dtype)
    if t.is_floating_point():
        return torch.randn(t.shape, generator=g)
    if s is not None and t.dtype != torch.bool and (s.value_range or s.columns):
        return s.draw_ints(tuple(t.shape), g)
    return torch.randint(0, 2, t.shape, generator=g)


def first_difference(model, bucket: GraphBucket, stream, seed: int, spec=None) -> Optional[str]:
    """Replay `bucket` and call the model plainly on the same random valid input (`spec`'s
    inputs, random_valid); None when every output is bit-identical, else the first difference as
    run/capture.py's mismatch words it."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    specs = list(spec.inputs) if spec is not None else [None] * len(bucket.inputs)
    with torch.cuda.stream(stream):
        for s, t in zip(specs, bucket.inputs):
            t.copy_(random_valid(s, t, g).to(t.dtype))
        bucket.graph.replay()
        replayed = {k: v.clone() for k, v in bucket.outputs.items()}
        plain = model(*bucket.inputs)
    if stream is not None:
        stream.synchronize()
    problem = mismatch(plain, replayed, f"the graph at batch {bucket.rows}")
    return None if problem is None else str(problem)


def why_not_capturable(kind, spec, pad=None) -> Optional[str]:
    if not getattr(kind, "graph_capturable", False):
        return f"{spec.backend} artifacts keep their own runtime's launch path"
    dynamic = [s.name for s in spec.inputs if any(d is None or isinstance(d, str) for d in s.shape[1:])]
    unnamed = [s.name for s in spec.inputs if any(d is None for d in s.shape[1:])]
    if unnamed or (dynamic and pad is None):
        # a graph replays one shape: requests of every length run through the artifact's own call
        return (f"input(s) {', '.join(dynamic)} have dynamic non-batch dimensions "
                f"({', '.join(getattr(spec, 'dims', {})) or 'unnamed'}) and no declared padding (handler.pad)")
    return None


class ReplayTable:
    """The replay times of captured graphs by (named-dimension sizes, batch bucket): what a call
    costs on the GPU. A worker served by the engine gets the engine's table in its Ready
    (handlers/engine/protocol.py) and pads its batch by it, as a runner with the graphs does."""

    def __init__(self, entries):
        """`entries`: (sizes as sorted (name, size) pairs, rows, ms or None) per graph."""
        self._by_sizes = {}  # named-dimension sizes -> {rows: replay ms}
        for sizes, rows, ms in entries:
            self._by_sizes.setdefault(tuple(tuple(p) for p in sizes), {})[rows] = ms

    def entries(self) -> list:
        """(sizes, rows, ms) of every graph with a timing."""
        return [(sizes, rows, ms) for sizes, by_rows in self._by_sizes.items() for rows, ms in by_rows.items()
                if ms is not None]

    def replay_ms(self, rows: int, sizes: dict) -> Optional[float]:
        """GPU time of the replay a call of `rows` rows at these named-dimension sizes would use,
        or None without such a graph (or without its timing)."""
        by_rows = self._by_sizes.get(tuple(sorted(sizes.items())))
        b = bucket_for(rows, sorted(by_rows)) if by_rows else None
        return by_rows[b] if b is not None else None

    def call_cost_ms(self, rows: int, sizes: dict) -> Optional[float]:
        """A call's cost (batch.PadPlan.targets' `cost`): its replay plus a call's fixed host cost."""
        ms = self.replay_ms(rows, sizes)
        return None if ms is None else ms + CALL_OVERHEAD_MS


class GraphSet:
    """The captured buckets of one worker, with the memory they hold: per input shape past the
    batch dimension (one shape without named dimensions), the batch buckets captured."""

    def __init__(self, buckets: dict, memory_bytes: int, dynamic: bool = False, failed: Optional[dict] = None):
        self.buckets = buckets  # (rows, shape_key) -> GraphBucket
        # (rows, shape_key) -> (named-dimension sizes, why): the capture failed, so the calls this
        # bucket would take run the artifact's own call
        self.failed = dict(failed or {})
        self.by_shape = {}  # shape_key -> ascending rows
        for rows, shapes in sorted(set(buckets) | set(self.failed)):
            self.by_shape.setdefault(shapes, []).append(rows)
        # without named dimensions every call has the one shape admission allows: not looked at
        self._fixed = None if dynamic or len(self.by_shape) != 1 else next(iter(self.by_shape))
        self.sizes = sorted({rows for rows, _ in buckets})
        self.memory_bytes = memory_bytes
        self.table = ReplayTable([(b.sizes, b.rows, b.replay_ms) for b in buckets.values()])

    def replay_ms(self, rows: int, sizes: dict) -> Optional[float]:
        return self.table.replay_ms(rows, sizes)

    def for_call(self, rows: int, parts: dict, names) -> Optional[GraphBucket]:
        """The graph for a call of `rows` rows of these input parts, or None."""
        return self.for_shape(rows, shape_key([parts[n] for n in names]) if self._fixed is None else self._fixed)

    def for_shape(self, rows: int, shapes: tuple) -> Optional[GraphBucket]:
        """The graph for a call of `rows` rows whose inputs' row shapes are `shapes` (shape_key's
        form), or None."""
        if self._fixed is not None:
            shapes = self._fixed
        sizes = self.by_shape.get(shapes)
        b = bucket_for(rows, sizes) if sizes else None
        return self.buckets.get((b, shapes)) if b is not None else None  # None also where its capture failed

    def describe(self) -> str:
        shapes = f" x {len(self.by_shape)} input shapes" if len(self.by_shape) > 1 else ""
        mib = self.memory_bytes / 2**20
        text = f"CUDA graphs for batch {self.sizes}{shapes} ({len(self.buckets)} graphs, {mib:.0f} MiB)"
        if self.failed:
            text += "; capture failed, plain calls for " + "; ".join(
                f"batch {rows}" + (f" at {dims}" if dims else "") + f" ({why})"
                for (rows, _), (dims, why) in sorted(self.failed.items(), key=lambda kv: kv[0][0]))
        return text


class GraphBuilder:
    """The captures of one runner, one (batch size, named-dimension sizes) pair per `step`, the
    smallest calls first, sharing one pool until the graphs would hold more than `cap_bytes`;
    with `verify`, every kept bucket is checked against the plain call. A shape whose capture
    raises runs plain calls (GraphSet.failed, in the load line). `build` runs every step at load,
    before the engine answers its first worker, so a capture never overlaps a batch on the device."""

    def __init__(self, target: Target, sizes: list, cap_bytes: int, verify: bool, lengths=({},)):
        self.target = target
        self.model, self.spec, self.device, self.stream = target
        self.cap_bytes, self.verify = cap_bytes, verify
        pairs = sorted(((rows, dict(n)) for rows in sizes for n in lengths),
                       key=lambda p: (p[0] * math.prod(p[1].values()), p[0]))
        if len(pairs) > MAX_GRAPHS:
            logger.info("capturing the %d smallest of %d (batch, length) shapes (at most %d graphs per runner)",
                        MAX_GRAPHS, len(pairs), MAX_GRAPHS)
            pairs = pairs[:MAX_GRAPHS]
        self.pending = pairs  # what is left to capture, smallest first
        self.kept, self.failed = {}, {}
        # the pool's growth over the captures alone: memory_reserved read around each capture,
        # where nothing else allocates (the serving thread is the capturing one)
        self.memory_bytes = 0
        self.pool = torch.cuda.graph_pool_handle()

    def step(self) -> None:
        """Capture, keep and check the next pending shape. Raises on a difference from the plain
        call (with `verify`) and on a sticky CUDA error; stops (nothing left pending) where the
        cap is reached or the device ran out of memory (larger shapes would need more)."""
        rows, dims = self.pending.pop(0)
        spec, out_of_memory = self.spec, None  # True/False once this shape's capture failed
        try:
            # the shape's own activations, cached for plain calls on this stream from now on,
            # are allocated by this call, before the graph's memory is counted
            run_shape(self.target, rows, dims or None)
            before = torch.cuda.memory_reserved(self.device)
            bucket = capture(self.target, rows, self.pool, dims or None)
        except Exception as e:  # this shape only: its calls run the artifact's own call
            key = (rows, tuple(tuple(s.concrete(rows, dims or spec.min_sizes())[1:]) for s in spec.inputs))
            self.failed[key] = (dims, _capture_failure(e, rows, dims, self.stream))
            # a capture that CUDA invalidated leaves its pool marked as recording (torch 2.11 on
            # an H100: every later capture into it failed "beginAllocateToPool: already
            # recording"); the shapes after it share a fresh one
            self.pool = torch.cuda.graph_pool_handle()
            out_of_memory = is_oom(e)
        if out_of_memory is not None:
            if out_of_memory:  # after the except block: its traceback no longer holds the capture's memory
                self._stop(f"out of device memory at batch {rows}")
            return
        used = self.memory_bytes + torch.cuda.memory_reserved(self.device) - before
        if used > self.cap_bytes:
            del bucket
            self._stop(f"graphs would hold {used / 2**20:.0f} MiB, over handler.cuda_graph_memory_mb", rows, dims)
            return
        self.memory_bytes = used
        self.kept[(rows, shape_key(bucket.inputs))] = bucket
        if self.verify:
            problem = first_difference(self.model, bucket, self.stream, seed=rows, spec=spec)
            if problem:
                raise GraphMismatch(problem)
        if spec.dims:  # read only to plan padding across length buckets (batch.PadPlan.targets)
            bucket.replay_ms = replay_ms(bucket, self.stream)

    def _stop(self, why: str, rows=None, dims=None) -> None:
        """No further capture: the shapes left (all larger) run plain calls."""
        what = f"CUDA graph for batch {rows} {dims or ''} not kept (nor any larger)" if rows else \
            f"no CUDA graph for the {len(self.pending)} larger shape(s) left"
        logger.info("%s: %s", what, why)
        self.pending = []
        torch.cuda.empty_cache()  # hand the dropped graph's pool memory back

    def graphs(self) -> GraphSet:
        """The graphs kept so far (a call of a shape not yet captured runs its plain call)."""
        return GraphSet(dict(self.kept), self.memory_bytes, dynamic=bool(self.spec.dims), failed=self.failed)

    def finish(self) -> GraphSet:
        """The graphs once nothing is pending; raises where every capture failed."""
        if not self.kept and self.failed:
            raise RuntimeError(f"every capture failed, the first: {next(iter(self.failed.values()))[1]}")
        return self.graphs()


def build(target: Target, sizes: list, cap_bytes: int, verify: bool, lengths=({},)) -> GraphSet:
    """Every shape captured now (GraphBuilder's steps, one after another); raises where none was
    captured, on a difference or on a sticky CUDA error (the caller decides whether that fails
    the load)."""
    builder = GraphBuilder(target, sizes, cap_bytes, verify, lengths)
    while builder.pending:
        builder.step()
    return builder.finish()


def _capture_failure(e: Exception, rows: int, dims: dict, stream) -> str:
    """The reason a capture failed, logged; re-raises where the CUDA context is unusable (a
    device-side assert, say: nothing can run in this process any more)."""
    def line(x):
        return f"{type(x).__name__}: {(str(x).splitlines() or [''])[0][:300]}"

    # torch.cuda.graph's exit ends the capture even after the model raised: its own error then
    # carries the model's as its context, the cause worth naming
    cause = e.__cause__ or e.__context__
    why = line(e) + (f" (after {line(cause)})" if cause is not None else "")
    if is_sticky(e) or (cause is not None and is_sticky(cause)):
        raise e
    try:
        if stream is not None:
            stream.synchronize()  # a capture that failed must leave nothing queued behind it
    except Exception as after:
        raise after from e
    logger.warning("CUDA graph capture failed for batch %d%s; those calls run without a graph: %s",
                   rows, f" at {dims}" if dims else "", why)
    return why
