"""One copy of the weights per device, through real TorchServe (issue 49; handlers/weights).

On the CPU the holder shares through named shared memory (`shared_weights: on`; the default,
auto, shares on GPU workers only), so this tests the lifecycle, not GPU memory: one holder per
model that every worker reads, a killed worker's replacement attaching to it, a killed holder
stopping its workers (TorchServe restarts them on a new one), right answers throughout, and no
holder left once the frontend is gone. The GPU figures: bench/bench_shared.py.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
from conftest import build_mar, close, eager, two, wait_back
from conftest import worker_pids as pids

pytestmark = pytest.mark.server

MODELS = {"sw_aoti": "two_aoti", "sw_export": "two_export"}
# a worker's load line in model_log.log: "W-PORT-MODEL_VERSION-stdout ... weights held by pid N (...)"
HELD = re.compile(r"W-\d+-(\w+?)_[\d.]+-stdout.*weights held by pid (\d+) \(\d+ tensors, \d+ MiB, "
                  r"(started by this worker|attached)\)")


def holders(ts) -> dict:
    """{pid: command line} of the weights holders this server's workers started (their socket
    lies under the server's TMPDIR)."""
    out = subprocess.run(["pgrep", "-af", "handlers.weights.holder"], capture_output=True, text=True).stdout
    tmp = str(ts.workdir / "tmp")
    return {int(line.split()[0]): line for line in out.splitlines() if tmp in line}


def holder_dirs(ts, pid: int) -> list:
    """The private directories (TMPDIR, with the unpacked library) of holder `pid`."""
    from handlers.weights.holder import PID_FILE

    return [p.parent for p in ts.workdir.rglob(f"cs-holder-*/{PID_FILE}") if p.read_text().strip() == str(pid)]


def held_lines(ts, model=None) -> list:
    """(holder pid, started|attached) of every load line so far (of `model`), in order."""
    return [(int(m.group(2)), m.group(3)) for m in HELD.finditer(ts.log()) if model in (None, m.group(1))]


def answers_right(ts, model, seed=0) -> None:
    f, m = two(3, seed=seed)
    for _ in range(4):  # more requests than workers: every worker answers some
        r = ts.predict(model, {"inputs": {"features": f.tolist(), "mask": m.tolist()}})
        assert r.status_code == 200, r.text
        close(r.json()["outputs"], eager("two_input", f, m))


@pytest.fixture(scope="module")
def shared_server(artifacts, serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("shared_store")
    mars = {name: build_mar(artifacts.get(art), name, store, "--workers", "2", "--batch-size", "4",
                            "--max-batch-delay", "5", "--handler-option", "shared_weights=on")
            for name, art in MODELS.items()}
    return serve(mars)


def test_every_worker_reads_one_holder_per_model_and_answers_right(shared_server):
    ts = shared_server
    lines = held_lines(ts)
    assert len(lines) == 4, ts.log()[-3000:]  # two workers of each model
    running = holders(ts)
    assert set(running) == {pid for pid, _ in lines}  # one holder per model, alive, the one they read
    assert len(running) == 2
    for pid in running:
        assert sorted(how for p, how in lines if p == pid) == ["attached", "started by this worker"]
    # each worker checked its held load against the artifact's own copy before serving
    assert ts.log().count("answers equal to the own copy's") == 4
    for model in MODELS:
        answers_right(ts, model)


def test_the_aoti_workers_map_the_library_their_holder_unpacked(shared_server):
    """An AOTInductor package's library (its weights embedded) is unpacked once, by the holder,
    and every worker loads that file instead of extracting a copy of its own (seconds per
    worker for a large model: docs/results/shared_weights_big_mlp_fp16_h200)."""
    ts = shared_server
    for pid in pids(ts, "sw_aoti"):
        with open(f"/proc/{pid}/maps") as f:
            libraries = {line.split()[-1] for line in f if line.rstrip().endswith(".so")
                         and "/data/aotinductor/" in line}
        assert len(libraries) == 1, libraries
        assert re.search(r"/cs-holder-[^/]+/library/", libraries.pop())


def test_a_killed_worker_comes_back_on_the_same_holder(shared_server):
    ts = shared_server
    before = pids(ts, "sw_aoti")
    holder_pids = set(holders(ts))
    os.kill(before[0], signal.SIGKILL)
    wait_back(ts, "sw_aoti", {before[0]})
    assert held_lines(ts, "sw_aoti")[-1] == (held_lines(ts, "sw_aoti")[0][0], "attached")
    assert set(holders(ts)) == holder_pids  # the holder did not restart
    answers_right(ts, "sw_aoti", seed=1)


def test_a_killed_holder_stops_its_workers_and_a_new_one_serves_them(shared_server):
    """No worker answers from memory whose owner is gone: the workers of a killed holder stop
    (503 meanwhile) and TorchServe restarts them on a new holder; the other model is untouched."""
    ts = shared_server
    old = set(holders(ts))
    workers, export_workers = pids(ts, "sw_aoti"), pids(ts, "sw_export")
    aoti_holder = held_lines(ts, "sw_aoti")[-1][0]
    assert aoti_holder in old
    (its_dir,) = holder_dirs(ts, aoti_holder)  # its unpacked library lies there
    os.kill(aoti_holder, signal.SIGKILL)
    wait_back(ts, "sw_aoti", set(workers))
    new = set(holders(ts)) - old
    assert len(new) == 1, holders(ts)
    assert not its_dir.exists() and len(holder_dirs(ts, next(iter(new)))) == 1  # swept by the new one's start
    assert {p for p, _ in held_lines(ts, "sw_aoti")[-2:]} == new  # both restarted workers read it
    assert pids(ts, "sw_export") == export_workers
    answers_right(ts, "sw_aoti", seed=2)
    answers_right(ts, "sw_export", seed=2)


def test_no_holder_outlives_the_frontend(shared_server):
    """The frontend's SIGTERM (what `torchserve --stop` sends) ends it and its workers; each
    holder sees its frontend gone and exits within a second. Last in this module: it stops the
    module's server."""
    ts = shared_server
    assert len(holders(ts)) == 2
    ts.stop()
    deadline = time.time() + 5
    while holders(ts) and time.time() < deadline:
        time.sleep(0.1)
    assert not holders(ts)
