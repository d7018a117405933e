"""How many sequences a decoder's slot-form cache holds on the GPU that will serve it, and how long
each (cs-export-lm's --slots and --max-seq defaults), with the arithmetic printed.

  usable = GPU memory x (1 - headroom) - the weights - a process's overhead
  slots  = min(MAX_SLOTS, usable // (max_seq x the cache's bytes per position))

The cache's bytes per position come from the model's own run (slot_lm.layer_shapes: per layer its
key-value heads and head dimensions) and the dtype; the overhead is the per-process figure
compiled_serving/worker_sizing.py measured (CUDA context, allocator, activations, graph pools).
The GPU is the export device where it is one (its whole memory, torch.cuda.mem_get_info's total:
the model already on it takes from what is free, and is counted as the weights), or the one
--gpu-memory-gib names. The cache is not in the artifact (artifact.json records it and the loader
allocates it: handlers/artifact/cache.py), so a GPU's worth costs no file size. Exported on the CPU
without --gpu-memory-gib: 8 slots of at most 512 positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from compiled_serving.worker_sizing import DEFAULT_HEADROOM, OVERHEAD_MIB, GpuMemory

MAX_SLOTS = 64  # the largest continuous batch served and benchmarked (issue 65: 1..64 streams)
GPU_SEQ = 2048  # positions per sequence on a GPU unless the model has fewer
CPU_SLOTS, CPU_SEQ = 8, 512
MIB = 1 << 20
ALLOCATED = "allocated when the artifact loads (not in it)"


class LmSizingError(ValueError):
    """The cache asked for (or even two slots) does not fit; the message gives the numbers and the fix."""


@dataclass(frozen=True)
class LmSizing:
    slots: int
    max_seq: int
    line: str  # what cs-export-lm prints: the choice and its arithmetic


def device_memory(device) -> GpuMemory:
    """The memory of GPU `device` (e.g. "cuda", "cuda:1"): torch.cuda.mem_get_info's total, with its name."""
    import torch

    dev = torch.device(device)
    dev = torch.device("cuda", torch.cuda.current_device()) if dev.index is None else dev
    _free, total = torch.cuda.mem_get_info(dev)
    return GpuMemory(total // MIB, f"{dev}, {torch.cuda.get_device_name(dev)}, the export device")


def position_bytes(shapes: list, element_size: int) -> int:
    """The cache's bytes for one position of one sequence: keys and values of every layer."""
    return sum(heads * (kd + vd) for heads, kd, vd in shapes) * element_size


def size(shapes: list, element_size: int, weights_bytes: int, positions: Optional[int], gpu: Optional[GpuMemory],
         slots: Optional[int] = None, max_seq: Optional[int] = None, headroom: float = DEFAULT_HEADROOM) -> LmSizing:
    """Slots and positions for `gpu` (None: the CPU's defaults); a given `slots`/`max_seq` is kept
    and checked; LmSizingError where it (or two slots) cannot fit."""
    per_pos = position_bytes(shapes, element_size)
    if gpu is None:
        seq = max_seq or min(CPU_SEQ, positions or CPU_SEQ)
        n = slots or CPU_SLOTS
        return LmSizing(n, seq, f"{n} slots x {seq} positions ({'given' if slots else 'the default on the CPU'}; "
                                f"pass --gpu-memory-gib G to size the cache for the GPU that will serve it); cache "
                                f"{n * seq * per_pos / MIB:.0f} MiB, {ALLOCATED}")
    seq = max_seq or min(GPU_SEQ, positions or GPU_SEQ)
    usable = math.floor(gpu.mib * (1 - headroom)) * MIB - weights_bytes - OVERHEAD_MIB * MIB
    per_slot = seq * per_pos
    fit = max(0, usable) // per_slot
    how = (f"GPU memory {gpu.mib} MiB ({gpu.how}) less {headroom:.0%} headroom, {weights_bytes / MIB:.0f} MiB weights "
           f"and {OVERHEAD_MIB} MiB overhead = {usable / MIB:.0f} MiB for the cache; a slot of {seq} positions x "
           f"{per_pos} bytes = {per_slot / MIB:.1f} MiB; {fit} fit")
    if slots is not None:
        if slots > fit:
            fewer = f"--slots {fit} or fewer, " if fit >= 2 else ""
            raise LmSizingError(f"--slots {slots} --max-seq {seq} do not fit: {how}. Fix: {fewer}a shorter --max-seq, "
                                "or size for a larger GPU (--gpu-memory-gib)")
        return LmSizing(slots, seq, f"{slots} slots x {seq} positions (given; {how})")
    if fit < 2:
        raise LmSizingError(f"not even 2 slots of {seq} positions fit: {how}. Fix: a shorter --max-seq, a smaller "
                            "dtype (--dtype bfloat16), or a larger GPU (--gpu-memory-gib)")
    n = min(MAX_SLOTS, fit)
    cap = f"at most {MAX_SLOTS}" if n == MAX_SLOTS else "all that fit"
    return LmSizing(n, seq, f"{n} slots x {seq} positions ({how}; {cap}; pass --slots N --max-seq L to choose); "
                            f"cache {n * per_slot / MIB:.0f} MiB, {ALLOCATED}")
