"""bench/worker_spy.py: py-spy's raw stacks summed into a worker's time per request by stage."""
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import skip_or_fail_in_ci

from bench import worker_spy

LOOP = "<module> (ts/model_service_worker.py:301);TorchModelServiceWorker.handle_connection (ts/model_service_worker.py:{})"
PREDICT = LOOP.format(185) + ";Service.predict (ts/service.py:{})"
HANDLE = PREDICT.format(135) + ";CompiledModelHandler.handle (ts_entry.py:67);serve (/x/main/handlers/pipeline.py:96)"


@pytest.mark.server
def test_stages_follow_the_priority_list():
    lines = [
        f"{LOOP.format(179)};retrieve_msg (/x/main/handlers/torchserve/frontend_frames.py:167) 30",
        f"{HANDLE};_run (/x/main/handlers/pipeline.py:122);admit_all (/x/main/handlers/pipeline.py:143) 20",
        f"{HANDLE};_run (/x/main/handlers/pipeline.py:128);infer (/x/main/handlers/pipeline.py:175);"
        "Event.query (/usr/lib/python3/site-packages/torch/cuda/streams.py:200) 40",
        # the logging that TorchServe's metrics call does is the metrics'
        f"{PREDICT.format(178)};MetricCacheAbstract.add_time (ts/metrics/metric_cache_abstract.py:167);"
        "Logger.info (logging/__init__.py:1489) 6",
        # logging inside the handler is logging
        f"{HANDLE};_run (/x/main/handlers/pipeline.py:122);admit_all (/x/main/handlers/pipeline.py:160);"
        "Logger.info (logging/__init__.py:1489) 2",
        f"{LOOP.format(187)} 4",
        "<module> (ts/model_service_worker.py:290) 1",
        "not a raw line",
    ]
    out = worker_spy.summarize(lines, rate=100, requests=10)
    # 100 samples per second over 10 requests: one sample is 1000 us per request
    assert out["samples"] == 103 and out["us_per_request"] == 103000.0
    assert out["stages"] == {"handler: run": 40000.0, "read request frames": 30000.0,
                             "handler: admission": 20000.0, "TorchServe metrics": 6000.0,
                             "worker loop (send, other)": 4000.0, "logging": 2000.0,
                             "outside the worker loop": 1000.0}
    own = dict(out["top_own"])
    assert own["Event.query (torch/cuda/streams.py)"] == 40000.0  # line numbers merged, path cut
    assert dict(out["top_inclusive"])["serve (handlers/pipeline.py)"] == 62000.0


def test_frame_names_drop_line_numbers_and_install_prefixes():
    assert worker_spy.frame_name("f (/a/lib/python3.11/site-packages/ts/service.py:12)") == "f (ts/service.py)"
    assert worker_spy.frame_name("info (/usr/lib/python3.12/logging/__init__.py:9)") == "info (logging/__init__.py)"
    # an archive's copy of the handler package, extracted by TorchServe
    assert worker_spy.frame_name("serve (/tmp/models/ab12/handlers/pipeline.py:96)") == "serve (handlers/pipeline.py)"
    assert worker_spy.frame_name("<module> (<string>:1)") == "<module> (<string>)"
    assert worker_spy.frame_name("odd") == "odd"


@pytest.mark.server
def test_only_one_servers_workers_are_found():
    """Workers are found by their command line, and with a root only below that process: a
    second server's workers on the same host are left out."""
    import os

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "model_service_worker"])
    try:
        # Popen returns once the child is forked; its command line is the new program's only
        # after exec, so wait for that (a loaded host can take a while) before looking for it
        deadline = time.monotonic() + 10
        while b"model_service_worker" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the child never exec'd"
            time.sleep(0.01)
        assert proc.pid in worker_spy.worker_pids()
        assert proc.pid in worker_spy.worker_pids(root=os.getpid())  # our child
        assert proc.pid not in worker_spy.worker_pids(root=proc.pid + 10**6)  # nobody's
    finally:
        proc.kill()
        proc.wait()


def test_no_requests_gives_zero_not_a_division_error():
    assert worker_spy.summarize(["a (f.py:1) 5"], rate=100, requests=0)["us_per_request"] == 0.0


@pytest.mark.server
def test_samples_a_real_process(monkeypatch):
    """py-spy on a Python process that spends its time in a function named like the handler's
    admission: the samples land in that stage and add up to about the time sampled."""
    try:
        exe = worker_spy.executable()
    except SystemExit:
        skip_or_fail_in_ci("py-spy is not installed (pyproject.toml's test dependencies name it)")
    code = textwrap.dedent("""
        import time
        def admit_all():
            end = time.perf_counter() + 0.05
            while time.perf_counter() < end:
                pass
        def handle_connection():
            while True:
                admit_all()
        handle_connection()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code, "model_service_worker"])
    try:
        monkeypatch.setattr(worker_spy, "worker_pids", lambda root=None: [proc.pid])
        spies = worker_spy.Spies(2, rate=100, exe=exe)
        out = spies.finish(req_s=10.0)  # 20 "requests" in the 2 s window
    finally:
        proc.kill()
        proc.wait()
    if out.get("failures"):
        pytest.skip(f"py-spy cannot sample here: {out['failures'][0]}")
    assert out["processes"] == 1 and out["samples"] > 100
    assert max(out["stages"], key=out["stages"].get) == "handler: admission"
    # a busy process sampled for 2 s: about 100 ms of it per "request"
    assert 50_000 < out["us_per_request"] < 110_000
    assert not spies.dir.exists()  # the samples' directory is gone with them


def test_a_sampler_that_cannot_attach_is_reported_and_nothing_is_left(monkeypatch, tmp_path):
    """A py-spy that fails (here: a stand-in that exits 1 at once, as on a refused attach) is
    named in `failures`, and its directory is removed."""
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Permission Denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(worker_spy, "worker_pids", lambda root=None: [12345])
    spies = worker_spy.Spies(1, rate=100, exe=str(fake))
    out = spies.finish(req_s=10.0)
    assert out["processes"] == 1 and out["samples"] == 0
    assert "Permission Denied" in out["failures"][0] and not spies.dir.exists()
