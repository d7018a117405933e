"""The GPU default (pytest -m gpu; skipped without CUDA): an archive made with no handler options,
served on a GPU, runs in one engine process per GPU (handler.engine: auto, handlers/engine_worker.py
wanted), a program exported on the CPU too: every worker's load line says it is served by the
engine, no worker holds GPU memory (nvidia-smi's compute apps), the engine does, and the answers
equal the eager model's.
tests/test_engine_serving.py runs the same path on the CPU with engine: on."""
from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import build_mar
from test_engine_serving import answers_right, engines, served_lines

pytestmark = [pytest.mark.gpu, pytest.mark.server]
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine: GPU engine tests run on the GPU machine",
                allow_module_level=True)


def gpu_processes() -> set:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return {int(p) for p in out.split() if p.strip().isdigit()}


@pytest.mark.parametrize("art", ["two_aoti", "two_export"])
def test_an_archive_with_no_options_is_served_by_the_engine_on_a_gpu(gpu_artifacts, serve, tmp_path_factory, art):
    store = tmp_path_factory.mktemp(f"engine_gpu_{art}")
    name = f"default_{art}"
    mar = build_mar(gpu_artifacts.get(art), name, store, "--workers", "3", "--batch-size", "4",
                    "--max-batch-delay", "5")
    ts = serve({name: mar})
    try:
        answers_right(ts, name)
        workers = {w.get("pid") for w in ts.workers(name)}
        on_gpu = gpu_processes()
        mine = set(engines(ts))
        assert len(served_lines(ts, name)) == 3, ts.log()[-3000:]  # every worker, through its GPU's engine
        # TorchServe gives the 3 workers GPUs in turn (0, 1, 0 on two GPUs): one engine per GPU in use
        assert len(set(served_lines(ts, name))) == min(3, torch.cuda.device_count())
        assert set(served_lines(ts, name)) <= mine
        assert not workers & on_gpu, (workers, on_gpu)  # the workers hold no CUDA context
        assert mine & on_gpu, (mine, on_gpu)
    finally:
        ts.stop()


def test_a_program_exported_on_the_cpu_runs_in_the_gpus_engine(artifacts, serve, tmp_path_factory):
    """A program exported on the CPU (relocatable), archived with no options and served on a GPU:
    its workers hold no CUDA context, the engine relocates it to its GPU (the per-worker path and
    its weights holder are retired), and the answers equal the eager model's."""
    store = tmp_path_factory.mktemp("engine_gpu_cpu_export")
    mar = build_mar(artifacts.get("two_export"), "cpu_export", store, "--workers", "2", "--batch-size", "4",
                    "--max-batch-delay", "5")
    ts = serve({"cpu_export": mar})
    try:
        answers_right(ts, "cpu_export")
        assert len(served_lines(ts, "cpu_export")) == 2, ts.log()[-3000:]
        assert not {w.get("pid") for w in ts.workers("cpu_export")} & gpu_processes()
        assert set(engines(ts)) & gpu_processes()
    finally:
        ts.stop()
