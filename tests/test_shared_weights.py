"""A model's loads on weights they do not own (issue 39 item 2, the CPU proof), as the engine's lanes
load them (handlers/run/lanes.py over handlers/weights/pack.py).

One tiny model compiled once into two packages: the normal one (weights in the .so) and one with
`aot_inductor.package_constants_in_so=False` (code only). The weights handed to the models come
from another source (a saved and reloaded state dict), as the lanes' one packed copy hands them.
"""
from __future__ import annotations

import os
import zipfile

import pytest
import torch


WIDTH = 32


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])

    def forward(self, x):
        return self.layers(x)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared_weights")
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(4, WIDTH)
    batch = torch.export.Dim("batch", min=1, max=16)
    with torch.no_grad():
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    normal = torch._inductor.aoti_compile_and_package(ep, package_path=str(d / "normal.pt2"))
    code_only = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(d / "code_only.pt2"),
        inductor_configs={"aot_inductor.package_constants_in_so": False})
    torch.save(model.state_dict(), d / "weights.pt")
    return {"model": model, "normal": normal, "code_only": code_only, "dir": d,
            "x": torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(1))}


def other_source(built):
    """The weights as another process would have them: their own tensors, equal values."""
    return dict(torch.load(built["dir"] / "weights.pt"))


def eager(built, weights, x):
    m = Stack().eval()
    m.load_state_dict(weights)
    with torch.no_grad():
        return m(x)


@pytest.mark.server
@pytest.mark.parametrize("package", ["normal", "code_only"])
def test_user_managed_constants_are_read_in_place(built, package):
    compiled = torch._inductor.aoti_load_package(built[package])
    weights = other_source(built)
    assert set(compiled.get_constant_fqns()) == set(weights)
    compiled.load_constants(weights, check_full_update=True, user_managed=True)
    x = built["x"]
    assert torch.equal(compiled(x), eager(built, weights, x))
    if package == "normal":
        unshared = torch._inductor.aoti_load_package(built["normal"])
        assert torch.equal(compiled(x), unshared(x))
    before = compiled(x).clone()
    with torch.no_grad():
        weights["layers.2.bias"].add_(1.0)  # the caller's tensor, after load_constants
        weights["layers.0.weight"].mul_(0.5)
    after = compiled(x)
    assert not torch.allclose(after, before)
    assert torch.allclose(after, eager(built, weights, x), atol=1e-5)  # the model read our memory


@pytest.mark.server
def test_runner_swaps_to_user_constants_and_frees_its_own(built, tmp_path):
    """The normal package through the container runner: the package's weights are loaded,
    user-managed ones go into the inactive buffer, swap, free the inactive (the package's copy).
    The active constants are then the caller's storage (same data pointers)."""
    with zipfile.ZipFile(built["normal"]) as z:
        z.extractall(tmp_path)
    so = next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".so"))
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1)
    x = built["x"]
    own = runner.run([x])[0].clone()
    names = runner.get_constant_names_to_original_fqns()
    shared = other_source(built)
    mine = {inner: shared[fqn] for inner, fqn in names.items()}
    own_ptrs = {k: v.data_ptr() for k, v in runner.extract_constants_map(False).items()}
    runner.update_constant_buffer(mine, True, True, True)  # use_inactive, validate, user_managed
    runner.swap_constant_buffer()
    runner.free_inactive_constant_buffer()
    active = runner.extract_constants_map(False)
    # extract_constants_map names the constants by their original fqn, as `shared` does
    assert {k: v.data_ptr() for k, v in active.items()} == {k: v.data_ptr() for k, v in shared.items()}
    assert not set(own_ptrs.values()) & {v.data_ptr() for v in mine.values()}
    assert torch.equal(runner.run([x])[0], own)
    with torch.no_grad():
        shared["layers.1.bias"].sub_(2.0)
    assert torch.allclose(runner.run([x])[0], eager(built, shared, x), atol=1e-5)


# ---------------------------------------------------------------- the packed copy (handlers/weights)

def test_pack_keeps_values_shapes_strides_in_one_aligned_allocation_per_dtype():
    from handlers.weights.pack import ALIGN_BYTES, pack

    g = torch.Generator().manual_seed(0)
    src = {"w": torch.randn(5, 7, generator=g), "wt": torch.randn(7, 5, generator=g).t(),  # strided
           "b": torch.randn(3, generator=g), "ids": torch.arange(11), "empty": torch.empty(0, 4),
           "half": torch.randn(4, 4, generator=g).half()}
    held = pack(src, torch.device("cpu"))
    for name, t in src.items():
        assert torch.equal(held[name], t) and held[name].stride() == t.stride(), name
        # at a multiple of ALIGN_BYTES from the allocation's start (whose own alignment is the allocator's)
        assert held[name].storage_offset() * t.element_size() % ALIGN_BYTES == 0, name
    storages = {}
    for name, t in held.items():
        storages.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
    assert all(len(s) == 1 for s in storages.values())  # one allocation (one IPC handle) per dtype
    ptrs = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in held.values() if t.numel())
    assert all(a[1] <= b[0] for a, b in zip(ptrs, ptrs[1:]))  # no two overlap


@pytest.mark.server
def test_exported_program_reads_held_tensors_in_place_and_refuses_a_wrong_one(built, tmp_path):
    """The export kind's adopt: the module's parameters are the held tensors themselves (same
    memory), answers equal the program's own; a held tensor of another shape fails the load."""
    from handlers.artifact.kinds.exported_program import adopt, read_only
    from handlers.errors import LoadError

    x = torch.randn(4, WIDTH)
    batch = torch.export.Dim("batch", min=1, max=16)
    with torch.no_grad():
        ep = torch.export.export(built["model"], (x,), dynamic_shapes=({0: batch},))
    torch.export.save(ep, tmp_path / "p.pt2")
    held = {k: v.detach().clone() for k, v in read_only(torch.export.load(tmp_path / "p.pt2")).items()}
    mine = torch.export.load(tmp_path / "p.pt2")
    adopt(mine, held)
    module = mine.module()
    ptrs = {t.data_ptr() for t in module.state_dict().values()}
    assert ptrs == {t.data_ptr() for t in held.values()}
    assert torch.equal(module(built["x"]), torch.export.load(tmp_path / "p.pt2").module()(built["x"]))
    bad = dict(held, **{"state:layers.0.weight": torch.zeros(WIDTH, WIDTH + 1)})
    with pytest.raises(LoadError, match="layers.0.weight"):
        adopt(torch.export.load(tmp_path / "p.pt2"), bad)


@pytest.mark.server
def test_aoti_adopt_frees_its_own_copy_and_names_a_missing_constant(built, tmp_path):
    from handlers.artifact.device import Placement
    from handlers.artifact.kinds import aoti_runner
    from handlers.errors import LoadError
    from handlers.weights.pack import pack

    cpu = Placement("cpu", None)
    so, kernels = aoti_runner.package_library(built["normal"], str(tmp_path / "a"))
    source = aoti_runner.new_runner(so, cpu, kernels)
    held = pack(aoti_runner.constants(source), torch.device("cpu"))
    del source  # the views it gave are gone with it; the packed copies stay
    so2, kernels2 = aoti_runner.package_library(built["normal"], str(tmp_path / "b"))
    runner = aoti_runner.new_runner(so2, cpu, kernels2)
    own = runner.run([built["x"]])[0].clone()
    assert aoti_runner.adopt(runner, held) == sum(t.numel() * t.element_size() for t in held.values())
    active = aoti_runner.constants(runner)
    assert {k: v.data_ptr() for k, v in active.items()} == {k: v.data_ptr() for k, v in held.items()}
    assert torch.equal(runner.run([built["x"]])[0], own)
    partial = {k: v for k, v in held.items() if k != "layers.1.bias"}
    with pytest.raises(LoadError, match="layers.1.bias"):
        aoti_runner.adopt(aoti_runner.new_runner(so2, cpu, kernels2), partial)


@pytest.mark.server
def test_a_runner_that_fails_its_first_call_on_held_weights_falls_back_to_the_threaded_one(built, monkeypatch, tmp_path):
    """AotiPackage._held: the single-threaded runner (CUDA graphs) is tried first; one whose
    first call fails is replaced by the threaded runner, and the load says so; both failing
    fails the load naming each."""
    from handlers.artifact.device import Placement
    from handlers.artifact.kinds import aoti_package, aoti_runner
    from handlers.errors import LoadError
    from handlers.weights.pack import pack

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    cpu = Placement("cpu", None)
    so, kernels = aoti_runner.package_library(built["normal"], str(tmp_path / "src"))
    source = aoti_runner.new_runner(so, cpu, kernels)  # alive while pack copies its constants
    held = pack(aoti_runner.constants(source), torch.device("cpu"))
    # the fields of an ArtifactSpec the kind's held load reads
    spec = type("Spec", (), {"artifact_path": str(built["normal"]), "batch_min": 1,
                             "example": lambda self, n, device: {"x": torch.randn(n, WIDTH)}})()
    calls = []
    real = aoti_runner.smoke

    def first_fails(runner, spec, placement):
        calls.append(len(calls))
        if len(calls) == 1:
            raise LoadError("a call on the held weights failed: RuntimeError: Unknown constant state")
        real(runner, spec, placement)

    monkeypatch.setattr(aoti_runner, "smoke", first_fails)
    runner, how = aoti_package.KIND._held(spec, cpu, True, held)
    assert len(calls) == 2 and "threaded runner (single-threaded runner: " in how and "Unknown constant" in how
    assert torch.equal(runner.run([built["x"]])[0], source.run([built["x"]])[0])
    monkeypatch.setattr(aoti_runner, "smoke", lambda *a: (_ for _ in ()).throw(LoadError("broken")))
    with pytest.raises(LoadError, match="single-threaded runner: broken; threaded runner: broken"):
        aoti_package.KIND._held(spec, cpu, True, held)
