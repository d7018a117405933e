"""Our cluster runtime: the manifests `python -m compiled_serving.kserve` writes by default (our
ClusterServingRuntime and InferenceServices naming it, sized from the archives), validated
against KServe's CRD schemas, and the image's entrypoint (kserve/entrypoint.sh) run exactly as
the container runs it -- same command and environment, with MODEL_ROOT, RUNTIME_DIR and
HTTP_PORT pointing under a test directory -- probed the way the kubelet runs the runtime's
declared HTTP probes.

Only the storage config's loopback ports are changed (to free ports: tests run in parallel).
"""
from __future__ import annotations

import gzip
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import requests
import torch
import yaml

from conftest import CLUSTER_WORKERS, ROOT, build_mar, close, corrupt_inside_mar, eager, two
from kserve_kit import Container, lay_out, unknown_fields
from compiled_serving import kserve as kserve_script

pytestmark = pytest.mark.server

ENTRYPOINT = Path(ROOT) / "kserve" / "entrypoint.sh"
DATA = Path(__file__).parent / "data"


def schema(name):
    with gzip.open(DATA / name) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# Manifests


def test_the_pods_body_limit_and_jvm_caps_follow_its_models(cluster_layout, cluster_mar):
    """max_request_size is the largest body the model accepts (its 8 MiB JSON limit: its binary
    rows are smaller) plus a sixteenth, not the template's 128 MiB; the JVM's heap and direct
    memory are capped in vmargs; cs-kserve says so."""
    out, r = cluster_layout
    props = (out / "storage" / "config" / "config.properties").read_text()
    limit = (8 << 20) + (8 << 20) // 16
    assert f"\nmax_request_size={limit}\n" in props
    vmargs = next(ln for ln in props.splitlines() if ln.startswith("vmargs="))
    assert f"-Xmx{kserve_script.JVM_HEAP_MIB}m" in vmargs and f"-XX:MaxDirectMemorySize={64 + 4 * 9}m" in vmargs
    assert f"request bodies up to {limit} bytes" in r.stdout
    # the gate's bound (pod/config.py), with its arithmetic: 64 + 2 x 9 + min(2, batchSize 4) x 9 <= 100
    assert ("at most 2 request bodies of 1,000,000 bytes or more reach TorchServe at once (64 MiB pool + 2 x 9 MiB "
            "bodies received + min(2, batchSize 4) x 9 MiB in the encoding of a batch = 100 MiB <= 100 MiB") in r.stdout
    assert "29 of 100,000-999,999 bytes (29 + min(29, 4)) x 999,999 <= 32 MiB; 163 of 10,000-99,999" in r.stdout


def test_the_large_bodies_at_once_follow_direct_memory_body_limit_and_batch_size():
    from pod.config import PodConfigError, large_bodies, large_bodies_at_once, pool_tiers

    assert large_bodies_at_once(100, 8912896, 4)[0] == 2
    assert large_bodies_at_once(100, 8912896, 1)[0] == 3  # one body per batch: one encoding at a time
    assert large_bodies_at_once(64 + 8 * 9, 8912896, 2)[0] == 6  # 64 + 6 x 9 + 2 x 9 = 136
    assert large_bodies_at_once(80, 8912896, 4)[0] == 0
    assert pool_tiers(4)[0] == ((100_000, 999_999, 29), (10_000, 99_999, 163))  # within the 64 MiB pool
    props = {"max_request_size": "8912896", "vmargs": "-Xmx384m -XX:MaxDirectMemorySize=80m"}
    with pytest.raises(PodConfigError, match="raise it to at least 82m"):
        large_bodies(props)
    with pytest.raises(PodConfigError, match="MaxDirectMemorySize=NNNm"):
        large_bodies({"max_request_size": "8912896", "vmargs": "-Xmx384m"})


def test_manifests_name_our_runtime_validate_and_follow_the_archive(cluster_layout, cluster_mar):
    import jsonschema

    out, r = cluster_layout
    isvc_schema = schema("kserve_inferenceservice_v1beta1.schema.json.gz")
    rt_schema = schema("kserve_clusterservingruntime_v1alpha1.schema.json.gz")
    files = sorted((out / "manifests").glob("compiled-*.yaml"))
    # a CPU-only archive: no GPU manifests unless forced, and the layout says why
    assert [f.name for f in files] == sorted(f"compiled-{p}.yaml" for p in ("v1", "v2", "grpc-v2"))
    assert "no gpu manifests" in r.stderr and "has no cuda variant" in r.stderr
    frontend = kserve_script.frontend_mib(kserve_script.body_limit([kserve_script.read_mar(str(cluster_mar))]))
    mem = f"{frontend + kserve_script.FRONTS_MIB + CLUSTER_WORKERS * kserve_script.WORKER_CPU_MIB}Mi"
    for f in files:
        doc = yaml.safe_load(f.read_text())
        jsonschema.Draft7Validator(isvc_schema).validate(doc)
        assert unknown_fields(doc, isvc_schema) == [], f.name
        model = doc["spec"]["predictor"]["model"]
        assert model["runtime"] == "compiled-torchserve"
        # gRPC goes to the bridge's port, over h2c; REST to the container's http1 port
        want_ports = [{"name": "h2c", "containerPort": 8081, "protocol": "TCP"}] if "grpc" in f.name else None
        assert model.get("ports") == want_ports, f.name
        # KServe merges the runtime's container into the model's by containerPort; Knative takes
        # one port only, so a service with more goes as a plain Deployment (RawDeployment)
        rt_ports = yaml.safe_load((Path(ROOT) / "kserve" / "servingruntime.yaml").read_text())["spec"]["containers"][0]["ports"]
        merged = {p["containerPort"] for p in rt_ports + (model.get("ports") or [])}
        mode = doc["metadata"].get("annotations", {}).get("serving.kserve.io/deploymentMode")
        assert (mode == "RawDeployment") == (len(merged) > 1), (f.name, merged, mode)
        res = model["resources"]
        assert res["requests"] == res["limits"] == {"cpu": str(CLUSTER_WORKERS + kserve_script.FRONTS_CPU), "memory": mem}
    runtimes = list(yaml.safe_load_all((out / "manifests" / "servingruntime.yaml").read_text()))
    assert len(runtimes) == 1
    rt = runtimes[0]
    jsonschema.Draft7Validator(rt_schema).validate(rt)
    assert unknown_fields(rt, rt_schema) == []
    assert rt["kind"] == "ClusterServingRuntime" and rt["metadata"]["name"] == "compiled-torchserve"
    assert {f["name"] for f in rt["spec"]["supportedModelFormats"]} == {"pytorch", "compiled-pytorch"}
    assert rt["spec"]["protocolVersions"] == ["v1", "v2", "grpc-v2"]
    torch_mm = ".".join(torch.__version__.split(".")[:2])
    assert rt["spec"]["containers"][0]["image"] == f"{kserve_script.IMAGE_REPO}:torch{torch_mm}-cpu"
    # the template in the repository validates too, and the check can fail
    template = yaml.safe_load((Path(ROOT) / "kserve" / "servingruntime.yaml").read_text())
    jsonschema.Draft7Validator(rt_schema).validate(template)
    template["spec"]["protocolversions"] = ["v2"]
    assert unknown_fields(template, rt_schema) == [".spec.protocolversions"]


def test_gpu_manifests_when_forced_and_image_torch_mismatch_refused(cluster_mar, tmp_path):
    r = lay_out([cluster_mar], tmp_path / "gpu", "--force-gpu", "--gpus", "2", "--device", "gpu",
                "--protocol", "v2")
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load((tmp_path / "gpu" / "manifests" / "compiled-v2-gpu.yaml").read_text())
    model = doc["spec"]["predictor"]["model"]
    assert model["runtime"] == "compiled-torchserve-gpu"
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "2"
    rt = yaml.safe_load((tmp_path / "gpu" / "manifests" / "servingruntime.yaml").read_text())
    assert rt["metadata"]["name"] == "compiled-torchserve-gpu" and rt["spec"]["containers"][0]["image"].endswith("-cuda")
    r = lay_out([cluster_mar], tmp_path / "old", "--image-torch", "2.4")
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
    # the pod's fronts: the distribution's nginx and grpcio for the bridge, in the handler's Python;
    # the image imports the pod's processes when it is built
    assert re.search(r"apt-get install[^&]* nginx( |$)", runs) and '"grpcio>=' in runs
    assert "import handlers.ts_entry, pod.grpc_bridge, pod.status" in runs
    env = " ".join(rest for op, rest in ops if op == "ENV")
    assert "GRPC_PORT=8081" in env and "METRICS_PORT=8082" in env


# ---------------------------------------------------------------------------------------------
# The entrypoint, run as the container runs it


@pytest.fixture(scope="module")
def container(cluster_layout, tmp_path_factory):
    c = Container(cluster_layout[0] / "storage", tmp_path_factory.mktemp("container"))
    yield c
    c.stop()


def test_entrypoint_serves_probes_pass_and_v1_answers_equal_eager(container):
    container.wait("live")
    r = container.wait("ready")
    assert json.loads(r.stdout) == {"ready": True}
    # the runtime config the pod wrote: TorchServe on loopback, paths under MODEL_ROOT, everything
    # else the storage's
    cfg = (container.root / "run" / "config.properties").read_text()
    assert f"inference_address=http://127.0.0.1:{container.ports['inference']}" in cfg and "/mnt/models" not in cfg.split(
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
    assert len(rss) == CLUSTER_WORKERS, rss
    print(f"worker RSS MiB: {[round(x) for x in rss]}")
    assert max(rss) < kserve_script.WORKER_CPU_MIB, rss
    assert "process died" not in container.log("ts_log.log")


def test_broken_archive_is_never_ready_and_says_why(cluster_mar, artifacts, tmp_path_factory):
    store = tmp_path_factory.mktemp("cluster_broken_store")
    bad = build_mar(artifacts.get("cls_export"), "bad", store)
    corrupt_inside_mar(bad)
    out = tmp_path_factory.mktemp("cluster_broken_out")
    r = lay_out([cluster_mar, bad], out)
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
        listed = c.management("/models/bad").json()
        assert any(w["status"] == "READY" for w in listed[0]["workers"]), listed
        # ... and the readiness probe fails, names the reason (once the pod's poll has had an
        # answer: on a busy host the management API can answer late, pod/state.py HOLD_S), and
        # stays failed
        deadline = time.time() + 60
        while True:
            p = c.probe("ready")
            assert p.returncode == 1, p.stdout
            if "bad: failed:" in p.stdout or time.time() > deadline:
                break
            time.sleep(1)
        for _ in range(3):
            assert p.returncode == 1 and "bad: failed:" in p.stdout and needle in p.stdout, p.stdout
            time.sleep(2)
            p = c.probe("ready")
        c.wait("live")
    finally:
        c.stop()
