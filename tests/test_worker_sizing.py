"""A model sized for its GPU's engine (issue 39 item 1, issue 64): the arithmetic, the weight bytes
read from real compiled artifacts, the archive's printed line and model-config.yaml, and the engine's
refusal to load where its GPU has less free than it needs (mem_get_info replaced: no GPU here)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
import zipfile

import pytest
import torch
import yaml
from conftest import PY, ROOT, repin, cs_command

from handlers.artifact.device import Placement
from handlers.artifact.metadata import read_spec
from handlers.config import parse_config
from handlers.errors import ConfigError
from compiled_serving import worker_sizing
from compiled_serving.compile import load_factory
from compiled_serving.weight_bytes import weight_bytes
from compiled_serving.worker_sizing import GpuMemory, Sizing, SizingError

GIB = 1024


def sizing(weights_mib, gpu_gib, overhead=worker_sizing.OVERHEAD_MIB, headroom=0.1, cores=16):
    return Sizing(weights_mib, "test", overhead, "test", GpuMemory(round(gpu_gib * GIB), "test"), headroom, cores)


# -- the arithmetic

@pytest.mark.parametrize("gpu_gib", [16, 22.5, 24, 40, 48, 80, 141])
@pytest.mark.parametrize("weights_mib", [127, 500, 1500, 4096, 7000, 13000, 30 * GIB])
def test_the_workers_follow_the_cores_once_the_one_engine_fits(gpu_gib, weights_mib):
    s = sizing(weights_mib, gpu_gib)
    need = math.ceil(weights_mib + worker_sizing.OVERHEAD_MIB)
    assert s.need_mib == need and s.fits == (need <= math.floor(gpu_gib * GIB * 0.9))
    if not s.fits:
        with pytest.raises(SizingError, match="the engine does not fit"):
            s.workers
        return
    assert s.workers == 12  # 0.75 x 16 cores, whatever the model: the workers hold no GPU memory
    assert sizing(weights_mib, gpu_gib, cores=1).workers == 2  # at least 2


def test_a_model_too_large_for_the_gpu_fails_with_the_numbers_and_the_fix():
    s = sizing(30 * GIB, 24)  # 30 GiB of weights
    with pytest.raises(SizingError) as e:
        s.workers
    msg = str(e.value)
    assert "the engine does not fit" in msg and "does not fit; the workers hold no GPU memory" in msg
    assert f"{24 * GIB} MiB" in msg and f"= {s.need_mib} MiB" in msg and f"{s.usable_mib} MiB usable" in msg
    assert f"at least {math.ceil(s.need_mib / 0.9 / 1024)} GiB" in msg and "--gpu-memory-gib" in msg


def test_a_hand_chosen_count_is_warned_about_only_where_the_engine_does_not_fit():
    fits, huge = sizing(4 * GIB, 24), sizing(30 * GIB, 24)
    assert fits.misfit(40) is None  # 40 workers hold no GPU memory: the one engine fits
    assert "the engine does not fit, whatever the worker count" in huge.misfit(4)
    assert "one engine process holds 4096.0 MiB weights" in fits.line() and "0.75 x 16 cores = 12 workers" in fits.line()


def test_gpu_memory_from_the_flag_this_machines_gpu_or_the_stated_default(monkeypatch):
    assert worker_sizing.target_gpu(80).mib == 80 * GIB
    with pytest.raises(SizingError, match="--gpu-memory-gib 0"):
        worker_sizing.target_gpu(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    g = worker_sizing.target_gpu(None)
    assert g.assumed and g.mib == round(worker_sizing.DEFAULT_GPU_GIB * GIB) and "assumed" in g.how
    props = type("Props", (), {"total_memory": 81559 * 2**20, "name": "NVIDIA H100 80GB HBM3"})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    g = worker_sizing.target_gpu(None)
    assert (g.mib, g.assumed) == (81559, False) and "H100" in g.how


# -- weight bytes of real artifacts

@pytest.mark.server
def test_exported_program_weights_are_its_state_dict_and_constants(artifacts):
    spec = read_spec(str(artifacts.get("cls_export")))
    ep = torch.export.load(spec.artifact_path)
    tensors = list(ep.state_dict.values()) + list(ep.constants.values())
    assert weight_bytes(spec).bytes == sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.server
def test_aoti_package_and_its_bare_library_carry_the_models_weights(artifacts):
    pkg = weight_bytes(read_spec(str(artifacts.get("cls_aoti"))))
    bare = weight_bytes(read_spec(str(artifacts.get("cls_aoti") / "bare_so")))
    assert "constants table" in pkg.how and "constants blob" in bare.how
    assert pkg.bytes == bare.bytes  # the wrapper's table and the linked blob, read independently
    m = load_factory(str(ROOT / "examples" / "models.py") + ":classifier")().eval()
    own = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    assert abs(pkg.bytes - own) <= 0.05 * own, (pkg.bytes, own)


@pytest.mark.server
def test_a_package_without_its_source_is_read_from_its_library(artifacts, tmp_path):
    spec = read_spec(str(artifacts.get("cls_aoti")))
    stripped = tmp_path / "model.pt2"
    with zipfile.ZipFile(spec.artifact_path) as zin, zipfile.ZipFile(stripped, "w") as zout:
        for item in zin.infolist():
            if not item.filename.endswith(".cpp"):
                zout.writestr(item, zin.read(item.filename))
    w = weight_bytes(dataclasses.replace(spec, variant_dir=str(tmp_path), artifact="model.pt2"))
    assert "constants blob of the AOTInductor package's .so" in w.how
    assert w.bytes == weight_bytes(spec).bytes


@pytest.mark.server
def test_an_artifact_whose_weights_cannot_be_read_apart_counts_its_file(artifacts):
    spec = read_spec(str(artifacts.get("cls_export")))
    w = weight_bytes(dataclasses.replace(spec, backend="tensorrt"))
    assert w.upper_bound and w.bytes == (artifacts.get("cls_export") / "model.pt2").stat().st_size


# -- the archive

def _cuda_copy(artifacts, name):
    """cls_export labelled as a CUDA artifact (an exported program is not loaded by the archive)."""
    d = artifacts.copy("cls_export", name)
    repin(d, device="cuda")
    return d


def _archive(art, out, *extra):
    return subprocess.run([*cs_command("archive"), "--artifact", str(art), "--name", "sized", "--out",
                           str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.server
def test_archive_prints_the_arithmetic_and_writes_the_need(artifacts, tmp_path):
    art = _cuda_copy(artifacts, "sizing_cuda")
    ep = torch.export.load(str(art / "model.pt2"))
    weights = sum(t.numel() * t.element_size() for t in [*ep.state_dict.values(), *ep.constants.values()]) / 2**20
    # one engine holds the copy, and the workers are sized by the cores
    r = _archive(art, tmp_path, "--gpu-memory-gib", "4", "--worker-overhead-mib", "1000")
    assert r.returncode == 0, r.stderr
    need = math.ceil(weights + 1000)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("cs-archive: --workers"))
    cores = max(2, int(worker_sizing.ENGINE_WORKERS_PER_CORE * (os.cpu_count() or 1)))
    assert line.startswith(f"cs-archive: --workers {cores} (GPU memory 4096 MiB (--gpu-memory-gib 4)"), line
    assert f"one engine process holds" in line and f"= {need} MiB, fits" in line, line
    with zipfile.ZipFile(tmp_path / "sized.mar") as z:
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    assert cfg["minWorkers"] == cfg["maxWorkers"] == cores
    assert cfg["handler"]["worker_gpu_mb"] == need and parse_config(cfg).worker_gpu_mb == need
    assert cfg["gpuSizing"]["gpuMiB"] == 4096 and cfg["gpuSizing"]["engine"] is True
    # the per-worker GPU path is retired: asking for it fails the archive with the fix
    r = _archive(art, tmp_path / "off", "--handler-option", "engine=off")
    assert r.returncode != 0 and "handler.engine off" in r.stderr and "was retired" in r.stderr, r.stderr


@pytest.mark.server
def test_archive_without_a_gpu_says_the_memory_was_assumed_and_refuses_what_cannot_fit(artifacts, tmp_path):
    art = _cuda_copy(artifacts, "sizing_cuda2")
    r = _archive(art, tmp_path, "--worker-overhead-mib", str(30 * GIB))
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: its memory is read, not assumed")
    assert r.returncode != 0 and not (tmp_path / "sized.mar").exists()
    assert re.search(r"the engine does not fit: GPU memory 24576 MiB \(assumed: no GPU here", r.stderr), r.stderr


# -- the engine's refusal and its GPU's ledger (handlers/engine/room.py)

def _free(monkeypatch, *free_mib, total_mib=23034):
    """mem_get_info answering each of `free_mib` in turn (the last one from then on)."""
    from handlers.engine import room

    seq = list(free_mib)
    calls = []

    def info(index):
        calls.append(index)
        return (seq.pop(0) if len(seq) > 1 else seq[0]) * 2**20, total_mib * 2**20

    monkeypatch.setattr(torch.cuda, "mem_get_info", info)
    monkeypatch.setattr(room.time, "sleep", lambda s: None)
    return calls


def _room(need, placement, ledger=None, **kw):
    from handlers.engine.room import reserved

    with reserved(need, placement, ledger, gpu_uuid="GPU-test", **kw):
        pass


def test_an_engine_with_less_free_than_it_needs_refuses_with_the_numbers(monkeypatch):
    from handlers.engine.room import InsufficientGpuMemory

    calls = _free(monkeypatch, 3000)
    with pytest.raises(InsufficientGpuMemory) as e:
        _room(5500, Placement("cuda", 1), wait_s=0.05)
    err = e.value
    assert err.status == 503 and err.recurs and calls[0] == 1
    assert "engine needs 5500 MiB" in err.message and "cuda:1 has 3000 MiB free of 23034 MiB" in err.message
    assert "nvidia-smi" in err.message and "more memory" in err.message


def test_an_engine_waits_out_another_load_then_loads(monkeypatch):
    calls = _free(monkeypatch, 3000, 3000, 8000)  # another process held memory for a moment
    _room(5500, Placement("cuda", 0), wait_s=5)
    assert len(calls) == 3


def test_no_check_on_the_cpu_or_without_a_need(monkeypatch):
    calls = _free(monkeypatch, 0)
    _room(5500, Placement("cpu", None))
    _room(0, Placement("cuda", 0))
    assert calls == []
    with pytest.raises(ConfigError, match="worker_gpu_mb"):
        parse_config({"handler": {"worker_gpu_mb": -1}})


@pytest.fixture
def other_engine(tmp_path):
    """Another engine of the same GPU in the middle of its load: a live process whose reservation
    of 6000 MiB is in the GPU's ledger (as handlers/engine/room.py writes it)."""
    from handlers.engine import room

    # an engine as the ledger knows one: its command line runs handlers.engine.serve
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "handlers.engine.serve"])
    time.sleep(0.05)  # its /proc entry
    (tmp_path / "gpu-room-GPU-test.json").write_text(json.dumps({str(proc.pid): [6000, room._start_time(proc.pid)]}))
    yield proc
    proc.kill()
    proc.wait()


def test_engines_loading_at_once_count_each_others_need(monkeypatch, tmp_path, other_engine):
    """Both would pass a check of free memory alone (10000 free, 6000 and 5500 needed); the second
    waits while the first loads, then, the first's memory allocated, refuses with the numbers."""
    from handlers.engine import room

    free = [10000]
    checks = []

    def memory():
        checks.append(free[0])
        if len(checks) == 3:  # the other engine's load ends: its memory is taken, its reservation gone
            free[0] = 4000
            other_engine.kill()
            other_engine.wait()
        return free[0], 23034.0

    monkeypatch.setattr(room.time, "sleep", lambda s: None)
    with pytest.raises(room.InsufficientGpuMemory) as e:
        with room.reserved(5500, Placement("cuda", 0), str(tmp_path), wait_s=0.05, memory=memory, gpu_uuid="GPU-test"):
            pytest.fail("loaded beside another engine's load that leaves it too little")
    assert checks[:2] == [10000, 10000] and checks[-1] == 4000, checks
    assert "has 4000 MiB free of 23034 MiB" in e.value.message
    assert json.loads((tmp_path / "gpu-room-GPU-test.json").read_text()) == {}


def test_a_reservation_of_an_engine_gone_or_of_a_pid_now_no_engines_is_dropped(tmp_path):
    """An engine killed mid-load leaves its entry; its pid may since run another program, or another engine."""
    from handlers.engine import room

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    other, engine = subprocess.Popen(sleep), subprocess.Popen(sleep + ["handlers.engine.serve"])  # no engine, an engine
    try:
        time.sleep(0.05)  # their /proc entries
        entries = {str(other.pid): [9000, room._start_time(other.pid)], "999999999": [9000, 1],
                   # an engine now, but not the process that reserved under its number (another start)
                   str(engine.pid): [9000, room._start_time(engine.pid) - 1]}
        (tmp_path / "gpu-room-GPU-test.json").write_text(json.dumps(entries))
        with room.reserved(5500, Placement("cuda", 0), str(tmp_path), wait_s=0.05,
                           memory=lambda: (10000.0, 23034.0), gpu_uuid="GPU-test"):
            assert json.loads((tmp_path / "gpu-room-GPU-test.json").read_text()) == {
                str(os.getpid()): [5500, room._start_time(os.getpid())]}
    finally:
        for p in (other, engine):
            p.kill()
            p.wait()


def test_an_engine_that_fits_beside_another_load_reserves_and_releases(tmp_path, other_engine):
    from handlers.engine import room

    ledger = tmp_path / "gpu-room-GPU-test.json"
    with room.reserved(3000, Placement("cuda", 0), str(tmp_path), memory=lambda: (10000.0, 23034.0),
                       gpu_uuid="GPU-test"):
        assert json.loads(ledger.read_text()) == {str(other_engine.pid): [6000, room._start_time(other_engine.pid)],
                                                  str(os.getpid()): [3000, room._start_time(os.getpid())]}
    assert json.loads(ledger.read_text()) == {str(other_engine.pid): [6000, room._start_time(other_engine.pid)]}
    with pytest.raises(RuntimeError):  # a load that fails releases its reservation too
        with room.reserved(3000, Placement("cuda", 0), str(tmp_path), memory=lambda: (10000.0, 23034.0),
                           gpu_uuid="GPU-test"):
            raise RuntimeError("the load failed")
    assert json.loads(ledger.read_text()) == {str(other_engine.pid): [6000, room._start_time(other_engine.pid)]}


def test_a_decoder_is_sized_as_the_engines_and_engine_off_is_refused_with_the_fix(monkeypatch):
    """Both decoder forms run in the engine (a one-sequence decoder as its lanes, handlers/run/lanes.py):
    its workers hold no copy; the retired per-worker path (engine: off) fails with what to set instead,
    a bare YAML off too, and the holder's retired option is ignored and named."""
    from types import SimpleNamespace
    from compiled_serving import archive
    from handlers.config import retired_in

    monkeypatch.setattr(archive, "weight_bytes", lambda spec: SimpleNamespace(mib=100.0, bytes=100 << 20, how="test"))
    args = SimpleNamespace(worker_overhead_mib=None, gpu_memory_headroom=0.1, gpu_memory_gib=24.0)
    for name in ("dec", "slots", "plain"):
        s = archive.gpu_sizing(args, [name], {"engine": "on"})
        assert s.need_mib == math.ceil(100 + worker_sizing.OVERHEAD_MIB) and s.record()["engine"], name
    for off in ("off", False):
        with pytest.raises(ConfigError, match=r"handler.engine off .* was retired .*Fix: remove handler.engine"):
            parse_config({"handler": {"engine": off}})
    assert parse_config({"handler": {"engine": True}}).engine == "on"  # YAML's bare on
    raw = {"handler": {"shared_weights": "on"}}
    assert parse_config(raw) == parse_config({}) and retired_in(raw)[0].startswith("handler.shared_weights is ignored")


def test_auto_serves_cuda_archives_on_a_gpu_through_the_engine_decoders_too(monkeypatch):
    """handler.engine auto: a GPU worker of a CUDA archive, stateless or a decoder of either form,
    is served by the engine, and so is a program exported on the CPU; a CPU worker and a package
    compiled for the CPU are not."""
    from types import SimpleNamespace
    from handlers import engine_worker

    spec = lambda name, device="cuda", backend="aoti": SimpleNamespace(name=name, device=device, backend=backend)  # noqa: E731
    serves = engine_worker.serves
    assert serves("auto", [spec("plain")], on_gpu=True) and serves("auto", [spec("slots")], on_gpu=True)
    assert not serves("auto", [spec("slots")], on_gpu=False) and not serves("auto", [spec("slots", "cpu")], True)
    assert serves("auto", [spec("one")], on_gpu=True) and serves("on", [spec("one", "cpu")], on_gpu=False)
    assert not serves("auto", [spec("one", "cpu")], on_gpu=True)
    assert serves("auto", [spec("one", "cpu", "export")], on_gpu=True) and serves("auto", [spec("p", "cpu", "export")], True)
    assert not serves("auto", [spec("p", "cpu", "export")], on_gpu=False)
    assert serves("on", [spec("slots", "cpu")], on_gpu=False)


def test_a_program_exported_on_the_cpu_is_sized_for_the_gpus_engine_only_with_device_type_gpu(monkeypatch):
    """cs-archive: a program exported on the CPU may be served on a CPU host (sized per core) unless
    deviceType is gpu, where a GPU worker relocates it and the engine runs it (sized as the engine's)."""
    from types import SimpleNamespace
    from compiled_serving import archive

    monkeypatch.setattr(archive, "weight_bytes", lambda spec: SimpleNamespace(mib=100.0, bytes=100 << 20, how="test"))
    monkeypatch.setattr(archive, "batched_decoder", lambda *a: None)
    monkeypatch.setattr(archive, "slot_decoder", lambda specs: None)
    program = SimpleNamespace(device="cpu", backend="export")
    args = lambda device_type: SimpleNamespace(worker_overhead_mib=None, gpu_memory_headroom=0.1,  # noqa: E731
                                               gpu_memory_gib=24.0, workers=None, device_type=device_type)
    cpu = archive.decide_workers(args(None), [program], {})
    assert cpu.value.worker_gpu_mb is None and "CPU artifact" in cpu.said[-1][1], cpu.said
    gpu = archive.decide_workers(args("gpu"), [program], {})
    assert gpu.value.gpu_sizing is not None and "engine" in gpu.said[-1][1], gpu.said
    assert archive.gpu_variants([program], "gpu") == [program] and archive.gpu_variants([program], None) == []
    assert archive.gpu_variants([SimpleNamespace(device="cpu", backend="aoti")], "gpu") == []


def test_cs_archive_refuses_a_retired_handler_option_and_says_why():
    from compiled_serving import archive

    with pytest.raises(archive.ArchiveError, match=r"--handler-option shared_weights: retired, the weights holder"):
        archive.handler_options(["shared_weights=on"])
    assert archive.handler_options(["max_json_mb=4"]) == {"max_json_mb": 4}


def test_an_engine_that_waits_for_room_says_so_and_when_it_has_it(monkeypatch, tmp_path, other_engine):
    """The engine's notices (printed before its ready line by handlers/engine/serve.py): one when
    it starts waiting for another engine's load, one when it has room, with the seconds waited."""
    from handlers.engine import room

    told, checks = [], []

    def memory():
        checks.append(1)
        if len(checks) == 3:  # the other engine's load ends: its reservation gone, room enough left
            other_engine.kill()
            other_engine.wait()
        return 10000.0, 23034.0

    monkeypatch.setattr(room.time, "sleep", lambda s: None)
    with room.reserved(5500, Placement("cuda", 0), str(tmp_path), memory=memory, gpu_uuid="GPU-test",
                       notice=told.append) as waited:
        assert waited >= 0
    assert [list(t) for t in told] == [["waiting_for_room"], ["room_after_s"]], told
    assert "6000 MiB of it reserved by other engines still loading, 5500 MiB needed" in told[0]["waiting_for_room"]


def _engine_script(tmp_path, lines: list) -> list:
    """A stand-in engine: prints each (seconds to wait first, JSON object) of `lines` on stdout."""
    script = tmp_path / "engine.py"
    script.write_text("import json, sys, time\n" + "".join(
        f"time.sleep({wait}); print(json.dumps({obj!r}), flush=True)\n" for wait, obj in lines)
        + "time.sleep(30)\n")
    return [sys.executable, str(script)]


def test_the_worker_waits_longer_for_an_engine_that_waits_for_gpu_room(monkeypatch, tmp_path):
    from handlers.engine import link, room
    from handlers.errors import LoadError

    monkeypatch.setattr(link, "ENGINE_START_S", 0.5)
    monkeypatch.setattr(room, "MAX_WAIT_S", 1.0)
    waits = _engine_script(tmp_path, [(0, {"waiting_for_room": "cuda:0: 4000 MiB free"}), (0.8, {"room_after_s": 0.8}),
                                      (0.3, {"pid": 4242})])
    proc = subprocess.Popen(waits, stdout=subprocess.PIPE)
    assert link._ready_line(proc, "LOG") == {"pid": 4242}  # 1.1 s after its start, past ENGINE_START_S
    proc.kill()
    proc.wait()
    silent = _engine_script(tmp_path, [(0, {"waiting_for_room": "cuda:0: 4000 MiB free"})])
    proc = subprocess.Popen(silent, stdout=subprocess.PIPE)
    t0 = time.monotonic()
    with pytest.raises(LoadError, match="it waited for GPU room first") as e:
        link._ready_line(proc, "LOG")
    assert 1.4 < time.monotonic() - t0 < 5 and proc.poll() is not None, e.value  # MAX_WAIT_S + ENGINE_START_S, then killed
    slow = _engine_script(tmp_path, [(1.0, {"pid": 1})])  # no notice: ENGINE_START_S is its limit
    proc = subprocess.Popen(slow, stdout=subprocess.PIPE)
    with pytest.raises(LoadError, match="still loading at the 0s limit"):
        link._ready_line(proc, "LOG")
