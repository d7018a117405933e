"""CPU thread budget of one worker, decided once at load.

torch starts one intra-op thread per core in every process. TorchServe runs several worker
processes per model beside its Java frontend, so by default each worker spins up as many
threads as the host has cores and every small CPU op of a request (tensor views, the copy into
pinned staging, output slicing) waits on a barrier across all of them while the other workers'
threads compete for the same cores. A worker running the model on the CPU gets an equal share
of the cores its process may run on (the affinity mask, which containers and `taskset` narrow) less one left to TorchServe's
frontend, split between this model's workers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from handlers import process

# Environment variables that size the OpenMP / MKL pools of native code in the worker
# (AOTInductor CPU kernels use OpenMP) and of the crash-safe probe child.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class ThreadBudget:
    intra_op: int
    inter_op: int
    reason: str

    def describe(self) -> str:
        return f"{self.intra_op} intra-op / {self.inter_op} inter-op thread(s) ({self.reason})"

    def child_env(self, env: dict) -> dict:
        """`env` plus the variables that make a child process (the crash-safe probe) use the
        same budget from its first torch import."""
        out = dict(env)
        for key in THREAD_ENV:
            out[key] = str(self.intra_op)
        out["TS_HANDLER_CPU_THREADS"] = str(self.intra_op)
        return out


def usable_cores() -> int:
    """Cores this process may run on: the affinity mask where the OS has one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def decide(device_kind: str, configured: int, workers: Optional[int], cores: int,
           gpu_threads: int = 1) -> ThreadBudget:
    """configured > 0 wins (model-config.yaml handler.cpu_threads). Otherwise a CUDA worker
    takes `gpu_threads` and a CPU worker (cores - 1) // workers (at least 1); `workers` is this
    model's worker count on the host when model-config.yaml states it, else unknown (None),
    in which case a CPU worker assumes it is alone."""
    if configured > 0:
        return ThreadBudget(configured, 1, "handler.cpu_threads")
    if device_kind == "cuda":
        return ThreadBudget(min(gpu_threads, cores), 1, "CUDA worker: the GPU does the heavy work")
    # One core stays with TorchServe's frontend and the request path outside torch's pool.
    share = max(1, (cores - 1) // max(1, workers or 1))
    who = f"{workers} worker(s)" if workers else "worker count not in model-config.yaml, assumed 1"
    return ThreadBudget(share, 1, f"CPU worker: ({cores} usable core(s) - 1 for the frontend) / {who}")


def apply(budget: ThreadBudget) -> ThreadBudget:
    """Sets torch's pools. The inter-op pool can be sized only before its first use; a worker
    that already used it keeps its size (reported in the returned budget)."""
    torch.set_num_threads(budget.intra_op)
    try:
        torch.set_num_interop_threads(budget.inter_op)
        inter = budget.inter_op
    except RuntimeError:  # "cannot set number of interop threads after parallel work has started"
        inter = torch.get_num_interop_threads()
    process.record("torch thread pools", f"intra-op {torch.get_num_threads()}, inter-op {inter}")
    return ThreadBudget(torch.get_num_threads(), inter, budget.reason)
