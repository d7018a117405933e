"""Which device this worker serves on, decided in one place.

Inputs: TorchServe's `gpu_id` (None on CPU workers), the model-config `deviceType`, what the
artifact was compiled for, and what the process can see (CUDA, device count,
CUDA_VISIBLE_DEVICES). A pure function so every combination is unit-tested on CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

from handlers.artifact.confine import visible_ids
from handlers.errors import IncompatibleArtifact


@dataclass(frozen=True)
class Placement:
    kind: str  # device kind: "cpu" or "cuda"
    index: Optional[int]  # logical CUDA index in this process, None on CPU
    note: str = ""  # why, for the load log
    # the GPU as the host names it (a CUDA_VISIBLE_DEVICES entry: an index or a UUID) where this
    # process was confined to it (confine()); None: the index is the host's own numbering
    gpu: Optional[str] = None

    @property
    def torch_device(self):
        import torch

        return torch.device(self.kind if self.index is None else f"{self.kind}:{self.index}")

    def __str__(self):  # a torch device string: runners and loaders take it as it is
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def where(self) -> str:
        """For logs and messages: the device in this process and, where the process is confined
        to one GPU, that GPU's host number (nvidia-smi's)."""
        return str(self) + (f" (host GPU {self.gpu})" if self.gpu is not None else "")


def _logical_index(gpu_id: int, device_count: int, visible: Optional[str]) -> int:
    """TorchServe counts GPUs itself and may hand out an id that is a physical GPU number
    (deviceIds in model-config) while CUDA_VISIBLE_DEVICES renumbers what torch sees."""
    if 0 <= gpu_id < device_count:
        return gpu_id
    if visible:
        ids = visible_ids(visible)
        if str(gpu_id) in ids and ids.index(str(gpu_id)) < device_count:
            return ids.index(str(gpu_id))
    raise IncompatibleArtifact(
        f"TorchServe assigned gpu_id {gpu_id}, but this worker sees {device_count} CUDA device(s)"
        f" (CUDA_VISIBLE_DEVICES={visible!r}). Fix: make deviceIds in model-config.yaml name GPUs "
        "that CUDA_VISIBLE_DEVICES exposes, or set number_of_gpu in config.properties to the "
        "visible count.")


class Seen(NamedTuple):
    """What this worker is given and sees: TorchServe's gpu_id and the process's CUDA devices."""
    gpu_id: Optional[int]
    cuda_available: bool
    device_count: int
    visible_devices: Optional[str] = None  # CUDA_VISIBLE_DEVICES


class Wanted(NamedTuple):
    """What the archive and the artifact ask for: model-config's deviceType, the artifact's
    device, its kind's name (`backend`, for messages) and whether that kind's artifacts can
    move to another device kind after compilation (`relocatable`, kinds/)."""
    device_type: Optional[str]
    artifact_device: str
    backend: str
    relocatable: bool


def resolve_placement(seen: Seen, wanted: Wanted) -> Placement:
    gpu_id, cuda_available, device_count, visible_devices = seen
    device_type, artifact_device, backend, relocatable = wanted
    gpu_ok = cuda_available and device_count > 0 and gpu_id is not None
    if device_type == "gpu" and not gpu_ok:
        why = ("CUDA is not available to this worker" if not cuda_available or device_count == 0
               else "TorchServe assigned no GPU to this worker (number_of_gpu=0?)")
        raise IncompatibleArtifact(
            f"model-config.yaml demands deviceType: gpu, but {why}. Fix: run on a host with a "
            "visible NVIDIA GPU and a CUDA build of torch, or set deviceType: cpu with a CPU artifact.")

    want_gpu = device_type == "gpu" or (device_type is None and gpu_ok)
    if artifact_device == "cuda":
        if not want_gpu:
            reason = ("model-config.yaml says deviceType: cpu" if device_type == "cpu"
                      else "this worker has no GPU (CUDA available: %s, devices: %d, gpu_id: %s)"
                      % (cuda_available, device_count, gpu_id))
            raise IncompatibleArtifact(
                f"the {backend} artifact was compiled for CUDA and cannot run on the CPU, but {reason}. "
                "Fix: serve it on a GPU worker, or recompile with cs-compile --device cpu.")
        idx = _logical_index(gpu_id, device_count, visible_devices)
        return Placement("cuda", idx, f"TorchServe gpu_id {gpu_id} -> cuda:{idx}")

    # artifact compiled for the CPU
    if want_gpu and relocatable:
        idx = _logical_index(gpu_id, device_count, visible_devices)
        return Placement("cuda", idx, f"CPU-exported program relocated to cuda:{idx}")
    if device_type == "gpu":
        raise IncompatibleArtifact(
            f"model-config.yaml demands deviceType: gpu, but the {backend} artifact was compiled "
            "for the CPU and holds only CPU kernels. Fix: recompile with cs-compile "
            "--device cuda, or set deviceType: cpu.")
    note = "CPU artifact" + (f"; GPU {gpu_id} assigned by TorchServe left unused" if gpu_ok else "")
    return Placement("cpu", None, note)


def placement_for_worker(gpu_id: Optional[int], wanted: Wanted) -> Placement:
    """resolve_placement with what this process sees."""
    import torch

    cuda = torch.cuda.is_available()
    return resolve_placement(Seen(gpu_id, cuda, torch.cuda.device_count() if cuda else 0,
                                  os.environ.get("CUDA_VISIBLE_DEVICES")), wanted)


def use_device(placement: Placement) -> None:
    """Make the placement's GPU current before anything creates CUDA state (contexts, engines,
    kernels, streams): CUDA objects bind to the device current when they are made, and a
    worker on cuda:1 that leaves cuda:0 current puts its state on the wrong GPU."""
    if placement.kind == "cuda":
        import torch

        torch.cuda.set_device(placement.index)
