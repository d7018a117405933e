"""The worker's CPU thread budget (handlers/torchserve/threads.py): the decision table, the override, and
that the crash-safe probe's child process starts with the same budget."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from handlers.config import parse_config
from handlers.errors import ConfigError
from handlers.torchserve import threads

ROOT = Path(__file__).resolve().parents[1]


# (device kind, cpu_threads option, workers in model-config.yaml, usable cores) -> intra-op threads
CASES = [
    ("cuda", 0, 3, 32, 1),      # GPU worker: one thread, whatever the host
    ("cuda", 0, None, 2, 1),
    ("cuda", 4, 3, 32, 4),      # the option wins
    ("cpu", 0, 4, 17, 4),       # CPU workers share the cores, one left to the frontend
    ("cpu", 0, 3, 16, 5),       # rounded down
    ("cpu", 0, 32, 16, 1),      # never below one
    ("cpu", 0, 1, 2, 1),        # 2 cores: one for the worker, one for the frontend
    ("cpu", 0, 1, 1, 1),
    ("cpu", 0, None, 16, 15),   # worker count unknown: assume alone
    ("cpu", 2, 4, 16, 2),
]


@pytest.mark.parametrize("kind,configured,workers,cores,expected", CASES)
def test_decision_table(kind, configured, workers, cores, expected):
    b = threads.decide(kind, configured, workers, cores)
    assert b.intra_op == expected
    assert b.inter_op == 1
    assert b.reason


def test_workers_from_model_config():
    """The model's worker count is read once, with the settings (handlers/config.py)."""
    assert parse_config({"minWorkers": 2, "maxWorkers": 6}).workers == 6
    assert parse_config({"minWorkers": 3}).workers == 3
    assert parse_config({}).workers is None
    assert parse_config(None).workers is None
    with pytest.raises(ConfigError, match="maxWorkers = True is invalid: expected an integer of at least 1"):
        parse_config({"maxWorkers": True})
    assert parse_config({"deviceIds": [1, 3]}).device_ids == (1, 3)


def test_cpu_threads_option_validated():
    assert parse_config({"handler": {"cpu_threads": 3}}).cpu_threads == 3
    assert parse_config({}).cpu_threads == 0
    with pytest.raises(ConfigError, match="cpu_threads = -1 is invalid: expected an integer of at least 0"):
        parse_config({"handler": {"cpu_threads": -1}})
    with pytest.raises(ConfigError, match="cpu_threads.*expected an integer"):
        parse_config({"handler": {"cpu_threads": 1.5}})


@pytest.mark.server
def test_apply_sets_torch_pools_in_a_fresh_process():
    code = ("import torch; from handlers.torchserve import threads;"
            "b = threads.apply(threads.ThreadBudget(3, 1, 'test'));"
            "print(torch.get_num_threads(), torch.get_num_interop_threads(), b.intra_op, b.inter_op)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.split() == ["3", "1", "3", "1"]


@pytest.mark.server
def test_probe_child_inherits_the_budget():
    """crash_safe_probe starts its child with ThreadBudget.child_env: torch there must come up
    with the parent's intra-op count, also for OpenMP-backed native kernels."""
    import os

    env = threads.ThreadBudget(2, 1, "test").child_env(os.environ)
    code = ("import os, torch; import handlers.artifact.probe;"
            "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, cwd=ROOT)
    assert out.stdout.split() == ["2", "2"]



def test_cuda_sync_option_validated():
    assert parse_config({}).cuda_sync == "auto"
    assert parse_config({"handler": {"cuda_sync": "block"}}).cuda_sync == "block"
    with pytest.raises(ConfigError, match=r"cuda_sync = 'yield' is invalid: expected auto"):
        parse_config({"handler": {"cuda_sync": "yield"}})


@pytest.mark.parametrize("configured,mode", [("auto", "spin"), ("spin", "spin"), ("block", "block"),
                                             ("hybrid", "hybrid")])
def test_cuda_wait_auto_spins_the_engine_alone_on_its_gpu(configured, mode):
    from handlers.run.cuda import cuda_wait

    assert cuda_wait(configured) == mode
