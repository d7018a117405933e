"""The command-line tools' contracts: clear errors for bad arguments, archive warnings."""
import os
import shutil
import subprocess

import pytest
from conftest import PY, ROOT, repin


def run(script, *args):
    """`python -m PACKAGE.NAME ARGS` from the repository root (every tool runs as a module)."""
    module = script.removesuffix(".py").replace("/", ".")
    return subprocess.run([PY, "-m", module, *args], cwd=ROOT, capture_output=True, text=True)


def test_compile_rejects_bad_arguments(tmp_path):
    base = ["compiled_serving/compile.py", "--model", "examples/models.py:classifier", "--backend", "export",
            "--device", "cpu", "--out", str(tmp_path / "x")]
    r = run(*base, "--input", "image:4x3x32:float32x")
    assert r.returncode != 0 and "dtype must be one of" in r.stderr
    r = run(*base, "--input", "pixels:4x3x32x32:float32")
    assert r.returncode != 0 and "must match forward()'s parameters ['image']" in r.stderr
    r = run(*base, "--input", "image:4x3x32x32:float32", "--dynamic-batch", "8:16")
    assert r.returncode != 0 and "outside --dynamic-batch 8:16" in r.stderr
    r = run(*base[:-6], "--backend", "tensorrt", "--device", "cpu", "--out", str(tmp_path / "t"),
            "--input", "image:4x3x32x32:float32")
    assert r.returncode != 0 and "torch_tensorrt" in r.stderr


def test_compile_into_a_relative_directory_from_anywhere_and_name_a_missing_input(tmp_path):
    """A newcomer runs cs-compile in a folder of their own with `--out artifacts/NAME`: the trial
    load (a child started in the package's directory) reads the same directory, not one relative
    to the package (it reported "no artifact.json" and left an artifact.json that cs-inspect and
    cs-archive took for a checked one). A forward() input left out is named."""
    model = f"{ROOT}/examples/models.py:two_input"
    base = ["-m", "compiled_serving.compile", "--model", model, "--backend", "export", "--device", "cpu"]
    r = subprocess.run([PY, *base, "--input", "features:4x16:float32", "--input", "mask:4x16:bool",
                        "--out", "artifacts/two"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "artifacts" / "two" / "artifact.json").is_file()
    r = subprocess.run([PY, *base, "--input", "features:4x16:float32", "--out", "artifacts/one"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "cs-compile: error: forward() also needs ['mask']" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.server
def test_archive_warns_when_batch_exceeds_artifact(artifacts, tmp_path):
    r = run("compiled_serving/archive.py", "--artifact", str(artifacts.get("two_export_2to4")), "--name", "w",
            "--out", str(tmp_path), "--batch-size", "8")
    assert r.returncode == 0, r.stderr
    assert "batchSize 8 exceeds what model.pt2 accepts per call (2..4)" in r.stderr
    r = run("compiled_serving/archive.py", "--artifact", str(artifacts.get("two_export_2to4")), "--name", "w",
            "--out", str(tmp_path), "--handler-option", "strem_priority=1")
    assert r.returncode != 0 and "unknown handler option(s) strem_priority" in r.stderr


@pytest.mark.server
def test_archive_warns_about_batched_large_responses(artifacts, tmp_path):
    """TorchServe 0.12 relays a batched worker response in time quadratic in its size; an
    image-sized output per row with batchSize > 1 gets a warning, batchSize 1 none."""
    from handlers.artifact.metadata import TensorSpec, read_spec

    art = tmp_path / "big_out"
    shutil.copytree(artifacts.get("cls_export"), art)
    out = read_spec(str(art)).outputs[0]
    repin(art, outputs=(TensorSpec(out.name, "float16", (None, 3, 2160, 3840)),))
    r = run("compiled_serving/archive.py", "--artifact", str(art), "--name", "b", "--out", str(tmp_path), "--batch-size", "2")
    assert r.returncode == 0, r.stderr
    assert "each row of model.pt2's outputs is 47.5 MiB" in r.stderr and "--batch-size 1" in r.stderr
    r = run("compiled_serving/archive.py", "--artifact", str(art), "--name", "b", "--out", str(tmp_path), "--batch-size", "1")
    assert r.returncode == 0 and "outputs is" not in r.stderr


@pytest.mark.server
def test_bench_writes_results_with_required_keys(artifacts, tmp_path):
    import json

    out = tmp_path / "bench.json"
    r = run("bench/bench.py", "--artifact", str(artifacts.get("cls_aoti")), "--batch-sizes", "1,3",
            "--iters", "3", "--warmup", "1", "--idle-seconds", "0.05", "--idle-repeats", "2", "--first-loads", "2",
            "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert list(report)[:4] == ["device", "date", "torch", "command"]
    # the command that ran, from its argv, not a literal
    assert report["command"] == ("python -m bench.bench --artifact " + str(artifacts.get("cls_aoti"))
                                 + f" --batch-sizes 1,3 --iters 3 --warmup 1 --idle-seconds 0.05 --idle-repeats 2"
                                 f" --first-loads 2 --out {out}")
    rows = {(x["batch"], x["format"]): x for x in report["results"]}
    assert set(rows) == {(1, "safetensors"), (1, "json"), (3, "safetensors"), (3, "json")}
    assert all(x["floor_ms"] > 0 and x["ratio"] > 0 and {"decode", "run", "encode"} <= set(x["stages_ms"])
               for x in rows.values())
    # first requests: each handler right after its load, each batch size's first call with the
    # handler's own stage times; after-idle calls at the smallest batch only
    first = report["first_request"]
    assert set(first) == {"no_warmup", "warmup"}
    for per in first.values():
        assert set(per) == {"b1", "b3"}
        b1 = per["b1"]
        assert b1["first_ms"] > 0 and b1["after_idle_median_ms"] > 0 and b1["idle_seconds"] == 0.05
        assert b1["first_over_steady"] == pytest.approx(b1["first_ms"] / b1["steady_median_ms"], rel=1e-3)
        assert set(b1["first_stages_ms"]) == {"HandlerDecodeTime", "HandlerRunTime", "HandlerEncodeTime", "HandlerTime"}
        assert "after_idle_median_ms" not in per["b3"]
        assert b1["idle_spin"] is False and b1["after_idle_stages_ms"]["HandlerRunTime"] > 0
        assert 0 <= b1["steady_calls_slower_than_first"] <= b1["steady_calls"] and b1["steady_p90_ms"] > 0
    # the warmed-up handler loaded twice: each load's first call, and their median
    ratios = first["warmup"]["b1"]["first_over_steady_loads"]
    assert len(ratios) == 2 and ratios[-1] == first["warmup"]["b1"]["first_over_steady"]
    assert first["warmup"]["b1"]["first_over_steady_median"] == pytest.approx(sum(ratios) / 2, abs=1e-3)
    assert "first request (warmup, batch 1)" in r.stdout
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_pause_sleeps_or_spins_for_the_time_asked():
    """--idle-spin keeps the core busy through the pause (CPU time ~ wall time); asleep, it
    takes almost no CPU time."""
    import time

    from bench.bench import pause

    cpu = {}
    for spin in (False, True):
        w, c = time.perf_counter(), time.process_time()
        pause(0.1, spin)
        wall, cpu[spin] = time.perf_counter() - w, time.process_time() - c
        assert wall >= 0.1
    # a loaded machine may preempt the spinning thread: compared with each other, not absolutes
    assert cpu[True] > cpu[False] + 0.01 and cpu[False] < 0.02, cpu


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without a GPU")
def test_xfer_study_says_it_needs_a_gpu():
    r = run("bench/xfer_study.py", "--iters", "1")
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr[-2000:]


@pytest.mark.server
def test_archive_defaults_are_the_measured_serving_settings(artifacts, tmp_path):
    """1 ms delay, batches of 8 capped at what the artifact accepts per call (docs/performance.md
    "Serving settings"; docs/results/e2e_*); workers for a CPU artifact from this machine's cores
    (6 per GPU for a CUDA one: compiled_serving.archive.default_workers)."""
    import zipfile

    import yaml

    def config(art, name):
        r = run("compiled_serving/archive.py", "--artifact", str(art), "--name", name, "--out", str(tmp_path))
        assert r.returncode == 0, r.stderr
        with zipfile.ZipFile(tmp_path / f"{name}.mar") as z:
            return yaml.safe_load(z.read("model-config.yaml"))

    cfg = config(artifacts.get("cls_export"), "wide")  # batch range 1..16
    import os
    cpu_workers = max(1, (os.cpu_count() or 1) // 4)
    assert (cfg["minWorkers"], cfg["maxWorkers"], cfg["batchSize"], cfg["maxBatchDelay"]) == \
        (cpu_workers, cpu_workers, 8, 1)
    assert config(artifacts.get("two_export_2to4"), "narrow")["batchSize"] == 4  # its max per call


def test_default_batch_size_follows_the_measured_rule():
    """No --batch-size: 16 for a CUDA model with small request rows (named dimensions at their
    maximum), 8 for large rows, CPU models or a dimension the metadata does not bound; never
    past what the artifact takes per call; --batch-size as given."""
    import torch

    from compiled_serving.archive import decide_batch_size
    from handlers.artifact.metadata import ArtifactSpec, TensorSpec

    def spec(device, inputs, batch_max=64, dims=None):
        return ArtifactSpec(backend="aoti", artifact="m.pt2", sha256="", device=device,
                            inputs=tuple(TensorSpec(n, d, (None, *shape)) for n, d, shape in inputs),
                            outputs=(TensorSpec("y", "float16", (None, 2)),), output_structure="tensor",
                            batch_min=1, batch_max=batch_max, torch_version=torch.__version__, dims=dims or {})

    text = [("input_ids", "int64", ("S",)), ("attention_mask", "int64", ("S",))]
    bert = spec("cuda", text, dims={"S": (8, 256)})  # 2 x 256 x 8 bytes = 4 KiB a row
    assert decide_batch_size(None, [bert], {}).value == 16
    assert "4.0 KiB" in decide_batch_size(None, [bert], {}).said[0][1]
    assert decide_batch_size(None, [spec("cuda", text, dims={"S": (8, 8192)})], {}).value == 8  # 128 KiB
    assert decide_batch_size(None, [spec("cuda", [("image", "float16", (3, 224, 224))])], {}).value == 8
    assert decide_batch_size(None, [spec("cpu", text, dims={"S": (8, 256)})], {}).value == 8
    assert decide_batch_size(None, [spec("cuda", text, dims={"S": (8, 256)}, batch_max=12)], {}).value == 12
    assert decide_batch_size(None, [bert, spec("cpu", text, dims={"S": (8, 256)})], {}).value == 8
    assert decide_batch_size(4, [bert], {}).value == 4


def test_a_batch_with_no_delay_is_refused_with_its_fix():
    """TorchServe 0.12 waits 100 ms for every batch of more than one when maxBatchDelay is 0."""
    from compiled_serving.archive import ArchiveError, check_delay

    check_delay(0, 1)
    check_delay(1, 16)
    with pytest.raises(ArchiveError, match="100 ms.*--max-batch-delay 1"):
        check_delay(0, 8)


def test_the_picked_compiler_reaches_an_inductor_config_imported_before_it(monkeypatch):
    """torch._inductor.config reads CXX once at its import; an export imports it, so a compiler picked
    after the export (cs-export-lm, examples/hf_bert.py) must be set there too (on the GPU image the
    inherited g++ 13 builds packages that crash at load)."""
    import torch._inductor.config as inductor

    from compiled_serving.compile import pick_compiler

    # set and put back by hand: monkeypatch's undo deletes the option from inductor's config module,
    # and every later compile in this process fails on `cpp.cxx does not exist`
    saved = inductor.cpp.cxx
    monkeypatch.setenv("CXX", "g++")
    try:
        inductor.cpp.cxx = (None, "g++-13-stand-in")
        assert pick_compiler("c++").startswith("c++")
        assert inductor.cpp.cxx == (None, "c++")
        assert os.environ["CXX"] == "c++"
    finally:
        inductor.cpp.cxx = saved


def test_test_processes_of_one_run_draw_ports_from_their_own_parts(monkeypatch):
    """compiled_serving/local_server.py free_port: two pytest-xdist workers could each find one
    port free before either server binds it; each worker draws from a part of its own."""
    from compiled_serving import local_server

    monkeypatch.setattr(local_server, "_ephemeral_low", lambda: 32768)
    ranges = {}
    for worker in ("gw0", "gw1", "gw15", "gw16"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        ranges[worker] = local_server._port_range(32768)
        port = local_server.free_port()
        assert ranges[worker][0] <= port < ranges[worker][1], (worker, port)
    assert ranges["gw0"][1] <= ranges["gw1"][0] and ranges["gw15"][1] <= 32768
    assert ranges["gw16"] == ranges["gw0"]  # past 16 workers the parts are shared again
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert local_server._port_range(32768) == (10000, 32768)
