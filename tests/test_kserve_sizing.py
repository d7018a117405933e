"""KServe manifests of GPU-sized archives (issue 39 item 1): the gpu manifests require nodes whose
GPU has the memory the archives' workers need (node affinity on nvidia.com/gpu.memory) and state
what the worker counts were sized for; CPU manifests and archives without a stated need carry neither."""
from __future__ import annotations

import subprocess
import zipfile

import jsonschema
import pytest
import yaml
from conftest import PY, ROOT, build_mar, repin, cs_command
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
    """Archives of the program with each worker running the model (engine=off): one sized for a
    4 GiB GPU with a 1000 MiB overhead (memory caps the count), one with 3 workers chosen by hand."""
    art = cuda_program
    store = tmp_path_factory.mktemp("sized_store")
    r = subprocess.run([*cs_command("archive"), "--artifact", str(art), "--name", "sized", "--out", str(store),
                        "--gpu-memory-gib", "4", "--worker-overhead-mib", "1000", "--handler-option", "engine=off"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "memory caps it" in r.stdout, r.stdout + r.stderr
    # build_mar passes --workers 1 first; a later --workers wins in argparse
    hand = build_mar(art, "hand", store, "--workers", "3", "--gpu-memory-gib", "80", "--handler-option", "engine=off")
    return store / "sized.mar", hand


@pytest.fixture(scope="module")
def engine_mar(cuda_program, sized_mars):
    """The same program archived without engine=off (handler.engine auto: one engine per GPU holds it)."""
    return build_mar(cuda_program, "eng", sized_mars[0].parent, "--workers", "4", "--gpu-memory-gib", "4",
                     "--worker-overhead-mib", "1000")


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


def test_gpu_manifests_require_the_memory_the_workers_need(sized_mars, tmp_path):
    cfgs = [_config(m) for m in sized_mars]
    r = _layout(sized_mars, tmp_path, "--device", "gpu", "--device", "cpu", "--protocol", "v2")
    assert 1 < cfgs[0]["minWorkers"] < 6 and cfgs[1]["minWorkers"] == 3
    need = sum(c["minWorkers"] * c["handler"]["worker_gpu_mb"] for c in cfgs)  # one GPU holds them all
    assert f"{GPU_MEMORY_LABEL} >= {need} MiB" in r.stdout, r.stdout
    gpu = yaml.safe_load((tmp_path / "manifests" / "sized-v2-gpu.yaml").read_text())
    jsonschema.Draft7Validator(crd_schema()).validate(gpu)
    assert unknown_fields(gpu, crd_schema()) == []
    terms = gpu["spec"]["predictor"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [
        {"key": GPU_MEMORY_LABEL, "operator": "Gt", "values": [str(need - 1)]}]}]
    note = gpu["metadata"]["annotations"][SIZING_ANNOTATION]
    assert note.startswith(f"each GPU needs {need} MiB") and "4096 MiB GPU (--gpu-memory-gib 4)" in note, note
    assert f"hand: 3 worker(s) per GPU x {cfgs[1]['handler']['worker_gpu_mb']:g} MiB" in note, note
    # the host-side sizing follows the chosen worker counts
    workers = sum(c["minWorkers"] for c in cfgs)
    assert gpu["spec"]["predictor"]["model"]["resources"]["requests"]["cpu"] == str(workers + 1)
    cpu = yaml.safe_load((tmp_path / "manifests" / "sized-v2.yaml").read_text())
    assert "affinity" not in cpu["spec"]["predictor"] and "annotations" not in cpu["metadata"]


def test_two_gpus_halve_what_each_needs_and_the_affinity_can_be_left_out(sized_mars, tmp_path):
    cfgs = [_config(m) for m in sized_mars]
    _layout(sized_mars, tmp_path / "two", "--device", "gpu", "--protocol", "v1", "--gpus", "2")
    doc = yaml.safe_load((tmp_path / "two" / "manifests" / "sized-v1-gpu.yaml").read_text())
    per_gpu = sum(-(-c["minWorkers"] // 2) * c["handler"]["worker_gpu_mb"] for c in cfgs)
    assert doc["metadata"]["annotations"][SIZING_ANNOTATION].startswith(f"each GPU needs {per_gpu} MiB")
    r = _layout(sized_mars, tmp_path / "none", "--device", "gpu", "--protocol", "v1", "--no-gpu-memory-affinity")
    doc = yaml.safe_load((tmp_path / "none" / "manifests" / "sized-v1-gpu.yaml").read_text())
    assert "affinity" not in doc["spec"]["predictor"] and "no node affinity" in r.stderr


def test_an_archive_served_by_the_engine_needs_its_engine_once_per_gpu(sized_mars, engine_mar, tmp_path):
    """Its worker_gpu_mb is the engine's (weights and overhead, once per GPU), not a worker's: the
    GPUs' need does not grow with the worker count, and the host counts the engine as a process."""
    per_worker, eng = _config(sized_mars[1]), _config(engine_mar)
    assert eng["gpuSizing"]["engine"] is True and "engine" not in per_worker["gpuSizing"]
    for gpus in (1, 2):
        out = tmp_path / f"g{gpus}"
        _layout([sized_mars[1], engine_mar], out, "--device", "gpu", "--protocol", "v1", "--gpus", str(gpus))
        doc = yaml.safe_load((out / "manifests" / "sized-v1-gpu.yaml").read_text())
        need = -(-3 // gpus) * per_worker["handler"]["worker_gpu_mb"] + eng["handler"]["worker_gpu_mb"]
        note = doc["metadata"]["annotations"][SIZING_ANNOTATION]
        assert note.startswith(f"each GPU needs {need:g} MiB") and "eng: one engine per GPU x" in note, note
        # the host: the workers of both, one engine per GPU, the fronts' core
        assert doc["spec"]["predictor"]["model"]["resources"]["requests"]["cpu"] == str(3 + 4 + gpus + 1)
