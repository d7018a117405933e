"""Room on the worker's GPU: before anything is loaded, a CUDA worker checks that its GPU has the
memory this worker needs free (handler.worker_gpu_mb: its copy of the weights plus context, graph
pools and activations, as cs-archive sized the worker count), and refuses to load with the
numbers where it has not. Without the check the last workers of a model too large for its GPU run
out of memory part-way through loading and TorchServe restarts them in a loop.

The check compares this worker's own need with what is free now, never the model's total: sibling
workers load at the same time, so free memory shrinks while they do, and each of them has already
taken its own share. A sibling's crash-safe trial load holds a second CUDA context for a few seconds
(handlers/artifact/probe.py), so a shortfall is read again for up to WAIT_S before it is final.

Workers that start together: TorchServe starts a model's workers at once, so each would read
free memory before any sibling has loaded. Each worker therefore reserves its need in a ledger of
its GPU (a small JSON file, under a lock, in the workers' private shared directory,
handlers/torchserve/scratch.py) from its check until its start is over, and counts its live
siblings' reservations as taken. Where this worker does not fit beside them it waits for them
to finish (their memory is then real and their reservations gone); it refuses only when no
sibling is loading and the GPU still lacks its need after WAIT_S, or after MAX_WAIT_S in all.
A sibling mid-load is counted at its whole need although part of it is already allocated, so on
a tight GPU workers load one after another rather than run out of memory.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

from handlers import process
from handlers.artifact.device import gpu_identity
from handlers.errors import LoadError

logger = logging.getLogger(__name__)

WAIT_S = 20.0
MAX_WAIT_S = 600.0  # a sibling that never finishes its start does not hold this worker forever
POLL_S = 0.5


class InsufficientGpuMemory(LoadError):
    """Less GPU memory free than one worker needs. It recurs (the same archive on the same GPU), so
    the worker answers every request 503 with this message (handler.answer_load_failure)."""

    status = 503
    error_type = "InsufficientGpuMemory"
    recurs = True


def check(need_mb: float, placement, workers: int | None, wait_s: float = WAIT_S, ledger_dir=None):
    """Reserves `need_mb` MiB on `placement`'s GPU (a CUDA Placement) and returns the function that
    releases it (call it when the worker's start is over, loaded or not). Raises
    InsufficientGpuMemory where the GPU lacks it (module docstring: when). Nothing on a CPU worker
    or where `need_mb` is 0; without `ledger_dir`, siblings' reservations are not counted."""
    if need_mb <= 0 or placement.kind != "cuda":
        return _nothing
    import torch

    ledger = Path(ledger_dir) / f"gpu-room-{gpu_identity(placement)}.json" if ledger_dir else None
    started = time.monotonic()
    while True:
        # cudaMemGetInfo: free and total bytes of the device, all processes counted
        free, total = (n / 2**20 for n in torch.cuda.mem_get_info(placement.index))
        with _entries(ledger) as entries:
            siblings = sum(mib for pid, mib in entries.items() if pid != str(os.getpid()))
            if free - siblings >= need_mb:
                entries[str(os.getpid())] = need_mb
                break
        waited = time.monotonic() - started
        if waited >= MAX_WAIT_S or (waited >= wait_s and not siblings):
            raise InsufficientGpuMemory(shortfall_message(need_mb, (free, total), placement, workers, waited))
        time.sleep(POLL_S)
    logger.info("GPU memory: this worker needs %.0f MiB (handler.worker_gpu_mb); %s has %.0f MiB free of %.0f MiB, "
                "%.0f MiB of it reserved by sibling workers still starting", need_mb, placement, free, total, siblings)
    return lambda: _release(ledger)


@contextmanager
def reserved(need_mb: float, placement, workers: int | None, ledger_dir=None):
    """check()'s reservation held for the block (a worker's start), released however it ends."""
    release = check(need_mb, placement, workers, ledger_dir=ledger_dir)
    try:
        yield
    finally:
        release()


def _nothing() -> None:
    return None


def _release(ledger) -> None:
    with _entries(ledger) as entries:
        entries.pop(str(os.getpid()), None)


@contextmanager
def _entries(ledger):
    """The ledger's live reservations {pid: MiB} under its lock, written back after the block;
    reservations of processes that are gone (killed mid-start) are dropped. No ledger: {}."""
    try:
        lock = open(ledger.with_suffix(".lock"), "a") if ledger is not None else None
    except OSError as e:  # the ledger is a refinement: without it the check counts free memory only
        logger.warning("GPU memory ledger %s not usable (%s): siblings' reservations not counted", ledger, e)
        lock = None
    if lock is None:
        yield {}
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        try:
            entries = json.loads(ledger.read_text())
            entries = {pid: mib for pid, mib in entries.items() if process.alive(int(pid))}
        except (OSError, ValueError, TypeError, AttributeError):  # none yet, or not ours: start afresh
            entries = {}
        yield entries
        tmp = ledger.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(entries))
            os.replace(tmp, ledger)
        except OSError as e:
            logger.warning("GPU memory ledger %s not written (%s)", ledger, e)


def shortfall_message(need_mb, free_total_mb: tuple, placement, workers, wait_s) -> str:
    """The refusal: what the worker needs, what the GPU has free of its total, and the fixes."""
    free_mb, total_mb = free_total_mb
    fit = int(total_mb // need_mb)
    many = (f"the model is configured for {workers} worker(s), {workers} x {need_mb:.0f} = {workers * need_mb:.0f} MiB "
            "if they share this GPU" if workers else "the worker count is not in model-config.yaml")
    return (f"not enough GPU memory to load: this worker needs {need_mb:.0f} MiB (handler.worker_gpu_mb: its copy "
            f"of the weights plus CUDA context, graph pools and activations, as cs-archive sized it) but "
            f"{placement} has {free_mb:.0f} MiB free of {total_mb:.0f} MiB (after waiting {wait_s:.0f}s for other "
            f"workers' loads); {many}. Fix: fewer workers (at most {fit} fit in {total_mb:.0f} MiB with nothing else "
            "on the GPU: re-archive with --workers N, or the management API's PUT /models/NAME?min_worker=N), a GPU "
            "with more memory (re-archive with its --gpu-memory-gib), or stop the other processes on the GPU "
            "(nvidia-smi lists them)")
