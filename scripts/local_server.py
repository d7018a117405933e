"""Start and stop a real TorchServe on loopback from the shipped config.properties, with only
ports, the model store and worker socket ports changed, so what is measured or tested runs
with the security settings users get (token authorization on, model API off)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(name: str) -> str:
    """torchserve / torch-model-archiver beside this Python (a venv), else on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


class LocalTorchServe:
    def __init__(self, workdir: Path, store: Path, models: dict, env: dict | None = None,
                 extra_config: str = ""):
        self.workdir, self.store, self.models = Path(workdir), Path(store), models
        self.ports = {k: free_port() for k in ("inf", "mgmt", "metrics", "grpc", "grpc_mgmt")}
        cfg = (ROOT / "config.properties").read_text()
        for old, key in (("8080", "inf"), ("8081", "mgmt"), ("8082", "metrics")):
            cfg = re.sub(rf"(?m)^(\w+_address=http://127\.0\.0\.1:){old}$", rf"\g<1>{self.ports[key]}", cfg)
        cfg = re.sub(r"(?m)^grpc_inference_port=.*$", f"grpc_inference_port={self.ports['grpc']}", cfg)
        cfg = re.sub(r"(?m)^grpc_management_port=.*$", f"grpc_management_port={self.ports['grpc_mgmt']}", cfg)
        cfg = re.sub(r"(?m)^model_store=.*$", f"model_store={self.store}", cfg)
        # distinct worker socket ports (/tmp/.ts.sock.<port>) so several servers can coexist
        cfg += f"\ninitial_worker_port={20000 + free_port() % 20000}\n{extra_config}\n"
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "tmp").mkdir(exist_ok=True)
        (self.workdir / "config.properties").write_text(cfg)
        # config.properties names log4j2.xml relative to where TorchServe starts: here
        shutil.copy2(ROOT / "log4j2.xml", self.workdir / "log4j2.xml")
        run_env = dict(os.environ if env is None else env)
        run_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{run_env.get('PATH', '')}"
        run_env.update(LOG_LOCATION=str(self.workdir / "logs"), METRICS_LOCATION=str(self.workdir / "logs"),
                       TMPDIR=str(self.workdir / "tmp"))
        spec = ",".join(f"{n}={Path(m).name}" for n, m in models.items())
        self.proc = subprocess.Popen(
            [tool("torchserve"), "--start", "--foreground", "--ncs", "--model-store", str(self.store),
             "--models", spec, "--ts-config", str(self.workdir / "config.properties")],
            cwd=self.workdir, env=run_env, stdout=open(self.workdir / "stdout.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.ports['inf']}"
        self.mgmt = f"http://127.0.0.1:{self.ports['mgmt']}"

    def key(self, kind: str = "inference") -> str:
        path = self.workdir / "key_file.json"
        deadline = time.time() + 90
        while True:  # TorchServe creates the file before it has written the keys into it
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"torchserve did not start: {self.log('stdout.log')[-3000:]}")
            try:
                return json.loads(path.read_text())[kind]["key"]
            except (OSError, json.JSONDecodeError):
                time.sleep(0.3)

    def workers(self, name: str) -> list:
        req = urllib.request.Request(f"{self.mgmt}/models/{name}",
                                     headers={"Authorization": f"Bearer {self.key('management')}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return [w.get("status") for w in json.loads(r.read())[0].get("workers", [])]
        except OSError:
            return []

    def wait_ready(self, timeout: float = 600) -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"torchserve exited: {self.log('stdout.log')[-3000:]}")
            states = [self.workers(n) for n in self.models]
            if all(s and all(x == "READY" for x in s) for s in states):
                return time.time() - t0
            time.sleep(1)
        raise TimeoutError(f"models not ready after {timeout}s: {self.log()[-4000:]}")

    def log(self, rel: str = "logs/model_log.log") -> str:
        p = self.workdir / rel
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self):
        stop_server(self.proc, self.store)


def stop_server(proc, store) -> None:
    """SIGTERM to the server's process group, SIGKILL if it lingers; the model workers are
    Python children of the Java frontend, found by the model store on their command line."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    subprocess.run(["pkill", "-9", "-f", f"model-store {store}"], capture_output=True)
