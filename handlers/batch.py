"""Fit a TorchServe batch of valid requests to the batch range the artifact accepts.

The rows of all requests are laid end to end, cut into chunks of at most `batch_max` rows and
each chunk padded up to `batch_min` (a fixed-batch artifact has min == max). Padding rows are
dropped from the outputs and every request gets exactly its own rows back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    start: int  # first row, in the concatenation of all requests
    rows: int  # real rows
    run_rows: int  # rows the artifact is called with (real + padding)


def plan_chunks(total_rows: int, batch_min: int, batch_max: int) -> list:
    chunks, start = [], 0
    while start < total_rows:
        rows = min(batch_max, total_rows - start)
        chunks.append(Chunk(start, rows, max(rows, batch_min)))
        start += rows
    return chunks


def rows_of(requests: list, names, start: int, rows: int) -> dict:
    """{input name: [row blocks]} covering rows [start, start + rows) of the requests laid end
    to end, as views: no concatenation copy before staging."""
    parts = {n: [] for n in names}
    at = 0
    for r in requests:
        n_rows = next(iter(r.values())).shape[0]
        a, b = max(start, at), min(start + rows, at + n_rows)
        if a < b:
            for n in names:
                parts[n].append(r[n][a - at:b - at])
        at += n_rows
    return parts


def offsets(row_counts) -> list:
    out, at = [], 0
    for n in row_counts:
        out.append((at, at + n))
        at += n
    return out


def batch_sizes_in(lo: int, hi: int, configured=(), option: str = "batch sizes") -> list:
    """`configured` (each inside [lo, hi], else ValueError naming `option`), or both ends of the
    range and the powers of two between them."""
    if configured:
        bad = [b for b in configured if not lo <= b <= hi]
        if bad:
            raise ValueError(f"{option} {bad} lie outside the artifact's batch range [{lo}, {hi}]")
        return sorted(set(configured))
    sizes = {lo, hi}
    p = 1
    while p < hi:
        if p > lo:
            sizes.add(p)
        p *= 2
    return sorted(sizes)


def warmup_sizes(batch_min: int, batch_max: int, configured=()) -> list:
    """A few buckets across the accepted range: both ends and the powers of two between, at
    most five sizes, so warm-up stays cheap for wide ranges."""
    sizes = batch_sizes_in(batch_min, batch_max, configured, "warmup_batch_sizes")
    if len(sizes) > 5 and not configured:
        keep = [sizes[round(i * (len(sizes) - 1) / 4)] for i in range(5)]
        sizes = sorted(set(keep))
    return sizes


@dataclass(frozen=True)
class PadPlan:
    """Padding along named dynamic dimensions, where the archive declares it safe
    (handler.pad): each request's inputs are padded with their pad value up to the smallest
    bucket that holds its length, so requests of different lengths share a call; each output
    that carries the dimension is cut back to the request's own length afterwards."""

    buckets: dict  # dimension name -> ascending bucket sizes (the range's maximum last)
    values: dict  # input name -> pad value
    in_axes: tuple  # (input name, axis, dimension name)
    out_axes: tuple  # (output name, axis, dimension name)

    @classmethod
    def of(cls, spec, pad: dict, configured=()) -> "PadPlan | None":
        """None without pad values; ValueError naming the fix when they do not cover every input
        with a named dimension, name unknown inputs, or a bucket lies outside a range."""
        if not pad or not spec.dims:
            return None
        names = {s.name for s in spec.inputs}
        unknown = sorted(set(pad) - names)
        in_axes = tuple((s.name, a, d) for s in spec.inputs for a, d in enumerate(s.shape) if isinstance(d, str))
        missing = sorted({n for n, _, _ in in_axes} - set(pad))
        if unknown or missing:
            raise ValueError(f"handler.pad must give a pad value for exactly the inputs with a named dimension "
                             f"({', '.join(sorted({n for n, _, _ in in_axes}))}); unknown: {unknown or 'none'}, "
                             f"missing: {missing or 'none'}")
        # only the dimensions some input carries are padded (an output-only one is not)
        buckets = {d: bucket_sizes(lo, hi, configured) for d, (lo, hi) in spec.dims.items()
                   if any(d == dim for _, _, dim in in_axes)}
        out_axes = tuple((s.name, a, d) for s in spec.outputs for a, d in enumerate(s.shape) if isinstance(d, str))
        return cls(buckets, dict(pad), in_axes, out_axes)

    def describe(self) -> str:
        return ", ".join(f"{d} to {b}" for d, b in self.buckets.items())

    def bucket(self, dim: str, size: int) -> int:
        return next(b for b in self.buckets[dim] if b >= size)

    def sizes(self, request: dict) -> dict:
        """{dimension: the request's own size}."""
        return {d: request[n].shape[a] for n, a, d in self.in_axes}

    def targets(self, sizes: list, rows: list, cost) -> list:
        """Per request (its named-dimension `sizes` and its `rows`), the sizes it is padded to.
        Each request's own buckets, unless `cost(rows, sizes)` (ms for one call of that many
        rows at those sizes; None where unknown) says padding neighbouring groups to one shared
        bucket is cheaper: a call has a fixed cost (upload, launch, wait, copy-out), so a batch
        of short and long texts is often faster as one call at the longer bucket than as one
        call per bucket. The groups, sorted by their buckets, are split into runs each padded to
        its largest buckets; the split of least total cost is found exactly by dynamic
        programming over the sorted groups (ties: fewer calls)."""
        dims = tuple(self.buckets)
        own = [tuple(self.bucket(d, s[d]) for d in dims) for s in sizes]
        keys = sorted(set(own))
        if len(keys) > 1:
            shared = _cheapest_runs(keys, [sum(r for k, r in zip(own, rows) if k == key) for key in keys],
                                    lambda n, at: cost(n, dict(zip(dims, at))))
            if shared:
                # with several dimensions two runs may meet at one target and run as one call
                # the split did not price: keep the split only where that call's cost is known
                calls = {}
                for k, r in zip(own, rows):
                    calls[shared[k]] = calls.get(shared[k], 0) + r
                if any(cost(n, dict(zip(dims, at))) is None for at, n in calls.items()):
                    shared = None
            own = [shared[k] for k in own] if shared else own
        return [dict(zip(dims, k)) for k in own]

    def pad(self, request: dict, target: dict) -> dict:
        """The request with each named dimension padded (with its input's pad value) up to
        `target` (each at least the request's own size)."""
        import torch

        out = dict(request)
        for n, a, d in self.in_axes:
            t, want = out[n], target[d]
            if t.shape[a] < want:
                # the op F.pad calls for constant padding, one call (not full + narrow + copy);
                # its widths run from the last dimension back: (before, after) per dimension
                widths = [0, 0] * (t.dim() - 1 - a) + [0, want - t.shape[a]]
                out[n] = torch.constant_pad_nd(t, widths, self.values[n])
        return out

    def cut(self, outputs: dict, sizes: dict) -> dict:
        out = dict(outputs)
        for n, a, d in self.out_axes:
            if n in out and out[n].shape[a] != sizes[d]:
                out[n] = out[n].narrow(a, 0, sizes[d])
        return out


def _cheapest_runs(keys: list, rows: list, cost):
    """{key: the key its run is padded to} for the split of the sorted `keys` (with `rows` rows
    each) into contiguous runs of least total `cost(rows, run's elementwise-largest key)`, or
    None when no split has a known cost."""
    def largest(run):  # elementwise over the run's keys
        return tuple(map(max, *run)) if len(run) > 1 else run[0]

    n = len(keys)
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # earlier i first: on equal cost the longer run (fewer calls) stays
            c = cost(sum(rows[i:j]), largest(keys[i:j]))
            if c is not None and best[i] + c < best[j]:
                best[j], cut[j] = best[i] + c, i
    if best[n] == math.inf:
        return None
    out, j = {}, n
    while j > 0:
        i = cut[j]
        out.update((k, largest(keys[i:j])) for k in keys[i:j])
        j = i
    return out


def bucket_sizes(lo: int, hi: int, configured=()) -> list:
    """Configured lengths inside [lo, hi] (hi added), else the powers of two in range and hi."""
    if configured:
        bad = [b for b in configured if not lo <= b <= hi]
        if bad:
            raise ValueError(f"handler.pad_buckets {bad} lie outside the dimension's range [{lo}, {hi}]")
        return sorted(set(configured) | {hi})
    sizes, p = {hi}, 1
    while p < hi:
        if p >= lo:
            sizes.add(p)
        p *= 2
    return sorted(sizes)
