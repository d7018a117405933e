"""Capture-and-verify, for every CUDA graph the runners keep (run/graphs.py's batch buckets,
run/decoder.py's step, run/slots.py's steps and prompt chunks): one call warmed up on the
worker's stream and captured into a new CUDAGraph, the capture undone where it raised
(`capture_graph`), and a graph's replayed outputs compared with a plain call's bit for bit, a
difference raised as `GraphMismatch` naming the graph, the output and the max |difference|
(`mismatch`, `check_equal`). What each graph is verified on (the inputs, the cache state both
calls start from) stays with its runner.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class GraphMismatch(RuntimeError):
    """A graph's replay gave other outputs than the plain call on the same inputs."""


def capture_graph(call: Callable[[], Any], stream, pool=None, warmup: int = 1, device=None) -> tuple:
    """`call` run `warmup` times on `stream` and waited for (lazy initialisation such as cuBLAS
    workspaces must not happen during capture), then captured once on `stream` into a new
    CUDAGraph in memory pool `pool` (None: a pool of its own); (graph, the captured call's
    outputs). A capture that raises is undone (`after_failed_capture`) and re-raised."""
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            call()
    stream.synchronize()
    # undoing a failed capture needs its pool's id, and CUDAGraph.pool() raises until a capture
    # succeeded; a fresh handle is a pool of the graph's own, as pool=None gives it
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graph = torch.cuda.CUDAGraph()
    before = torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outputs = call()
    except Exception:
        after_failed_capture(device, pool, before)
        raise
    return graph, outputs


def after_failed_capture(device, pool, before) -> None:
    """What torch.cuda.graph leaves behind when ending the capture raises (torch 2.11, seen on
    an H100: a capture the model invalidated): its stream still current, and the caching
    allocator still routing that capture's allocations into `pool`. Both undone here; the pool
    itself stays unusable for captures (a caller capturing more moves on to a fresh one)."""
    torch.cuda.set_stream(before)
    index = device.index if isinstance(device, torch.device) and device.index is not None else None
    index = torch.cuda.current_device() if index is None else index
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:  # ending the capture got that far itself ("not currently recording")
        pass


def mismatch(plain, graphed, graph: str, output: str = "its output") -> Optional[GraphMismatch]:
    """None where `graphed` (a graph's replayed outputs: a tensor, or a dict of tensors by output
    name) is bit-identical to `plain` (the plain call's, same form), else the GraphMismatch naming
    `graph`, the first differing output (`output` for a tensor, its name for a dict's) and the max
    |difference| (or both shapes, where they differ)."""
    pairs = plain.items() if isinstance(plain, dict) else [(None, plain)]
    for name, want in pairs:
        got = graphed if name is None else graphed[name]
        if got.shape == want.shape and torch.equal(got, want):
            continue
        what = output if name is None else f"output {name!r}"
        if got.shape != want.shape:
            by = f"shape {tuple(got.shape)}, the plain call's {tuple(want.shape)}"
        else:
            by = f"max |d| {(got.float() - want.float()).abs().max().item():.3g}"
        return GraphMismatch(f"{graph} replays {what} differing from the plain call's ({by})")
    return None


def check_equal(plain, graphed, graph: str, output: str = "its output") -> None:
    """Raises `mismatch`'s GraphMismatch where `graphed` differs from `plain`."""
    problem = mismatch(plain, graphed, graph, output)
    if problem is not None:
        raise problem
