"""Shared fixtures: artifacts compiled once per test run, and real TorchServe processes.

Every artifact is built through the public CLI (python -m scripts.compile) and cached for the run;
every archive through python -m scripts.archive (torch-model-archiver). Servers are real
`torchserve --start` processes on loopback, configured from the repository's config.properties
with only ports and paths changed, so the security settings under test are the shipped ones.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PY = sys.executable
# torchserve and torch-model-archiver: beside this Python (.venv), else on PATH (GPU kit)
BIN = Path(PY).parent if (Path(PY).parent / "torchserve").exists() else Path(shutil.which("torchserve") or PY).parent

# name -> compile.py arguments. Example batches sit inside the dynamic range (not 1).
ARTIFACTS = {
    "cls_aoti": ["--model", "examples/models.py:classifier", "--input", "image:4x3x32x32:float32",
                 "--dynamic-batch", "1:16", "--backend", "aoti", "--bare-so"],
    "cls_export": ["--model", "examples/models.py:classifier", "--input", "image:4x3x32x32:float32",
                   "--dynamic-batch", "1:16", "--backend", "export"],
    "two_aoti": ["--model", "examples/models.py:two_input", "--input", "features:4x16:float32",
                 "--input", "mask:4x16:bool", "--dynamic-batch", "1:32", "--backend", "aoti", "--bare-so"],
    "two_export": ["--model", "examples/models.py:two_input", "--input", "features:4x16:float32",
                   "--input", "mask:4x16:bool", "--dynamic-batch", "1:32", "--backend", "export"],
    # narrow range: batches of 8 single-row requests must be split; 1 row padded up to 2
    "two_export_2to4": ["--model", "examples/models.py:two_input", "--input", "features:3x16:float32",
                        "--input", "mask:3x16:bool", "--dynamic-batch", "2:4", "--backend", "export"],
    # ids outside 0..7 make the model itself fail at run time (examples/models.py:lookup)
    "lookup_export": ["--model", "examples/models.py:lookup", "--input", "ids:4x3:int64",
                      "--dynamic-batch", "1:32", "--backend", "export"],
    # fixed batch of 4: everything is padded or split to exactly 4 rows
    "cls_export_fixed4": ["--model", "examples/models.py:classifier", "--input", "image:4x3x32x32:float32",
                          "--backend", "export"],
}


def write_gpu_results(results: dict) -> None:
    """GPU_RESULTS=path: write the device list, date, torch and this run's command
    (scripts.results_meta.header) followed by `results`, the values a GPU test module measured.
    Called from a module's autouse fixture after its tests, so a failing run writes too."""
    path = os.environ.get("GPU_RESULTS")
    if not path:
        return
    import torch

    from scripts.results_meta import header

    head = header([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], env=("GPU_RESULTS",))
    with open(path, "w") as f:
        json.dump({**head, **results}, f, indent=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Artifacts:
    def __init__(self, root: Path, device: str):
        self.root = root
        self.device = device
        self._lock = threading.Lock()

    def get(self, name: str, index: int = 0, extra=()) -> Path:
        """Compile once per run; `index` picks the CUDA device compiled on."""
        tag = self.device if self.device == "cpu" else f"cuda{index}"
        out = self.root / f"{name}_{tag}{'_'.join([''] + [e.strip('-') for e in extra])}"
        with self._lock:
            if not (out / "artifact.json").exists():
                cmd = [PY, "-m", "scripts.compile", *ARTIFACTS[name], *extra, "--device", self.device,
                       "--out", str(out)]
                if self.device == "cuda":
                    cmd += ["--device-index", str(index)]
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"compile {name} failed:\n{r.stdout}\n{r.stderr}")
        return out

    def copy(self, name: str, dest_name: str) -> Path:
        """A private copy of an artifact directory, for tests that alter it."""
        dest = self.root / dest_name
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(self.get(name), dest)
        return dest


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    return Artifacts(tmp_path_factory.mktemp("artifacts"), "cpu")


def build_mar(artifact_dirs, name: str, store: Path, *extra) -> Path:
    if isinstance(artifact_dirs, (str, Path)):
        artifact_dirs = [artifact_dirs]
    # The tests' archives: one worker, unbatched, unless a test says otherwise (the shipped
    # defaults are sized for a GPU host: README "Serving settings").
    cmd = [PY, "-m", "scripts.archive", "--name", name, "--out", str(store), "--workers", "1",
           "--batch-size", "1", "--max-batch-delay", "5", *extra]
    for d in artifact_dirs:
        cmd += ["--artifact", str(d)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
    if r.returncode != 0:
        raise RuntimeError(f"archive {name} failed:\n{r.stdout}\n{r.stderr}")
    return store / f"{name}.mar"


def _env():
    env = dict(os.environ)
    # In-process handler tests set this in os.environ (ts_entry.initialize); servers started
    # later must see TorchServe's default, which the handler under test changes by itself.
    env.pop("TS_DECODE_INPUT_REQUEST", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


class TorchServe:
    """A real TorchServe started with `torchserve --start --foreground` in its own directory."""

    def __init__(self, workdir: Path, store: Path, models: dict, grpc: bool = False):
        self.workdir = workdir
        self.store = store
        self.ports = {k: free_port() for k in ("inf", "mgmt", "metrics", "grpc", "grpc_mgmt")}
        cfg = (ROOT / "config.properties").read_text()
        subs = {"8080": self.ports["inf"], "8081": self.ports["mgmt"], "8082": self.ports["metrics"],
                "7070": self.ports["grpc"], "7071": self.ports["grpc_mgmt"]}
        for old, new in subs.items():
            cfg = re.sub(rf"(?m)^(\w+)=(.*){old}$", rf"\g<1>=\g<2>{new}", cfg)
            cfg = re.sub(rf"(?m)^(grpc_\w+_port)={old}$", rf"\g<1>={new}", cfg)
        cfg = re.sub(r"(?m)^model_store=.*$", f"model_store={store}", cfg)
        # Several servers in one run: distinct worker socket ports (/tmp/.ts.sock.<port>) and
        # pid files (torchserve keeps one in the temp dir and refuses a second instance).
        cfg += f"\ninitial_worker_port={TorchServe._next_worker_port()}\n"
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "tmp").mkdir(exist_ok=True)
        (workdir / "config.properties").write_text(cfg)
        # config.properties names log4j2.xml relative to where TorchServe starts, as beside it here
        shutil.copy2(ROOT / "log4j2.xml", workdir / "log4j2.xml")
        self.base = f"http://127.0.0.1:{self.ports['inf']}"
        self.mgmt = f"http://127.0.0.1:{self.ports['mgmt']}"
        self.models = models
        spec = ",".join(f"{n}={Path(m).name}" for n, m in models.items())
        env = _env()
        env["LOG_LOCATION"] = str(workdir / "logs")
        env["TMPDIR"] = str(workdir / "tmp")
        env["METRICS_LOCATION"] = str(workdir / "logs")
        self.proc = subprocess.Popen(
            [str(BIN / "torchserve"), "--start", "--foreground", "--ncs", "--model-store", str(store),
             "--models", spec, "--ts-config", str(workdir / "config.properties")],
            cwd=workdir, env=env, stdout=open(workdir / "stdout.log", "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self._keys = None
        deadline = time.time() + 90
        while not (workdir / "key_file.json").exists():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"torchserve did not start: {self.log('stdout.log')[-3000:]}")
            time.sleep(0.5)

    _worker_port = 9000 + (os.getpid() % 200) * 100

    @classmethod
    def _next_worker_port(cls) -> int:
        cls._worker_port += 100
        return cls._worker_port

    @property
    def keys(self) -> dict:
        if self._keys is None:
            path = self.workdir / "key_file.json"
            deadline = time.time() + 60
            while not path.exists() and time.time() < deadline:
                time.sleep(0.5)
            while True:  # TorchServe creates the file before it has written the keys into it
                try:
                    self._keys = json.loads(path.read_text())
                    break
                except json.JSONDecodeError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.2)
        return self._keys

    def auth(self, kind="inference"):
        return {"Authorization": f"Bearer {self.keys[kind]['key']}"}

    def model_status(self, name):
        r = requests.get(f"{self.mgmt}/models/{name}", headers=self.auth("management"), timeout=10)
        if r.status_code != 200:
            return []
        return [w.get("status") for w in r.json()[0].get("workers", [])]

    def describe(self, name) -> dict:
        """The handler's own description (customizedMetadata of GET /models/NAME?customized=true):
        {"ready", "load_error", "device_fault"}; {} when the worker gave none."""
        r = requests.get(f"{self.mgmt}/models/{name}?customized=true", headers=self.auth("management"), timeout=30)
        meta = r.json()[0].get("customizedMetadata") if r.status_code == 200 else None
        return json.loads(meta) if isinstance(meta, str) and meta.startswith("{") else (meta or {})

    def wait_ready(self, names=None, timeout=300):
        names = names or list(self.models)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"torchserve exited: {self.log('stdout.log')[-3000:]}")
            try:
                if all(s and all(x == "READY" for x in s) for s in map(self.model_status, names)):
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"models {names} not ready: {self.log('logs/model_log.log')[-4000:]}")

    def log(self, rel="logs/model_log.log") -> str:
        p = self.workdir / rel
        return p.read_text(errors="replace") if p.exists() else ""

    def predict(self, model, body, content_type="application/json", headers=None, auth=True, timeout=120):
        h = {"Content-Type": content_type}
        if auth:
            h.update(self.auth())
        h.update(headers or {})
        data = json.dumps(body) if isinstance(body, (dict, list)) else body
        if isinstance(data, bytearray):  # requests sends only str/bytes bodies as-is
            data = bytes(data)
        return requests.post(f"{self.base}/predictions/{model}", data=data, headers=h, timeout=timeout)

    def stop(self):
        from scripts.local_server import stop_server

        stop_server(self.proc, self.store)


@pytest.fixture(scope="session")
def serve(tmp_path_factory):
    """Factory: serve({name: mar_path}) -> started TorchServe (stopped at session end)."""
    servers = []

    def start(models: dict, ready=True, timeout=300) -> TorchServe:
        stores = {Path(m).parent for m in models.values()}
        assert len(stores) == 1, "all archives of one server must share a model store"
        ts = TorchServe(tmp_path_factory.mktemp("ts"), stores.pop(), models)
        servers.append(ts)
        if ready:
            ts.wait_ready(timeout=timeout)
        return ts

    yield start
    for ts in servers:
        ts.stop()


def corrupt_inside_mar(mar, member="model.pt2"):
    """Damage the artifact inside a built archive (disk or transfer corruption after archiving)."""
    import zipfile

    tmp = str(mar) + ".tmp"
    with zipfile.ZipFile(mar) as zin, zipfile.ZipFile(tmp, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == member:
                data = data[:100] + b"\x00" * 16 + data[116:]
            zout.writestr(item, data)
    os.replace(tmp, mar)


def rewrite_package_metadata(art, **changes):
    """Alter the AOTInductor metadata inside a .pt2 package, as a build for another target would."""
    import zipfile

    pkg = os.path.join(art, "model.pt2")
    tmp = pkg + ".tmp"
    with zipfile.ZipFile(pkg) as zin, zipfile.ZipFile(tmp, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("wrapper_metadata.json"):
                data = json.dumps({**json.loads(data), **changes}).encode()
            zout.writestr(item, data)
    os.replace(tmp, pkg)


def repin(art, **fields):
    """Rewrite artifact.json with the artifact's current SHA-256 (and any changed fields)."""
    from handlers.metadata import read_spec, sha256_file, write_spec

    spec = read_spec(str(art))
    write_spec(type(spec)(**{**spec.__dict__, "sha256": sha256_file(spec.artifact_path), **fields}), str(art))


def eager(factory: str, *inputs):
    import torch

    from scripts.compile import load_factory

    model = load_factory(str(ROOT / "examples" / "models.py") + ":" + factory)()
    with torch.no_grad():
        out = model(*inputs)
    return out if isinstance(out, dict) else {"output": out}


# name -> (artifact, extra archive.py arguments)
MAIN_MODELS = {
    "cls_aoti": ("cls_aoti", ["--batch-size", "8", "--max-batch-delay", "20"]),
    "cls_so": ("cls_aoti/bare_so", []),
    "cls_export": ("cls_export", []),
    "two_aoti": ("two_aoti", ["--batch-size", "8", "--max-batch-delay", "600"]),
    "two_export": ("two_export", []),
    "two_small": ("two_export_2to4", ["--batch-size", "8", "--max-batch-delay", "600"]),
    "cls_fixed4": ("cls_export_fixed4", ["--batch-size", "8", "--max-batch-delay", "50"]),
    "cls_nosplit": ("cls_export", ["--handler-option", "split_oversized=false"]),
    # small admission limits: a 4-row binary body (49 KB) is over 0.02 MiB, 5 rows over 4
    "cls_limits": ("cls_export", ["--handler-option", "max_body_mb=0.02",
                                  "--handler-option", "max_rows_per_request=4"]),
    "lookup": ("lookup_export", ["--batch-size", "8", "--max-batch-delay", "600"]),
}


@pytest.fixture(scope="session")
def main_server(artifacts, serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    mars = {}
    for name, (art, extra) in MAIN_MODELS.items():
        base, _, sub = art.partition("/")
        path = artifacts.get(base) / sub if sub else artifacts.get(base)
        mars[name] = build_mar(path, name, store, *extra)
    return serve(mars)
