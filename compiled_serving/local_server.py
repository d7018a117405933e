"""Start and stop a real TorchServe on loopback from the shipped config.properties, with only
ports, the model store and worker socket ports changed, so what is measured or tested runs
with the security settings users get (token authorization on, model API off)."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from compiled_serving.server_logs import read_log

ROOT = Path(__file__).resolve().parents[1]


_HANDED_OUT: set = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux: ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _port_range(low: int) -> tuple:
    """[first, end) of the ports free_port draws from: 10000 up to the ephemeral range, or, in a
    pytest-xdist worker (PYTEST_XDIST_WORKER gwN), the N-th of 16 equal parts of it (wrapping), so
    two test processes never hand out the same port: both could find it free before either server
    binds it (a fresh-clone CI run, 2026-11-30: TorchServe's gRPC bind, "Address already in use")."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not (worker.startswith("gw") and worker[2:].isdigit()):
        return 10000, low
    part = (low - 10000) // 16
    first = 10000 + (int(worker[2:]) % 16) * part
    return first, first + part


def free_port() -> int:
    """A loopback port free now, chosen below the kernel's ephemeral range where there is one:
    a port of that range, released before the server binds it, can meanwhile become an outgoing
    connection's source port (TorchServe then failed with "Address already in use"), while ports
    below it are only ever taken by an explicit bind. Never the same port twice in a process, nor
    in two test processes of one run (_port_range)."""
    low = _ephemeral_low()
    first, end = _port_range(low)
    for _ in range(200 if low > 11000 else 0):
        port = random.randrange(first, end)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(name: str) -> str:
    """torchserve / torch-model-archiver beside this Python (a venv), else on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def server_env(env: dict | None = None) -> dict:
    """The environment to start TorchServe with: `env` (default: this process's), with the
    directory of the torchserve tools first on PATH."""
    out = dict(os.environ if env is None else env)
    # A handler loaded in this process (tests) sets this for its own worker; a server's
    # workers start from TorchServe's default, which the handler under test changes itself.
    out.pop("TS_DECODE_INPUT_REQUEST", None)
    out["PATH"] = f"{Path(tool('torchserve')).parent}{os.pathsep}{out.get('PATH', '')}"
    return out


# TorchServe numbers its workers from initial_worker_port up: the port names each worker's socket
# (java.io.tmpdir/.ts.sock.<port>, in the server's own TEMP here) and its threads in the
# logs (W-<port>-<model>). Each server of this process gets its own block of 100 and processes
# start apart by their pid, so worker names stay unique across the servers of a run, and
# sockets stay apart even where two servers share a temp directory.
_worker_port = 9000 + (os.getpid() % 200) * 100


def next_worker_port() -> int:
    global _worker_port
    _worker_port += 100
    return _worker_port


class LocalTorchServe:
    """`torchserve --start --foreground` in its own directory (config, logs, temp files, keys),
    from the shipped config.properties with ports, the model store and the worker socket ports
    changed, plus `extra_config` lines; the shipped log4j2.xml unless `log_config` gives another."""

    def __init__(self, workdir: Path, store: Path, models: dict, env: dict | None = None,
                 extra_config: str = "", log_config: str | None = None):
        self.workdir, self.store, self.models = Path(workdir), Path(store), models
        self.ports = {k: free_port() for k in ("inf", "mgmt", "metrics", "grpc", "grpc_mgmt")}
        cfg = (ROOT / "config.properties").read_text()
        for old, key in (("8080", "inf"), ("8081", "mgmt"), ("8082", "metrics")):
            cfg = re.sub(rf"(?m)^(\w+_address=http://127\.0\.0\.1:){old}$", rf"\g<1>{self.ports[key]}", cfg)
        cfg = re.sub(r"(?m)^grpc_inference_port=.*$", f"grpc_inference_port={self.ports['grpc']}", cfg)
        cfg = re.sub(r"(?m)^grpc_management_port=.*$", f"grpc_management_port={self.ports['grpc_mgmt']}", cfg)
        cfg = re.sub(r"(?m)^model_store=.*$", f"model_store={self.store}", cfg)
        cfg += f"\ninitial_worker_port={next_worker_port()}\n{extra_config}\n"
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "tmp").mkdir(exist_ok=True)
        (self.workdir / "config.properties").write_text(cfg)
        # config.properties names log4j2.xml relative to where TorchServe starts: here (the
        # shipped one, or the text `log_config`)
        (self.workdir / "log4j2.xml").write_text(log_config or (ROOT / "log4j2.xml").read_text())
        run_env = server_env(env)
        # TEMP: the frontend's java.io.tmpdir, where it unpacks every archive (never removed) and
        # puts the workers' Unix sockets, whose paths must fit 107 bytes: a short directory of
        # this server's own, removed by stop(), not the workdir (118 bytes under a test's
        # temporary directory stopped every worker from starting)
        self.java_tmp = tempfile.mkdtemp(prefix="ts-", dir="/tmp")
        run_env.update(LOG_LOCATION=str(self.workdir / "logs"), METRICS_LOCATION=str(self.workdir / "logs"),
                       TMPDIR=str(self.workdir / "tmp"), TEMP=self.java_tmp)
        spec = ",".join(f"{n}={Path(m).name}" for n, m in models.items())
        self.proc = subprocess.Popen(
            [tool("torchserve"), "--start", "--foreground", "--ncs", "--model-store", str(self.store),
             "--models", spec, "--ts-config", str(self.workdir / "config.properties")],
            cwd=self.workdir, env=run_env, stdout=open(self.workdir / "stdout.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.ports['inf']}"
        self.mgmt = f"http://127.0.0.1:{self.ports['mgmt']}"
        self._keys = None

    @property
    def keys(self) -> dict:
        """key_file.json, which TorchServe writes where it starts ({kind: {"key": ...}})."""
        path = self.workdir / "key_file.json"
        deadline = time.time() + 90
        while self._keys is None:  # TorchServe creates the file before it has written the keys
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"torchserve did not start: {self.log('stdout.log')[-3000:]}")
            try:
                self._keys = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                time.sleep(0.3)
        return self._keys

    def key(self, kind: str = "inference") -> str:
        return self.keys[kind]["key"]

    def auth(self, kind: str = "inference") -> dict:
        return {"Authorization": f"Bearer {self.key(kind)}"}

    def workers(self, name: str, timeout: float = 10) -> list:
        """The model's workers as the management API describes them (id, status, pid, ...);
        [] while it is not registered."""
        req = urllib.request.Request(f"{self.mgmt}/models/{name}", headers=self.auth("management"))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())[0].get("workers", [])
        except (OSError, ValueError, LookupError):
            return []

    def model_status(self, name: str) -> list:
        """The states of the model's workers (READY, ...); [] while it is not registered."""
        return [w.get("status") for w in self.workers(name)]

    def wait_ready(self, names=None, timeout: float = 600) -> float:
        """Seconds until every worker of `names` (default: all models) is READY."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"torchserve exited: {self.log('stdout.log')[-3000:]}")
            if all(s and all(x == "READY" for x in s) for s in map(self.model_status, names or self.models)):
                return time.time() - t0
            time.sleep(1)
        raise TimeoutError(f"models {list(names or self.models)} not ready after {timeout}s: {self.log()[-4000:]}")

    def log(self, rel: str = "logs/model_log.log") -> str:
        return read_log(self.workdir / rel)

    def stop(self):
        stop_server(self.proc, self.store, self.workdir)
        shutil.rmtree(self.java_tmp, ignore_errors=True)


def stop_server(proc, store, workdir=None) -> None:
    """SIGTERM to the server's process group, SIGKILL if it lingers; the model workers are
    Python children of the Java frontend, found by the model store on their command line, and
    the frontend by its config file (it can outlive the `torchserve` launcher, whose exit
    would otherwise skip the group: seen as a frontend left running after the test suite)."""
    kids = _descendants(proc.pid)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if workdir is not None:
        subprocess.run(["pkill", "-9", "-f", f"{workdir}/config.properties"], capture_output=True)
    subprocess.run(["pkill", "-9", "-f", f"model-store {store}"], capture_output=True)
    _, alive = psutil.wait_procs(kids, timeout=10)
    # seen on the GPU machine: a model worker holding 6 GiB outlived its server's stop. Workers
    # first; a worker's scratch reaper (handlers/torchserve/scratch.py, a shell that removes the
    # worker's directory once it is gone) gets 3 s to do that before it is killed too
    reapers = [p for p in alive if _is_shell(p)]
    _kill([p for p in alive if p not in reapers])
    _kill(psutil.wait_procs(reapers, timeout=3)[1])


def _is_shell(p) -> bool:
    try:
        return p.name() in ("sh", "dash", "bash")
    except psutil.Error:
        return False


def _kill(procs: list) -> None:
    for p in procs:
        try:
            print(f"stop_server: {p.pid} ({' '.join(p.cmdline()[:2])}) outlived its server; killed", file=sys.stderr)
            p.kill()
        except psutil.Error:  # gone meanwhile
            pass


def _descendants(pid: int) -> list:
    """The server's processes below its launcher (the frontend and its model workers)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
