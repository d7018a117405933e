"""The engine behind real TorchServe (issue 64 step 2; handlers/engine, handler.engine: on).

On the CPU the engine runs the CPU runner, so this tests the path and the lifecycle, not GPU
figures (bench/bench_e2e.py --handler-option engine=on on the GPU machine): every worker of a
model served by one engine process that runs their requests together, answers equal to the
model's, a killed worker's replacement on the same engine, a killed engine's in-flight
requests answered (503 or result, none hanging) and a successor serving, a hung (stopped)
engine answered 504, killed and replaced, no engine once the frontend is gone.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import time

import pytest
from conftest import build_mar, close, eager, two, wait_back
from conftest import worker_pids as pids

pytestmark = pytest.mark.server

MODELS = {"en_aoti": "two_aoti", "en_export": "two_export", "en_hang": "two_aoti"}
HANG_TIMEOUT_S = 3  # en_hang's handler.engine_timeout_s
# a worker's load line in model_log.log: "W-PORT-MODEL_VERSION-stdout ... served by the engine: engine pid N: ..."
SERVED = re.compile(r"W-\d+-(\w+?)_[\d.]+-stdout.*served by the engine: engine pid (\d+): ")


def engines(ts) -> dict:
    """{pid: command line} of the engines this server's workers started (their socket lies
    under the server's TMPDIR)."""
    out = subprocess.run(["pgrep", "-af", "handlers.engine.serve"], capture_output=True, text=True).stdout
    tmp = str(ts.workdir / "tmp")
    return {int(line.split()[0]): line for line in out.splitlines() if tmp in line}


def served_lines(ts, model=None) -> list:
    """The engine pid of every worker's load line so far (of `model`), in order."""
    return [int(m.group(2)) for m in SERVED.finditer(ts.log()) if model in (None, m.group(1))]


def answer(ts, model, seed):
    f, m = two(3, seed=seed)
    return ts.predict(model, {"inputs": {"features": f.tolist(), "mask": m.tolist()}}), eager("two_input", f, m)


def answers_right(ts, model, seed=0) -> None:
    for i in range(4):  # more requests than workers: every worker answers some
        r, want = answer(ts, model, seed + i)
        assert r.status_code == 200, r.text
        close(r.json()["outputs"], want)


@pytest.fixture(scope="module")
def engine_server(artifacts, serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("engine_store")
    mars = {name: build_mar(artifacts.get(art), name, store, "--workers", "2", "--batch-size", "4",
                            "--max-batch-delay", "5", "--handler-option", "engine=on",
                            *(("--handler-option", f"engine_timeout_s={HANG_TIMEOUT_S}") if name == "en_hang" else ()))
            for name, art in MODELS.items()}
    return serve(mars)


def test_every_worker_of_a_model_is_served_by_its_one_engine(engine_server):
    ts = engine_server
    running = engines(ts)
    assert len(running) == len(MODELS), running  # one per model
    for model in MODELS:
        lines = served_lines(ts, model)
        assert len(lines) == 2 and len(set(lines)) == 1 and lines[0] in running, ts.log()[-3000:]
        answers_right(ts, model)
        info = ts.describe(model)  # the management API's description names the engine (the pod reads it)
        assert info["ready"] and info["engine"]["pid"] == lines[0] and info["engine"]["connected"], info


def test_the_workers_hold_no_model(engine_server):
    """A worker served by the engine never loads the artifact: no AOTInductor library mapped in
    it (the engine maps the one copy)."""
    ts = engine_server
    engine_pid = served_lines(ts, "en_aoti")[0]
    for pid in pids(ts, "en_aoti") + [engine_pid]:
        with open(f"/proc/{pid}/maps") as f:
            libraries = {line.split()[-1] for line in f if line.rstrip().endswith(".so") and "aotinductor" in line}
        assert bool(libraries) == (pid == engine_pid), (pid, engine_pid, libraries)


def test_concurrent_clients_of_both_workers_get_their_own_rows(engine_server):
    ts = engine_server

    def one(seed):
        r, want = answer(ts, "en_export", seed)
        assert r.status_code == 200, r.text
        close(r.json()["outputs"], want)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(64)))


def test_a_killed_worker_comes_back_on_the_same_engine(engine_server):
    ts = engine_server
    before, running = pids(ts, "en_aoti"), set(engines(ts))
    os.kill(before[0], signal.SIGKILL)
    wait_back(ts, "en_aoti", {before[0]})
    assert served_lines(ts, "en_aoti")[-1] == served_lines(ts, "en_aoti")[0]
    assert set(engines(ts)) == running  # the engine did not restart
    answers_right(ts, "en_aoti", seed=10)


def test_a_killed_engine_answers_every_request_in_flight_and_a_successor_serves(engine_server):
    """kill -9 of the engine: requests in flight and sent meanwhile get a result or a retryable
    503, none hangs; a new engine is started by the workers (not restarted by TorchServe), and
    the other model's engine is untouched."""
    ts = engine_server
    old, other = served_lines(ts, "en_aoti")[-1], served_lines(ts, "en_export")[-1]
    workers = pids(ts, "en_aoti")
    statuses = []

    def load(seed):
        r, want = answer(ts, "en_aoti", seed)
        statuses.append(r.status_code)
        if r.status_code == 200:
            close(r.json()["outputs"], want)
        else:
            assert r.status_code == 503 and "engine" in r.text.lower(), r.text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(load, s) for s in range(8)]
        os.kill(old, signal.SIGKILL)
        futures += [pool.submit(load, s) for s in range(8, 24)]
        for f in futures:
            f.result(timeout=60)
    deadline = time.time() + 60
    while True:  # every worker reaches the successor (until then a worker still answers 503 retry)
        try:
            answers_right(ts, "en_aoti", seed=20)
            break
        except AssertionError as e:
            if time.time() > deadline or "EngineDead" not in str(e):
                raise
            time.sleep(0.5)
    now = set(engines(ts))
    assert old not in now and other in now and len(now) == len(MODELS), (old, other, now)
    assert pids(ts, "en_aoti") == workers  # the workers stayed; they reconnected
    assert 503 in statuses or 200 in statuses
    deadline = time.time() + 30  # the description asks one worker; each reconnects on its own thread
    while not (info := ts.describe("en_aoti")).get("ready") and time.time() < deadline:
        time.sleep(0.5)
    assert info["ready"] and info["engine"]["connected"] and info["engine"]["pid"] in now - {old}, info


def test_a_hung_engine_is_answered_504_then_killed_and_a_successor_serves(engine_server):
    """SIGSTOP of the engine (alive, its socket open, nothing answered): a request waiting on it
    is answered 504 after handler.engine_timeout_s, the worker that saw it kills the engine (a
    State unanswered for 5 s more: at least 5 s, else as long as a request waits), and a successor serves; nothing hangs."""
    ts = engine_server
    old = served_lines(ts, "en_hang")[-1]
    os.kill(old, signal.SIGSTOP)
    try:
        t0 = time.time()
        r, _ = answer(ts, "en_hang", 1)
        assert r.status_code == 504 and "engine" in r.text.lower(), r.text
        assert HANG_TIMEOUT_S <= time.time() - t0 < HANG_TIMEOUT_S + 10
        deadline = time.time() + 60
        while time.time() < deadline and old in engines(ts):
            time.sleep(0.5)
        assert old not in engines(ts), "the hung engine was not killed"
        while time.time() < deadline:
            r, _ = answer(ts, "en_hang", 2)
            if r.status_code == 200:
                break
            assert r.status_code in (503, 504), r.text
            time.sleep(0.5)
        answers_right(ts, "en_hang", seed=30)
    finally:
        try:
            os.kill(old, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_no_engine_outlives_the_frontend(engine_server):
    """Last in this module: it stops the module's server."""
    ts = engine_server
    assert len(engines(ts)) == len(MODELS)
    ts.stop()
    deadline = time.time() + 5
    while engines(ts) and time.time() < deadline:
        time.sleep(0.1)
    assert not engines(ts)
