"""Fit a TorchServe batch of valid requests to the batch range the artifact accepts.

The rows of all requests are laid end to end, cut into chunks of at most `batch_max` rows and
each chunk padded up to `batch_min` (a fixed-batch artifact has min == max). Padding rows are
dropped from the outputs and every request gets exactly its own rows back.
"""
from __future__ import annotations

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
