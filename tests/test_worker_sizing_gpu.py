"""A model sized for its GPU's engine on a real GPU (pytest -m gpu; skipped without CUDA), issue 39
item 1 and issue 64:

- archiving on the GPU machine reads GPU 0's memory (not assumed) and prints the engine's arithmetic;
- a model of 1 GiB of fp16 weights archived for an 8 GiB GPU: its workers load and answer on a GPU
  with only 8 GiB left free (the rest held by this test process), and the whole server uses no more
  GPU memory than the engine's need the archive counted (GPU_RESULTS);
- an engine whose need is more than its GPU has free refuses to load: 503 with needed and free MiB.

GPU_RESULTS=PATH writes what was measured (bench/results_meta.header first).
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import time
import zipfile

import pytest
import torch
import yaml
from conftest import ARTIFACTS, ROOT, build_mar, cs_command

from compiled_serving.local_server import server_env

pytestmark = [pytest.mark.gpu, pytest.mark.server, pytest.mark.usefixtures("results_file")]
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine: GPU sizing tests run on the GPU machine",
                allow_module_level=True)

from handlers.wire import safetensors_io  # noqa: E402

ARTIFACTS.setdefault("encoder_aoti_fp16", [
    "--model", "examples/text_encoder.py:text_encoder", "--input", "input_ids:8xS:int64", "--input",
    "attention_mask:8xS:int64", "--dim", "S=8:128", "--dynamic-batch", "1:16", "--backend", "aoti",
    "--precision", "fp16"])
RESULTS = {}
MIB = 2**20
WIDE, LAYERS = 8192, 8  # 8 x 8192 x 8192 fp16: 1 GiB of weights
TARGET_GIB = 8


def archive(art, name, store, *extra):
    r = subprocess.run([*cs_command("archive"), "--artifact", str(art), "--name", name, "--out", str(store),
                        "--batch-size", "4", "--max-batch-delay", "5", *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env=server_env())
    assert r.returncode == 0, r.stdout + r.stderr
    with zipfile.ZipFile(store / f"{name}.mar") as z:
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("cs-archive: --workers")), "")
    return cfg, line


def test_archiving_on_the_gpu_machine_reads_gpu_0(gpu_artifacts, tmp_path):
    cfg, line = archive(gpu_artifacts.get("encoder_aoti_fp16"), "enc", tmp_path)
    props = torch.cuda.get_device_properties(0)
    total = props.total_memory // MIB
    need = cfg["handler"]["worker_gpu_mb"]
    want = max(2, math.floor(0.75 * (os.cpu_count() or 1)))  # the workers follow the cores
    RESULTS["archive_on_gpu"] = {"line": line, "gpu_total_mib": total, "worker_gpu_mb": need,
                                 "workers": cfg["minWorkers"]}
    assert f"GPU memory {total} MiB (GPU 0 of this machine, {props.name})" in line, line
    assert "assumed" not in line and cfg["gpuSizing"]["gpuMiB"] == total and cfg["gpuSizing"]["engine"]
    assert cfg["minWorkers"] == want and "one engine process holds" in line, (line, cfg)


@pytest.fixture(scope="module")
def wide_program(tmp_path_factory):
    """A torch.export program of LAYERS fp16 Linear(WIDE, WIDE) on cuda:0 (batch 1..16; nn.Sequential
    names its input `input`)."""
    d = tmp_path_factory.mktemp("wide")
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        lin = torch.nn.Linear(WIDE, WIDE, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(WIDE, WIDE, generator=g) / WIDE**0.5)
        layers += [lin, torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).half().cuda().eval()
    x = torch.randn(4, WIDE, device="cuda", dtype=torch.float16)
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    torch.export.save(ep, d / "wide.pt2")
    probe = torch.randn(2, WIDE, generator=g).half()
    with torch.no_grad():
        ref = model(probe.cuda()).float().cpu()
    del model, ep, x
    torch.cuda.empty_cache()
    return d / "wide.pt2", probe, ref


def _blocker(leave_gib: float):
    """A tensor in this process holding all but `leave_gib` of GPU 0's free memory."""
    torch.cuda.init()
    free, _total = torch.cuda.mem_get_info(0)
    hold = free - int(leave_gib * 2**30)
    assert hold > 0, f"GPU 0 has only {free / MIB:.0f} MiB free"
    return torch.empty(hold, dtype=torch.uint8, device="cuda:0")


def test_a_large_models_engine_fits_the_gpu_it_was_sized_for(wide_program, serve, tmp_path_factory):
    program, probe, ref = wide_program
    store = tmp_path_factory.mktemp("wide_store")
    cfg, line = archive(program, "wide", store, "--gpu-memory-gib", str(TARGET_GIB), "--pad", "none")
    n, need = cfg["minWorkers"], cfg["handler"]["worker_gpu_mb"]
    RESULTS["large_model"] = {"line": line, "workers": n, "worker_gpu_mb": need, "target_gib": TARGET_GIB}
    assert f"--workers {n} (GPU memory {TARGET_GIB * 1024} MiB (--gpu-memory-gib {TARGET_GIB})" in line, line
    assert n >= 2 and need <= TARGET_GIB * 1024 * 0.9 and ", fits;" in line, (n, need)
    hold = _blocker(TARGET_GIB)
    free_before = torch.cuda.mem_get_info(0)[0] / MIB
    t0 = time.time()
    ts = serve({"wide": store / "wide.mar"}, timeout=900)
    try:
        ready_s = time.time() - t0
        used = free_before - torch.cuda.mem_get_info(0)[0] / MIB
        workers = ts.workers("wide")
        r = ts.predict("wide", bytes(safetensors_io.dumps({"input": probe})), content_type=safetensors_io.CONTENT_TYPE)
        RESULTS["large_model"].update({
            "free_before_server_mib": round(free_before), "server_used_mib": round(used),
            "ready_s": round(ready_s, 1),
            "worker_states": [w.get("status") for w in workers], "predict_status": r.status_code,
            "refusals_in_log": ts.log().count("not enough GPU memory to load")})
    finally:
        ts.stop()  # its GPU memory back before the next test (the session's teardown stops it again)
        del hold
    assert [w.get("status") for w in workers] == ["READY"] * n
    assert RESULTS["large_model"]["refusals_in_log"] == 0
    assert r.status_code == 200, r.text
    out = next(iter(safetensors_io.loads(r.content).values())).float()
    assert (out - ref).abs().max().item() < 5e-2
    assert used <= need, f"the server used {used:.0f} MiB, more than the engine's {need} MiB the archive counted"


def test_an_engine_that_cannot_fit_answers_503_with_the_numbers(gpu_artifacts, serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("nofit_store")
    total = torch.cuda.get_device_properties(0).total_memory // MIB
    mar = build_mar(gpu_artifacts.get("encoder_aoti_fp16"), "nofit", store,
                    "--handler-option", f"worker_gpu_mb={total + 1024}")
    t0 = time.time()
    ts = serve({"nofit": mar}, timeout=300)
    ids = torch.randint(0, 100, (1, 16))
    r = ts.predict("nofit", bytes(safetensors_io.dumps({"input_ids": ids, "attention_mask": torch.ones_like(ids)})),
                   content_type=safetensors_io.CONTENT_TYPE)
    RESULTS["refusal"] = {"status": r.status_code, "message": r.text[:600], "seconds_to_ready": round(time.time() - t0, 1)}
    ts.stop()
    assert r.status_code == 503, r.text
    assert re.search(rf"this model's engine needs {total + 1024} MiB .* has \d+ MiB free of \d+ MiB", r.text), r.text
    assert "Fix: stop the other processes" in r.text
