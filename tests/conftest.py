"""Shared fixtures: artifacts compiled once per test run, and real TorchServe processes.

Every artifact is built through the public CLI (python -m compiled_serving.compile) and cached for the run;
every archive through python -m compiled_serving.archive (torch-model-archiver). Servers are real
`torchserve --start` processes on loopback, configured from the repository's config.properties
with only ports and paths changed, so the security settings under test are the shipped ones.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from compiled_serving import local_server  # noqa: E402
from compiled_serving.local_server import LocalTorchServe, server_env  # noqa: E402

PY = sys.executable
# The build side's console commands (pyproject.toml's [project.scripts], installed into .venv by
# scripts/setup_env.sh) by module: the tests run the tools as a user does. Where they are not
# installed (the GPU machine's kit runs python3 with the repository on its path) the module runs.
CS_COMMANDS = {"compile": "cs-compile", "import_artifact": "cs-import", "archive": "cs-archive",
               "inspect_artifact": "cs-inspect", "verify_store": "cs-verify", "kserve": "cs-kserve",
               "client": "cs-client", "export_lm": "cs-export-lm"}


def cs_command(module: str) -> list:
    """The command line that runs compiled_serving.MODULE: its console command where installed."""
    exe = Path(PY).parent / CS_COMMANDS[module]
    return [str(exe)] if exe.exists() else [PY, "-m", f"compiled_serving.{module}"]



# Under pytest-xdist (scripts/test.sh runs `-n 2`) each worker is a process of its own. TorchServe
# names its workers' unix sockets java.io.tmpdir/.ts.sock.<port> from initial_worker_port (a
# server started otherwise than by LocalTorchServe, which gives each its own, has /tmp), and
# compiled_serving.local_server gives each server of a process a block of 100 ports counted from
# the process id, so two workers' blocks could meet: each xdist worker counts from a range of its own.
_XDIST = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST.startswith("gw"):
    local_server._worker_port = 9000 + int(_XDIST[2:]) % 5 * 10000

# The processes a test starts take their temporary files from a directory of this pytest process
# alone: torch-model-archiver stages every archive in $TMPDIR/<model name> and deletes it after,
# so two processes (xdist workers, or two people's runs on one machine) archiving a model of the
# same name at once would share that directory and fail.
_RUN_TMP = tempfile.mkdtemp(prefix=f"cs-tests-{_XDIST or 'run'}-")
os.environ["TMPDIR"] = _RUN_TMP


def pytest_unconfigure(config):
    shutil.rmtree(_RUN_TMP, ignore_errors=True)


# A worker that runs in this process (tests/worker_kit.py) and meets a sticky device fault asks
# handlers/torchserve/restart.py to os._exit(70): in the pytest process that would end the run with
# no report. Its exit is replaced here, for the whole session (its timer can fire after the test
# that started it), by one that records the code; a child forked from here (tests/test_frames.py)
# exits as the worker does. The fixture below fails the test whose worker asked for the exit.
_PYTEST_PID = os.getpid()
EXITS_ASKED: list = []


def _exit_unless_pytest(code: int) -> None:
    if os.getpid() != _PYTEST_PID:
        os._exit(code)
    EXITS_ASKED.append(code)


def pytest_configure(config):
    from handlers.torchserve import restart

    restart._exit = _exit_unless_pytest


@pytest.fixture(autouse=True)
def the_runs_tmpdir_after_each_test():
    """A worker driven in this process points TMPDIR at a scratch directory of its own
    (handlers/torchserve/scratch.enter), and its exit after a sticky fault removes that directory
    (restart._exit_now: scratch.remove_now) while this process goes on: every later test's
    subprocess would inherit a TMPDIR that is gone (cs-export-lm's AOTInductor load failed with
    "Error generating temporary directory" in a CI run). Each test ends with the run's own back."""
    before = os.environ.get("TMPDIR")
    yield
    if os.environ.get("TMPDIR") != before:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        tempfile.tempdir = None  # Python's tempfile re-reads TMPDIR
    os.makedirs(_RUN_TMP, exist_ok=True)


@pytest.fixture(autouse=True)
def no_worker_exit_in_the_test_process():
    """Fails a test after which an in-process worker has an exit pending (restart.exit_soon: a
    sticky device fault), and clears it so the next test starts with none."""
    from handlers.torchserve import restart

    yield
    reason, restart._exit_reason = restart._exit_reason, None
    if reason is not None:
        pytest.fail(f"an in-process worker asked to exit the test process (os._exit(70)): {reason}", pytrace=False)


# The modules whose tests use main_server: under `-n N --dist loadfile` one xdist worker runs them
# all, so main_server (11 archives, one TorchServe) starts once. A module missing here still
# passes; it only starts a main_server of its own on another worker.
MAIN_SERVER_MODULES = {"test_serving.py", "test_batching.py", "test_client.py", "test_grpc.py", "test_wire_grpc.py"}


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the MAIN_SERVER_MODULES as one file: each module runs whole on one
    worker (its module-scoped servers start once). pytest-xdist's own grouping by mark
    (`--dist loadgroup`) does not work with pytest 9: it renames items through `_nodeid`, which
    pytest 9's `nodeid` no longer reads."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "main_server" if Path(path).name in MAIN_SERVER_MODULES else path

    return ModuleScheduling(config, log)


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory every xdist worker of this run shares (the run's base temp directory; the
    session's own without xdist), so what is built once serves them all."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if _XDIST else base
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextmanager
def file_lock(path: Path):
    """Exclusive across processes (the xdist workers) while held."""
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

# A test that compiles, starts TorchServe or runs the project's scripts in a process of its own is
# marked `server` where it is written: `pytestmark = pytest.mark.server` in its module, or
# `@pytest.mark.server` on the test. `pytest -m "not server"` runs the in-process rest
# (docs/testing.md). The fixtures below that compile or start servers are SERVER_FIXTURES; a test
# that reaches one of them, or whose source or fixtures' source makes one of the SERVER_CALLS,
# without the marker fails the collection (the `gpu` suite, run apart with -m gpu on the GPU
# machine, is exempt).
SERVER_FIXTURES = {"artifacts", "serve", "main_server", "hf_bert"}
# What a test (or a fixture it reaches) does that makes it a `server` test, found in its source:
# starts TorchServe or the pod, compiles with AOTInductor or cs-compile, archives with cs-archive,
# runs one of the project's scripts.
SERVER_CALLS = re.compile(r"\b(?:LocalTorchServe|TorchServe|Container)\(|aoti_compile_and_package\("
                          r"|cs_command\(\"(?:compile|archive)\"\)|\bbuild_mar\(|\[\s*\"(?:ba)?sh\",\s*\"scripts/")


def server_calls(item) -> set:
    """The SERVER_CALLS in the source of `item`'s test function and of every fixture it reaches."""
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        funcs += [d.func for d in defs]
    found = set()
    for f in funcs:
        try:
            found |= {m.group(0) for m in SERVER_CALLS.finditer(inspect.getsource(f))}
        except (OSError, TypeError):  # a built-in fixture (tmp_path, monkeypatch): pytest's own
            continue
    return found


def pytest_collection_modifyitems(config, items):
    unmarked = []
    for item in items:
        if item.get_closest_marker("server") or item.get_closest_marker("gpu"):
            continue
        why = sorted(SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))) + sorted(server_calls(item))
        if why:
            unmarked.append(f"{item.nodeid} ({', '.join(why)})")
    if unmarked:
        raise pytest.UsageError(
            "these tests compile, start TorchServe or run the project's scripts (a fixture of "
            + ", ".join(sorted(SERVER_FIXTURES)) + ", or a call in their own or their fixtures' source) "
            "but are not marked `server`: add `pytestmark = pytest.mark.server` to the module (or "
            "`@pytest.mark.server` to the test) so that `pytest -m \"not server\"` stays in process:\n  "
            + "\n  ".join(sorted(unmarked)))


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
    (bench.results_meta.header) followed by `results`, the values a GPU test module measured.
    Called from a module's autouse fixture after its tests, so a failing run writes too."""
    path = os.environ.get("GPU_RESULTS")
    if not path:
        return
    import torch

    from bench.results_meta import header

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
        with self._lock, file_lock(self.root / f".{out.name}.lock"):
            if not (out / "artifact.json").exists():
                cmd = [*cs_command("compile"), *ARTIFACTS[name], *extra, "--device", self.device,
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
    return Artifacts(shared_dir(tmp_path_factory, "artifacts"), "cpu")


@pytest.fixture(scope="session")
def gpu_artifacts(tmp_path_factory):
    """The GPU suite's artifacts, compiled on the CUDA device `get(name, index)` names, once per run."""
    return Artifacts(shared_dir(tmp_path_factory, "gpu_artifacts"), "cuda")


@pytest.fixture(scope="module")
def results_file(request):
    """The one writer of a measuring module's RESULTS (a dict at its top level): yields it and, once
    the module's tests are done (a failing run writes too), writes its non-empty entries after the
    provenance keys: a `gpu` module to $GPU_RESULTS (write_gpu_results), the CPU fault suite to
    $FAULT_RESULTS. A module asks for it with `pytest.mark.usefixtures("results_file")` in its
    pytestmark."""
    results = request.module.RESULTS
    yield results
    measured = {k: v for k, v in results.items() if v}
    if request.node.get_closest_marker("gpu"):
        write_gpu_results(measured)
    elif os.environ.get("FAULT_RESULTS") and measured:
        from bench.results_meta import header

        path = Path(os.environ["FAULT_RESULTS"])
        out = {**header(f"CPU ({os.cpu_count()} cores), real TorchServe", env=("FAULT_RESULTS",)), **measured}
        try:  # several measuring modules of one run: each adds its entries to what the others wrote
            before = json.loads(path.read_text())
        except (OSError, ValueError):
            before = {}
        if before.get("command") == out["command"]:
            out = {**before, **out}
        path.write_text(json.dumps(out, indent=1) + "\n")


# The KServe tests' archive: two_export with 2 workers, batches of 4 (tests/kserve_kit.py lays it out).
CLUSTER_WORKERS = 2


@pytest.fixture(scope="module")
def cluster_mar(artifacts, tmp_path_factory):
    store = tmp_path_factory.mktemp("cluster_store")
    return build_mar(artifacts.get("two_export"), "two", store, "--workers", str(CLUSTER_WORKERS),
                     "--batch-size", "4", "--max-batch-delay", "300")


@pytest.fixture(scope="module")
def cluster_layout(cluster_mar, tmp_path_factory):
    """(out, completed process) of `python -m compiled_serving.kserve` on cluster_mar."""
    from kserve_kit import lay_out

    out = tmp_path_factory.mktemp("cluster_out")
    r = lay_out([cluster_mar], out)
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r


@pytest.fixture(scope="session")
def hf_bert(tmp_path_factory):
    """A Hugging Face transformers BERT classifier as a user hands it over (examples/hf_bert.py, the
    tiny config, random weights, CPU): (directory holding program.pt2 and its AOTInductor
    package.pt2, the eager model). Exported and compiled once per run, for every test that serves it."""
    import torch

    from examples import hf_bert as hf

    d = shared_dir(tmp_path_factory, "hf_bert")
    with file_lock(d / ".lock"):
        if (d / "package.pt2").exists():  # another xdist worker built it; the weights are seeded
            return d, hf.build("tiny")
        model, ep = hf.export("tiny")
        torch.export.save(ep, d / "program.pt2")
        torch._inductor.aoti_compile_and_package(ep, package_path=str(d / "package.pt2"))
    return d, model


def build_mar(artifact_dirs, name: str, store: Path, *extra) -> Path:
    if isinstance(artifact_dirs, (str, Path)):
        artifact_dirs = [artifact_dirs]
    # The tests' archives: one worker, unbatched, unless a test says otherwise (the shipped
    # defaults are sized for a GPU host: README "Serving settings").
    cmd = [*cs_command("archive"), "--name", name, "--out", str(store), "--workers", "1",
           "--batch-size", "1", "--max-batch-delay", "5", *extra]
    for d in artifact_dirs:
        cmd += ["--artifact", str(d)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=server_env())
    if r.returncode != 0:
        raise RuntimeError(f"archive {name} failed:\n{r.stdout}\n{r.stderr}")
    return store / f"{name}.mar"


class TorchServe(LocalTorchServe):
    """compiled_serving.local_server's server (the shipped config, ports and paths changed), started at
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


def rewrite_model_config(mar, edit, out=None) -> Path:
    """The archive `mar` with its model-config.yaml as `edit(cfg)` leaves the parsed dict (changed
    in place), written to `out`, or over `mar` where none is given; returns the path written."""
    import zipfile

    import yaml

    out = Path(out or mar)
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(mar) as zin, zipfile.ZipFile(tmp, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename == "model-config.yaml":
                cfg = yaml.safe_load(data)
                edit(cfg)
                data = yaml.safe_dump(cfg).encode()
            zout.writestr(item, data)
    os.replace(tmp, out)
    return out


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

    from compiled_serving.compile import load_factory

    model = load_factory(str(ROOT / "examples" / "models.py") + ":" + factory)()
    with torch.no_grad():
        out = model(*inputs)
    return out if isinstance(out, dict) else {"output": out}


# The example models' requests and the comparison every serving test makes (absolute tolerance
# against eager: compiled kernels reorder float sums).
TOL = 1e-4


def image(n, seed=0):
    """`n` inputs of examples/models.py:classifier."""
    import torch

    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def two(n, seed=0):
    """`n` rows of examples/models.py:two_input (features, mask)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.rand(n, 16, generator=g) > 0.3


def close(got: dict, ref: dict):
    """An answer (lists or tensors by output name) equal to eager's within TOL, output by output."""
    import torch

    assert set(got) == set(ref)
    for k in ref:
        t = torch.tensor(got[k]) if not isinstance(got[k], torch.Tensor) else got[k]
        assert t.shape == ref[k].shape, k
        assert (t - ref[k]).abs().max().item() < TOL, k


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


@pytest.fixture(scope="session")
def stubs(tmp_path_factory):
    """TorchServe's gRPC stubs, generated from the .proto files inside its frontend jar."""
    import zipfile

    import ts
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("grpc")
    jar = os.path.join(os.path.dirname(ts.__file__), "frontend", "model-server.jar")
    with zipfile.ZipFile(jar) as z:
        for name in ("inference.proto", "google/rpc/status.proto"):
            z.extract(name, out)
    import grpc_tools

    includes = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main(["protoc", f"-I{out}", f"-I{includes}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(out / "inference.proto"),
                      str(out / "google/rpc/status.proto")])
    assert rc == 0
    sys.path.insert(0, str(out))
    import inference_pb2
    import inference_pb2_grpc

    return inference_pb2, inference_pb2_grpc


def skip_or_fail_in_ci(reason: str) -> None:
    """Skips the test, or under CI=true (.ci/run's machine, where everything the suite needs is
    installed) fails it: a test that cannot run there is a failure to see, not a skip to miss."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and this test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def kserve_env():
    """The Python of .venv-kserve (the kserve SDK and tritonclient), installed on first use."""
    if not (Path(ROOT) / ".venv-kserve" / ".installed").exists():
        r = subprocess.run(["sh", "scripts/setup_kserve_env.sh"], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0:
            skip_or_fail_in_ci("scripts/setup_kserve_env.sh could not install .venv-kserve (the kserve SDK and "
                               f"tritonclient) that the pod's and tritonclient's tests run: {r.stderr[-500:]}")
    return Path(ROOT) / ".venv-kserve" / "bin" / "python"


def worker_pids(ts, model) -> list:
    """The pids of `model`'s workers, as the management API lists them."""
    return sorted(w["pid"] for w in ts.workers(model))


def wait_back(ts, model, gone: set, n: int = 2, timeout: float = 120) -> float:
    """Seconds until `n` workers of `model` are READY, none of them in `gone` (killed ones);
    fails with the server's log where they are not within `timeout`."""
    import time

    t0 = time.time()
    while time.time() - t0 < timeout:
        ws = ts.workers(model)
        if len(ws) == n and all(w.get("status") == "READY" and w.get("pid") not in gone for w in ws):
            return time.time() - t0
        time.sleep(0.2)
    raise AssertionError(f"{model} not back: {ts.workers(model)}\n{ts.log()[-3000:]}")
