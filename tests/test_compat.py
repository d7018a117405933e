"""Incompatible artifacts are refused before a worker reports ready, with a message naming the
artifact's target, the machine and the fix: in real TorchServe and in compiled_serving/inspect_artifact.py.

Every case starts from a real compiled artifact and alters what a real mismatch would alter
(package metadata, artifact.json, the file itself), re-pinning the SHA-256 where a rebuilt
artifact would carry a new one."""
import os
import shutil
import subprocess
import time
import zipfile

import pytest
import torch
from conftest import (
    PY,
    ROOT,
    build_mar,
    corrupt_inside_mar,
    cs_command,
    repin,
    rewrite_package_metadata,
)

from handlers.artifact import rules
from handlers.artifact.device import Placement
from handlers.artifact.kinds import kind_of
from handlers.artifact.machine import ISA_FLAGS, Machine, cpu_flags
from handlers.artifact.metadata import read_spec, sha256_file, write_spec


def check(spec, placement, m, strict_versions=False):
    return rules.check(spec, kind_of(spec), placement, m, strict_versions)


def missing_isa():
    flags = cpu_flags()
    for name in ("AMX_TILE", "AVX512", "AVX512_VNNI", "SVE"):
        if not all(f in flags for f in ISA_FLAGS[name]):
            return name
    pytest.skip("this CPU has every ISA extension we could claim")


FAKE_TRT = '''
import torch

@torch.library.custom_op("tensorrt::execute_engine", mutates_args=())
def execute_engine(x: torch.Tensor) -> torch.Tensor:
    return x * 2

@execute_engine.register_fake
def _(x):
    return torch.empty_like(x)

class Engine(torch.nn.Module):
    def forward(self, image):
        return torch.ops.tensorrt.execute_engine(image)
'''


def fake_trt_artifact(dest):
    """An exported program whose graph calls `tensorrt::execute_engine`, the op Torch-TensorRT
    inserts for each engine. The op here is a stand-in defined by this test (TensorRT cannot be
    installed on these machines); detection reads only the serialized graph."""
    import importlib.util

    os.makedirs(dest, exist_ok=True)
    src = os.path.join(dest, "..", "fake_trt_model.py")
    with open(src, "w") as f:
        f.write(FAKE_TRT)
    spec_ = importlib.util.spec_from_file_location("fake_trt_model", src)
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    ep = torch.export.export(mod.Engine(), (torch.randn(2, 4),))
    torch.export.save(ep, os.path.join(dest, "model.pt2"))
    from handlers.artifact.metadata import ArtifactSpec, TensorSpec

    write_spec(ArtifactSpec(
        backend="tensorrt", artifact="model.pt2", sha256=sha256_file(os.path.join(dest, "model.pt2")),
        device="cuda", inputs=(TensorSpec("image", "float32", (2, 4)),),
        outputs=(TensorSpec("output", "float32", (2, 4)),), output_structure="tensor", batch_min=2,
        batch_max=2, torch_version=torch.__version__, compute_capability="9.0", cuda_archs=("sm_90",),
        platform="linux", machine="x86_64",
        extra={"tensorrt_version": "10.13.0", "torch_tensorrt_version": "2.13.0", "format": "exported_program",
               "state": {"mutated": [], "checked": "torch.export program graph"}}),  # as cs-compile records
        dest)
    return dest


CRASH_C = r'''
#include <signal.h>
__attribute__((constructor)) static void crash_on_load(void) { raise(SIGSEGV); }
'''


@pytest.fixture(scope="module")
def broken(artifacts, tmp_path_factory):
    """name -> (artifact dir, text the load error must contain)."""
    root = tmp_path_factory.mktemp("broken")
    cases = {}

    isa = missing_isa()
    d = artifacts.copy("two_aoti", "isa")
    rewrite_package_metadata(d, AOTI_CPU_ISA=f"AVX2 {isa}")
    repin(d, cpu_isa=f"AVX2 {isa}")
    cases["wrong_isa"] = (d, f"this CPU lacks {isa}")

    d = artifacts.copy("two_aoti", "cuda_only")
    rewrite_package_metadata(d, AOTI_DEVICE_KEY="cuda", AOTI_COMPUTE_CAPABILITY="90")
    repin(d, device="cuda", compute_capability="9.0", cuda_archs=("sm_90",))
    cases["cuda_on_cpu"] = (d, "compiled for CUDA and cannot run on the CPU")

    d = artifacts.copy("cls_export", "corrupt")
    with open(os.path.join(d, "model.pt2"), "r+b") as f:
        f.seek(100)
        f.write(b"\x00" * 16)
    cases["corrupt"] = (d, "does not match its own archive's record")

    d = artifacts.copy("cls_export", "truncated")
    path = os.path.join(d, "model.pt2")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    repin(d)
    cases["truncated"] = (d, "not a valid .pt2 archive")

    d = artifacts.copy("cls_aoti", "crash")
    so_dir = os.path.join(d, "bare_so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-x", "c", "-", "-o", os.path.join(so_dir, "model.so")],
                   input=CRASH_C, text=True, check=True)
    repin(so_dir)
    cases["crashing_library"] = (so_dir, "crashed the trial process with SIGSEGV")

    d = fake_trt_artifact(str(root / "trt"))
    cases["trt_missing"] = (d, "pip install torch-tensorrt==2.13.0")
    return cases


@pytest.fixture(scope="module")
def broken_server(broken, artifacts, serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("broken_store")
    mars = {}
    for name, (d, _) in broken.items():
        if name == "corrupt":  # archive.py refuses a corrupt artifact, so corrupt the archive
            mars[name] = build_mar(artifacts.get("cls_export"), name, store)
            corrupt_inside_mar(mars[name])
        else:
            mars[name] = build_mar(d, name, store)
    return serve(mars, ready=False)


@pytest.mark.server
@pytest.mark.parametrize("name", ["wrong_isa", "cuda_on_cpu", "corrupt", "truncated", "crashing_library",
                                  "trt_missing"])
def test_refused_with_message_and_answered(broken, broken_server, name):
    """The load error is in the log, and since it recurs (handler.answer_load_failure, the
    default) the worker answers every request 503 ModelLoadFailed with it instead of leaving
    clients waiting while TorchServe restarts it; its description says ready: false."""
    needle = broken[name][1]
    deadline = time.time() + 240
    while time.time() < deadline:
        lines = [ln for ln in broken_server.log().splitlines() if "W-" in ln and f"-{name}_" in ln]
        if any(needle in ln for ln in lines):
            break
        time.sleep(2)
    else:
        pytest.fail(f"{name}: no load error containing {needle!r} in the model log:\n"
                    + "\n".join(lines[-20:]))
    broken_server.wait_ready([name], timeout=120)  # TorchServe lists the answering worker READY
    r = broken_server.predict(name, {"inputs": {}}, timeout=60)
    assert r.status_code == 503 and r.json()["type"] == "ModelLoadFailed", r.text
    assert needle in r.json()["message"], r.text
    assert broken_server.describe(name)["ready"] is False
    # answering the request touched nothing the failed load never set
    mine = [ln for ln in broken_server.log().splitlines() if f"-{name}_" in ln]
    assert not [ln for ln in mine if "AttributeError" in ln], mine[-10:]


@pytest.mark.server
@pytest.mark.parametrize("name", ["wrong_isa", "cuda_on_cpu", "corrupt", "truncated", "crashing_library",
                                  "trt_missing"])
def test_inspect_names_the_mismatch(broken, name):
    d, needle = broken[name]
    cmd = [*cs_command("inspect_artifact"), str(d)] + (["--trial-load"] if name == "crashing_library" else [])
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert needle in r.stdout, r.stdout


@pytest.mark.server
def test_inspect_accepts_a_good_mar(artifacts, tmp_path):
    mar = build_mar(artifacts.get("two_aoti"), "good", tmp_path)
    r = subprocess.run([*cs_command("inspect_artifact"), str(mar)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "OK             runs here on cpu" in r.stdout, r.stdout


@pytest.mark.server
def test_variants_pick_the_one_that_fits(artifacts, broken, tmp_path):
    """An archive with a variant this CPU cannot run and one it can: the worker picks the second."""
    from handlers.artifact.variants import choose_variant
    from handlers.config import parse_config

    mar = build_mar([broken["wrong_isa"][0], artifacts.get("two_aoti")], "multi", tmp_path)
    out = tmp_path / "x"
    with zipfile.ZipFile(mar) as z:
        z.extractall(out)
    spec, placement, _ = choose_variant(str(out), None, parse_config({}))
    # the runnable variant (whatever ISA this CPU compiled it for), not the one lacking an extension
    good, bad = read_spec(str(artifacts.get("two_aoti"))), read_spec(str(broken["wrong_isa"][0]))
    assert spec.cpu_isa == good.cpu_isa != bad.cpu_isa and placement.kind == "cpu", (spec.cpu_isa, bad.cpu_isa)
    # only the bad one: the error lists what it has and what the machine is
    mar = build_mar([broken["wrong_isa"][0], broken["cuda_on_cpu"][0]], "multi_bad", tmp_path)
    out = tmp_path / "y"
    with zipfile.ZipFile(mar) as z:
        z.extractall(out)
    with pytest.raises(Exception) as e:
        choose_variant(str(out), None, parse_config({}))
    assert "This machine: linux" in str(e.value) and "this CPU lacks" in str(e.value) \
        and "compiled for CUDA" in str(e.value)


# ---------------------------------------------------------------- rules, unit level


def spec_for(backend="aoti", cc="9.0", archs=("sm_90",), torch_version=None, extra=None):
    from handlers.artifact.metadata import ArtifactSpec

    return ArtifactSpec(backend=backend, artifact="m", sha256="", device="cuda", inputs=(), outputs=(),
                        output_structure="tensor", batch_min=1, batch_max=1,
                        torch_version=torch_version or torch.__version__, compute_capability=cc,
                        cuda_archs=archs, platform="linux", machine="x86_64", extra=extra or {})


def machine(cc, **pk):
    return Machine("linux", "x86_64", torch.__version__, frozenset(), cc, "GPU", pk)


@pytest.mark.parametrize("art,dev,archs,fatal,warn", [
    ("9.0", "9.0", ("sm_90",), False, False),
    ("8.0", "9.0", ("sm_80",), True, False),   # other major
    ("8.6", "8.0", ("sm_86",), True, False),   # device minor lower
    ("8.0", "8.6", ("sm_80",), False, True),   # binary compatible, warn
    ("9.0", "9.0", ("sm_90a",), False, False),
])
def test_compute_capability_rules(art, dev, archs, fatal, warn):
    f, w = check(spec_for(cc=art, archs=archs), Placement("cuda", 0), machine(dev))
    assert bool(f) == fatal and bool(w) == warn, (f, w)
    if fatal:
        assert "Fix" in f[0] and art in f[0] and dev in f[0]


def test_arch_specific_kernels_need_the_exact_gpu():
    f, _ = check(spec_for(cc="9.0", archs=("sm_90a",)), Placement("cuda", 0), machine("10.0"))
    assert f


def test_torch_version_rules():
    f, _ = check(spec_for(torch_version="1.13.0"), Placement("cuda", 0), machine("9.0"))
    assert "C++ ABI" in f[0]
    f, w = check(spec_for(backend="export", torch_version="1.13.0"), Placement("cuda", 0), machine("9.0"))
    assert not f and w


def test_tensorrt_rules():
    extra = {"tensorrt_version": "10.3.0", "torch_tensorrt_version": "2.5.0"}
    f, _ = check(spec_for(backend="tensorrt", extra=extra), Placement("cuda", 0), machine("9.0"))
    assert "pip install torch-tensorrt==2.5.0" in f[0]
    f, _ = check(spec_for(backend="tensorrt", extra=extra), Placement("cuda", 0),
                 machine("9.0", torch_tensorrt="2.5.0", tensorrt="10.7.0"))
    assert "TensorRT 10.3.0" in f[0]
    f, _ = check(spec_for(backend="tensorrt", cc="8.6", extra={**extra, "hardware_compatible": True}),
                 Placement("cuda", 0), machine("9.0", torch_tensorrt="2.5.0", tensorrt="10.3.1"))
    assert not f
    f, _ = check(spec_for(backend="tensorrt", cc="8.6", extra=extra), Placement("cuda", 0),
                 machine("9.0", torch_tensorrt="2.5.0", tensorrt="10.3.1"))
    assert "--hardware-compatible" in f[0]


def test_tensorrt_detected_without_importing_it(tmp_path):
    from handlers.artifact.kinds import recognise
    from handlers.artifact.kinds.tensorrt import has_tensorrt_engines

    d = fake_trt_artifact(str(tmp_path / "trt"))
    assert has_tensorrt_engines(os.path.join(d, "model.pt2"))
    spec = read_spec(d)
    relabelled = recognise(type(spec)(**{**spec.__dict__, "backend": "export"}))
    assert relabelled.backend == "tensorrt"  # a mislabelled artifact is still recognised


_COUNT_ISA_BUILDS = r"""
import sys, time
sys.path.insert(0, {root!r})
from torch._inductor import cpu_vec_isa
builds = []
real = cpu_vec_isa.VecISA.check_build
cpu_vec_isa.VecISA.check_build = lambda self, code: builds.append(str(self)) or real(self, code)
from handlers.artifact.device import Placement
from handlers.artifact.load import load_artifact
from handlers.artifact.metadata import read_spec
t0 = time.perf_counter()
load_artifact(read_spec({art!r}), Placement("cpu", None))
print(len(builds), round(time.perf_counter() - t0, 2))
"""


@pytest.mark.server
def test_aoti_load_compiles_no_isa_probes(artifacts):
    """Left alone, aoti_load_package builds a probe library per SIMD extension and imports torch
    in a child Python to dlopen each (minutes per worker on the GPU image). Our
    compatibility rules already covered the CPU ISA; a fresh process must load with no such build."""
    code = _COUNT_ISA_BUILDS.format(root=str(ROOT), art=str(artifacts.get("cls_aoti")))
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    builds, seconds = r.stdout.split()[-2:]
    assert builds == "0", f"inductor built {builds} ISA probe(s) during load ({seconds} s)"


def test_platform_and_architecture_refused_for_native_artifacts():
    spec = spec_for(cc="9.0")
    other = type(spec)(**{**spec.__dict__, "platform": "linux", "machine": "aarch64"})
    f, _ = check(other, Placement("cuda", 0), machine("9.0"))
    assert f == ["built for linux/aarch64, this machine is linux/x86_64: recompile on the target platform"]
    # an exported program is a graph, not native code: no platform rule
    exp = type(spec)(**{**other.__dict__, "backend": "export"})
    assert check(exp, Placement("cuda", 0), machine("9.0")) == ([], [])


def test_arch_specific_kernels_refused_on_a_higher_minor_of_the_same_major():
    """sm_100a kernels run only on 10.0. On 10.3 (same major, higher minor) plain sm_100 is
    binary compatible (warning), the arch-specific build is not (fatal)."""
    f, w = check(spec_for(cc="10.0", archs=("sm_100a",)), Placement("cuda", 0), machine("10.3"))
    assert len(f) == 1 and "compute capability 10.0 (sm_100a)" in f[0] and "compute capability 10.3" in f[0] \
        and "Fix:" in f[0], f
    f, w = check(spec_for(cc="10.0", archs=("sm_100",)), Placement("cuda", 0), machine("10.3"))
    assert f == [] and w == ["built for compute capability 10.0, running on 10.3 (binary compatible; "
                             "recompile for best speed)"]


def _patched(version: str) -> str:
    base, plus, local = version.partition("+")
    major, minor, *rest = base.split(".")
    return f"{major}.{minor}.{int(rest[0].rstrip('abcdefghijklmnopqrstuvwxyz') or 0) + 1 if rest else 1}"


@pytest.mark.server
def test_strict_versions_makes_a_patch_difference_fatal(artifacts):
    """Through the worker's own path (choose_variant + parse_config) on a real exported
    program whose artifact.json records another torch patch release."""
    from handlers.artifact.variants import choose_variant
    from handlers.config import parse_config
    from handlers.errors import IncompatibleArtifact

    d = artifacts.copy("cls_export", "patch_version")
    other = _patched(torch.__version__)
    repin(d, torch_version=other)
    spec, placement, warn = choose_variant(str(d), None, parse_config({}))
    assert placement.kind == "cpu" and warn == [f"built with torch {other}, this worker has torch {torch.__version__}"]
    with pytest.raises(IncompatibleArtifact) as e:
        choose_variant(str(d), None, parse_config({"handler": {"strict_versions": True}}))
    assert f"built with torch {other}, this worker has torch {torch.__version__}" in str(e.value)
    assert "no artifact in this archive can run on this worker" in str(e.value)


@pytest.mark.server
def test_package_metadata_disagreeing_with_artifact_json_fails(artifacts):
    from handlers.artifact.variants import open_variant
    from handlers.errors import IncompatibleArtifact

    d = artifacts.copy("two_aoti", "meta_disagrees")
    rewrite_package_metadata(d, AOTI_DEVICE_KEY="cuda")  # the package says CUDA, artifact.json CPU
    repin(d)
    with pytest.raises(IncompatibleArtifact) as e:
        open_variant(str(d))
    assert str(e.value) == ("model.pt2 was compiled for cuda (package metadata) but artifact.json says cpu: "
                            "rebuild the archive")


@pytest.mark.server
def test_package_metadata_wins_over_artifact_json(artifacts):
    from handlers.artifact.variants import open_variant

    d = artifacts.copy("two_aoti", "meta_wins")
    rewrite_package_metadata(d, AOTI_DEVICE_KEY="cuda", AOTI_COMPUTE_CAPABILITY="90")
    repin(d, device="cuda", compute_capability="8.0", cuda_archs=("sm_80",))
    spec = open_variant(str(d))
    assert (spec.compute_capability, spec.cuda_archs) == ("9.0", ("sm_90",))


# ---------------------------------------------------------------- crash-safe probe paths


@pytest.mark.server
def test_probe_reports_a_python_error_as_the_load_error(artifacts):
    """A Python-level failure in the child comes back as the child's own error message."""
    from handlers.artifact.kinds import recognise
    from handlers.artifact.load import load_artifact
    from handlers.artifact.probe import crash_safe_probe
    from handlers.config import parse_config
    from handlers.errors import LoadError

    d = artifacts.copy("cls_export", "probe_pyerror")
    path = os.path.join(d, "model.pt2")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    repin(d)
    spec = read_spec(str(d))
    # the child's steps: recognise, then load (the parent checked integrity when it chose the
    # variant; this truncated file was re-pinned, so only loading it fails)
    with pytest.raises(LoadError) as in_process:
        load_artifact(recognise(read_spec(str(d))), Placement("cpu", None))
    with pytest.raises(LoadError) as probed:
        crash_safe_probe(spec, Placement("cpu", None), parse_config({}))
    assert "torch.export.load failed for model.pt2" in str(probed.value)
    assert str(probed.value) == str(in_process.value)


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """Make the probe's child a given shell script (the probe runs sys.executable)."""
    import sys

    def make(body: str):
        exe = tmp_path / "python"
        exe.write_text("#!/bin/sh\n" + body + "\n")
        exe.chmod(0o755)
        monkeypatch.setattr(sys, "executable", str(exe))
    return make


@pytest.mark.server
def test_probe_timeout_is_a_load_error(artifacts, fake_python):
    from handlers.artifact.probe import crash_safe_probe
    from handlers.config import parse_config
    from handlers.errors import LoadError

    spec = read_spec(str(artifacts.get("cls_export")))
    fake_python("exec sleep 30")  # a trial load that hangs
    t0 = time.time()
    with pytest.raises(LoadError) as e:
        crash_safe_probe(spec, Placement("cpu", None), parse_config({"handler": {"crash_safe_timeout_s": 1}}))
    assert time.time() - t0 < 10
    assert str(e.value) == ("trial load of model.pt2 on cpu did not finish within 1s "
                            "(handler.crash_safe_timeout_s)")


@pytest.mark.server
def test_probe_names_an_abort(artifacts, fake_python):
    from handlers.artifact.probe import crash_safe_probe
    from handlers.config import parse_config
    from handlers.errors import LoadError

    spec = read_spec(str(artifacts.get("cls_export")))
    fake_python("echo 'terminate called after throwing' >&2; kill -ABRT $$")
    with pytest.raises(LoadError) as e:
        crash_safe_probe(spec, Placement("cpu", None), parse_config({}))
    msg = str(e.value)
    assert msg.startswith("loading model.pt2 (export) on cpu crashed the trial process with SIGABRT: "
                          "an abort in native code"), msg
    assert msg.endswith("Last output: terminate called after throwing"), msg


@pytest.mark.server
def test_a_load_hashes_only_the_variant_it_serves(artifacts, tmp_path, monkeypatch):
    """Two fitting variants: the first (archive order) is chosen and hashed, the second is never
    read past its artifact.json, so its corrupt file does not stop the load; the chosen one's
    corruption does, with the integrity message."""
    from handlers.artifact import variants
    from handlers.config import parse_config
    from handlers.errors import LoadError

    model_dir = tmp_path / "m"
    for i in range(2):
        shutil.copytree(artifacts.get("cls_export"), model_dir / "variants" / f"{i:02d}_export_cpu")
    with open(model_dir / "variants" / "01_export_cpu" / "model.pt2", "r+b") as f:
        f.truncate(100)  # no longer matches its pinned SHA-256
    hashed = []
    real = variants.verify_integrity
    monkeypatch.setattr(variants, "verify_integrity", lambda spec, zipped, root=None: (
        hashed.append(spec.variant_dir), real(spec, zipped, root)))
    spec, placement, warn = variants.choose_variant(str(model_dir), None, parse_config({}))
    assert spec.variant_dir.endswith("00_export_cpu") and placement.kind == "cpu" and not warn
    assert [os.path.basename(d) for d in hashed] == ["00_export_cpu"]
    with open(model_dir / "variants" / "00_export_cpu" / "model.pt2", "r+b") as f:
        f.truncate(100)
    with pytest.raises(LoadError, match="SHA-256"):
        variants.choose_variant(str(model_dir), None, parse_config({}))


def test_variant_choice_looks_past_a_warning_and_stops_at_an_exact_fit(monkeypatch):
    """Ranked by artifact.json, judged again by the files: a variant whose own facts turn its
    warning into an exact fit wins over an earlier one that still warns; the search stops at the
    first exact fit (opening, i.e. hashing, nothing after it)."""
    import types

    from handlers.artifact import variants
    from handlers.config import parse_config

    # (warnings by artifact.json, warnings by the artifact's own files)
    facts = {"a": (["old driver"], ["old driver"]), "b": (["old driver"], []), "c": ([], [])}
    opened = []
    monkeypatch.setattr(variants, "_variant_dirs", lambda model_dir, config: list(facts))
    monkeypatch.setattr(variants, "read_spec", lambda d: types.SimpleNamespace(d=d, refined=False))
    monkeypatch.setattr(variants, "open_variant",
                        lambda d, root=None: (opened.append(d), types.SimpleNamespace(d=d, refined=True))[1])
    from handlers.artifact.device import Placement

    cpu = Placement("cpu", None)
    monkeypatch.setattr(variants, "assess", lambda spec, *a: (cpu, [], facts[spec.d][spec.refined]))
    spec, _, warn = variants.choose_variant("/m", None, parse_config({}))
    assert spec.d == "c" and not warn and opened == ["c"]  # the exact fit by artifact.json, alone
    facts["c"] = (["old driver"], ["old driver"])
    spec, _, warn = variants.choose_variant("/m", None, parse_config({}))
    assert spec.d == "b" and not warn and opened[1:] == ["a", "b"]


_LOAD_WITHOUT_INDUCTOR = r"""
import sys, json
sys.path.insert(0, {root!r})
import torch
from handlers.artifact.device import Placement
from handlers.artifact.load import load_artifact
from handlers.artifact.metadata import read_spec
spec = read_spec({art!r})
model = load_artifact(spec, Placement("cpu", None))
inductor = "torch._inductor" in sys.modules
g = torch.Generator().manual_seed(3)
args = [torch.randn(s.concrete(3), generator=g).to(getattr(torch, s.dtype)) for s in spec.inputs]
ours = model(*args)
from torch._inductor import aoti_load_package
theirs = torch.utils._pytree.tree_leaves(aoti_load_package(spec.artifact_path)(*args))
print(json.dumps({{"inductor": inductor, "names": list(ours),
                   "equal": [torch.equal(a, b) for a, b in zip(ours.values(), theirs)]}}))
"""


@pytest.mark.server
@pytest.mark.parametrize("name", ["cls_aoti", "two_aoti"])
def test_aoti_package_loads_without_inductor_and_answers_as_torch_wrapper(artifacts, name):
    """The package goes through the loader aoti_load_package wraps, never importing
    torch._inductor (4.2 s of a GPU worker's start), and every output equals what torch's own
    wrapper returns, in artifact.json's order (two_aoti has two outputs)."""
    import json

    code = _LOAD_WITHOUT_INDUCTOR.format(root=str(ROOT), art=str(artifacts.get(name)))
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["inductor"] is False
    assert got["equal"] and all(got["equal"]), got
    assert got["names"] == read_spec(str(artifacts.get(name))).output_names
