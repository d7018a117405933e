"""KServe manifests of GPU-sized archives (issue 39 item 1, issue 64): the gpu manifests require nodes
whose GPU has the memory the archives' engines need (node affinity on nvidia.com/gpu.memory) and state
what each archive was sized for; CPU manifests and archives without a stated need carry neither."""
from __future__ import annotations

import subprocess
import zipfile

import jsonschema
import pytest
import yaml
from conftest import PY, ROOT, build_mar, repin, rewrite_model_config, cs_command
from kserve_kit import crd_schema, unknown_fields

from compiled_serving.kserve import GPU_MEMORY_LABEL, SIZING_ANNOTATION

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def cuda_program(artifacts):
    """A CUDA-labelled exported program (archived, never loaded here)."""
    art = artifacts.copy("cls_export", "kserve_sizing_cuda")
    repin(art, device="cuda")
    return art


@pytest.fixture(scope="module")
def sized_mars(cuda_program, tmp_path_factory):
    """Archives of the program, each served by one engine per GPU: one sized for a 4 GiB GPU with a
    1000 MiB overhead, one with 3 workers chosen by hand for an 80 GiB GPU."""
    art = cuda_program
    store = tmp_path_factory.mktemp("sized_store")
    r = subprocess.run([*cs_command("archive"), "--artifact", str(art), "--name", "sized", "--out", str(store),
                        "--gpu-memory-gib", "4", "--worker-overhead-mib", "1000"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "one engine process holds" in r.stdout, r.stdout + r.stderr
    # build_mar passes --workers 1 first; a later --workers wins in argparse
    hand = build_mar(art, "hand", store, "--workers", "3", "--gpu-memory-gib", "80")
    return store / "sized.mar", hand


def _config(mar):
    with zipfile.ZipFile(mar) as z:
        return yaml.safe_load(z.read("model-config.yaml"))


def _layout(mars, out, *extra):
    cmd = [*cs_command("kserve"), "--storage-uri", "gs://b/p", "--out", str(out), "--name", "sized", *extra]
    for m in mars:
        cmd += ["--mar", str(m)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_gpu_manifests_require_the_memory_the_engines_need(sized_mars, tmp_path):
    cfgs = [_config(m) for m in sized_mars]
    r = _layout(sized_mars, tmp_path, "--device", "gpu", "--device", "cpu", "--protocol", "v2")
    assert cfgs[1]["minWorkers"] == 3 and all(c["gpuSizing"]["engine"] is True for c in cfgs)
    need = sum(c["handler"]["worker_gpu_mb"] for c in cfgs)  # one engine of each on the GPU, whatever the workers
    assert f"{GPU_MEMORY_LABEL} >= {need} MiB" in r.stdout, r.stdout
    gpu = yaml.safe_load((tmp_path / "manifests" / "sized-v2-gpu.yaml").read_text())
    jsonschema.Draft7Validator(crd_schema()).validate(gpu)
    assert unknown_fields(gpu, crd_schema()) == []
    terms = gpu["spec"]["predictor"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [
        {"key": GPU_MEMORY_LABEL, "operator": "Gt", "values": [str(need - 1)]}]}]
    note = gpu["metadata"]["annotations"][SIZING_ANNOTATION]
    assert note.startswith(f"each GPU needs {need} MiB") and "4096 MiB GPU (--gpu-memory-gib 4)" in note, note
    assert f"hand: one engine per GPU x {cfgs[1]['handler']['worker_gpu_mb']:g} MiB" in note, note
    # the host: the workers, one engine of each archive on the one GPU, the fronts' core
    workers = sum(c["minWorkers"] for c in cfgs)
    assert gpu["spec"]["predictor"]["model"]["resources"]["requests"]["cpu"] == str(workers + 2 + 1)
    cpu = yaml.safe_load((tmp_path / "manifests" / "sized-v2.yaml").read_text())
    assert "affinity" not in cpu["spec"]["predictor"] and "annotations" not in cpu["metadata"]


def test_each_of_two_gpus_needs_every_engine_and_the_affinity_can_be_left_out(sized_mars, tmp_path):
    cfgs = [_config(m) for m in sized_mars]
    r = _layout(sized_mars, tmp_path / "two", "--device", "gpu", "--protocol", "v1", "--gpus", "2")
    doc = yaml.safe_load((tmp_path / "two" / "manifests" / "sized-v1-gpu.yaml").read_text())
    need = sum(c["handler"]["worker_gpu_mb"] for c in cfgs)
    assert doc["metadata"]["annotations"][SIZING_ANNOTATION].startswith(f"each GPU needs {need:g} MiB")
    workers = sum(c["minWorkers"] for c in cfgs)
    assert doc["spec"]["predictor"]["model"]["resources"]["requests"]["cpu"] == str(workers + 2 * 2 + 1)
    r = _layout(sized_mars, tmp_path / "none", "--device", "gpu", "--protocol", "v1", "--no-gpu-memory-affinity")
    doc = yaml.safe_load((tmp_path / "none" / "manifests" / "sized-v1-gpu.yaml").read_text())
    assert "affinity" not in doc["spec"]["predictor"] and "no node affinity" in r.stderr


def test_an_archive_sized_per_worker_before_the_engine_needs_its_engine_once_per_gpu(sized_mars, tmp_path):
    """An archive made before the engine (gpuSizing without engine: its worker_gpu_mb was one
    worker's copy of the weights plus overhead) is served by the engine today: each GPU needs it
    once, not once per worker."""
    old = rewrite_model_config(sized_mars[1], lambda cfg: cfg["gpuSizing"].pop("engine"), tmp_path / "old.mar")
    mb = _config(old)["handler"]["worker_gpu_mb"]
    _layout([old], tmp_path / "out", "--device", "gpu", "--protocol", "v1", "--gpus", "2")
    doc = yaml.safe_load((tmp_path / "out" / "manifests" / "sized-v1-gpu.yaml").read_text())
    assert doc["metadata"]["annotations"][SIZING_ANNOTATION].startswith(f"each GPU needs {mb:g} MiB")
    assert doc["spec"]["predictor"]["model"]["resources"]["requests"]["cpu"] == str(3 + 2 + 1)
