"""A worker confined to the one GPU TorchServe gave it, before CUDA starts in its process.

Facts this relies on:
- CUDA reads CUDA_VISIBLE_DEVICES once per process, when its driver initialises (cuInit); torch
  calls that at its first CUDA query (torch.cuda.is_available(), a device count without NVML, any
  tensor on a GPU). `import torch` does not, and TorchServe 0.12's worker makes no CUDA call
  before the handler's initialize (ts/model_service_worker.py, ts/model_loader.py).
- The CUDA driver answers cuDeviceGetCount with CUDA_ERROR_NOT_INITIALIZED (3) until cuInit ran,
  so whether it is too late to confine can be asked without starting anything.
- CUDA's current device is per thread and starts at 0 in every new thread: in a process that sees
  every GPU, a thread that calls a CUDA API without setting the device (an event, a stream, a
  synchronize, a library's own thread) makes a context on GPU 0. On a two-GPU host each worker on
  GPU 1 and its weights holder (since retired) held 518-520 MiB on GPU 0 (BRIEF.md section 12). A
  process that sees one GPU cannot touch another, whatever its threads do.
- Children inherit the environment: the engine a confined worker starts sees the same single GPU
  as cuda:0.
"""
from __future__ import annotations

import ctypes
import os
from typing import NamedTuple, Optional

VAR = "CUDA_VISIBLE_DEVICES"
CUDA_ERROR_NOT_INITIALIZED = 3


class Confined(NamedTuple):
    """What confine() did: the GPU's entry as the host names it (CUDA_VISIBLE_DEVICES: an index
    or a UUID), the GPUs this process saw before (-1: unknown), and why nothing was done (or "")."""
    entry: Optional[str]
    host_gpus: int
    why_not: str = ""


def visible_ids(visible: Optional[str]) -> Optional[list]:
    """CUDA_VISIBLE_DEVICES's entries (indices or UUIDs), or None where it is not set."""
    return None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]


def host_entry(gpu_id: int, visible: Optional[str], count: int) -> Optional[str]:
    """The CUDA_VISIBLE_DEVICES entry of TorchServe's `gpu_id`, read as device.py's
    _logical_index reads it: the gpu_id-th visible GPU, else the visible entry equal to it (a
    deviceIds naming host GPUs); with no CUDA_VISIBLE_DEVICES the id itself. None where it names
    no GPU here (count: the GPUs visible, -1 when unknown)."""
    ids = visible_ids(visible)
    if ids is None:
        return str(gpu_id) if count < 0 or 0 <= gpu_id < count else None
    if 0 <= gpu_id < len(ids):
        return ids[gpu_id]
    return str(gpu_id) if str(gpu_id) in ids else None


def driver_started() -> bool:
    """Whether CUDA's driver is initialised in this process (False where there is no driver)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    n = ctypes.c_int(0)
    return cuda.cuDeviceGetCount(ctypes.byref(n)) != CUDA_ERROR_NOT_INITIALIZED


def cuda_built() -> bool:
    import torch

    return torch.cuda._is_compiled()


def visible_gpus() -> int:
    """The GPUs this process may use, counted through NVML (which starts no CUDA driver and
    honours CUDA_VISIBLE_DEVICES); -1 where NVML cannot say."""
    import torch

    count = getattr(torch.cuda, "_device_count_nvml", None)
    if count is None:
        return -1
    try:
        return int(count())
    except Exception:  # noqa: BLE001  (no NVML library: unknown)
        return -1


def confine(gpu_id: Optional[int], environ=None) -> Confined:
    """Sets CUDA_VISIBLE_DEVICES to the one GPU TorchServe gave this worker (which is then cuda:0
    here); does nothing where no GPU was given, the gpu_id names no GPU here (the placement then
    refuses it, naming what the worker sees), or CUDA already started in this process."""
    environ = os.environ if environ is None else environ
    if gpu_id is None:
        return Confined(None, -1, "no GPU assigned")
    if not cuda_built():
        return Confined(None, 0, "a torch without CUDA")
    count = visible_gpus()
    if driver_started():
        return Confined(None, count, "CUDA had started in this process before the handler ran; it sees every GPU")
    entry = host_entry(int(gpu_id), environ.get(VAR), count)
    if entry is None:
        return Confined(None, count, f"gpu_id {gpu_id} names no GPU here")
    environ[VAR] = entry
    return Confined(entry, count)


def child_env(env: dict, kind: str, index: Optional[int]) -> tuple:
    """(environment, device index) for a child process that works on one device: on a GPU it sees
    that GPU alone (as cuda:0). In a confined worker that is the same single GPU."""
    if kind != "cuda" or index is None:
        return env, index
    ids = visible_ids(env.get(VAR))
    entry = str(index) if ids is None else (ids[index] if index < len(ids) else None)
    if entry is None:  # the parent's own placement would have failed first
        return env, index
    return {**env, VAR: entry}, 0
