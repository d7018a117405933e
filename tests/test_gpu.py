"""GPU suite (pytest -m gpu; skipped without CUDA). Run on the GPU machine, two GPUs for the
placement tests. Set GPU_RESULTS=path to write what was observed as JSON: device, date, torch
and this run's real command first, then only values measured here, each recorded before the
assertion on it (a failing run still writes what it saw)."""
import shutil

import pytest
import torch
from conftest import ARTIFACTS, build_mar, repin, rewrite_package_metadata

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("results_file")]
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine: GPU tests run on the GPU machine",
                allow_module_level=True)

from handlers.artifact.device import Placement  # noqa: E402
from handlers.artifact.load import load_artifact  # noqa: E402
from handlers.artifact.metadata import read_spec  # noqa: E402
from handlers.artifact.variants import choose_variant  # noqa: E402
from handlers.config import parse_config  # noqa: E402
from handlers.errors import IncompatibleArtifact  # noqa: E402
from handlers.run import runner_for  # noqa: E402

TWO_GPUS = torch.cuda.device_count() >= 2
multigpu = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices (nvidia-h200-x2)")
ARTIFACTS["big_aoti_fp16"] = ["--model", "examples/models.py:big_conv", "--input", "image:2x3x2160x3840:float32",
                              "--dynamic-batch", "1:2", "--backend", "aoti", "--precision", "fp16"]
ARTIFACTS["big_export_fp32"] = ["--model", "examples/models.py:big_conv", "--input",
                                "image:2x3x2160x3840:float32", "--dynamic-batch", "1:2", "--backend", "export"]
RESULTS = {"placement": [], "streams": [], "torchserve": {}, "compat": {}}


def eager_on(factory, device, inputs, half=False):
    from compiled_serving.compile import load_factory

    m = load_factory(f"examples/models.py:{factory}")().to(device)
    if half:
        m = m.half()
    with torch.no_grad():
        out = m(*[t.to(device) for t in inputs])
    return out if isinstance(out, dict) else {"output": out}


def two_inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 16, generator=g), torch.rand(n, 16, generator=g) > 0.3]


@multigpu
@pytest.mark.parametrize("backend", ["aoti", "export", "aoti_so"])
@pytest.mark.parametrize("src,dst", [(0, 1), (1, 0)])
def test_served_on_the_gpu_it_was_not_compiled_on(gpu_artifacts, backend, src, dst):
    name = "two_export" if backend == "export" else "two_aoti"
    art = gpu_artifacts.get(name, index=src)
    spec = read_spec(str(art / "bare_so") if backend == "aoti_so" else str(art))
    model = load_artifact(spec, Placement("cuda", dst))
    inputs = two_inputs(7, seed=src * 10 + dst)
    ref = eager_on("two_input", torch.device(f"cuda:{src}"), inputs)
    # direct call: outputs live on the assigned GPU
    direct = model(*[t.to(f"cuda:{dst}") for t in inputs])
    assert {v.device for v in direct.values()} == {torch.device(f"cuda:{dst}")}
    if backend == "export":
        fn = model._fn
        devs = {p.device for p in fn.parameters()} | {b.device for b in fn.buffers()}
        assert devs == {torch.device(f"cuda:{dst}")}
    out = runner_for(model, spec, torch.device(f"cuda:{dst}")).run([dict(zip(spec.input_names, inputs))])[0]
    diff = max((out[k] - ref[k].cpu()).abs().max().item() for k in ref)
    RESULTS["placement"].append({"backend": backend, "compiled_on": f"cuda:{src}", "served_on": f"cuda:{dst}",
                                 "max_abs_diff_vs_eager_on_compile_device": diff})
    assert diff < 1e-4


@pytest.mark.parametrize("name,half", [("big_aoti_fp16", True), ("big_export_fp32", False)])
def test_side_stream_large_inputs_never_stale(gpu_artifacts, name, half):
    """Field report 002: fp16 on a user stream returned all zeros. Every output here is
    compared with its own reference computed on the default stream."""
    art = gpu_artifacts.get(name)
    spec = read_spec(str(art))
    dev = torch.device("cuda:0")
    model = load_artifact(spec, Placement("cuda", 0))
    ex = runner_for(model, spec, dev)
    from compiled_serving.compile import load_factory

    ref_model = load_factory("examples/models.py:big_conv")().to(dev)
    if half:
        ref_model = ref_model.half()
    dt = torch.float16 if half else torch.float32
    mismatches = zeros = 0
    n = 12
    for i in range(n):
        x = torch.randn(1, 3, 2160, 3840, generator=torch.Generator().manual_seed(i)).to(dt)
        out = ex.run([{"image": x}])[0]["output"]
        with torch.no_grad():
            ref = ref_model(x.to(dev)).cpu()
        if not out.abs().sum().item():
            zeros += 1
        err = (out.float() - ref.float()).abs().max().item()
        if err > (5e-2 if half else 1e-3):
            mismatches += 1
    staged_pinned = ex.host_inputs._bufs["image"].is_pinned()
    # Several requests in one TorchServe batch, more rows than the artifact's batch_max (2):
    # cut into chunks, the 2-row request straddling them; each answer against its own reference.
    xs = [torch.randn(r, 3, 2160, 3840, generator=torch.Generator().manual_seed(100 + r)).to(dt) for r in (1, 2)]
    chunked_err = 0.0
    for x, out in zip(xs, ex.run([{"image": x} for x in xs])):
        with torch.no_grad():
            ref = torch.cat([ref_model(x[i:i + 1].to(dev)).cpu() for i in range(x.shape[0])])
        assert out["output"].shape == ref.shape
        zeros += int(not out["output"].abs().sum().item())
        chunked_err = max(chunked_err, (out["output"].float() - ref.float()).abs().max().item())
    mismatches += int(chunked_err > (5e-2 if half else 1e-3))
    RESULTS["streams"].append({"artifact": name, "dtype": str(dt), "input": [1, 3, 2160, 3840], "requests": n,
                               "multi_chunk_requests_rows": [x.shape[0] for x in xs],
                               "multi_chunk_max_abs_diff": chunked_err, "mismatches": mismatches,
                               "all_zero_outputs": zeros, "input_staging_pinned": staged_pinned})
    assert staged_pinned, "input staging is not page-locked: uploads would not be asynchronous"
    assert mismatches == 0 and zeros == 0


def _alter_cc(src: str, dest: str, cc: str):
    """A copy of a CUDA AOTI artifact whose package and metadata claim another compute capability."""
    shutil.copytree(src, dest)
    rewrite_package_metadata(dest, AOTI_COMPUTE_CAPABILITY=cc.replace(".", ""))
    repin(dest, compute_capability=cc, cuda_archs=(f"sm_{cc.replace('.', '')}",))


def test_wrong_compute_capability_refused(gpu_artifacts, tmp_path):
    art = gpu_artifacts.get("two_aoti")
    major, minor = torch.cuda.get_device_capability(0)
    wrong = "8.0" if major != 8 else "9.0"
    bad = str(tmp_path / "wrong_cc")
    _alter_cc(str(art), bad, wrong)
    with pytest.raises(IncompatibleArtifact) as e:
        choose_variant(bad, 0, parse_config({}))
    msg = str(e.value)
    RESULTS["compat"]["wrong_cc_message"] = msg
    assert f"compute capability {wrong}" in msg and f"{major}.{minor}" in msg and "Fix" in msg


def host_gpu(load_line: str) -> str:
    """The GPU a load line names: "on cuda:0 (host GPU 1)" in a worker confined to GPU 1
    (handlers/artifact/confine.py), "on cuda:1" in one that is not."""
    where = load_line.split(" on ", 1)[1]
    if where.startswith("cuda:0 (host GPU "):
        return "cuda:" + where.split("(host GPU ", 1)[1].split(")")[0]
    return where.split(" ")[0]


def stray_contexts(ts, models) -> list:
    """Each worker of `models` and each engine of the server that holds memory on more than one GPU
    (nvidia-smi --query-compute-apps): [{pid, gpus}]."""
    import subprocess

    def smi(q):
        out = subprocess.run(["nvidia-smi", q, "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
        return [[c.strip() for c in ln.split(",")] for ln in out.strip().splitlines() if ln.strip()]

    index = {uuid: int(i) for i, uuid in smi("--query-gpu=index,uuid")}
    gpus: dict = {}
    for pid, uuid in smi("--query-compute-apps=pid,gpu_uuid"):
        gpus.setdefault(int(pid), set()).add(index.get(uuid, -1))
    holders = subprocess.run(["pgrep", "-f", "handlers.engine.serve"], capture_output=True, text=True).stdout.split()
    pids = [w.get("pid") for m in models for w in ts.workers(m)] + [int(p) for p in holders]
    return [{"pid": p, "gpus": sorted(gpus[p])} for p in pids if len(gpus.get(p, ())) > 1]


@multigpu
def test_torchserve_four_workers_two_gpus(gpu_artifacts, serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("gpu_store")
    mar = build_mar(gpu_artifacts.get("two_aoti", index=0), "two_gpu", store,
                    "--workers", "4", "--batch-size", "4", "--max-batch-delay", "5")
    major, minor = torch.cuda.get_device_capability(0)
    bad_dir = str(tmp_path_factory.mktemp("badcc") / "wrong")
    _alter_cc(str(gpu_artifacts.get("two_aoti", index=0)), bad_dir, "8.0" if major != 8 else "9.0")
    bad_mar = build_mar(bad_dir, "wrong_cc", store)
    ts = serve({"two_gpu": mar, "wrong_cc": bad_mar}, ready=False)
    ts.wait_ready(["two_gpu"], timeout=600)
    log = ts.log()
    # each worker's load line names its GPU's engine and where that engine placed the model
    placed = [host_gpu(ln.split("served by the engine: ", 1)[1]) for ln in log.splitlines()
              if "served by the engine: " in ln and " aoti artifact " in ln]
    strays = stray_contexts(ts, ["two_gpu"])
    RESULTS["torchserve"] = {"workers": len(placed), "gpus": torch.cuda.device_count(),
                             "worker_devices": sorted(placed), "stray_contexts": strays}
    assert sorted(placed) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"], placed
    assert strays == [], strays  # no worker or engine holds memory on a GPU it was not given

    # In this process first: the same requests through the CUDA runner on each GPU, so a
    # TorchServe-only failure can be told apart from a handler one.
    spec = read_spec(str(gpu_artifacts.get("two_aoti", index=0)))
    in_process = {}
    for dev in (0, 1):
        ex = runner_for(load_artifact(spec, Placement("cuda", dev)), spec, torch.device(f"cuda:{dev}"))
        diffs = []
        for rows in (1, 2, 3, 4):
            inputs = two_inputs(rows, seed=rows)
            out = ex.run([dict(zip(spec.input_names, inputs))])[0]
            ref = eager_on("two_input", torch.device("cuda:0"), inputs)
            diffs.append(max((out[k] - ref[k].cpu()).abs().max().item() for k in ref))
        in_process[f"cuda:{dev}"] = diffs

    n_requests = 40
    bad, failures, sent = 0, [], 0
    for i in range(n_requests):
        inputs = two_inputs(1 + i % 4, seed=1000 + i)
        r = ts.predict("two_gpu", {"inputs": {"features": inputs[0].tolist(), "mask": inputs[1].tolist()}})
        sent += 1
        ref = eager_on("two_input", torch.device("cuda:0"), inputs)
        got = r.json()["outputs"] if r.status_code == 200 else None
        diff = (max((torch.tensor(got[k]) - ref[k].cpu()).abs().max().item() for k in ref)
                if got is not None else None)
        if diff is None or diff > 1e-4:
            bad += 1
            failures.append({"request": i, "rows": 1 + i % 4, "status": r.status_code,
                             "max_diff": diff, "body": r.text[:300]})
    RESULTS["torchserve"].update({"requests": sent, "mismatches": bad,
                                  "in_process_max_diff_rows_1_to_4": in_process, "failures": failures,
                                  "log_errors": [ln[:300] for ln in ts.log().splitlines()
                                                 if "ERROR" in ln or "Error" in ln][:40]})
    assert bad == 0, (in_process, failures[:6])
    import time

    deadline = time.time() + 120
    while "IncompatibleArtifact" not in ts.log() and time.time() < deadline:
        time.sleep(2)
    statuses = ts.model_status("wrong_cc")
    refusals = [ln[:400] for ln in ts.log().splitlines() if "cannot run on the assigned GPU" in ln]
    # The load failure recurs, so the worker answers requests with it (handler.answer_load_failure)
    answer = ts.predict("wrong_cc", {"inputs": {}}, timeout=60)
    described = ts.describe("wrong_cc")
    RESULTS["torchserve"].update({"wrong_cc_worker_statuses": statuses, "wrong_cc_load_errors": refusals[:2],
                                  "wrong_cc_answer_status": answer.status_code,
                                  "wrong_cc_described_ready": described.get("ready")})
    assert refusals, "no load error naming the compute capability in the model log"
    assert answer.status_code == 503 and "cannot run on the assigned GPU" in answer.json()["message"], answer.text
    assert described.get("ready") is False, described
