"""How one model's serving fits a GPU: one engine process per GPU holds the model (handlers/engine:
one copy of the weights, one CUDA context, the graphs and activations), and the TorchServe workers,
which hold no GPU memory, are counted from the host's cores once the engine fits.

  engine = weights + overhead <= GPU memory x (1 - headroom);  workers = max(2, 0.75 x cores)

compiled_serving/archive.py prints the arithmetic in one line and writes the engine's need into
model-config.yaml (handler.worker_gpu_mb, for the cluster's manifests) with the GPU memory it was
sized for (gpuSizing, read by compiled_serving/kserve.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Measured on an H100 (issue 39): a BERT-style classifier (6 layers, hidden 768, fp16, 133 MB of
# weights) used 1,528 MiB of GPU memory in each process that ran it (nvidia-smi) with declared
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
# Memory kept free of the arithmetic: the allocator's fragmentation, a load's moment of a second
# copy (an AOTInductor package's constants before they are swapped), whatever else shares the GPU.
DEFAULT_HEADROOM = 0.10
# handler.engine (issue 64): the workers hold no GPU and each has one batch in flight, so more of
# them keep the engine busier, up to a point: more workers split the same clients into smaller
# batches, and each job costs the engine's one loop. On a 16-core H200 host 12 workers served BERT
# 1.48x and the MLP 1.37x what 6 did at 128 clients (git show fdf9e3a:docs/results/engine_bert_fp16_h200_s69b.json,
# engine_mlp_fp16_h200_s69b.json), and 24 served BERT 0.87x and the MLP 1.0x what 12 did
# (docs/results/engine_bert_fp16_h200_s70.json; the MLP's file, superseded by
# engine_mlp_fp16_h200_s77: git show 37f2a8e:docs/results/engine_mlp_fp16_h200_s70.json): 3 of every 4 cores.
ENGINE_WORKERS_PER_CORE = 0.75


class SizingError(ValueError):
    """The engine does not fit the GPU; the message gives the numbers and the fix."""


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
    """The engine's GPU memory (one copy of the weights plus the overhead, held once per GPU
    whatever the worker count) against the target GPU's, and the workers from the host's cores."""
    weights_mib: float
    weights_how: str
    overhead_mib: float
    overhead_how: str
    gpu: GpuMemory
    headroom: float = DEFAULT_HEADROOM
    cores: int = 1

    @property
    def need_mib(self) -> int:
        return math.ceil(self.weights_mib + self.overhead_mib)

    @property
    def usable_mib(self) -> int:
        return math.floor(self.gpu.mib * (1.0 - self.headroom))

    @property
    def fits(self) -> bool:
        return self.need_mib <= self.usable_mib

    @property
    def engine_workers(self) -> int:
        return max(2, math.floor(self.cores * ENGINE_WORKERS_PER_CORE))

    @property
    def workers(self) -> int:
        """From the cores, once the engine fits; SizingError where it does not."""
        if not self.fits:
            raise SizingError(self.refusal())
        return self.engine_workers

    def arithmetic(self) -> str:
        g = self.gpu
        return (f"GPU memory {g.mib} MiB ({g.how}) less {self.headroom:.0%} headroom = {self.usable_mib} MiB usable; "
                f"one engine process holds {self.weights_mib:.1f} MiB weights ({self.weights_how}) + "
                f"{self.overhead_mib:.0f} MiB overhead ({self.overhead_how}) = {self.need_mib} MiB, "
                f"{'fits' if self.fits else 'does not fit'}; the workers hold no GPU memory: "
                f"{ENGINE_WORKERS_PER_CORE:g} x {self.cores} cores = {self.engine_workers} workers (at least 2)")

    def line(self) -> str:
        """The archive's printed line for the chosen count."""
        return (f"--workers {self.workers} ({self.arithmetic()}; measured: compiled_serving/worker_sizing.py; "
                "pass --workers N to choose)")

    def misfit(self, workers: int) -> str | None:
        """A warning where the engine does not fit (whatever `workers`, chosen by hand); None where it does."""
        return None if self.fits else f"the engine does not fit, whatever the worker count: {self.refusal()}"

    def refusal(self) -> str:
        return (f"the engine does not fit: {self.arithmetic()}. Fix: a GPU with at least "
                f"{math.ceil(self.need_mib / (1.0 - self.headroom) / 1024)} GiB (--gpu-memory-gib if it is not this "
                "machine's), a smaller model (fp16/bf16 weights, fewer layers), or a measured smaller "
                "--worker-overhead-mib (e.g. with --handler-option cuda_graphs=off)")

    def record(self) -> dict:
        """What model-config.yaml keeps of the sizing (gpuSizing, beside handler.worker_gpu_mb = need_mib, the
        engine's, held once per GPU whatever the worker count), for compiled_serving/kserve.py. TorchServe's
        frontend skips top-level keys it does not know (ModelConfig.build's `default: break`) and the handler
        reads only deviceType and handler."""
        return {"gpuMiB": self.gpu.mib, "gpuMemory": self.gpu.how, "headroom": self.headroom, "engine": True}
