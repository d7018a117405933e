"""A TorchServe worker whose frontend dies (kill -9, the OOM killer) must not outlive it with its
model's memory. The ordinary worker leaves its loop on the closed socket (through this
project's buffered frame reader); the async one needs handlers/torchserve/frontend_watch.py
(tested in tests/test_continuous.py, where a slot model is served that way)."""
import time

import psutil
import pytest
import requests
from conftest import build_mar

pytestmark = pytest.mark.server


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def workers_left_after_the_frontend_dies(ts, model: str, wait_s: float = 15) -> list:
    """Kills the server's Java frontend with SIGKILL; the pids of `model`'s workers still alive
    `wait_s` later (killed then, so that none outlives the test)."""
    r = requests.get(f"{ts.mgmt}/models/{model}", headers=ts.auth("management"), timeout=10)
    pids = [w["pid"] for w in r.json()[0]["workers"]]
    assert pids and all(alive(p) for p in pids), pids
    frontend = [p for p in psutil.Process(ts.proc.pid).children(recursive=True) if "java" in p.name()]
    assert len(frontend) == 1, frontend
    frontend[0].kill()
    deadline = time.time() + wait_s
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        psutil.Process(p).kill()
    return left


def test_a_worker_whose_frontend_is_killed_exits(artifacts, serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("frontend_death") / "store"
    store.mkdir()
    ts = serve({"two": build_mar(artifacts.get("two_export"), "two", store)})
    assert "buffered frame reader" in ts.log(), "the worker's load line names its frame reader"
    left = workers_left_after_the_frontend_dies(ts, "two")
    assert not left, f"workers {left} outlived their frontend by 15 s"
