"""TorchServe's workers forked from a warm process (compiled_serving/prefork.py, its hook in the
environment's cs_prefork.pth, written by scripts/setup_env.sh). Without TorchServe: this test's
process stands in for the frontend (the starting worker's parent), a script named
model_service_worker.py for TorchServe's worker. The first start runs as it always did and starts
the zygote; the next is forked from it, with the starting process's stdout, stderr, working
directory and arguments, the archive's `handlers` from PYTHONPATH, torch already imported, and its
exit status mirrored; a killed launcher ends its child; the zygote ends with its frontend. The
zygote has imported what every handler's start imports (PREIMPORTS) and compiled the archive's
sources, which a forked worker imports without compiling them again unless their bytes changed.
Then through real TorchServe: a killed worker's successor is forked and answers as the first did."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from compiled_serving import prefork

pytestmark = pytest.mark.server  # every test starts interpreters, the warm process, or TorchServe

LAUNCHER = sys.executable  # TorchServe runs the worker with the interpreter of its `torchserve` command
# The stand-in worker reports what it found imported, and the files Python compiled while it
# imported `handlers` (the import system's source_to_code calls the builtin `compile`)
WORKER = textwrap.dedent("""
    import builtins, json, os, sys, time
    had_torch = "torch" in sys.modules
    modules = sorted(sys.modules)
    compiled, compile_ = [], builtins.compile
    builtins.compile = lambda src, name, *a, **k: compiled.append(name) or compile_(src, name, *a, **k)
    import handlers
    builtins.compile = compile_
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
                      "had_torch": had_torch, "handlers": handlers.__file__, "path0": sys.path[0],
                      "frontend": os.environ.get("CS_FRONTEND_PID"), "modules": modules,
                      "compiled": compiled, "value": getattr(handlers, "VALUE", None),
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
    (model / "handlers" / "__init__.py").write_text("# the archive's copy\nVALUE = 1\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # no bytecode written (as on the GPU machine's image): each import of a source compiles it,
    # unless the zygote compiled it. The model's directory first on PYTHONPATH, then what the run
    # was given (a checkout's compiled_serving, tested in place of the installed one).
    path = os.pathsep.join([str(model)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp), "PYTHONDONTWRITEBYTECODE": "1"}
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
    assert set(prefork.PREIMPORTS) <= set(two["modules"]), "the zygote imports what every handler's start imports"
    assert not any(m == "handlers" or m.startswith("handlers.") for m in two["modules"])


def test_a_forked_worker_takes_the_zygotes_compiled_archive_unless_its_bytes_changed(world):
    """The first start compiles the archive's `handlers` (no bytecode written); the forked one
    compiles nothing of it; once its source changes, the next forked one compiles and runs the new
    source."""
    script, model, env, tmp = world
    init = model / "handlers" / "__init__.py"
    first = start(script, model, env)
    one = json.loads(first.communicate(timeout=120)[0])
    assert one["compiled"] == [str(init)] and one["value"] == 1
    wait_zygote(tmp)
    second = start(script, model, env)
    two = json.loads(second.communicate(timeout=60)[0])
    assert two["had_torch"] and two["compiled"] == [] and two["value"] == 1
    init.write_text(init.read_text().replace("VALUE = 1", "VALUE = 2"))  # the same size: only the bytes tell
    third = start(script, model, env)
    three = json.loads(third.communicate(timeout=60)[0])
    assert three["had_torch"] and three["compiled"] == [str(init)] and three["value"] == 2


def test_compiled_sources_are_named_as_the_import_system_names_them(tmp_path, monkeypatch):
    """compile_sources spells each path as importlib's FileFinder does for an absolute entry with
    a trailing separator and a relative one, leaves out a file that does not compile or warns, and
    nothing outside the working directory; use_compiled answers the loader with that code and
    compiles a changed source as before."""
    import builtins
    from importlib.machinery import SourceFileLoader

    pkg = tmp_path / "model" / "cs_pkg_probe"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("X = 1\n")
    (pkg / "bad.py").write_text("def (:\n")
    (pkg / "warns.py").write_text("x = '\\d'\n")  # an invalid escape: a warning at compile time
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "stale.py").write_text("")
    (tmp_path / "model" / "lib").mkdir()
    (tmp_path / "model" / "lib" / "top_probe.py").write_text("Y = 2\n")
    (tmp_path / "outside.py").write_text("")
    monkeypatch.chdir(tmp_path / "model")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "model") + "/", "lib", str(tmp_path)] + sys.path)
    sources = prefork.compile_sources(str(tmp_path / "model"))
    base = str(tmp_path / "model")
    assert set(sources) == {f"{base}/cs_pkg_probe/__init__.py", f"{base}/cs_pkg_probe/sub/__init__.py",
                            f"{base}/cs_pkg_probe/sub/mod.py", f"{base}/lib/top_probe.py"}
    monkeypatch.setattr(SourceFileLoader, "source_to_code", SourceFileLoader.source_to_code)  # restored after
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    prefork.use_compiled(sources)
    (pkg / "__init__.py").write_text("CHANGED = True\n")
    compiled, compile_ = [], builtins.compile
    monkeypatch.setattr(builtins, "compile", lambda src, name, *a, **k: compiled.append(name) or compile_(src, name, *a, **k))
    for m in ("cs_pkg_probe", "cs_pkg_probe.sub", "cs_pkg_probe.sub.mod", "top_probe"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    try:
        import cs_pkg_probe.sub.mod
        import top_probe
    finally:
        for m in ("cs_pkg_probe", "cs_pkg_probe.sub", "cs_pkg_probe.sub.mod", "top_probe"):
            sys.modules.pop(m, None)
    assert cs_pkg_probe.sub.mod.X == 1 and top_probe.Y == 2 and cs_pkg_probe.CHANGED
    assert compiled == [f"{base}/cs_pkg_probe/__init__.py"], "only the changed source is compiled"
    assert cs_pkg_probe.sub.mod.__file__ == f"{base}/cs_pkg_probe/sub/mod.py"


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
    # the zygote compiled every source of the archive, found from TorchServe's working directory
    # and PYTHONPATH for the worker (its ready line, in its log under the server's TMPDIR)
    logs = "".join(p.read_text() for p in (ts.workdir / "tmp").glob("cs-prefork-*/*.log"))
    sources = sum(name.endswith(".py") for name in zipfile.ZipFile(mar).namelist())
    assert sources > 100 and f"({sources} source files compiled)" in logs, logs
    print(f"kill -9 to READY: {back:.2f}s (forked from the zygote)")
    ts.stop()
    deadline = time.monotonic() + 10
    while zygote.is_running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not zygote.is_running(), "the zygote outlived its server"
