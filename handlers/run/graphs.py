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
input, keep graphs only if every output matches bit for bit; otherwise log why and run without).
"""
from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from handlers.batch import batch_sizes_in
from handlers.errors import LoadError

logger = logging.getLogger(__name__)
# Graphs per worker at most: each costs a warm-up call, a capture and a verifying replay at load
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


def capture(model, spec, rows: int, device, stream, pool, sizes: Optional[dict] = None) -> GraphBucket:
    """Capture one call of `model` at `rows` rows (named dimensions at `sizes`) on `stream`
    (warmed up on it first: lazy initialisation such as cuBLAS workspaces must not happen
    during capture)."""
    inputs = _static_inputs(spec, rows, device, sizes)
    with torch.cuda.stream(stream):
        model(*inputs)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = model(*inputs)
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


def first_difference(model, bucket: GraphBucket, stream, seed: int) -> Optional[str]:
    """Replay `bucket` and call the model plainly on the same random input; None when every
    output is bit-identical, else a description of the first difference."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.cuda.stream(stream):
        for t in bucket.inputs:
            src = torch.randn(t.shape, generator=g) if t.is_floating_point() else torch.randint(0, 2, t.shape, generator=g)
            t.copy_(src.to(t.dtype))
        bucket.graph.replay()
        replayed = {k: v.clone() for k, v in bucket.outputs.items()}
        plain = model(*bucket.inputs)
    if stream is not None:
        stream.synchronize()
    for name, want in plain.items():
        got = replayed[name]
        if got.shape != want.shape or not torch.equal(got, want):
            diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shape"
            return f"output {name!r} at batch {bucket.rows} differs from the plain call (max |d| {diff})"
    return None


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


class GraphSet:
    """The captured buckets of one worker, with the memory they hold: per input shape past the
    batch dimension (one shape without named dimensions), the batch buckets captured."""

    def __init__(self, buckets: dict, memory_bytes: int, dynamic: bool = False):
        self.buckets = buckets  # (rows, shape_key) -> GraphBucket
        self.by_shape = {}  # shape_key -> ascending rows
        for rows, shapes in sorted(buckets):
            self.by_shape.setdefault(shapes, []).append(rows)
        # without named dimensions every call has the one shape admission allows: not looked at
        self._fixed = None if dynamic or len(self.by_shape) != 1 else next(iter(self.by_shape))
        self.sizes = sorted({rows for rows, _ in buckets})
        self.memory_bytes = memory_bytes
        self._by_sizes = {}  # named-dimension sizes -> {rows: replay ms}
        for b in buckets.values():
            self._by_sizes.setdefault(b.sizes, {})[b.rows] = b.replay_ms

    def replay_ms(self, rows: int, sizes: dict) -> Optional[float]:
        """GPU time of the replay a call of `rows` rows at these named-dimension sizes would use,
        or None without such a graph (or without its timing)."""
        by_rows = self._by_sizes.get(tuple(sorted(sizes.items())))
        b = bucket_for(rows, sorted(by_rows)) if by_rows else None
        return by_rows[b] if b is not None else None

    def for_call(self, rows: int, parts: dict, names) -> Optional[GraphBucket]:
        """The graph for a call of `rows` rows of these input parts, or None."""
        shapes = self._fixed if self._fixed is not None else shape_key([parts[n] for n in names])
        sizes = self.by_shape.get(shapes)
        b = bucket_for(rows, sizes) if sizes else None
        return self.buckets[(b, shapes)] if b is not None else None

    def describe(self) -> str:
        shapes = f" x {len(self.by_shape)} input shapes" if len(self.by_shape) > 1 else ""
        return f"CUDA graphs for batch {self.sizes}{shapes} ({len(self.buckets)} graphs, {self.memory_bytes / 2**20:.0f} MiB)"


def build(model, spec, device, stream, sizes: list, cap_bytes: int, verify: bool, lengths=({},)) -> GraphSet:
    """Capture every (batch size, named-dimension sizes) pair of `sizes` x `lengths`, the
    smallest calls first, sharing one pool, until the pool would pass `cap_bytes`; with `verify`,
    every kept bucket is checked against the plain call. Raises on a capture error or a
    difference (the caller decides whether that fails the load)."""
    pool = torch.cuda.graph_pool_handle()
    base = torch.cuda.memory_reserved(device)
    kept = {}
    pairs = sorted(((rows, dict(n)) for rows in sizes for n in lengths),
                   key=lambda p: (p[0] * math.prod(p[1].values()), p[0]))
    if len(pairs) > MAX_GRAPHS:
        logger.info("capturing the %d smallest of %d (batch, length) shapes (at most %d graphs per worker)",
                    MAX_GRAPHS, len(pairs), MAX_GRAPHS)
        pairs = pairs[:MAX_GRAPHS]
    for rows, dims in pairs:
        bucket = capture(model, spec, rows, device, stream, pool, dims or None)
        used = torch.cuda.memory_reserved(device) - base
        if used > cap_bytes:
            logger.info("CUDA graph for batch %d %s not kept (nor any larger): graphs would hold %.0f MiB, "
                        "over handler.cuda_graph_memory_mb", rows, dims or "", used / 2**20)
            del bucket
            torch.cuda.empty_cache()  # hand the dropped graph's pool memory back
            break
        kept[(rows, shape_key(bucket.inputs))] = bucket
        if verify:
            problem = first_difference(model, bucket, stream, seed=rows)
            if problem:
                raise RuntimeError(problem)
        if spec.dims:  # read only to plan padding across length buckets (batch.PadPlan.targets)
            bucket.replay_ms = replay_ms(bucket, stream)
    return GraphSet(kept, torch.cuda.memory_reserved(device) - base, dynamic=bool(spec.dims))
