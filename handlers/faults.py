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
import re

from handlers.errors import RequestError, ServingError

logger = logging.getLogger(__name__)
# Substrings of CUDA's error strings for errors that poison the context (cudaGetErrorString).
# "device-side assert triggered", not "device-side assert": torch ends every CUDA error's message
# with "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
STICKY = ("device-side assert triggered", "illegal memory access", "illegal address", "unspecified launch failure",
          "misaligned address", "an illegal instruction was encountered", "uncorrectable ECC",
          "CUDA error: unknown error")
# Substrings of the errors an index outside a table raises (torch's checks, fbgemm's
# embedding_bag, one_hot, an AOTInductor kernel's bounds check)
INDEX_ERRORS = ("index out of range", "out of bounds", "out of range:", "index_size", "not in the valid range",
                "Class values must be")
_NATIVE = re.compile(r"\s*\((?:Triggered internally at|Could this error message be improved)[^)]*\)?"
                     r"|\s*(?:Exception raised from .*|(?:at |in )?(?:/[^\s:()]+)+(?::\d+)?)")


class OutOfDeviceMemory(ServingError):
    status = 507
    error_type = "OutOfMemory"

    @classmethod
    def for_request(cls, e: BaseException) -> "OutOfDeviceMemory":
        """One request's answer where the model ran out of device memory on it: the device's own
        words and the fix (the same from a worker's call and from the engine's)."""
        return cls(f"out of device memory for this request ({plain_message(str(e))}); retry later or send fewer rows")


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
    dimension, raised by the model (IndexError; torch's and fbgemm's index checks; an
    AOTInductor kernel's "index out of bounds"). Only where the artifact takes integer inputs;
    any other failure is the server's. Value contracts (handlers/values.py) refuse such requests
    in admission where the graph gave a bound (unless handler.check_values is off); this catches
    the rest. The answer carries the error's own first line only: no native file paths or C++
    frames (TORCH_SHOW_CPP_STACKTRACES, AOTInductor kernels' sources)."""
    msg = str(e)
    ints = [s.name for s in spec.inputs if s.dtype.startswith(("int", "uint"))]
    if not ints or not (isinstance(e, IndexError) or any(m in msg for m in INDEX_ERRORS)):
        return None
    return RequestError(f"the model cannot index with this request's values ({type(e).__name__}: "
                        f"{plain_message(msg)}); check the values of {', '.join(ints)} against the model's tables")


def plain_message(msg: str, limit: int = 300) -> str:
    """The first line of an error message without native file paths, C++ frames or torch's
    "(Could this error message be improved? ...)" request."""
    first = (msg.strip().splitlines() or [""])[0]
    return _NATIVE.sub("", first).strip()[:limit]


def release_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
