"""A newcomer's first day: the quickstart stops only the server it started, the archive picks its
worker count from the artifact's device and the machine (and says so), an empty body and a
non-JSON body get different messages, and compiled_serving.client sends values read from a file."""
import json
import os
import re
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch
import yaml
from conftest import PY, ROOT, build_mar, cs_command

from handlers.errors import RequestError
from handlers.wire import safetensors_io, strict_json
from compiled_serving.archive import default_workers
from compiled_serving.client import read_inputs
from compiled_serving.local_server import LocalTorchServe

# -- the two body messages (the same strings TorchServe's 400 carries, tests/test_serving.py)

@pytest.mark.parametrize("body", [b"", b"  \n", ""])
def test_empty_body_says_empty(body):
    with pytest.raises(RequestError) as e:
        strict_json.loads(body)
    assert str(e.value).startswith("empty JSON body: send a JSON object"), e.value
    assert "Expecting value" not in str(e.value)


@pytest.mark.parametrize("body, start", [(b"hello", "'hello'"), (b"  <xml/>", "'<xml/>'"),
                                         (b"\x00\x01", "'\\x00\\x01'")])
def test_non_json_body_says_not_json_and_shows_its_start(body, start):
    with pytest.raises(RequestError) as e:
        strict_json.loads(body)
    assert f"JSON body is not JSON at all (it starts with {start})" in str(e.value), e.value
    assert "application/x-safetensors" in str(e.value)


def test_broken_json_still_says_where():
    with pytest.raises(RequestError) as e:
        strict_json.loads(b'{"inputs": [1, 2')
    assert str(e.value).startswith("malformed JSON body: Expecting ',' delimiter at line 1 column"), e.value


# -- archive worker defaults

def test_default_cpu_workers_by_cores():
    """On the CPU one worker per 4 cores, at least 1 (a GPU's workers follow the engine's sizing:
    compiled_serving/worker_sizing.py)."""
    assert default_workers(2)[0] == 1
    assert default_workers(16)[0] == 4
    assert default_workers(1)[0] == 1
    assert "2 cores" in default_workers(2)[1]


@pytest.mark.server
def test_archive_of_a_cpu_artifact_sizes_workers_to_the_machine(artifacts, tmp_path):
    r = subprocess.run([*cs_command("archive"), "--artifact", str(artifacts.get("cls_export")),
                        "--name", "sized", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    want = max(1, (os.cpu_count() or 1) // 4)
    assert f"--workers {want} (a CPU artifact on {os.cpu_count()} cores" in r.stdout, r.stdout
    with zipfile.ZipFile(tmp_path / "sized.mar") as z:
        cfg = yaml.safe_load(z.read("model-config.yaml"))
        # stored, not deflated: weights barely compress, and deflate costs minutes per GB at both ends
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
    assert cfg["minWorkers"] == cfg["maxWorkers"] == want, cfg


@pytest.mark.server
def test_archive_says_which_artifact_it_could_not_read(tmp_path):
    r = subprocess.run([*cs_command("archive"), "--artifact", str(tmp_path), "--name", "x",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no artifact.json in" in r.stderr, r.stderr


def test_a_torchscript_or_torch_save_file_is_named_with_the_way_to_a_program(tmp_path):
    """The model file a user most often has: torch.jit.save or torch.save, named as such, with the
    export that makes a program (it was torch's 'checkpoint is corrupted' after a wall of warnings)."""
    from compiled_serving.import_artifact import ImportError_, load_program
    m = torch.nn.Linear(2, 2)
    torch.jit.save(torch.jit.script(m), tmp_path / "scripted.pt")
    torch.save(m, tmp_path / "pickled.pt")
    torch.save(m.state_dict(), tmp_path / "weights.pt")
    for name, kind in (("scripted.pt", "TorchScript module"), ("pickled.pt", "torch.save checkpoint"),
                       ("weights.pt", "torch.save checkpoint")):
        with pytest.raises(ImportError_, match=f"{kind} .*torch.export.export"):
            load_program(str(tmp_path / name))
    ep = torch.export.export(m, (torch.ones(1, 2),))
    torch.export.save(ep, tmp_path / "program.pt2")
    assert load_program(str(tmp_path / "program.pt2")) is not None


# -- client values from a file

def test_read_inputs_from_npy_json_and_safetensors(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "a.npy", a)
    (tmp_path / "b.json").write_text(json.dumps([[1, 2], [3, 4]]))
    (tmp_path / "all.json").write_text(json.dumps({"c": [0.5, 1.5]}))
    (tmp_path / "d.safetensors").write_bytes(bytes(safetensors_io.dumps({"d": torch.ones(2, 2, dtype=torch.bool)})))
    got = read_inputs([f"a={tmp_path / 'a.npy'}", f"b={tmp_path / 'b.json'}", str(tmp_path / "all.json"),
                       str(tmp_path / "d.safetensors")])
    assert torch.equal(got["a"], torch.from_numpy(a))
    assert got["b"].tolist() == [[1, 2], [3, 4]]
    assert got["c"].tolist() == [0.5, 1.5]
    assert got["d"].dtype == torch.bool and got["d"].all()
    with pytest.raises(ValueError, match="expected NAME=FILE.npy"):
        read_inputs([str(tmp_path / "a.npy")])  # one array needs its input's name
    (tmp_path / "ragged.json").write_text("[[1, 2], [3]]")
    with pytest.raises(ValueError, match="input 'r': not a rectangular numeric array"):
        read_inputs([f"r={tmp_path / 'ragged.json'}"])
    # the README's request.json (a request body in our JSON) gives its inputs
    (tmp_path / "request.json").write_text(json.dumps({"inputs": {"x": [[1.0, 2.0]], "y": [[3]]}}))
    got = read_inputs([str(tmp_path / "request.json")])
    assert sorted(got) == ["x", "y"] and got["x"].tolist() == [[1.0, 2.0]]
    (tmp_path / "v2.json").write_text(json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                                              "data": [1.0]}]}))
    with pytest.raises(ValueError, match="KServe v2 request body"):
        read_inputs([str(tmp_path / "v2.json")])


def test_a_named_key_file_that_is_missing_stops_the_client_and_inspect_names_a_missing_path(tmp_path, capsys):
    from compiled_serving.client import find_key_file
    from compiled_serving.inspect_artifact import main as inspect_main
    with pytest.raises(SystemExit, match="--key-file .*nope.json: no such file"):
        find_key_file(str(tmp_path / "nope.json"))
    assert inspect_main([str(tmp_path / "absent")]) == 2
    assert "absent: no such file or directory" in capsys.readouterr().out


@pytest.fixture(scope="module")
def cls_server(artifacts, serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("first_day_store")
    return serve({"cls_export": build_mar(artifacts.get("cls_export"), "cls_export", store)})


@pytest.mark.server
@pytest.mark.parametrize("fmt", ["json", "safetensors"])
def test_client_sends_values_from_a_file_and_matches_eager(cls_server, tmp_path, fmt):
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "image.npy", x)
    keys = tmp_path / "key_file.json"
    keys.write_text(json.dumps(cls_server.keys))
    r = subprocess.run([*cs_command("client"), "--model", "cls_export", "--url", cls_server.base,
                        "--key-file", str(keys), "--input", f"image={tmp_path / 'image.npy'}", "--format", fmt,
                        "--check-eager", "--factory", "examples/models.py:classifier"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "(OK)" in r.stdout, r.stdout + r.stderr
    # the file's two rows were sent (the random --example path is not taken without --example)
    assert re.search(r"output: predicted classes \[\d+, \d+\]", r.stdout), r.stdout


def test_client_summary_names_classes_only_for_scores():
    from compiled_serving.client import summary

    scores = torch.tensor([[0.1, 0.9, 0.0], [0.7, 0.2, 0.1]])
    assert summary({"logits": scores}) == "logits: predicted classes [1, 0]"
    one_column = torch.tensor([[0.25], [-1.5]])  # a regression or a single logit: no classes
    assert summary({"score": one_column}) == "score: shape [2, 1], values [0.25, -1.5]"
    assert "predicted classes" not in summary({"ids": torch.arange(6).view(2, 3)})


# -- quickstart stops only its own server

@pytest.mark.server
def test_quickstart_stop_leaves_another_torchserve_running(tmp_path):
    """... and the keys of the checkout's own quickstart server: TorchServe's --stop deletes the
    key_file.json of the directory it runs in, and the suite's stop of a server of its own (another
    QUICKSTART_STATE) deleted a running quickstart's keys in the repository root."""
    (tmp_path / "store").mkdir()
    keys = ROOT / "key_file.json"
    sentinel = not keys.exists()  # stands for a quickstart server's keys; a real one is left as it is
    if sentinel:
        keys.write_text('{"inference": {"key": "sentinel"}}')
    ours = LocalTorchServe(tmp_path / "ours", tmp_path / "store", {})
    other = LocalTorchServe(tmp_path / "other", tmp_path / "store", {})
    try:
        ours.keys, other.keys  # both frontends up (they write key_file.json once listening)
        r = subprocess.run(["bash", "scripts/quickstart.sh", "--stop"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**os.environ, "QUICKSTART_STATE": str(tmp_path / "ours")})
        assert r.returncode == 0, r.stdout + r.stderr
        deadline = time.time() + 60
        while ours.proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert ours.proc.poll() is not None, "the quickstart's server is still running"
        assert other.proc.poll() is None, "the quickstart stopped a TorchServe it did not start"
        assert keys.exists(), "stopping the suite's server deleted the checkout's key_file.json"
        # and with no server of its own, --stop stops nothing
        r = subprocess.run(["bash", "scripts/quickstart.sh", "--stop"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**os.environ, "QUICKSTART_STATE": str(tmp_path / "none")})
        assert r.returncode == 0, r.stderr
        time.sleep(2)
        assert other.proc.poll() is None
    finally:
        ours.stop()
        other.stop()
        if sentinel:
            keys.unlink(missing_ok=True)


@pytest.mark.server
def test_stopping_a_server_whose_launcher_died_stops_its_frontend(tmp_path):
    """The Java frontend can outlive the `torchserve` launcher (killed here); stop() still ends
    it, found by its config file: no server is left running after the suite."""
    (tmp_path / "store").mkdir()
    ts = LocalTorchServe(tmp_path / "ts", tmp_path / "store", {})
    try:
        ts.keys  # the frontend is up
        frontend = subprocess.run(["pgrep", "-f", f"{tmp_path / 'ts'}/config.properties.*ModelServer|"
                                   f"ModelServer.*{tmp_path / 'ts'}/config.properties"],
                                  capture_output=True, text=True).stdout.split()
        assert frontend, "no Java frontend found by its config file"
        os.kill(ts.proc.pid, 9)  # the launcher only: the frontend keeps running
        ts.proc.wait(10)
        assert all(os.path.exists(f"/proc/{p}") for p in frontend)
    finally:
        ts.stop()
    deadline = time.time() + 10
    while any(os.path.exists(f"/proc/{p}") for p in frontend) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") for p in frontend), "the frontend outlived stop()"


# -- the quickstart's --serve takes several names; the setup installs nginx only for the tests

@pytest.mark.server
@pytest.mark.parametrize("args", [["qs_probe_a", "qs_probe_b"], ["qs_probe_a,qs_probe_b"]])
def test_quickstart_serve_looks_for_every_name(args):
    """`--serve a b` once served a alone, silently, and `--serve a,b` looked for a,b.mar: with a's
    archive present and b's missing, both spellings must stop at b, naming it."""
    present = ROOT / "model_store" / "qs_probe_a.mar"
    present.parent.mkdir(exist_ok=True)
    present.write_bytes(b"")
    try:
        r = subprocess.run(["bash", "scripts/quickstart.sh", "--serve", *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, QUICKSTART_STATE=str(ROOT / "logs" / "qs_probe")))
    finally:
        present.unlink()
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no model_store/qs_probe_b.mar" in r.stderr and "a,b" not in r.stderr, r.stderr


def fake_apt(tmp_path, says: str):
    """A PATH whose apt-get records its arguments and fails saying `says`."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "apt-get").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/apt.calls\necho '{says}' >&2\nexit 100\n")
    (bin_ / "apt-get").chmod(0o755)
    return dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", NGINX=str(tmp_path / "no" / "nginx"))


@pytest.mark.server
def test_setup_without_nginx_never_asks_apt_for_it(tmp_path):
    """The quickstart's setup needs no nginx: on a machine without one it does not call apt."""
    env = fake_apt(tmp_path, "E: Could not get lock /var/lib/dpkg/lock-frontend")
    r = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (tmp_path / "apt.calls").exists(), (tmp_path / "apt.calls").read_text()


@pytest.mark.server
def test_setup_for_the_pod_tests_says_what_to_do_when_apt_is_locked(tmp_path):
    env = fake_apt(tmp_path, "E: Could not get lock /var/lib/dpkg/lock-frontend")
    r = subprocess.run(["bash", "scripts/setup_env.sh", "--pod-tests"], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=600)
    if os.geteuid() != 0:  # not root: it says what to install instead of calling apt
        assert r.returncode == 1 and "install it (apt-get install nginx) or set NGINX" in r.stderr, r.stderr
        return
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DPkg::Lock::Timeout=300" in (tmp_path / "apt.calls").read_text()  # it waited for the lock
    assert "installing nginx for the KServe pod's tests (nginx) with apt-get failed" in r.stderr, r.stderr
    assert "If another apt or dpkg is running, wait for it and run this again" in r.stderr, r.stderr


_STUBBORN_SERVER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c",  # prints its pid once it ignores SIGTERM
                           "import os, signal, time; signal.signal(signal.SIGTERM, lambda *a: None); "
                           "print(os.getpid(), flush=True); time.sleep(1000)"])
# as handlers/torchserve/scratch.py's reaper: its own session, it waits for the worker, then cleans up
subprocess.Popen(["/bin/sh", "-c", f"while kill -0 {worker.pid} 2>/dev/null; do sleep 1; done; touch {sys.argv[1]}"],
                 start_new_session=True)
time.sleep(1000)
"""


def test_stop_server_kills_a_worker_that_outlives_the_stop_and_lets_its_reaper_finish(tmp_path):
    """stop_server (the benchmarks' and tests' stop): a server process that ignores SIGTERM (as an
    async TorchServe worker did on the GPU machine, holding its memory) is killed 10 s later, and
    the scratch reaper waiting for it still removes what it must before it too is stopped."""
    import psutil

    from compiled_serving.local_server import stop_server

    reaped = tmp_path / "reaped"
    p = subprocess.Popen([sys.executable, "-c", _STUBBORN_SERVER, str(reaped)], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    worker = int(p.stdout.readline())
    stop_server(p, tmp_path / "no-store")
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    deadline = time.time() + 5
    while not reaped.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert reaped.exists()
