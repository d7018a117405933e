"""Workers sized by GPU memory (issue 39 item 1): the arithmetic, the weight bytes read from real
compiled artifacts, the archive's printed line and model-config.yaml, and a worker's refusal to load
where its GPU has less free than it needs (mem_get_info replaced: no GPU here)."""
from __future__ import annotations

import dataclasses
import math
import os
import time
import re
import subprocess
import zipfile

import pytest
import torch
import yaml
from conftest import PY, ROOT, repin, cs_command

from handlers.artifact import room
from handlers.artifact.device import Placement
from handlers.artifact.metadata import read_spec
from handlers.config import parse_config
from handlers.errors import ConfigError
from compiled_serving import worker_sizing
from compiled_serving.compile import load_factory
from compiled_serving.weight_bytes import weight_bytes
from compiled_serving.worker_sizing import GpuMemory, Sizing, SizingError

GIB = 1024


def sizing(weights_mib, gpu_gib, overhead=worker_sizing.OVERHEAD_MIB, headroom=0.1):
    return Sizing(weights_mib, "test", overhead, "test", GpuMemory(round(gpu_gib * GIB), "test"), headroom)


# -- the arithmetic

@pytest.mark.parametrize("gpu_gib", [16, 22.5, 24, 40, 48, 80, 141])
@pytest.mark.parametrize("weights_mib", [127, 500, 1500, 4096, 7000, 13000])
def test_count_is_the_most_that_fit_at_most_the_speed_cap(gpu_gib, weights_mib):
    s = sizing(weights_mib, gpu_gib)
    usable = gpu_gib * GIB * 0.9
    need = weights_mib + worker_sizing.OVERHEAD_MIB
    if need > usable:
        with pytest.raises(SizingError):
            s.workers
        return
    n = s.workers
    assert 1 <= n <= 6
    assert n * need <= usable, (n, need, usable)
    assert n == 6 or (n + 1) * need > usable, f"{n} workers leave room for another: {s.arithmetic()}"


def test_a_4gb_fp16_model_on_a_24gb_gpu_gets_a_count_whose_total_fits():
    weights = 2 * 2**31 / 2**20  # 2 G parameters in fp16: 4 GiB of weights
    s = sizing(weights, 24)
    n = s.workers
    assert 1 <= n < 6, "six copies of 4 GiB plus six contexts cannot fit in 24 GiB"
    assert n * (weights + worker_sizing.OVERHEAD_MIB) <= 24 * GIB * 0.9
    assert f"--workers {n} (" in s.line() and "memory caps it below the speed cap 6" in s.line(), s.line()
    # the same model on an 80 GiB GPU: memory does not bind
    assert sizing(weights, 80).workers == 6


def test_a_model_too_large_for_the_gpu_fails_with_the_numbers_and_the_fix():
    s = sizing(30 * GIB, 24)  # 30 GiB of weights
    with pytest.raises(SizingError) as e:
        s.workers
    msg = str(e.value)
    assert "not even one worker fits" in msg
    assert f"{24 * GIB} MiB" in msg and f"{s.need_mib} MiB" in msg and f"{s.usable_mib} // {s.need_mib} = 0" in msg
    assert f"at least {math.ceil(s.need_mib / 0.9 / 1024)} GiB" in msg and "--gpu-memory-gib" in msg


def test_a_hand_chosen_count_is_warned_about_only_where_it_does_not_fit():
    s = sizing(4 * GIB, 24)
    assert s.misfit(s.fitting) is None
    warn = s.misfit(s.fitting + 1)
    assert warn and f"Pass --workers {s.fitting} or less" in warn and "503" in warn


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
    # a GPU small enough that memory, not the speed cap, decides; each worker its own copy (the
    # per-worker path: the default engine holds the one copy, tested below)
    r = _archive(art, tmp_path, "--gpu-memory-gib", "4", "--worker-overhead-mib", "1000",
                 "--handler-option", "shared_weights=off", "--handler-option", "engine=off")
    assert r.returncode == 0, r.stderr
    need = math.ceil(weights + 1000)
    want = math.floor(4 * GIB * 0.9) // need
    assert want < 6
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("cs-archive: --workers"))
    assert line.startswith(f"cs-archive: --workers {want} (GPU memory 4096 MiB (--gpu-memory-gib 4)"), line
    assert f"= {need} MiB;" in line and "memory caps it" in line, line
    with zipfile.ZipFile(tmp_path / "sized.mar") as z:
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    assert cfg["minWorkers"] == cfg["maxWorkers"] == want
    assert cfg["handler"]["worker_gpu_mb"] == need and parse_config(cfg).worker_gpu_mb == need
    assert cfg["gpuSizing"]["gpuMiB"] == 4096
    # per worker with shared weights: the workers read one held copy, so the GPU holds it (and the
    # holder's context) once, plus one loading worker's copy, then the overhead per worker
    r = _archive(art, tmp_path / "shared", "--gpu-memory-gib", "4", "--worker-overhead-mib", "1000",
                 "--handler-option", "engine=off")
    assert r.returncode == 0, r.stderr
    fixed = math.ceil(2 * weights + worker_sizing.CONTEXT_MIB)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("cs-archive: --workers"))
    assert line.startswith(f"cs-archive: --workers {(math.floor(4 * GIB * 0.9) - fixed) // 1000} "), line
    assert f"shared weights: the holder's copy" in line and f"= {fixed} MiB once" in line, line
    # the default (engine: auto): one engine holds the copy, and the workers are sized by the cores
    r = _archive(art, tmp_path / "engine", "--gpu-memory-gib", "4", "--worker-overhead-mib", "1000")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("cs-archive: --workers"))
    cores = max(2, int(worker_sizing.ENGINE_WORKERS_PER_CORE * (os.cpu_count() or 1)))
    assert line.startswith(f"cs-archive: --workers {cores} ") and "the engine (handler.engine): one engine process" in line, line


def test_shared_weights_fit_more_workers_of_a_large_model_on_a_24_gib_gpu():
    """A 4 GiB fp16 model on a 24 GiB card: each worker its own copy, 4 workers fit; reading one
    held copy, the speed cap's 6 (8 would fit)."""
    gpu = worker_sizing.GpuMemory(24 * GIB, "--gpu-memory-gib 24")
    own = worker_sizing.Sizing(4096, "weights", worker_sizing.OVERHEAD_MIB, "measured", gpu)
    shared = worker_sizing.Sizing(4096, "weights", worker_sizing.OVERHEAD_MIB, "measured", gpu, shared=True)
    assert own.workers == (math.floor(24 * GIB * 0.9)) // (4096 + worker_sizing.OVERHEAD_MIB) == 4
    assert shared.fitting == (math.floor(24 * GIB * 0.9) - 2 * 4096 - worker_sizing.CONTEXT_MIB) // \
        worker_sizing.OVERHEAD_MIB == 9 and shared.workers == 6
    assert shared.misfit(9) is None and "Pass --workers 9 or less" in shared.misfit(10)
    assert shared.need_mib == own.need_mib  # each worker's load still holds a copy for a moment


@pytest.mark.server
def test_archive_without_a_gpu_says_the_memory_was_assumed_and_refuses_what_cannot_fit(artifacts, tmp_path):
    art = _cuda_copy(artifacts, "sizing_cuda2")
    r = _archive(art, tmp_path, "--worker-overhead-mib", str(30 * GIB))
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: its memory is read, not assumed")
    assert r.returncode != 0 and not (tmp_path / "sized.mar").exists()
    assert re.search(r"not even one worker fits: GPU memory 24576 MiB \(assumed: no GPU here", r.stderr), r.stderr


# -- the worker's refusal

def _free(monkeypatch, *free_mib, total_mib=23034):
    """mem_get_info answering each of `free_mib` in turn (the last one from then on)."""
    seq = list(free_mib)
    calls = []

    def info(index):
        calls.append(index)
        return (seq.pop(0) if len(seq) > 1 else seq[0]) * 2**20, total_mib * 2**20

    monkeypatch.setattr(torch.cuda, "mem_get_info", info)
    monkeypatch.setattr(room, "POLL_S", 0.01)
    return calls


def test_a_worker_with_less_free_than_it_needs_refuses_with_the_numbers(monkeypatch):
    calls = _free(monkeypatch, 3000)
    with pytest.raises(room.InsufficientGpuMemory) as e:
        room.check(5500, Placement("cuda", 1), workers=6, wait_s=0.05)
    err = e.value
    assert err.status == 503 and err.recurs and calls[0] == 1
    assert "needs 5500 MiB" in err.message and "cuda:1 has 3000 MiB free of 23034 MiB" in err.message
    assert "6 worker(s), 6 x 5500 = 33000 MiB" in err.message and "at most 4 fit" in err.message
    assert "--workers N" in err.message and "more memory" in err.message


def test_a_worker_checks_its_own_need_only_and_waits_out_a_siblings_load(monkeypatch, caplog):
    # 6 workers x 5500 MiB is more than is free, but this worker's own 5500 is: it loads
    _free(monkeypatch, 6000)
    with caplog.at_level("INFO", logger="handlers.artifact.room"):
        room.check(5500, Placement("cuda", 0), workers=6, wait_s=0)
    assert "needs 5500 MiB (handler.worker_gpu_mb); cuda:0 has 6000 MiB free of 23034 MiB" in caplog.text
    # free memory short while a sibling's trial load holds a second context, then back
    calls = _free(monkeypatch, 3000, 3000, 8000)
    room.check(5500, Placement("cuda", 0), workers=6, wait_s=5)
    assert len(calls) == 3


def test_no_check_on_a_cpu_worker_or_without_a_need(monkeypatch):
    calls = _free(monkeypatch, 0)
    room.check(5500, Placement("cpu", None), workers=2)
    room.check(0, Placement("cuda", 0), workers=2)
    assert calls == []
    with pytest.raises(ConfigError, match="worker_gpu_mb"):
        parse_config({"handler": {"worker_gpu_mb": -1}})


# -- siblings starting together: the GPU's ledger of reservations

def _ledger(monkeypatch, tmp_path):
    monkeypatch.setattr(room, "gpu_identity", lambda placement: f"test{placement.index}")
    return tmp_path / "gpu-room-test0.json"


def test_a_sibling_still_starting_is_counted_and_waited_for(monkeypatch, tmp_path):
    """8000 MiB free, a live sibling has reserved 5000 and not yet allocated it: this worker's 5500
    do not fit beside it, so it waits (past wait_s: a sibling is loading) until the sibling's start
    is over, then reserves its own."""
    import json
    import subprocess
    import sys
    import threading

    ledger = _ledger(monkeypatch, tmp_path)
    _free(monkeypatch, 8000)
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ledger.write_text(json.dumps({str(sibling.pid): 5000}))
        def sibling_done():  # the sibling's start is over: it releases as a worker does, under the ledger's lock
            with room._entries(ledger) as entries:  # (a plain write could be overwritten by the check's write-back)
                entries.pop(str(sibling.pid), None)

        done = threading.Timer(0.3, sibling_done)
        done.start()
        t0 = time.monotonic()
        release = room.check(5500, Placement("cuda", 0), workers=2, wait_s=0.05, ledger_dir=tmp_path)
        assert time.monotonic() - t0 >= 0.25
        assert json.loads(ledger.read_text()) == {str(os.getpid()): 5500}
        release()
        assert json.loads(ledger.read_text()) == {}
    finally:
        sibling.kill()
        sibling.wait()


def test_a_reservation_of_a_process_that_is_gone_is_dropped(monkeypatch, tmp_path):
    import json
    import subprocess
    import sys

    ledger = _ledger(monkeypatch, tmp_path)
    _free(monkeypatch, 8000)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    ledger.write_text(json.dumps({gone: 5000}))
    with room.reserved(5500, Placement("cuda", 0), workers=2, ledger_dir=tmp_path):
        assert json.loads(ledger.read_text()) == {str(os.getpid()): 5500}
    assert json.loads(ledger.read_text()) == {}


def test_with_no_sibling_loading_a_shortfall_is_refused_and_nothing_stays_reserved(monkeypatch, tmp_path):
    import json

    ledger = _ledger(monkeypatch, tmp_path)
    _free(monkeypatch, 3000)
    with pytest.raises(room.InsufficientGpuMemory, match="needs 5500 MiB"):
        with room.reserved(5500, Placement("cuda", 0), workers=6, ledger_dir=tmp_path):
            pass
    assert not ledger.exists() or json.loads(ledger.read_text()) == {}
    # a start that fails after its check releases the reservation too
    _free(monkeypatch, 8000)
    with pytest.raises(RuntimeError):
        with room.reserved(5500, Placement("cuda", 0), workers=6, ledger_dir=tmp_path):
            assert json.loads(ledger.read_text()) == {str(os.getpid()): 5500}
            raise RuntimeError("load failed")
    assert json.loads(ledger.read_text()) == {}


def test_a_sibling_that_never_finishes_does_not_hold_a_worker_forever(monkeypatch, tmp_path):
    import json

    ledger = _ledger(monkeypatch, tmp_path)
    _free(monkeypatch, 8000)
    monkeypatch.setattr(room, "MAX_WAIT_S", 0.1)
    ledger.write_text(json.dumps({str(os.getppid()): 5000}))  # a live process that never releases
    with pytest.raises(room.InsufficientGpuMemory):
        room.check(5500, Placement("cuda", 0), workers=2, wait_s=0.0, ledger_dir=tmp_path)
    assert json.loads(ledger.read_text()) == {str(os.getppid()): 5000}


def test_a_ledger_that_cannot_be_used_leaves_the_free_memory_check(monkeypatch, tmp_path):
    """An unreadable or unwritable ledger never fails a load: the check falls back to free memory."""
    ledger = _ledger(monkeypatch, tmp_path)
    _free(monkeypatch, 8000)
    ledger.write_text("not json")
    with room.reserved(5500, Placement("cuda", 0), workers=2, ledger_dir=tmp_path):
        pass
    with room.reserved(5500, Placement("cuda", 0), workers=2, ledger_dir=tmp_path / "missing"):
        pass


def test_with_the_engine_the_workers_follow_the_cores_and_only_the_engine_must_fit():
    """handler.engine: on: one engine holds the weights and the overhead; the workers hold no GPU
    memory, 3 of every 4 cores (12 on the 16-core host the figure was measured on), at least 2; an
    engine that cannot fit is refused with its numbers, whatever count is asked for."""
    gpu = worker_sizing.GpuMemory(24 * GIB, "--gpu-memory-gib 24")
    big = worker_sizing.Sizing(4096, "weights", worker_sizing.OVERHEAD_MIB, "measured", gpu, engine=True, cores=16)
    assert big.workers == 12 and big.fixed_mib == big.need_mib and big.per_worker_mib == 0
    assert big.misfit(40) is None  # 40 workers hold no GPU memory: the one engine fits
    assert "one engine process holds 4096.0 MiB weights" in big.line() and "0.75 x 16 cores = 12 workers" in big.line()
    assert worker_sizing.Sizing(100, "w", 500, "m", gpu, engine=True, cores=2).workers == 2
    huge = worker_sizing.Sizing(30 * GIB, "weights", worker_sizing.OVERHEAD_MIB, "measured", gpu, engine=True, cores=16)
    with pytest.raises(SizingError, match=r"not even one worker fits: .*the engine \(handler.engine\): .*does not fit"):
        huge.workers
    assert "the engine does not fit, whatever the worker count" in huge.misfit(4)


def test_a_decoder_archived_with_engine_on_is_sized_as_the_engines(monkeypatch):
    """Both decoder forms run in the engine (a one-sequence decoder as its lanes, handlers/run/lanes.py):
    its workers hold no copy, so the engine's arithmetic counts them as holding nothing; with the
    engine off a decoder's workers are sized per worker."""
    from types import SimpleNamespace
    from compiled_serving import archive

    monkeypatch.setattr(archive, "weight_bytes", lambda spec: SimpleNamespace(mib=100.0, bytes=100 << 20, how="test"))
    monkeypatch.setattr(archive, "shares_weights", lambda specs, opts: False)
    args = SimpleNamespace(worker_overhead_mib=None, gpu_memory_headroom=0.1, gpu_memory_gib=24.0)
    for name in ("dec", "slots", "plain"):
        on = archive.gpu_sizing(args, [name], 6, {"engine": "on"})
        assert on.engine and on.per_worker_mib == 0, name
    off = archive.gpu_sizing(args, ["dec"], 6, {"engine": "off"})
    assert not off.engine and off.per_worker_mib > 0 and off.workers <= 6


def test_auto_serves_cuda_archives_on_a_gpu_through_the_engine_decoders_too(monkeypatch):
    """handler.engine auto: a GPU worker of a CUDA archive, stateless or a decoder of either form,
    is served by the engine, and so is a program exported on the CPU; a CPU worker and a package
    compiled for the CPU are not; off never."""
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
    assert not serves("off", [spec("slots")], on_gpu=True) and serves("on", [spec("slots", "cpu")], on_gpu=False)


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
