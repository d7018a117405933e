"""Our cluster runtime: the manifests `python -m scripts.kserve` writes by default (our
ClusterServingRuntime and InferenceServices naming it, sized from the archives), validated
against KServe's CRD schemas, and the image's entrypoint (kserve/entrypoint.sh) run exactly as
the container runs it -- same command and environment, with MODEL_ROOT, RUNTIME_DIR and
HTTP_PORT pointing under a test directory -- probed the way the kubelet runs the runtime's
declared exec probes.

Only the storage config's loopback ports are changed (to free ports: tests run in parallel).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests
import torch
import yaml

from conftest import PY, ROOT, build_mar, corrupt_inside_mar, eager
from scripts import kserve as kserve_script
from scripts.local_server import free_port, next_worker_port, server_env
from test_kserve import STORAGE_URI, _unknown_fields
from test_serving import close, two

ENTRYPOINT = Path(ROOT) / "kserve" / "entrypoint.sh"
WORKERS = 2
DATA = Path(__file__).parent / "data"


def schema(name):
    with gzip.open(DATA / name) as f:
        return json.load(f)


def lay_out(mars, out, *extra):
    cmd = [PY, "-m", "scripts.kserve", "--storage-uri", STORAGE_URI, "--out", str(out), "--name", "compiled",
           *extra]
    for m in mars:
        cmd += ["--mar", str(m)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=server_env())


@pytest.fixture(scope="module")
def good_mar(artifacts, tmp_path_factory):
    store = tmp_path_factory.mktemp("cluster_store")
    return build_mar(artifacts.get("two_export"), "two", store, "--workers", str(WORKERS),
                     "--batch-size", "4", "--max-batch-delay", "300")


@pytest.fixture(scope="module")
def layout(good_mar, tmp_path_factory):
    out = tmp_path_factory.mktemp("cluster_out")
    r = lay_out([good_mar], out)
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r


# ---------------------------------------------------------------------------------------------
# Manifests


def test_manifests_name_our_runtime_validate_and_follow_the_archive(layout):
    import jsonschema

    out, r = layout
    isvc_schema = schema("kserve_inferenceservice_v1beta1.schema.json.gz")
    rt_schema = schema("kserve_clusterservingruntime_v1alpha1.schema.json.gz")
    files = sorted((out / "manifests").glob("compiled-*.yaml"))
    # a CPU-only archive: no GPU manifests unless forced, and the layout says why
    assert [f.name for f in files] == sorted(f"compiled-{p}.yaml" for p in ("v1", "v2", "grpc-v2"))
    assert "no gpu manifests" in r.stderr and "has no cuda variant" in r.stderr
    mem = f"{kserve_script.FRONTEND_MIB + WORKERS * kserve_script.WORKER_CPU_MIB}Mi"
    for f in files:
        doc = yaml.safe_load(f.read_text())
        jsonschema.Draft7Validator(isvc_schema).validate(doc)
        assert _unknown_fields(doc, isvc_schema) == [], f.name
        model = doc["spec"]["predictor"]["model"]
        assert model["runtime"] == "compiled-torchserve" and "ports" not in model
        res = model["resources"]
        assert res["requests"] == res["limits"] == {"cpu": str(WORKERS), "memory": mem}
    runtimes = list(yaml.safe_load_all((out / "manifests" / "servingruntime.yaml").read_text()))
    assert len(runtimes) == 1
    rt = runtimes[0]
    jsonschema.Draft7Validator(rt_schema).validate(rt)
    assert _unknown_fields(rt, rt_schema) == []
    assert rt["kind"] == "ClusterServingRuntime" and rt["metadata"]["name"] == "compiled-torchserve"
    assert {f["name"] for f in rt["spec"]["supportedModelFormats"]} == {"pytorch", "compiled-pytorch"}
    assert rt["spec"]["protocolVersions"] == ["v1", "v2", "grpc-v2"]
    torch_mm = ".".join(torch.__version__.split(".")[:2])
    assert rt["spec"]["containers"][0]["image"] == f"{kserve_script.IMAGE_REPO}:torch{torch_mm}-cpu"
    # the template in the repository validates too, and the check can fail
    template = yaml.safe_load((Path(ROOT) / "kserve" / "servingruntime.yaml").read_text())
    jsonschema.Draft7Validator(rt_schema).validate(template)
    template["spec"]["protocolversions"] = ["v2"]
    assert _unknown_fields(template, rt_schema) == [".spec.protocolversions"]


def test_gpu_manifests_when_forced_and_image_torch_mismatch_refused(good_mar, tmp_path):
    r = lay_out([good_mar], tmp_path / "gpu", "--force-gpu", "--gpus", "2", "--device", "gpu",
                "--protocol", "v2")
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load((tmp_path / "gpu" / "manifests" / "compiled-v2-gpu.yaml").read_text())
    model = doc["spec"]["predictor"]["model"]
    assert model["runtime"] == "compiled-torchserve-gpu"
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "2"
    rt = yaml.safe_load((tmp_path / "gpu" / "manifests" / "servingruntime.yaml").read_text())
    assert rt["metadata"]["name"] == "compiled-torchserve-gpu" and rt["spec"]["containers"][0]["image"].endswith("-cuda")
    r = lay_out([good_mar], tmp_path / "old", "--image-torch", "2.4")
    assert r.returncode != 0
    assert "the image has torch 2.4" in r.stderr and "--build-arg TORCH_VERSION=" in r.stderr, r.stderr
    assert not (tmp_path / "old" / "storage").exists()


def test_dockerfile_parses_and_names_what_the_runtime_runs():
    """No docker here: the recipe is parsed (instructions, build args) and checked against the
    runtime manifest and the files it copies; it was not built."""
    lines, cur = [], ""
    for raw in (Path(ROOT) / "kserve" / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        cur += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            lines.append(cur.strip())
            cur = ""
    ops = [ln.split(None, 1) for ln in lines]
    known = {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "ENTRYPOINT"}
    assert all(op in known for op, _ in ops), ops
    args = {rest.split("=")[0] for op, rest in ops if op == "ARG"}
    assert {"BASE", "TORCH_VERSION", "TORCH_INDEX", "TORCHSERVE_VERSION"} <= args
    for op, rest in ops:
        if op == "COPY":
            for src in rest.split()[:-1]:
                assert (Path(ROOT) / src).exists(), src
    users = [rest for op, rest in ops if op == "USER"]
    assert users and users[-1] != "0" and users[-1] != "root"
    entry = json.loads(next(rest for op, rest in ops if op == "ENTRYPOINT"))
    assert entry == ["/opt/serve/kserve/entrypoint.sh"]
    rt = yaml.safe_load((Path(ROOT) / "kserve" / "servingruntime.yaml").read_text())
    c = rt["spec"]["containers"][0]
    expose = " ".join(rest for op, rest in ops if op == "EXPOSE").split()
    assert {str(p["containerPort"]) for p in c["ports"]} <= set(expose) and "8081" in expose  # 8081: OIP gRPC
    runs = " ".join(rest for op, rest in ops if op == "RUN")
    assert "torchserve==${TORCHSERVE_VERSION}" in runs
    # the front door's Python: the same kserve pin as scripts/setup_kserve_env.sh, and the entrypoint is told
    kserve_pin = re.search(r'"kserve==[^"]+"', (Path(ROOT) / "scripts" / "setup_kserve_env.sh").read_text()).group(0)
    assert f"/opt/front-door/bin/pip install {kserve_pin}" in runs
    env = " ".join(rest for op, rest in ops if op == "ENV")
    assert "FRONT_DOOR_PYTHON=/opt/front-door/bin/python" in env


# ---------------------------------------------------------------------------------------------
# The entrypoint, run as the container runs it


class Container:
    """kserve/entrypoint.sh with the container's environment; MODEL_ROOT is a copy of the
    layout's storage with free loopback ports."""

    def __init__(self, storage: Path, root: Path, front_door_python=None):
        """front_door_python: the image's FRONT_DOOR_PYTHON (the kserve SDK's Python), so the
        entrypoint starts the front door on HTTP_PORT/GRPC_PORT in front of TorchServe."""
        self.root = root
        mnt = root / "mnt" / "models"
        shutil.copytree(storage, mnt)
        cfg = mnt / "config" / "config.properties"
        text = cfg.read_text()
        self.ports = {k: free_port() for k in ("inference", "management", "metrics", "grpc", "grpc_mgmt")}
        for key, value in (("inference_address", f"http://127.0.0.1:{self.ports['inference']}"),
                           ("management_address", f"http://127.0.0.1:{self.ports['management']}"),
                           ("metrics_address", f"http://127.0.0.1:{self.ports['metrics']}"),
                           ("grpc_inference_port", self.ports["grpc"]),
                           ("grpc_management_port", self.ports["grpc_mgmt"])):
            text = "\n".join(f"{key}={value}" if ln.startswith(f"{key}=") else ln for ln in text.splitlines())
        cfg.write_text(text + f"\ninitial_worker_port={next_worker_port()}\n")
        self.http = free_port()
        self.env = server_env()
        self.env.update(MODEL_ROOT=str(mnt), RUNTIME_DIR=str(root / "run"), HTTP_PORT=str(self.http))
        self.grpc = None
        if front_door_python:
            self.grpc = free_port()
            self.env.update(FRONT_DOOR_PYTHON=str(front_door_python), GRPC_PORT=str(self.grpc))
        self.out = open(root / "stdout.log", "w")
        self.proc = subprocess.Popen([str(ENTRYPOINT)], env=self.env, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.http}"

    def probe(self, kind):
        """The runtime's declared exec probe, in the container's working directory and env."""
        rt = yaml.safe_load((Path(ROOT) / "kserve" / "servingruntime.yaml").read_text())
        cmd = rt["spec"]["containers"][0][{"live": "livenessProbe", "ready": "readinessProbe"}[kind]]["exec"]["command"]
        assert cmd[:3] == ["python3", "-m", "scripts.cluster_probe"]
        return subprocess.run([PY, *cmd[1:]], cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=30)

    def wait(self, kind, timeout=180):
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log("stdout.log")
            r = self.probe(kind)
            if r.returncode == 0:
                return r
            time.sleep(1)
        raise TimeoutError(f"{kind} probe never passed: {r.stdout}\n{self.log()[-3000:]}")

    def log(self, name="model_log.log"):
        p = (self.root / name) if name == "stdout.log" else (self.root / "run" / "logs" / name)
        return p.read_text(errors="replace") if p.exists() else ""

    def worker_rss_mib(self):
        java = psutil.Process(self.proc.pid)
        workers = [p for p in java.children(recursive=True) if "model_service_worker" in " ".join(p.cmdline())]
        return [p.memory_info().rss / 2**20 for p in workers]

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.out.close()


@pytest.fixture(scope="module")
def container(layout, tmp_path_factory):
    c = Container(layout[0] / "storage", tmp_path_factory.mktemp("container"))
    yield c
    c.stop()


def test_entrypoint_serves_probes_pass_and_v1_answers_equal_eager(container):
    container.wait("live")
    r = container.wait("ready")
    assert r.stdout.strip() == "ready: yes"
    # the runtime config the entrypoint wrote: the inference API on the container port, paths
    # under MODEL_ROOT, everything else the storage's
    cfg = (container.root / "run" / "config.properties").read_text()
    assert f"inference_address=http://0.0.0.0:{container.http}" in cfg and "/mnt/models" not in cfg.split(
        "model_snapshot")[0].replace(str(container.root / "mnt" / "models"), "")
    f, m = two(3, seed=5)
    inst = [{"features": f[j].tolist(), "mask": m[j].tolist()} for j in range(3)]
    out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"instances": inst}), f"{container.base}/v1/models/two:predict"],
                         capture_output=True, text=True, timeout=120)
    body, code = out.stdout.rsplit("\n", 1)
    assert code == "200", out.stdout + out.stderr
    ref = eager("two_input", f, m)
    preds = json.loads(body)["predictions"]
    for j, p in enumerate(preds):
        close({k: torch.tensor(v) for k, v in p.items()}, {k: v[j] for k, v in ref.items()})
    inst[0]["mask"] = [0.5] * 16
    bad = requests.post(f"{container.base}/v1/models/two:predict", json={"instances": inst}, timeout=120)
    assert bad.status_code == 400 and "input 'mask'" in bad.json()["message"], bad.text
    # the sizing's per-worker figure holds for the example model
    rss = container.worker_rss_mib()
    assert len(rss) == WORKERS, rss
    print(f"worker RSS MiB: {[round(x) for x in rss]}")
    assert max(rss) < kserve_script.WORKER_CPU_MIB, rss
    assert "process died" not in container.log("ts_log.log")


def test_broken_archive_is_never_ready_and_says_why(good_mar, artifacts, tmp_path_factory):
    store = tmp_path_factory.mktemp("cluster_broken_store")
    bad = build_mar(artifacts.get("cls_export"), "bad", store)
    corrupt_inside_mar(bad)
    out = tmp_path_factory.mktemp("cluster_broken_out")
    r = lay_out([good_mar, bad], out)
    assert r.returncode == 0, r.stderr
    c = Container(out / "storage", tmp_path_factory.mktemp("container_broken"))
    try:
        c.wait("live")
        needle = "does not match its own archive's record"
        deadline = time.time() + 180
        while needle not in c.log() and time.time() < deadline:
            time.sleep(1)
        assert needle in c.log(), c.log()[-3000:]
        # TorchServe itself lists the broken model's worker READY (it answers 503) ...
        listed = requests.get(f"http://127.0.0.1:{c.ports['management']}/models/bad", timeout=10).json()
        assert any(w["status"] == "READY" for w in listed[0]["workers"]), listed
        # ... and the readiness probe fails, names the reason, and stays failed
        for _ in range(3):
            p = c.probe("ready")
            assert p.returncode == 1 and "bad:" in p.stdout and needle in p.stdout, p.stdout
            time.sleep(2)
        assert c.probe("live").returncode == 0
    finally:
        c.stop()
