"""Shared fixtures: artifacts compiled once per test run, and real TorchServe processes.

Every artifact is built through the public CLI (python -m scripts.compile) and cached for the run;
every archive through python -m scripts.archive (torch-model-archiver). Servers are real
`torchserve --start` processes on loopback, configured from the repository's config.properties
with only ports and paths changed, so the security settings under test are the shipped ones.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.local_server import LocalTorchServe, server_env  # noqa: E402

PY = sys.executable

# A test is marked `server` when it compiles, starts TorchServe or runs the project's scripts in
# a process of their own: a fixture of SERVER_FIXTURES in its closure, or those calls in its own
# code. `pytest -m "not server"` runs the in-process rest (docs/testing.md).
SERVER_FIXTURES = {"artifacts", "serve", "main_server", "hf_bert"}
SERVER_CALLS = ("subprocess", "torchserve", "LocalTorchServe", "Popen")


def pytest_collection_modifyitems(config, items):
    import inspect

    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        try:
            # the handler package's own `handlers.torchserve` is no call of TorchServe
            code = inspect.getsource(item.function).replace("handlers.torchserve", "handlers.")
        except (OSError, TypeError):
            code = ""
        module_fixtures = {name for name in fixtures if name not in ("request", "tmp_path", "monkeypatch")
                           and _fixture_code(item, name, SERVER_CALLS)}
        if fixtures & SERVER_FIXTURES or module_fixtures or any(c in code for c in SERVER_CALLS):
            item.add_marker(pytest.mark.server)


def _fixture_code(item, name: str, needles) -> bool:
    """Whether fixture `name` of this item's module calls any of `needles` in its own code."""
    import inspect

    fn = getattr(item.module, name, None)
    fn = getattr(fn, "__wrapped__", fn)
    try:
        return any(n in inspect.getsource(fn) for n in needles)
    except (OSError, TypeError):
        return False


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
    # a text encoder whose length varies: two int64 inputs (ids within the vocabulary, a mask)
    "text_tiny_aoti": ["--model", "examples/text_encoder.py:text_encoder_tiny", "--input", "input_ids:4xS:int64",
                       "--input", "attention_mask:4xS:int64", "--dim", "S=4:64", "--dynamic-batch", "1:16",
                       "--backend", "aoti"],
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


@pytest.fixture(scope="session")
def hf_bert(tmp_path_factory):
    """A Hugging Face transformers BERT classifier as a user hands it over (examples/hf_bert.py, the
    tiny config, random weights, CPU): (directory holding program.pt2 and its AOTInductor
    package.pt2, the eager model). Exported and compiled once per run, for every test that serves it."""
    import torch

    from examples import hf_bert as hf

    d = tmp_path_factory.mktemp("hf_bert")
    model, ep = hf.export("tiny")
    torch.export.save(ep, d / "program.pt2")
    torch._inductor.aoti_compile_and_package(ep, package_path=str(d / "package.pt2"))
    return d, model


def build_mar(artifact_dirs, name: str, store: Path, *extra) -> Path:
    if isinstance(artifact_dirs, (str, Path)):
        artifact_dirs = [artifact_dirs]
    # The tests' archives: one worker, unbatched, unless a test says otherwise (the shipped
    # defaults are sized for a GPU host: README "Serving settings").
    cmd = [PY, "-m", "scripts.archive", "--name", name, "--out", str(store), "--workers", "1",
           "--batch-size", "1", "--max-batch-delay", "5", *extra]
    for d in artifact_dirs:
        cmd += ["--artifact", str(d)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=server_env())
    if r.returncode != 0:
        raise RuntimeError(f"archive {name} failed:\n{r.stdout}\n{r.stderr}")
    return store / f"{name}.mar"


class TorchServe(LocalTorchServe):
    """scripts.local_server's server (the shipped config, ports and paths changed), started at
    construction and checked to have come up (its key file), with the calls tests make."""

    def __init__(self, workdir: Path, store: Path, models: dict):
        super().__init__(workdir, store, models)
        self.key()  # waits for the key file; raises with TorchServe's output if it did not start

    def describe(self, name) -> dict:
        """The handler's own description (customizedMetadata of GET /models/NAME?customized=true):
        {"ready", "load_error", "device_fault"}; {} when the worker gave none."""
        r = requests.get(f"{self.mgmt}/models/{name}?customized=true", headers=self.auth("management"), timeout=30)
        meta = r.json()[0].get("customizedMetadata") if r.status_code == 200 else None
        return json.loads(meta) if isinstance(meta, str) and meta.startswith("{") else (meta or {})

    def predict(self, model, body, content_type="application/json", headers=None, auth=True, timeout=120):
        h = {"Content-Type": content_type}
        if auth:
            h.update(self.auth())
        h.update(headers or {})
        data = json.dumps(body) if isinstance(body, (dict, list)) else body
        if isinstance(data, bytearray):  # requests sends only str/bytes bodies as-is
            data = bytes(data)
        return requests.post(f"{self.base}/predictions/{model}", data=data, headers=h, timeout=timeout)


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
    from handlers.artifact.metadata import read_spec, sha256_file, write_spec

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
    # value checks off: ids past the table reach the model, which fails on them at run time
    "lookup": ("lookup_export", ["--batch-size", "8", "--max-batch-delay", "600",
                                 "--handler-option", "check_values=false"]),
    "lookup_checked": ("lookup_export", ["--batch-size", "8", "--max-batch-delay", "600"]),
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
