"""Faults of the device while serving, and what each one means for the worker.

- CUDA out of memory (torch.OutOfMemoryError): the allocator is intact; the request that
  needed the memory gets 507 with the reason (the batch was already retried request by
  request, so it is the smallest unit that failed), the cache is released and the worker
  keeps serving.
- Sticky CUDA errors (a device-side assert, an illegal address, a launch failure): the CUDA
  context is unusable for the life of the process, every later call fails. The requests at
  hand get 500 with the reason, every later one 503, and the process exits shortly after
  answering so TorchServe starts a fresh worker (it restarts workers that die).
"""
from __future__ import annotations

import logging
import os
import threading

from handlers.errors import RequestError, ServingError

logger = logging.getLogger(__name__)
# Substrings of CUDA's error strings for errors that poison the context (cudaGetErrorString)
STICKY = ("device-side assert", "illegal memory access", "illegal address", "unspecified launch failure",
          "misaligned address", "an illegal instruction was encountered", "uncorrectable ECC",
          "CUDA error: unknown error")
EXIT_DELAY_S = 1.0  # the latest exit after a sticky fault (see exit_soon)
_exit_reason = None  # set once a sticky fault was seen: the process exits soon


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


def exit_soon(reason: str, delay_s: float = EXIT_DELAY_S) -> None:
    """Exit the process soon, without running Python cleanup that could touch the broken CUDA
    context (atexit-registered directories are removed first). With the buffered frame reader
    in TorchServe's loop, the exit comes as soon as the loop is back for its next message with
    none arrived (frontend_frames.retrieve_msg asks exit_if_idle): the answers of this batch have
    been sent and no batch is half-read, so the frontend loses no request. A daemon timer exits
    after delay_s in any case (without that reader, it is the only exit)."""
    global _exit_reason
    _exit_reason = reason
    logger.critical("worker exits when its answers are sent (at most %.1fs) so TorchServe restarts it: %s",
                    delay_s, reason)
    from handlers.torchserve import process

    process.record("exit", f"os._exit after a sticky device fault, once idle (at most {delay_s:.1f}s)")
    t = threading.Timer(delay_s, _exit_now)
    t.daemon = True
    t.start()


def exit_if_idle(conn) -> None:
    """Exits now if an exit is pending and nothing of a next message waits on `conn` (a socket
    the frontend writes to; checked without blocking)."""
    if _exit_reason is None:
        return
    import socket

    try:
        waiting = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        waiting = b""
    except OSError:
        waiting = b""  # the frontend is gone: nothing left to answer
    if not waiting:
        # at once: anything slower here (removing the scratch directory, which holds the
        # extracted artifact) would widen the window for a next batch to arrive; the reaper
        # process scratch.enter started removes that directory when this process is gone
        os._exit(70)


def _exit_now() -> None:
    from handlers.torchserve import scratch

    scratch.remove_now()
    os._exit(70)
