"""The KServe pod run here as its container runs it: kserve/entrypoint.sh with the image's
environment, on a copy of a storage layout (`python -m compiled_serving.kserve`), every port a free
loopback port. Used by the pod's tests and by bench/bench_pod.py."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from compiled_serving.local_server import ROOT, free_port, next_worker_port, server_env
from compiled_serving.server_logs import read_log

ENTRYPOINT = ROOT / "kserve" / "entrypoint.sh"
RUNTIME_MANIFEST = ROOT / "kserve" / "servingruntime.yaml"


class LocalPod:
    """storage: DIR/storage of a layout; root: a new directory for this pod's files.
    properties: config.properties keys to set in the copied storage; env: more environment."""

    def __init__(self, storage: Path, root: Path, properties: dict | None = None, env: dict | None = None):
        self.root = Path(root)
        mnt = self.root / "mnt" / "models"
        shutil.copytree(storage, mnt)
        cfg = mnt / "config" / "config.properties"
        text = cfg.read_text()
        self.ports = {k: free_port() for k in ("inference", "management", "metrics", "grpc_ts", "grpc_mgmt")}
        settings = {"inference_address": f"http://127.0.0.1:{self.ports['inference']}",
                    "management_address": f"http://127.0.0.1:{self.ports['management']}",
                    "metrics_address": f"http://127.0.0.1:{self.ports['metrics']}",
                    "grpc_inference_port": self.ports["grpc_ts"], "grpc_management_port": self.ports["grpc_mgmt"],
                    **(properties or {})}
        for key, value in settings.items():
            text = "\n".join(f"{key}={value}" if ln.startswith(f"{key}=") else ln for ln in text.splitlines())
        cfg.write_text(text + f"\ninitial_worker_port={next_worker_port()}\n")
        self.http, self.grpc, self.public_metrics, self.status = free_port(), free_port(), free_port(), free_port()
        self.bridge, self.probe_port = free_port(), free_port()
        self.env = server_env()
        self.env.update(MODEL_ROOT=str(mnt), RUNTIME_DIR=str(self.root / "run"), HTTP_PORT=str(self.http),
                        GRPC_PORT=str(self.grpc), METRICS_PORT=str(self.public_metrics),
                        STATUS_PORT=str(self.status), GRPC_BRIDGE_PORT=str(self.bridge), PROBE_PORT=str(self.probe_port),
                        POD_PYTHON=sys.executable,
                        **(env or {}))
        self.out = open(self.root / "stdout.log", "w")
        self.proc = subprocess.Popen([str(ENTRYPOINT)], env=self.env, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.http}"
        self.grpc_target = f"127.0.0.1:{self.grpc}"
        self.direct = f"http://127.0.0.1:{self.ports['inference']}"  # TorchServe itself, loopback

    def probe(self, kind: str) -> tuple:
        """The runtime's declared probe as the kubelet runs it: GET its path on the port it names
        (the image's PROBE_PORT 8083 = this pod's probe_port; HTTP_PORT 8080 = its http port),
        within its timeoutSeconds. (passed, body)."""
        import requests

        rt = yaml.safe_load(RUNTIME_MANIFEST.read_text())
        spec = rt["spec"]["containers"][0][{"live": "livenessProbe", "ready": "readinessProbe"}[kind]]
        get = spec["httpGet"]
        ports = {8083: self.probe_port, 8080: self.http}  # kserve/Dockerfile's PROBE_PORT, HTTP_PORT
        if get["port"] not in ports:
            raise ValueError(f"{RUNTIME_MANIFEST}: the {kind} probe names port {get['port']}, which the image does not serve")
        try:
            r = requests.get(f"http://127.0.0.1:{ports[get['port']]}{get['path']}", timeout=spec["timeoutSeconds"])
        except requests.RequestException as e:
            return False, f"{kind}: {e}"
        return r.status_code < 400, r.text

    def wait(self, kind: str, timeout: float = 180) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the pod exited ({self.proc.returncode}): {self.log('stdout.log')[-3000:]}")
            ok, body = LocalPod.probe(self, kind)  # a subclass may reshape probe()
            if ok:
                return body
            time.sleep(1)
        raise TimeoutError(f"{kind} probe never passed: {body}\n{self.log('stdout.log')[-3000:]}\n{self.log()[-3000:]}")

    def processes(self) -> list:
        """Every process of the pod (psutil.Process): its process group, which TorchServe's
        frontend keeps after its launcher exits and it is no longer a descendant."""
        import psutil

        out = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.proc.pid:
                    out.append(p)
            except (ProcessLookupError, psutil.Error):
                pass
        return out

    def inference_key(self) -> str:
        """TorchServe's inference key (the pod runs it with token authorization, pod/start.py): what
        a client of `direct` sends as `Authorization: Bearer KEY`."""
        return json.loads((self.root / "run" / "key_file.json").read_text())["inference"]["key"]

    def log(self, name: str = "model_log.log") -> str:
        return read_log((self.root / name) if name == "stdout.log" else (self.root / "run" / "logs" / name))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        try:  # TorchServe's frontend daemonized itself out of the group: stop it by its config
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.out.close()
