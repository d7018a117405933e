"""TorchServe's workers forked from a warm process (compiled_serving/prefork.py, its hook in the
environment's cs_prefork.pth, written by scripts/setup_env.sh). Without TorchServe: this test's
process stands in for the frontend (the starting worker's parent), a script named
model_service_worker.py for TorchServe's worker. The first start runs as it always did and starts
the zygote; the next is forked from it, with the starting process's stdout, stderr, working
directory and arguments, the archive's `handlers` from PYTHONPATH, torch already imported, and its
exit status mirrored; a killed launcher ends its child; the zygote ends with its frontend. Then
through real TorchServe: a killed worker's successor is forked and answers as the first did."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from compiled_serving import prefork

pytestmark = pytest.mark.server  # every test starts interpreters, the warm process, or TorchServe

LAUNCHER = sys.executable  # TorchServe runs the worker with the interpreter of its `torchserve` command
WORKER = textwrap.dedent("""
    import json, os, sys, time
    had_torch = "torch" in sys.modules
    import handlers
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
                      "had_torch": had_torch, "handlers": handlers.__file__, "path0": sys.path[0],
                      "frontend": os.environ.get("CS_FRONTEND_PID"),
                      "cuda_initialized": "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()}),
          flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if "--sleep" in sys.argv:
        time.sleep(120)
    sys.exit(3)
""")


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A worker script, a model directory with a stand-in `handlers` on PYTHONPATH, and a
    directory of its own for the zygotes (TMPDIR: prefork.home), removed with their processes."""
    ts = tmp_path / "ts"
    ts.mkdir()
    (ts / "model_service_worker.py").write_text(WORKER)
    model = tmp_path / "model"
    (model / "handlers").mkdir(parents=True)
    (model / "handlers" / "__init__.py").write_text("# the archive's copy\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(model), "TMPDIR": str(tmp)}
    env.pop("CS_PREFORK", None)
    yield ts / "model_service_worker.py", model, env, tmp
    for lock in tmp.glob("cs-prefork-*/*.lock"):  # every zygote of this test stopped
        pid = zygote_pid(lock)
        if pid and prefork.alive(pid):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(tmp, ignore_errors=True)


def zygote_pid(lock: Path):
    log = lock.with_suffix(".log")
    for line in log.read_text().splitlines() if log.exists() else []:
        if line.startswith("zygote ") and " pid " in line:
            return int(line.split(" pid ")[1].split()[0])
    return None


def start(script, model, env, *args, **kw):
    return subprocess.Popen([str(LAUNCHER), str(script), "--sock-type", "unix", *args], cwd=model, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def wait_zygote(tmp: Path, timeout=60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for lock in tmp.glob("cs-prefork-*/*.lock"):
            pid = zygote_pid(lock)  # its line is written once its socket listens
            if pid:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no zygote answered: {[p.read_text() for p in tmp.glob('cs-prefork-*/*.log')]}")


def test_the_hook_is_in_this_environment():
    import sysconfig

    pth = Path(sysconfig.get_paths()["purelib"]) / "cs_prefork.pth"
    assert pth.read_text().strip() == prefork.PTH_LINE, "scripts/setup_env.sh writes it"


def test_the_second_worker_is_forked_from_the_zygote_as_python_would_run_it(world):
    script, model, env, tmp = world
    first = start(script, model, env, "--a", "1")
    out, err = first.communicate(timeout=120)
    one = json.loads(out)
    assert first.returncode == 3 and "to stderr" in err
    assert one["ppid"] == os.getpid() and not one["had_torch"]  # exec'd: TorchServe's own start
    zygote = wait_zygote(tmp)
    second = start(script, model, env, "--b", "2")
    out, err = second.communicate(timeout=60)
    two = json.loads(out)
    assert second.returncode == 3 and "to stderr" in err  # the launcher's pipes, its status
    assert two["ppid"] == zygote and two["pid"] != second.pid and two["had_torch"]
    assert one["frontend"] is None and two["frontend"] == str(os.getpid())  # handlers/process.frontend_pid
    assert two["argv"] == ["--sock-type", "unix", "--b", "2"] and two["cwd"] == str(model)
    assert two["handlers"] == one["handlers"] == str(model / "handlers" / "__init__.py")
    assert two["path0"] == one["path0"] == str(script.parent) and two["cuda_initialized"] is False


FRONTEND = textwrap.dedent("""
    import glob, subprocess, sys, time
    launcher, script, tmp = sys.argv[1:]
    subprocess.run([launcher, script])  # exec'd, and the zygote of this frontend started
    while not any(" ready in " in open(f).read() for f in glob.glob(tmp + "/cs-prefork-*/*.log")):
        time.sleep(0.05)
    p = subprocess.Popen([launcher, script, "--sleep"])  # forked from it
    print(p.pid, flush=True)
    time.sleep(300)
""")


def test_a_killed_launcher_ends_its_child_and_the_zygote_ends_with_its_frontend(world):
    """TorchServe stops a worker by SIGKILL of the process it started (the launcher); the zygote
    checks its frontend each second."""
    script, model, env, tmp = world
    frontend = subprocess.Popen([sys.executable, "-c", FRONTEND, str(LAUNCHER), str(script), str(tmp)], cwd=model,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert json.loads(frontend.stdout.readline())["ppid"] == frontend.pid
        zygote = wait_zygote(tmp)
        lines = [frontend.stdout.readline() for _ in range(2)]  # the launcher's pid and its child's line, any order
        child = next(json.loads(ln) for ln in lines if ln.startswith("{"))
        launcher = next(int(ln) for ln in lines if not ln.startswith("{"))
        assert child["ppid"] == zygote and child["had_torch"]
        os.kill(launcher, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while prefork.alive(child["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not prefork.alive(child["pid"]), "the child outlived its killed launcher"
        assert prefork.alive(zygote)
    finally:
        frontend.kill()
        frontend.wait()
    deadline = time.monotonic() + 10
    while prefork.alive(zygote) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not prefork.alive(zygote), "the zygote outlived its frontend"


def test_anything_but_torchserves_worker_and_prefork_off_start_as_they_always_did(world, tmp_path):
    script, model, env, tmp = world
    other = tmp_path / "other.py"
    other.write_text("import os, sys; print(os.getppid()); sys.exit(5)")
    r = subprocess.run([str(LAUNCHER), str(other)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 5 and int(r.stdout) == os.getpid()
    r = subprocess.run([str(LAUNCHER), str(script)], cwd=model, env={**env, "CS_PREFORK": "off"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and json.loads(r.stdout)["ppid"] == os.getpid()
    assert not list(tmp.glob("cs-prefork-*/*.lock")), "CS_PREFORK=off started a zygote"
    assert prefork.PTH_LINE.startswith("import ")  # site runs a .pth line only when it starts so


def _zygote_of(frontend: int) -> list:
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if "--zygote" in (p.info["cmdline"] or [])
            and p.info["cmdline"][p.info["cmdline"].index("--frontend") + 1] == str(frontend)]


def test_through_torchserve_a_killed_worker_comes_back_forked_and_answers(artifacts, serve, tmp_path):
    """The first worker is TorchServe's child, and its start starts the zygote; after a kill -9 the
    new worker is the zygote's child, READY again and answering as the first did; the zygote ends
    with the server."""
    import psutil
    import torch
    from conftest import build_mar

    mar = build_mar(artifacts.get("cls_aoti"), "cls_pf", tmp_path / "store")
    ts = serve({"cls_pf": mar})
    x = torch.randn(2, 3, 32, 32).tolist()
    first = ts.predict("cls_pf", {"instances": x})
    assert first.status_code == 200, first.text
    (w,) = ts.workers("cls_pf")
    frontend = psutil.Process(w["pid"]).ppid()  # started as it always was, TorchServe's child
    assert "java" in psutil.Process(frontend).name()
    deadline = time.monotonic() + 60
    while not _zygote_of(frontend) and time.monotonic() < deadline:
        time.sleep(0.1)
    (zygote,) = _zygote_of(frontend)
    time.sleep(3)  # its imports done (a launcher that finds no socket yet starts the worker itself)
    t0 = time.monotonic()
    os.kill(w["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ws = ts.workers("cls_pf")
        if ws and ws[0].get("status") == "READY" and ws[0].get("pid") != w["pid"]:
            break
        time.sleep(0.05)
    back = time.monotonic() - t0
    (w2,) = ts.workers("cls_pf")
    assert w2["status"] == "READY" and psutil.Process(w2["pid"]).ppid() == zygote.pid, (w2, zygote.pid)
    again = ts.predict("cls_pf", {"instances": x})
    assert again.status_code == 200 and again.json() == first.json()
    print(f"kill -9 to READY: {back:.2f}s (forked from the zygote)")
    ts.stop()
    deadline = time.monotonic() + 10
    while zygote.is_running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not zygote.is_running(), "the zygote outlived its server"
