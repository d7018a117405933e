"""Device resolution for a worker and the relocation check of exported programs (in process)."""

import pytest
import torch

from handlers.artifact.device import Seen, Wanted, resolve_placement
from handlers.artifact.kinds import KINDS
from handlers.artifact.relocate import leftovers, relocate
from handlers.errors import IncompatibleArtifact, LoadError


def place(**kw):
    base = dict(gpu_id=None, device_type=None, artifact_device="cpu", backend="aoti",
                cuda_available=False, device_count=0, visible_devices=None)
    base.update(kw)
    base["relocatable"] = KINDS[base["backend"]].relocatable
    return resolve_placement(Seen(**{k: base[k] for k in Seen._fields}), Wanted(**{k: base[k] for k in Wanted._fields}))


GPU = dict(cuda_available=True, device_count=2)


# Workers as TorchServe and the machine present them.
WORKERS = {
    "gpu1": dict(gpu_id=1, cuda_available=True, device_count=2),  # TorchServe assigned GPU 1
    "cpu": dict(gpu_id=None, cuda_available=False, device_count=0),  # CPU-only host
    "no_gpu_id": dict(gpu_id=None, cuda_available=True, device_count=2),  # GPUs, none assigned
    "id_no_cuda": dict(gpu_id=0, cuda_available=False, device_count=0),  # gpu_id, CPU build of torch
}
NATIVE = ("aoti", "aoti_so", "tensorrt")
ALL = NATIVE + ("export",)
CUDA1 = ("cuda", 1)
# Refusals: the phrase that says why.
NO_CUDA = "demands deviceType: gpu, but CUDA is not available"
NONE_ASSIGNED = "demands deviceType: gpu, but TorchServe assigned no GPU"
SAYS_CPU = "compiled for CUDA and cannot run on the CPU, but model-config.yaml says deviceType: cpu"
HAS_NO_GPU = "compiled for CUDA and cannot run on the CPU, but this worker has no GPU"
CPU_KERNELS = "compiled for the CPU and holds only CPU kernels"

# (worker, artifact device, deviceType, backends) -> expected: "cpu", ("cuda", index) or a
# refusal phrase. Written out case by case from the README's placement rules, not computed.
PLACEMENT_TABLE = [
    ("gpu1", "cuda", None, ALL, CUDA1),
    ("gpu1", "cuda", "gpu", ALL, CUDA1),
    ("gpu1", "cuda", "cpu", ALL, SAYS_CPU),
    ("gpu1", "cpu", None, NATIVE, "cpu"),  # native CPU kernels stay on the CPU
    ("gpu1", "cpu", None, ("export",), CUDA1),  # a CPU-exported program is relocated
    ("gpu1", "cpu", "cpu", ALL, "cpu"),
    ("gpu1", "cpu", "gpu", NATIVE, CPU_KERNELS),
    ("gpu1", "cpu", "gpu", ("export",), CUDA1),
    ("cpu", "cuda", None, ALL, HAS_NO_GPU),
    ("cpu", "cuda", "cpu", ALL, SAYS_CPU),
    ("cpu", "cuda", "gpu", ALL, NO_CUDA),
    ("cpu", "cpu", None, ALL, "cpu"),
    ("cpu", "cpu", "cpu", ALL, "cpu"),
    ("cpu", "cpu", "gpu", ALL, NO_CUDA),
    ("no_gpu_id", "cuda", None, ALL, HAS_NO_GPU),
    ("no_gpu_id", "cuda", "cpu", ALL, SAYS_CPU),
    ("no_gpu_id", "cuda", "gpu", ALL, NONE_ASSIGNED),
    ("no_gpu_id", "cpu", None, ALL, "cpu"),
    ("no_gpu_id", "cpu", "cpu", ALL, "cpu"),
    ("no_gpu_id", "cpu", "gpu", ALL, NONE_ASSIGNED),
    ("id_no_cuda", "cuda", None, ALL, HAS_NO_GPU),
    ("id_no_cuda", "cuda", "cpu", ALL, SAYS_CPU),
    ("id_no_cuda", "cuda", "gpu", ALL, NO_CUDA),
    ("id_no_cuda", "cpu", None, ALL, "cpu"),
    ("id_no_cuda", "cpu", "cpu", ALL, "cpu"),
    ("id_no_cuda", "cpu", "gpu", ALL, NO_CUDA),
]
PLACEMENT_CASES = [(w, a, d, b, want) for w, a, d, backends, want in PLACEMENT_TABLE for b in backends]


def test_placement_table_covers_every_combination():
    keys = [(w, a, d, b) for w, a, d, b, _ in PLACEMENT_CASES]
    assert len(keys) == len(set(keys)) == len(WORKERS) * 2 * 3 * len(ALL)


@pytest.mark.parametrize("worker,artifact_device,device_type,backend,want", PLACEMENT_CASES,
                         ids=lambda v: str(v))
def test_placement(worker, artifact_device, device_type, backend, want):
    """Every combination has one required outcome: a placement, or a refusal naming why and
    the fix. A refusal where a placement is expected fails, and the other way round."""
    kw = dict(device_type=device_type, artifact_device=artifact_device, backend=backend, **WORKERS[worker])
    if isinstance(want, str) and want != "cpu":
        with pytest.raises(IncompatibleArtifact) as e:
            place(**kw)
        assert want in str(e.value) and "Fix:" in str(e.value), str(e.value)
        return
    p = place(**kw)
    assert (p.kind, p.index) == (("cpu", None) if want == "cpu" else want), p


def test_cuda_artifact_on_cpu_worker_names_the_fix():
    with pytest.raises(IncompatibleArtifact, match="compiled for CUDA.*--device cpu"):
        place(artifact_device="cuda")


def test_cpu_native_artifact_when_gpu_demanded():
    with pytest.raises(IncompatibleArtifact, match="holds only CPU kernels"):
        place(device_type="gpu", gpu_id=0, **GPU)


def test_cpu_artifact_on_gpu_worker_without_demand_runs_on_cpu():
    p = place(gpu_id=1, **GPU)
    assert p.kind == "cpu" and "left unused" in p.note


def test_cuda_visible_devices_remaps_physical_ids():
    p = place(gpu_id=3, artifact_device="cuda", cuda_available=True, device_count=2, visible_devices="2,3")
    assert (p.kind, p.index) == ("cuda", 1)
    with pytest.raises(IncompatibleArtifact, match="sees 2 CUDA device"):
        place(gpu_id=5, artifact_device="cuda", cuda_available=True, device_count=2, visible_devices="2,3")


class DeviceArgs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("shift", torch.ones(4))
        self.const = torch.tensor(2.0)

    def forward(self, x):
        return self.lin(x) + torch.arange(4, device=x.device) + torch.ones(4, device=x.device) * self.const + self.shift


def exported():
    return torch.export.export(DeviceArgs().eval(), (torch.randn(2, 4),))


def test_graph_has_device_arguments_to_relocate():
    ep = exported()
    left = leftovers(ep, torch.device("meta"))
    kinds = " ".join(left)
    assert "state_dict['lin.weight']" in kinds and "state_dict['shift']" in kinds
    assert "constant" in kinds and "argument device=cpu" in kinds


def test_relocation_moves_everything():
    moved = relocate(exported(), torch.device("meta"))
    assert leftovers(moved, torch.device("meta")) == []
    devs = {torch.device(n.kwargs["device"]) for n in moved.graph.nodes if "device" in n.kwargs}
    assert devs == {torch.device("meta")}


def test_relocation_check_names_what_stayed_behind(monkeypatch):
    import torch.export.passes as passes

    def partial(ep, device):  # moves parameters only: graph kwargs and constants stay behind
        for k, v in list(ep.state_dict.items()):
            ep.state_dict[k] = v.to(device)
        return ep

    monkeypatch.setattr(passes, "move_to_device_pass", partial)
    with pytest.raises(LoadError, match=r"left \d+ item\(s\) behind:.*argument device=cpu"):
        relocate(exported(), torch.device("meta"))


def test_string_device_kwargs_are_checked():
    ep = relocate(exported(), torch.device("meta"))
    node = next(n for n in ep.graph.nodes if "device" in n.kwargs)
    node.kwargs = {**node.kwargs, "device": "cpu"}  # a string left behind
    assert any("argument device=cpu" in x for x in leftovers(ep, torch.device("meta")))
