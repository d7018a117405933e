"""Faults of the device while serving, and what each one means for the worker.

- CUDA out of memory (torch.OutOfMemoryError): the allocator is intact; the request that
  needed the memory gets 507 with the reason (the batch was already retried request by
  request, so it is the smallest unit that failed), the cache is released and the worker
  keeps serving.
- Sticky CUDA errors (a device-side assert, an illegal address, a launch failure): the CUDA
  context is unusable for the life of the process, every later call fails. The requests at
  hand get 500 with the reason, every later one 503, and the process exits shortly after
  answering so TorchServe starts a fresh worker (it restarts workers that die): the exit itself
  is handlers/torchserve/restart.py's.
"""
from __future__ import annotations

import logging

from handlers.errors import RequestError, ServingError

logger = logging.getLogger(__name__)
# Substrings of CUDA's error strings for errors that poison the context (cudaGetErrorString)
STICKY = ("device-side assert", "illegal memory access", "illegal address", "unspecified launch failure",
          "misaligned address", "an illegal instruction was encountered", "uncorrectable ECC",
          "CUDA error: unknown error")


class OutOfDeviceMemory(ServingError):
    status = 507
    error_type = "OutOfMemory"


class WorkerRestarting(ServingError):
    status = 503
    error_type = "WorkerRestarting"


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "CUDA out of memory" in str(e)


def is_sticky(e: BaseException) -> bool:
    msg = str(e)
    return any(s in msg for s in STICKY)


def client_fault(e: BaseException, spec) -> "RequestError | None":
    """A failure of one request's own run that its values caused: an index past a table or
    dimension, raised by an exported program's Python-level run (IndexError, torch's "index out
    of range"). Only where the artifact takes integer inputs; any other failure is the server's.
    Value contracts (handlers/values.py) refuse such requests in admission where the graph gave a
    bound; this catches the rest, which the load line lists as unchecked."""
    msg = str(e)
    ints = [s.name for s in spec.inputs if s.dtype.startswith(("int", "uint"))]
    if not ints or not (isinstance(e, IndexError) or "index out of range" in msg or "out of bounds" in msg):
        return None
    return RequestError(f"the model cannot index with this request's values ({type(e).__name__}: "
                        f"{msg[:300]}); check the values of {', '.join(ints)} against the model's tables")


def release_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
