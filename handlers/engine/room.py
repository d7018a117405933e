"""Room on the engine's GPU: before anything is loaded, an engine checks that its GPU has the memory
it needs free (handler.worker_gpu_mb: one copy of the weights plus the CUDA context, graphs and
activations, as cs-archive sized it), and refuses to load with the numbers where it has not;
without the check a model too large for what is left runs out of memory part-way through its load.

Engines that load at once: TorchServe loads every model of its configuration together at its
start, and each model's first worker on a GPU starts that model's engine, so the engines of
several models read the GPU's free memory before any of them has allocated: each would pass, and
the last to allocate would run out part-way. Each engine therefore reserves its need in a ledger
of its GPU (a small JSON file under a lock, beside the engines' sockets in the private directory
this user's workers share, the engine's --verdict-root, keyed by the GPU's UUID, so engines that
see the GPU under other numbers agree) from
its check until its load is over, graphs captured, and counts the live reservations of the others
as taken. Where it does not fit beside them it waits for them to finish (their memory is then
real and their reservations gone); it refuses when none is loading and the GPU still lacks its
need after WAIT_S (another process may hold memory for a moment), or after MAX_WAIT_S in all. An
engine mid-load counts at its whole need though part of it is allocated already, so on a tight
GPU engines load one after another rather than run out of memory. Engines of another user, or
of another TMPDIR, keep another ledger: only free memory counts between them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from handlers import process
from handlers.engine.runner import is_engine
from handlers.errors import LoadError

logger = logging.getLogger(__name__)
WAIT_S = 20.0  # another process may hold memory for a moment (a load's trial copy, a capture)
# another engine that never finishes its load (it may take link.ENGINE_START_S) does not hold this one
# forever; a worker waits this much longer for an engine that says it waits (link._ready_line)
MAX_WAIT_S = 600.0
POLL_S = 0.5
LOCK_S = 60.0  # the ledger's lock is held for a read, CUDA's free memory and a write


class InsufficientGpuMemory(LoadError):
    """Less GPU memory free than the engine needs. It recurs (the same archive on the same GPU): the
    workers answer every request 503 with this message (handler.answer_load_failure)."""

    status = 503
    error_type = "InsufficientGpuMemory"
    recurs = True


@contextmanager
def reserved(need_mib: float, placement, ledger_dir: Optional[str], wait_s: float = WAIT_S,
             memory: Optional[Callable[[], tuple]] = None, gpu_uuid: Optional[str] = None,
             notice: Optional[Callable[[dict], None]] = None):
    """The GPU's room for `need_mib` MiB reserved for the block (the engine's load), released
    however it ends, the block given the seconds it waited for it; InsufficientGpuMemory where the
    GPU lacks it (the module's docstring: when). Nothing on the CPU or where `need_mib` is 0.
    `ledger_dir` None: other engines' reservations are not counted. `memory` (free, total) MiB and
    `gpu_uuid`: the device's own, read through CUDA where not given (tests give both). `notice` is
    told {"waiting_for_room": why} when the engine starts waiting for other engines' loads and
    {"room_after_s": seconds} when it then has room (handlers/engine/serve.py prints them for the
    worker, which waits for the engine that long more: handlers/engine/link.py)."""
    if need_mib <= 0 or placement.kind != "cuda":
        yield 0.0
        return
    memory = memory or (lambda: tuple(n / 2**20 for n in _cuda().mem_get_info(placement.index)))
    ledger = None
    if ledger_dir:
        ledger = Path(ledger_dir) / f"gpu-room-{gpu_uuid or _gpu_uuid(placement)}.json"
        with contextlib.suppress(OSError):  # link.paths made it for the socket; an unusable ledger is logged
            os.makedirs(ledger_dir, mode=0o700, exist_ok=True)
    waited = _reserve(need_mib, placement, ledger, wait_s, memory, notice or (lambda event: None))
    try:
        yield waited
    finally:
        with _entries(ledger) as entries:
            entries.pop(str(os.getpid()), None)


def _reserve(need_mib: float, placement, ledger, wait_s: float, memory: Callable[[], tuple], notice) -> float:
    """Reserves the room, waiting as the module's docstring says; returns the seconds it waited."""
    started, told = time.monotonic(), False
    while True:
        with _entries(ledger) as entries:
            # read under the lock: an engine that releases its reservation has allocated by then
            free, total = memory()  # cudaMemGetInfo: every process on the device counted
            others = sum(mib for pid, (mib, _) in entries.items() if pid != str(os.getpid()))
            if free - others >= need_mib:
                entries[str(os.getpid())] = (need_mib, _start_time(os.getpid()))
                break
        waited = time.monotonic() - started
        if waited >= MAX_WAIT_S or (waited >= wait_s and not others):
            raise InsufficientGpuMemory(_shortfall(need_mib, free, total, placement, waited, others))
        if others and not told:
            told = True
            notice({"waiting_for_room": f"{placement.where}: {free:.0f} MiB free, {others:.0f} MiB of it reserved by "
                                        f"other engines still loading, {need_mib:.0f} MiB needed"})
        time.sleep(POLL_S)
    waited = time.monotonic() - started
    if told:
        notice({"room_after_s": round(waited, 1)})
    logger.info("GPU memory: this engine needs %.0f MiB (handler.worker_gpu_mb); %s has %.0f MiB free of %.0f MiB, "
                "%.0f MiB of it reserved by other engines still loading; waited %.1f s", need_mib, placement.where,
                free, total, others, waited)
    return waited


@contextmanager
def _entries(ledger):
    """The ledger's live reservations {pid: (MiB, the process's start time)} under its lock, written
    back after the block; those of engines that are gone (killed mid-load) dropped. No ledger, or
    none usable (its lock kept past LOCK_S by a process stuck holding it): {}."""
    try:
        lock = open(ledger.with_suffix(".lock"), "a") if ledger is not None else None
    except OSError as e:  # the ledger refines the check: without it free memory alone counts
        logger.warning("GPU memory ledger %s not usable (%s): other engines' reservations not counted", ledger, e)
        lock = None
    if lock is not None and not process.lock_within(lock.fileno(), LOCK_S):  # released when the file is closed
        logger.warning("GPU memory ledger %s kept locked over %.0f s: other engines' reservations not counted",
                       ledger, LOCK_S)
        lock.close()
        lock = None
    if lock is None:
        yield {}
        return
    with lock:
        try:
            entries = {pid: (float(mib), start) for pid, (mib, start) in json.loads(ledger.read_text()).items()
                       if _loading(int(pid), start)}
        except (OSError, ValueError, TypeError, AttributeError):  # none yet, or not ours: start afresh
            entries = {}
        yield entries
        tmp = ledger.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(entries))
            os.replace(tmp, ledger)
        except OSError as e:
            logger.warning("GPU memory ledger %s not written (%s)", ledger, e)


def _loading(pid: int, start) -> bool:
    """Whether the engine that reserved under `pid` may still be loading: that pid is alive, still
    an engine, and the same process (its start time; an engine killed mid-load leaves its entry,
    and a later process, an engine too, may take its number)."""
    return pid == os.getpid() or (process.alive(pid) and is_engine(pid) and _start_time(pid) == start)


def _start_time(pid: int):
    """The process's start time in clock ticks after boot (/proc/PID/stat field 22; the fields
    after the command's closing parenthesis, which may itself hold spaces), None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _shortfall(need_mib: float, free: float, total: float, placement, waited: float, others: float) -> str:
    """The refusal: what the engine needs, what the GPU has free of its total, and the fixes."""
    loading = f", {others:.0f} MiB of it reserved by other engines still loading" if others else ""
    return (f"not enough GPU memory to load: this model's engine needs {need_mib:.0f} MiB (handler.worker_gpu_mb: "
            f"its copy of the weights plus CUDA context, graphs and activations, as cs-archive sized it) but "
            f"{placement.where} has {free:.0f} MiB free of {total:.0f} MiB{loading} (after {waited:.0f}s). Fix: stop "
            "the other processes on that GPU (nvidia-smi lists them) or serve fewer models on it, or a GPU with more "
            "memory (re-archive with its --gpu-memory-gib)")


def _gpu_uuid(placement) -> str:
    """The GPU's UUID (nvidia-smi's), the same in every process whatever CUDA_VISIBLE_DEVICES
    numbers it; where torch does not tell it, the GPU as the host names it."""
    try:
        return str(_cuda().get_device_properties(placement.index).uuid)
    except (AttributeError, RuntimeError):
        return f"host-{placement.gpu if placement.gpu is not None else placement.index}"


def _cuda():
    import torch

    return torch.cuda
