"""A runner's warm-up across batch sizes and length buckets: kernels, allocator, staging buffers,
the first-execution costs a client's first request would otherwise pay. The one place for it:
a worker that runs its model (handlers/warmup.py) and the engine process (handlers/engine/artifact.py)
both call it."""
from __future__ import annotations

import torch

from handlers.batch import warmup_sizes


def warm(spec, runner, batch_sizes=()) -> None:
    """The model across a few batch sizes, then
    every length bucket at that batch. Its inputs are valid requests (ArtifactSpec.example: ids
    inside their ranges, per column; masks all ones), never all zeros: a fully masked row or an
    id outside its table is what kernels fail on. `batch_sizes`: handler.warmup_batch_sizes."""
    sizes = warmup_sizes(spec.batch_min, spec.batch_max, batch_sizes)
    for size in sizes:
        with torch.inference_mode():
            runner.run([spec.example(size)])
    # every length bucket (padding), or the longest request: the allocator sees its blocks now
    pad = runner.pad
    lengths = ([{d: b for d in pad.buckets} for b in sorted({b for v in pad.buckets.values() for b in v})]
               if pad else [{k: hi for k, (_lo, hi) in spec.dims.items()}] if spec.dims else [])
    for sizes in lengths:
        sizes = {d: min(n, spec.dims[d][1]) for d, n in sizes.items()}
        with torch.inference_mode():
            runner.run([spec.example(spec.batch_min, sizes=sizes)])
