"""Room on the worker's GPU: before anything is loaded, a CUDA worker checks that its GPU has the
memory this worker needs free (handler.worker_gpu_mb: its copy of the weights plus context, graph
pools and activations, as cs-archive sized the worker count), and refuses to load with the
numbers where it has not. Without the check the last workers of a model too large for its GPU run
out of memory part-way through loading and TorchServe restarts them in a loop.

The check compares this worker's own need with what is free now, never the model's total: sibling
workers load at the same time, so free memory shrinks while they do, and each of them has already
taken its own share. A sibling's crash-safe trial load holds a second CUDA context for a few seconds
(handlers/artifact/probe.py), so a shortfall is read again for up to WAIT_S before it is final.

What it does not do: TorchServe starts a model's workers at once, so their checks run before any
of them has loaded, and all pass. Keeping their sum within the GPU is the archive's count
(compiled_serving/worker_sizing.py); the check catches the rest (a GPU shared with other models or
processes, a count chosen by hand): a worker that lost that race fails its load out of memory once,
and on TorchServe's restart sees its siblings' memory and refuses here, instead of every restart
running out of memory again.
"""
from __future__ import annotations

import logging
import time

from handlers.errors import LoadError

logger = logging.getLogger(__name__)

WAIT_S = 20.0
POLL_S = 0.5


class InsufficientGpuMemory(LoadError):
    """Less GPU memory free than one worker needs. It recurs (the same archive on the same GPU), so
    the worker answers every request 503 with this message (handler.answer_load_failure)."""

    status = 503
    error_type = "InsufficientGpuMemory"
    recurs = True


def check(need_mb: float, placement, workers: int | None, wait_s: float = WAIT_S) -> None:
    """Raises InsufficientGpuMemory where `placement` (a CUDA Placement) has less than `need_mb` MiB
    free after up to `wait_s` seconds; nothing on a CPU worker or where `need_mb` is 0 (no check)."""
    if need_mb <= 0 or placement.kind != "cuda":
        return
    import torch

    deadline = time.monotonic() + wait_s
    while True:
        # cudaMemGetInfo: free and total bytes of the device, all processes counted
        free, total = (n / 2**20 for n in torch.cuda.mem_get_info(placement.index))
        if free >= need_mb or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if free < need_mb:
        raise InsufficientGpuMemory(shortfall_message(need_mb, free, total, placement, workers, wait_s))
    logger.info("GPU memory: this worker needs %.0f MiB (handler.worker_gpu_mb); %s has %.0f MiB free of %.0f MiB",
                need_mb, placement, free, total)


def shortfall_message(need_mb, free_mb, total_mb, placement, workers, wait_s) -> str:
    fit = int(total_mb // need_mb)
    many = (f"the model is configured for {workers} worker(s), {workers} x {need_mb:.0f} = {workers * need_mb:.0f} MiB "
            "if they share this GPU" if workers else "the worker count is not in model-config.yaml")
    return (f"not enough GPU memory to load: this worker needs {need_mb:.0f} MiB (handler.worker_gpu_mb: its copy "
            f"of the weights plus CUDA context, graph pools and activations, as cs-archive sized it) but "
            f"{placement} has {free_mb:.0f} MiB free of {total_mb:.0f} MiB (after waiting {wait_s:g}s for other "
            f"workers' loads); {many}. Fix: fewer workers (at most {fit} fit in {total_mb:.0f} MiB with nothing else "
            "on the GPU: re-archive with --workers N, or the management API's PUT /models/NAME?min_worker=N), a GPU "
            "with more memory (re-archive with its --gpu-memory-gib), or stop the other processes on the GPU "
            "(nvidia-smi lists them)")
