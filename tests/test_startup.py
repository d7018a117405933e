"""A worker's start in process: precision, warm-up through the request path, the list of process-wide changes, the scratch root, the trial load's arguments."""

import os
import pytest
import torch


@pytest.mark.server
@pytest.mark.parametrize("option,expected", [(None, "highest"), ("high", "high")])
def test_load_restores_fp32_matmul_precision(artifacts, option, expected):
    """TorchServe's base_handler sets TF32 ("high") on import when it sees an Ampere+ GPU; the
    handler puts back what the archive asks for (torch's default unless configured). Uses
    TorchServe's own Context class."""
    from ts.context import Context

    from handlers.ts_entry import CompiledModelHandler

    opts = {"crash_safe_load": False, "warmup": False}
    if option:
        opts["float32_matmul_precision"] = option
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # stands in for what base_handler did
    try:
        ctx = Context("p", str(artifacts.get("cls_export")), {"model": {"modelName": "p"}}, 1, None, "0.12.0",
                      model_yaml_config={"handler": opts})
        CompiledModelHandler().initialize(ctx)
        assert torch.get_float32_matmul_precision() == expected
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.server
@pytest.mark.parametrize("buckets,batches,json_mb,cap", [
    ([1, 2, 4], [4, 2], 8.0, None),
    ([], [16, 8, 4, 2], 8.0, None),
    ([], [2], 0.001, 30_000),  # 12.4 KB bodies: no JSON under 1 KB, batches up to 30 KB
])
def test_warm_up_request_path_covers_graph_buckets_and_ends_on_the_binary_path(artifacts, monkeypatch,
                                                                               buckets, batches, json_mb, cap):
    """The request-path warm-up sends one JSON request, then a binary batch at every bucket the
    runner reports (CUDA graph buckets; stood in for here, a CPU runner has none) or, without
    buckets, at the warm-up sizes (1..16 for this artifact), largest first, up to a byte cap,
    and ends with the smallest binary batch, 8 times (JSON only where max_json_mb admits it), so the fast path is what the caches hold and what the
    interpreter has specialized. Uses TorchServe's own Context class and a real exported
    artifact."""
    from ts.context import Context

    from handlers.run.cpu import CpuRunner
    from handlers.torchserve import exchange, headers
    from handlers.ts_entry import CompiledModelHandler
    from handlers.wire import safetensors_io

    monkeypatch.setattr(CpuRunner, "bucket_sizes", lambda self: buckets)
    if cap:
        monkeypatch.setattr("handlers.warmup.WARMUP_BATCH_BYTES", cap)
    seen = []
    real_handle = exchange.handle

    def handle(worker, data, context):
        cts = {headers.read(context, i).content_type for i in range(len(data))}
        out = real_handle(worker, data, context)
        seen.append((len(data), cts.pop(), [context.get_response_status(i)[0] for i in range(len(data))]))
        return out

    monkeypatch.setattr(exchange, "handle", handle)
    ctx = Context("p", str(artifacts.get("cls_export")), {"model": {"modelName": "p"}}, 1, None, "0.12.0",
                  model_yaml_config={"handler": {"crash_safe_load": False, "max_json_mb": json_mb}})
    h = CompiledModelHandler()
    h.initialize(ctx)
    assert h.worker.health.state == "ready" and (h.worker.loaded.spec.batch_min, h.worker.loaded.spec.batch_max) == (1, 16)
    st = safetensors_io.CONTENT_TYPE
    json_case = [(1, "application/json")] if json_mb >= 1 else []
    assert [(n, ct) for n, ct, _ in seen] == json_case + [(n, st) for n in batches] + [(1, st)] * 8
    assert all(s in (None, 200) for _, _, statuses in seen for s in statuses)
    assert ctx.request_ids is None  # the batch state TorchServe set (none before a request) is back


@pytest.mark.server
def test_load_lists_every_process_wide_change_it_made(artifacts, caplog):
    """handlers/process.py: the load logs one line naming each change to the process (the
    environment, torch's global state, signal handlers), recorded where it is made."""
    import logging
    import os

    from ts.context import Context

    from handlers import process
    from handlers.ts_entry import CompiledModelHandler

    ctx = Context("p", str(artifacts.get("cls_export")), {"model": {"modelName": "p"}}, 1, None, "0.12.0",
                  model_yaml_config={"handler": {"crash_safe_load": False, "warmup": False}})
    with caplog.at_level(logging.INFO, logger="handlers.startup"):
        CompiledModelHandler().initialize(ctx)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("process-wide changes: ")]
    assert len(lines) == 1 and lines[0] == "process-wide changes: " + process.describe()
    for what in ("TS_DECODE_INPUT_REQUEST: false", "TMPDIR and tempfile.tempdir: ", "torch thread pools: intra-op ",
                 f"torch fp32 matmul precision: {torch.get_float32_matmul_precision()}"):
        assert what in lines[0], (what, lines[0])
    assert os.environ["TMPDIR"] in lines[0]


def test_scratch_root_must_be_private(tmp_path):
    from handlers.torchserve import scratch

    mine = tmp_path / "mine"
    assert scratch._owned_root(str(mine)) == str(mine) and (mine.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # writable by others: extracted libraries could be swapped
    assert scratch._owned_root(str(shared)) is None
    link = tmp_path / "link"
    link.symlink_to(mine)
    assert scratch._owned_root(str(link)) is None


def test_probe_child_loads_as_the_worker_will(monkeypatch):
    """The crash-safe probe passes the worker's cuda_graphs setting, which decides how an AOTI
    package loads (run_single_threaded), so the child tries the load the worker will make."""
    import subprocess
    import types

    from handlers.artifact import probe
    from handlers.artifact.device import Placement
    from handlers.config import parse_config

    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return types.SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    spec = types.SimpleNamespace(variant_dir="/nonexistent", artifact="model.pt2", backend="aoti")
    probe.crash_safe_probe(spec, Placement("cpu", None), parse_config({"handler": {"cuda_graphs": "off"}}))
    assert seen["cmd"][-4:] == ["/nonexistent", "cpu", "-1", "off"]
    probe.crash_safe_probe(spec, Placement("cpu", None), parse_config({}))
    assert seen["cmd"][-1] == "auto"


def test_start_steps_breakdown_reads_back_as_the_benchmark_parses_it(monkeypatch):
    """The load line's start breakdown (handlers/startup.StartSteps) is what bench.bench_start
    reads from TorchServe's log: every step and the total come back, the process's age first."""
    import time

    from handlers import process, startup
    from bench.bench_start import start_steps

    monkeypatch.setattr(process, "age_s", lambda: 2.5)
    steps = startup.StartSteps()
    for name in ("variant", "trial load", "load"):
        time.sleep(0.01)
        steps.done(name)
    steps.done("load")  # a step done twice adds up
    line = f"loaded aoti artifact model.pt2 (aoti_package) on cuda:0 [x]; started in {steps.describe()}; trial load"
    (back,) = start_steps(line)
    assert list(back) == ["process and imports", "variant", "trial load", "load", "total"]
    assert back["process and imports"] == 2.5 and all(back[k] >= 0.01 for k in ("variant", "trial load", "load"))
    assert abs(back["total"] - sum(v for k, v in back.items() if k != "total")) < 0.02


def test_process_age_counts_from_the_process_start():
    """process.age_s reads the kernel's start time of this process: a child started now is
    younger than this test process, and at most seconds old."""
    import subprocess
    import sys

    from handlers import process

    child = float(subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); "
                                  "from handlers import process; print(process.age_s())"],
                                 capture_output=True, text=True, check=True).stdout)
    assert 0.25 <= child < 10.0
    assert process.age_s() > child


def test_a_failed_start_reaches_torchserve_with_its_real_cause(monkeypatch, tmp_path, caplog):
    """TorchServe 0.12's worker (ts/model_service_worker.py load_model) answers a RuntimeError
    naming CUDA, raised by a handler's initialize, with 507 "System out of memory" and logs
    "cuda OOM" (a worker that hit a device-side assert while capturing CUDA graphs was reported
    so). The handler turns every exception of its start into a LoadError naming its type and
    message: TorchServe's mapping does not take it, the worker's log has the cause, and since a
    restart may pass it is re-raised (TorchServe starts a fresh worker), not answered 503.
    Runs TorchServe's own load_model with a loader that initializes the handler."""
    import logging
    import types

    import ts.model_service_worker as msw
    from ts.context import Context

    from handlers import startup
    from handlers.errors import LoadError
    from handlers.ts_entry import CompiledModelHandler

    cause = RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
                         "reported at some other API call")

    def failing_start(*a, **k):
        raise cause

    class Loader:
        def __init__(self, initialize):
            self.initialize = initialize

        def load(self, model_name, model_dir, *a, **k):
            self.initialize(Context(model_name, model_dir, {"model": {"modelName": model_name}}, 1, None, "0.12.0",
                                    model_yaml_config={}))

    def load(initialize):
        monkeypatch.setattr(msw.ModelLoaderFactory, "get_model_loader", staticmethod(lambda: Loader(initialize)))
        me = types.SimpleNamespace(metrics_cache=types.SimpleNamespace(model_name=None))
        request = {"modelPath": str(tmp_path).encode(), "modelName": b"p", "handler": b"", "batchSize": b"1"}
        return msw.TorchModelServiceWorker.load_model(me, request)

    def raw(ctx):
        raise cause

    assert load(raw)[1:] == ("System out of memory", 507)  # what TorchServe makes of the raw error
    monkeypatch.setattr(startup, "plan", failing_start)
    with caplog.at_level(logging.ERROR, logger="handlers.worker"), pytest.raises(LoadError) as e:
        load(lambda ctx: CompiledModelHandler().initialize(ctx))
    assert e.value.message == ("the worker's start failed with RuntimeError: CUDA error: device-side assert "
                               "triggered\nCUDA kernel errors might be asynchronously reported at some other API call")
    assert e.value.recurs is False and e.value.__cause__ is cause
    assert any("TorchServe restarts the worker: the worker's start failed with RuntimeError: CUDA error: "
               "device-side assert triggered" in r.getMessage() for r in caplog.records)
    # a LoadError stays itself: one that recurs is answered 503 with its reason
    def no_variant(*a, **k):
        raise LoadError("no variant fits")

    h = CompiledModelHandler()
    monkeypatch.setattr(startup, "plan", no_variant)
    load(h.initialize)
    assert h.worker.health.reason == "model 'p' failed to load: no variant fits"


def test_a_worker_that_compiles_torchs_sources_at_every_start_says_so_and_how_to_fix_it(tmp_path):
    """process.uncompiled_imports: a module with no .pyc under an interpreter that writes none
    (PYTHONDONTWRITEBYTECODE, as the GPU image sets it) is named with the compileall fix; once
    compiled, or where the interpreter writes bytecode itself, nothing is said."""
    import shutil
    import subprocess
    import sys

    (tmp_path / "slowmod.py").write_text("X = 1\n")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import slowmod; from handlers import process; "
             "print(process.uncompiled_imports(slowmod))")

    def says(**env):
        return subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True,
                              check=True, env={**os.environ, **env}).stdout.strip()

    text = says(PYTHONDONTWRITEBYTECODE="1")
    assert "slowmod has no compiled bytecode" in text and "PYTHONDONTWRITEBYTECODE is set" in text
    assert f"python -m compileall -q -j 0 {tmp_path.parent}" in text
    assert not (tmp_path / "__pycache__").exists()
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tmp_path)], check=True)
    assert says(PYTHONDONTWRITEBYTECODE="1") == "None"
    shutil.rmtree(tmp_path / "__pycache__")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    assert subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True,
                          check=True, env=env).stdout.strip() == "None"  # it writes them itself


_HELD_BY_A_THREAD = """
import atexit, signal, sys, threading
from handlers.torchserve import scratch
signal.signal(signal.SIGTERM, scratch._exit_on_sigterm)
atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
threading.Thread(target=threading.Event().wait).start()  # not a daemon, never ends (as TorchServe's async threads)
print("ready", flush=True)
threading.Event().wait()
"""


def test_sigterm_ends_a_worker_that_threads_hold_and_runs_its_atexit_handlers(tmp_path):
    """The worker's SIGTERM handler (scratch.py) ends the process even where threads that are not
    daemons would hold interpreter shutdown for ever (TorchServe's async worker), after atexit's
    handlers (the scratch directory's removal among them). With sys.exit it hung."""
    import signal
    import subprocess
    import sys

    from conftest import ROOT

    marker = tmp_path / "marker"
    p = subprocess.Popen([sys.executable, "-c", _HELD_BY_A_THREAD, str(marker)], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 128 + signal.SIGTERM
    finally:
        p.kill()
    assert marker.read_text() == "atexit ran"


def test_the_frontend_watch_leaves_once_the_parent_is_gone():
    """frontend_watch.watch returns through `leave` when this process's parent is no longer the
    one it was given (a parent that dies hands its children to init), and not before."""
    import threading

    from handlers.torchserve import frontend_watch

    left = []
    t = threading.Thread(target=frontend_watch.watch, args=(os.getppid(), 0.01, left.append), daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive() and not left
    frontend_watch.watch(os.getppid() + 1 if os.getppid() != 1 else 2, 0.01, left.append)  # not the parent
    assert left == [os.getppid() + 1 if os.getppid() != 1 else 2]


def test_a_forked_workers_watch_leaves_once_its_frontend_ends(monkeypatch):
    """A worker forked from compiled_serving/prefork.py's warm process takes its frontend from
    CS_FRONTEND_PID (not its parent) and watches that process until it ends."""
    import subprocess
    import sys
    import threading

    from handlers import process
    from handlers.torchserve import frontend_watch

    assert process.frontend_pid() == os.getppid()
    front = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setenv(process.FRONTEND_ENV, str(front.pid))
    assert process.frontend_pid() == front.pid
    left = []
    t = threading.Thread(target=frontend_watch.watch_pid, args=(front.pid, 0.01, left.append), daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive() and not left
    front.kill()
    front.wait()
    t.join(5)
    assert left == [front.pid]


def test_a_zombie_is_not_alive_to_either_watch():
    """A killed process its parent has not reaped still answers signal 0; every liveness check
    (holder sweep, frontend and launcher watches) must call it dead, or a dead weights holder's
    directory is never swept where pid 1 does not reap (a container's)."""
    import subprocess
    import time

    from compiled_serving import prefork
    from handlers import process

    running = subprocess.Popen(["sleep", "30"])
    ended = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while not process.zombie(ended.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.zombie(ended.pid), "the unreaped child never showed state Z"
        os.kill(ended.pid, 0)  # signal 0 still finds it: what the check must see through
        assert not process.alive(ended.pid) and not prefork.alive(ended.pid)
        assert process.alive(running.pid) and prefork.alive(running.pid) and not process.zombie(running.pid)
    finally:
        running.kill()
        running.wait()
        ended.wait()
    assert not process.alive(ended.pid) and not prefork.alive(ended.pid)
