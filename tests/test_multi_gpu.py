"""A host of several GPUs, as far as the CPU can check it (issue 62): a program saved from a GPU
this machine lacks reads and relocates, the archive's checks choose one device and say which, a
worker is confined to its GPU before CUDA starts (and every process it starts with it), and siblings
on different GPUs never share an engine.
The GPU side (no stray context in nvidia-smi, every archive READY) is tests/test_gpu.py and
bench/placement.py on two GPUs."""
import os
import zipfile

import pytest
import torch

from compiled_serving import import_artifact as ia
from handlers.artifact import confine
from handlers.artifact.device import Placement
from handlers.artifact.metadata import read_spec
from handlers.artifact.program_file import load_on_cpu
from handlers.artifact.relocate import leftovers, relocate

CPU = torch.device("cpu")


class Named(torch.nn.Module):
    """State of every kind the export lifts (parameters, a buffer, a plain tensor attribute) and
    devices named in forward, from the input and by name."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 3, 1)
        self.bn = torch.nn.BatchNorm1d(3)
        self.register_buffer("shift", torch.linspace(0, 1, 3))
        self.scale = torch.tensor([2.0, 3.0, 4.0])

    def forward(self, x, mask):
        y = self.bn(self.conv(x)).mean(-1) * self.scale + self.shift
        return (y + torch.arange(3, device=x.device) + torch.ones(3, device="cpu")) * mask


def example(rows=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, 5, generator=g), (torch.rand(rows, 3, generator=g) > 0.3).float()


def save_program(path):
    model = Named().eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(model, example(), dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(ep, path)
    return model


def as_if_saved_on(src, dest, device=b'{"type": "cuda", "index": 1}'):
    """A copy of a saved program whose every tensor, recorded value and device argument says
    `device`, as torch.export.save writes a program exported there (the weights' and constants'
    configs and the graph name the device the same way)."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dest, "w") as out:
        for info in z.infolist():
            data = z.read(info.filename)
            if info.filename.endswith(".json"):
                data = data.replace(b'{"type": "cpu", "index": null}', device)
            out.writestr(info, data)
    return dest


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    d = tmp_path_factory.mktemp("programs")
    model = save_program(str(d / "cpu.pt2"))
    return model, str(d / "cpu.pt2"), as_if_saved_on(str(d / "cpu.pt2"), str(d / "cuda1.pt2"))


def test_a_program_saved_on_a_gpu_this_machine_lacks_reads_and_relocates(programs):
    model, _, cuda1 = programs
    with pytest.raises(Exception):  # torch's own load puts the tensors back on cuda:1
        torch.export.load(cuda1)
    ep, saved = load_on_cpu(cuda1)
    assert saved.device == torch.device("cuda", 1)
    # read onto the CPU whole: state, recorded values and device arguments (a process that sees
    # one GPU cannot even make a fake tensor on cuda:1)
    assert leftovers(ep, CPU) == []
    moved = relocate(ep, CPU)
    assert leftovers(moved, CPU) == []
    assert {torch.device(n.kwargs["device"]) for n in moved.graph.nodes if "device" in n.kwargs} == {CPU}
    for rows in (1, 3, 8):
        x, mask = example(rows, seed=rows)
        assert torch.allclose(moved.module()(x, mask), model(x, mask), atol=1e-6)


def test_the_checks_device_follows_the_export_then_gpu_0_then_the_cpu(monkeypatch):
    def host(gpus):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    cuda = torch.device
    host(2)
    assert ia.check_device(cuda("cuda", 1), False) == cuda("cuda", 1)  # exported there, and it exists
    assert ia.check_device(cuda("cuda", 1), True, asked=0) == cuda("cuda", 0)  # --device-index wins
    assert ia.check_device(CPU, False) == CPU  # a CPU program is checked where it runs
    host(1)
    assert ia.check_device(cuda("cuda", 1), True) == cuda("cuda", 0)  # no cuda:1 here: GPU 0
    with pytest.raises(ia.ImportError_, match="--device-index 1: this machine has 1 GPU"):
        ia.check_device(cuda("cuda", 1), True, asked=1)
    host(0)
    assert ia.check_device(cuda("cuda", 1), False) == CPU  # a program relocates to the CPU
    with pytest.raises(ia.ImportError_, match="compiled for CUDA and this machine has no GPU"):
        ia.check_device(cuda("cuda", 0), True)


def test_the_archive_imports_a_program_saved_on_cuda_1_and_says_where_it_checked(programs, tmp_path, capsys):
    _, _, cuda1 = programs
    out = ia.import_artifact(cuda1, str(tmp_path / "imported"), find_pad=False)
    said = capsys.readouterr().out
    assert "the checks run on cpu (the program was exported on cuda:1; this machine has 0 GPU(s))" in said
    spec = read_spec(out)
    assert spec.device == "cuda" and spec.batch_min == 1 and spec.batch_max == 8


def test_host_entry_reads_gpu_id_as_the_placement_does():
    assert confine.host_entry(1, None, 2) == "1"
    assert confine.host_entry(1, None, -1) == "1"  # NVML cannot count: TorchServe's id as it is
    assert confine.host_entry(2, None, 2) is None  # no such GPU: the placement refuses it, naming why
    assert confine.host_entry(1, "2,3", 2) == "3"  # TorchServe counts the visible GPUs
    assert confine.host_entry(3, "2,3", 2) == "3"  # deviceIds naming a host GPU
    assert confine.host_entry(0, "GPU-aa,GPU-bb", 2) == "GPU-aa"  # UUIDs pass through
    assert confine.host_entry(0, "", 0) is None


def test_a_worker_is_confined_before_cuda_starts_and_not_after(monkeypatch):
    env = {}
    monkeypatch.setattr(confine, "cuda_built", lambda: False)
    assert confine.confine(1, env).entry is None and env == {}  # a CPU build: nothing to confine
    monkeypatch.setattr(confine, "cuda_built", lambda: True)
    monkeypatch.setattr(confine, "visible_gpus", lambda: 2)
    monkeypatch.setattr(confine, "driver_started", lambda: False)
    env = {}
    done = confine.confine(1, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "1"} and done.entry == "1" and done.host_gpus == 2
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert confine.confine(1, env).entry == "5" and env["CUDA_VISIBLE_DEVICES"] == "5"
    assert confine.confine(None, env).why_not == "no GPU assigned"
    monkeypatch.setattr(confine, "driver_started", lambda: True)
    env = {}
    late = confine.confine(1, env)
    assert env == {} and late.entry is None and "before the handler ran" in late.why_not


def test_the_worker_places_by_cuda_0_once_confined(monkeypatch):
    from handlers import startup

    monkeypatch.setattr(confine, "cuda_built", lambda: True)
    monkeypatch.setattr(confine, "visible_gpus", lambda: 2)
    monkeypatch.setattr(confine, "driver_started", lambda: False)
    # set, then removed through monkeypatch: its first record is the variable as it was, so what
    # confine writes below is undone too (a CUDA_VISIBLE_DEVICES left in this process makes every
    # TorchServe a later test starts count a GPU and hand out gpu_id 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    gpu_id, done = startup.confine_worker(1)
    assert (gpu_id, done.entry, os.environ["CUDA_VISIBLE_DEVICES"]) == (0, "1", "1")
    monkeypatch.setattr(confine, "driver_started", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert startup.confine_worker(1)[0] == 1  # not confined: it places by TorchServe's id


def test_a_child_sees_its_one_gpu_as_cuda_0():
    assert confine.child_env({}, "cuda", 1) == ({"CUDA_VISIBLE_DEVICES": "1"}, 0)
    assert confine.child_env({"CUDA_VISIBLE_DEVICES": "5"}, "cuda", 0) == ({"CUDA_VISIBLE_DEVICES": "5"}, 0)
    assert confine.child_env({"CUDA_VISIBLE_DEVICES": "2,3"}, "cuda", 1) == ({"CUDA_VISIBLE_DEVICES": "3"}, 0)
    assert confine.child_env({}, "cpu", None) == ({}, None)


def test_the_trial_load_child_is_confined(monkeypatch, tmp_path):
    from handlers.artifact import probe
    from handlers.config import HandlerConfig

    seen = {}

    def run(cmd, env, **kw):
        seen.update(cmd=cmd, env=env)
        raise probe.subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(probe.subprocess, "run", run)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = type("S", (), {"variant_dir": str(tmp_path), "artifact": "model.pt2"})()
    with pytest.raises(Exception, match="did not finish"):
        probe.crash_safe_probe(spec, Placement("cuda", 1), HandlerConfig())
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "1" and seen["cmd"][5] == "0"


def test_workers_on_two_gpus_never_share_an_engine(monkeypatch, tmp_path):
    """Two workers confined to two GPUs each call theirs cuda:0: the engine they reach is named by the
    GPU as the host names it (handlers/engine/link.py), so each GPU gets its own."""
    from handlers.engine import link

    model_dir = str(tmp_path)
    a = link.paths(str(tmp_path), model_dir, {}, "0")
    b = link.paths(str(tmp_path), model_dir, {}, "1")
    assert a != b and b == link.paths(str(tmp_path), model_dir, {}, "1")
    assert link.paths(str(tmp_path), model_dir, {}, None) not in (a, b)  # the CPU's engine is a third


def test_held_weights_read_from_a_program_saved_on_cuda_1(programs, tmp_path):
    """The engine's lanes read the program's read-only tensors from the file onto the host before
    packing them on its device: a program saved from a GPU this process lacks reads too."""
    from handlers.artifact.kinds.exported_program import KIND, read_only

    _, cpu, cuda1 = programs
    spec = type("S", (), {"artifact_path": cuda1, "artifact": "model.pt2", "torch_version": torch.__version__})()
    mine = read_only(KIND._program(spec))
    theirs = read_only(torch.export.load(cpu))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert {t.device for t in mine.values()} == {CPU}


def test_a_package_that_fails_on_another_gpu_names_the_fix():
    aoti = type("S", (), {"backend": "aoti"})()
    cuda = torch.device
    hint = ia.moved_hint(aoti, cuda("cuda", 1), cuda("cuda", 0))
    assert "compiled on cuda:1 and checked on cuda:0" in hint and "--device-index 1" in hint
    assert ia.moved_hint(aoti, cuda("cuda", 0), cuda("cuda", 0)) == ""  # failed where it was built: no move
    assert ia.moved_hint(type("S", (), {"backend": "export"})(), cuda("cuda", 1), cuda("cuda", 0)) == ""


def test_an_engine_confined_to_its_gpu_names_it_as_the_host_does(monkeypatch):
    """The engine inherits its worker's CUDA_VISIBLE_DEVICES: its cuda:0 is named as the host names
    it in its load line (what every worker's line repeats), and nothing changes where it sees every
    GPU or runs on the CPU."""
    from handlers.engine.artifact import _host_named

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert _host_named(Placement("cuda", 0)).where == "cuda:0 (host GPU 1)"
    assert _host_named(Placement("cpu", None)).where == "cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert _host_named(Placement("cuda", 1)).where == "cuda:1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _host_named(Placement("cuda", 0)).where == "cuda:0"
