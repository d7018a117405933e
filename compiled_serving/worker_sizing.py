"""How many CUDA workers of one model fit on its GPU: every worker holds a CUDA context, CUDA graph
pools and activations, and its own copy of the weights unless they are shared (handlers/weights:
then the GPU holds one copy and the holder's context, plus one loading worker's copy at a time),
so memory, not speed, caps the count.

  count = min(speed cap, floor(GPU memory x (1 - headroom) / (weights + per-worker overhead)))
  shared: min(speed cap, floor((GPU memory x (1 - headroom) - 2 x weights - context) / overhead))

compiled_serving/archive.py prints the arithmetic in one line and writes the per-worker need into
model-config.yaml (handler.worker_gpu_mb, checked by each worker before it loads:
handlers/artifact/room.py) with the GPU memory it was sized for (gpuSizing, read by compiled_serving/kserve.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Measured on an H100 (issue 39): a BERT-style classifier (6 layers, hidden 768, fp16, 133 MB of
# weights) with 6 workers used 1,528 MiB of GPU memory per worker process (nvidia-smi) with declared
# padding and CUDA graphs, 952 MiB without graphs. The overhead is that minus the weights: the CUDA
# context, the caching allocator's blocks and activations at the largest batch, and the graph pools
# (their cap is handler.cuda_graph_memory_mb, 2048 by default, so a larger model's pools may grow
# past this figure: measure yours and pass --worker-overhead-mib).
MEASURED_WEIGHTS_MIB = 133e6 / 2**20
MEASURED_WORKER_MIB = 1528
MEASURED_WORKER_NO_GRAPHS_MIB = 952
OVERHEAD_MIB = round(MEASURED_WORKER_MIB - MEASURED_WEIGHTS_MIB)  # 1401
OVERHEAD_NO_GRAPHS_MIB = round(MEASURED_WORKER_NO_GRAPHS_MIB - MEASURED_WEIGHTS_MIB)  # 825
# Where no GPU can be read: the 24 GB class clusters use for inference (NVIDIA L4, A10G). Such
# cards give CUDA somewhat less than 24 GiB; the headroom below covers the difference.
DEFAULT_GPU_GIB = 24.0
# Memory kept free of the arithmetic: the allocator's fragmentation, a trial load's second
# context while workers start (handlers/artifact/probe.py), whatever else shares the GPU.
DEFAULT_HEADROOM = 0.10
# A bare CUDA context (a process that made one tensor), measured on an H200 with torch 2.11
# (docs/results/shared_weights_big_mlp_fp16_h200.json, cuda_context_mib): what the weights holder
# costs beside its copy of the weights (handlers/weights).
CONTEXT_MIB = 520
# handler.engine (issue 64): the workers hold no GPU and each has one batch in flight, so more of
# them keep the engine busier, up to a point: more workers split the same clients into smaller
# batches, and each job costs the engine's one loop. On a 16-core H200 host 12 workers served BERT
# 1.48x and the MLP 1.37x what 6 did at 128 clients (git show fdf9e3a:docs/results/engine_bert_fp16_h200_s69b.json,
# engine_mlp_fp16_h200_s69b.json), and 24 served BERT 0.87x and the MLP 1.0x what 12 did
# (docs/results/engine_bert_fp16_h200_s70.json; the MLP's file, superseded by
# engine_mlp_fp16_h200_s77: git show 37f2a8e:docs/results/engine_mlp_fp16_h200_s70.json): 3 of every 4 cores.
ENGINE_WORKERS_PER_CORE = 0.75


class SizingError(ValueError):
    """Not even one worker fits; the message gives the numbers and the fix."""


@dataclass(frozen=True)
class GpuMemory:
    mib: int
    how: str  # where the figure comes from, printed with the arithmetic
    assumed: bool = False


def target_gpu(gib_flag: float | None) -> GpuMemory:
    """--gpu-memory-gib as given; else the total memory of GPU 0 of this machine; else the default,
    marked assumed."""
    if gib_flag is not None:
        if gib_flag <= 0:
            raise SizingError(f"--gpu-memory-gib {gib_flag}: expected the target GPU's memory in GiB, e.g. 24 or 80")
        return GpuMemory(round(gib_flag * 1024), f"--gpu-memory-gib {gib_flag:g}")
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return GpuMemory(props.total_memory // 2**20, f"GPU 0 of this machine, {props.name}")
    return GpuMemory(round(DEFAULT_GPU_GIB * 1024),
                     f"assumed: no GPU here, the {DEFAULT_GPU_GIB:g} GiB L4/A10G class; pass --gpu-memory-gib "
                     "for the GPU that will serve it", assumed=True)


@dataclass(frozen=True)
class Sizing:
    weights_mib: float
    weights_how: str
    overhead_mib: float
    overhead_how: str
    gpu: GpuMemory
    headroom: float = DEFAULT_HEADROOM
    speed_cap: int = 6
    # The workers read one copy held by the GPU's weights holder (handlers/weights): the GPU holds
    # that copy and the holder's context once, each worker its overhead, and a worker's load its
    # own copy for a moment (loads on one GPU take turns: handlers/weights/attach.py).
    shared: bool = False
    # handler.engine: on: one engine process holds the model (one copy, one context, the graphs);
    # the workers hold no GPU memory, and their count follows the host's cores (`cores`)
    engine: bool = False
    cores: int = 1

    @property
    def need_mib(self) -> int:
        """One worker's GPU memory while it loads: a copy of the weights plus the overhead (its
        own for its life unshared; with shared weights, only until the held ones replace it)."""
        return math.ceil(self.weights_mib + self.overhead_mib)

    @property
    def usable_mib(self) -> int:
        return math.floor(self.gpu.mib * (1.0 - self.headroom))

    @property
    def fixed_mib(self) -> int:
        """What the GPU holds once whatever the worker count: the engine's copy and overhead;
        shared, the holder's copy and context plus the one copy a loading worker holds for a
        moment; unshared, nothing."""
        if self.engine:
            return self.need_mib
        return math.ceil(2 * self.weights_mib + CONTEXT_MIB) if self.shared else 0

    @property
    def per_worker_mib(self) -> int:
        if self.engine:
            return 0
        return math.ceil(self.overhead_mib) if self.shared else self.need_mib

    @property
    def fitting(self) -> int:
        if self.engine:  # any count, once the engine fits
            return self.engine_workers if self.usable_mib >= self.fixed_mib else 0
        return max(0, self.usable_mib - self.fixed_mib) // self.per_worker_mib

    @property
    def engine_workers(self) -> int:
        return max(2, math.floor(self.cores * ENGINE_WORKERS_PER_CORE))

    @property
    def workers(self) -> int:
        """The count: the speed cap, fewer where memory allows fewer (with the engine: from the
        cores, once the engine fits); SizingError where none fits."""
        if self.fitting < 1:
            raise SizingError(self.refusal())
        return self.engine_workers if self.engine else min(self.speed_cap, self.fitting)

    def arithmetic(self) -> str:
        g = self.gpu
        head = f"GPU memory {g.mib} MiB ({g.how}) less {self.headroom:.0%} headroom = {self.usable_mib} MiB usable; "
        if self.engine:
            return (head + f"the engine (handler.engine): one engine process holds {self.weights_mib:.1f} MiB weights ({self.weights_how}) "
                    f"+ {self.overhead_mib:.0f} MiB overhead ({self.overhead_how}) = {self.need_mib} MiB, "
                    f"{'fits' if self.need_mib <= self.usable_mib else 'does not fit'}; the workers hold no GPU memory: "
                    f"{ENGINE_WORKERS_PER_CORE:g} x {self.cores} cores = {self.engine_workers} workers (at least 2)")
        if self.shared:
            return (head + f"shared weights: the holder's copy {self.weights_mib:.1f} MiB ({self.weights_how}) + its "
                    f"context {CONTEXT_MIB} MiB + one loading worker's copy {self.weights_mib:.1f} MiB = {self.fixed_mib} "
                    f"MiB once, then {self.overhead_mib:.0f} MiB per worker ({self.overhead_how}); "
                    f"({self.usable_mib} - {self.fixed_mib}) // {self.per_worker_mib} = {self.fitting} fit")
        return (head + f"per worker {self.weights_mib:.1f} MiB weights ({self.weights_how}) + {self.overhead_mib:.0f} MiB "
                f"overhead ({self.overhead_how}) = {self.need_mib} MiB; {self.usable_mib} // {self.need_mib} = "
                f"{self.fitting} fit")

    def line(self) -> str:
        """The archive's printed line for the chosen count."""
        n = self.workers
        if self.engine:
            return f"--workers {n} ({self.arithmetic()}; measured: compiled_serving/worker_sizing.py; pass --workers N to choose)"
        cap = (f"the speed cap {self.speed_cap} (docs/performance.md)" if n == self.speed_cap
               else f"memory caps it below the speed cap {self.speed_cap}")
        return f"--workers {n} ({self.arithmetic()}; {cap}; pass --workers N to choose)"

    def misfit(self, workers: int) -> str | None:
        """A warning where `workers` (chosen by hand) do not fit; None where they do."""
        total = self.fixed_mib + workers * self.per_worker_mib
        if total <= self.usable_mib:  # with the engine: it fits, whatever the count
            return None
        if self.engine:
            return f"the engine does not fit, whatever the worker count: {self.refusal()}"
        return (f"--workers {workers} need {self.fixed_mib} + {workers} x {self.per_worker_mib} = {total} MiB of GPU "
                f"memory, more than the {self.usable_mib} MiB usable ({self.arithmetic()}): the last workers will "
                f"refuse to load (503 with the reason). Pass --workers {max(1, self.fitting)} or less, or size for "
                "the GPU that will serve it with --gpu-memory-gib")

    def refusal(self) -> str:
        return (f"not even one worker fits: {self.arithmetic()}. Fix: a GPU with at least "
                f"{math.ceil((self.fixed_mib + self.per_worker_mib) / (1.0 - self.headroom) / 1024)} GiB (--gpu-memory-gib if it is not this "
                "machine's), a smaller model (fp16/bf16 weights, fewer layers), or a measured smaller "
                "--worker-overhead-mib (e.g. with --handler-option cuda_graphs=off)")

    def record(self) -> dict:
        """What model-config.yaml keeps of the sizing (gpuSizing, beside handler.worker_gpu_mb = need_mib),
        for compiled_serving/kserve.py. TorchServe's frontend skips top-level keys it does not know
        (ModelConfig.build's `default: break`) and the handler reads only deviceType and handler."""
        record = {"gpuMiB": self.gpu.mib, "gpuMemory": self.gpu.how, "headroom": self.headroom}
        if self.engine:  # worker_gpu_mb is the engine's, held once per GPU whatever the worker count
            record["engine"] = True
        return record
