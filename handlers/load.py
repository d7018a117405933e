"""Load an artifact onto the worker's device, with the runner that matches how it was built.

Every artifact is checked against the SHA-256 in its metadata before anything in it runs or
is unpickled: loading an AOTInductor package dlopens a shared library, and torch.export.load
unpickles, so an artifact is code.
"""
from __future__ import annotations

import contextlib
import glob
import os
import zipfile

import torch

from .device import Placement
from .errors import IncompatibleArtifact, LoadError
from .metadata import ArtifactSpec, sha256_file
from .relocate import relocate


_verified = {}  # (path, mtime, size) -> digest: the variant choice and the load hash once


def verify_integrity(spec: ArtifactSpec) -> None:
    path = spec.artifact_path
    real = os.path.realpath(path)
    home = os.path.realpath(spec.variant_dir)
    if not real.startswith(home + os.sep):
        raise LoadError(f"artifact {spec.artifact!r} resolves outside the model directory ({real}); "
                        "refusing to load it")
    if not os.path.isfile(real):
        raise LoadError(f"artifact {spec.artifact!r} named in artifact.json is missing from {home}; "
                        "rebuild the archive with scripts/archive.py")
    st = os.stat(real)
    key = (real, st.st_mtime_ns, st.st_size)
    digest = _verified.get(key) or sha256_file(real)
    _verified[key] = digest
    if digest != spec.sha256:
        raise LoadError(f"artifact {spec.artifact} has SHA-256 {digest}, but artifact.json pins "
                        f"{spec.sha256}: the file is corrupt, truncated or was replaced. Rebuild it "
                        "with scripts/compile.py and scripts/archive.py.")
    if spec.backend in ("aoti", "export", "tensorrt") and not zipfile.is_zipfile(real):
        raise LoadError(f"artifact {spec.artifact} is not a valid .pt2 archive (zip directory not "
                        "found; truncated?). Rebuild it with scripts/compile.py.")


class LoadedModel:
    """A callable taking the artifact's inputs positionally and returning {output name: tensor}."""

    def __init__(self, fn, spec: ArtifactSpec, device: torch.device, kind: str, flat_outputs=False):
        self._fn = fn
        self.spec = spec
        self.device = device
        self.kind = kind
        self._flat = flat_outputs

    def __call__(self, *tensors):
        out = self._fn(list(tensors)) if self._flat else self._fn(*tensors)
        leaves = torch.utils._pytree.tree_leaves(out)
        names = self.spec.output_names
        if len(leaves) != len(names):
            raise LoadError(f"model returned {len(leaves)} output tensor(s), artifact.json names "
                            f"{len(names)} ({', '.join(names)})")
        return dict(zip(names, leaves))


def skip_isa_probe_builds():
    """aoti_load_package compares the package's metadata with inductor's description of this
    machine, only to log a warning on a difference. To name this machine's CPU ISA, inductor
    compiles a probe library per SIMD extension (AVX512, VNNI, BF16, AMX, AMX-FP16) and imports
    torch in a fresh Python to dlopen each: 40-100 s per worker process on the GPU image
    (measured, docs/results), paid again by every worker and by the crash-safe probe.
    compat.check has already compared device kind, compute capability and the CPU flags the
    package needs with this machine, and fails the load on a real mismatch, so inductor's
    comparison is replaced by an empty one for the duration of the call."""
    from unittest import mock

    from torch._inductor import codecache

    if not hasattr(codecache, "get_device_information"):
        return contextlib.nullcontext()
    return mock.patch.object(codecache, "get_device_information", lambda device_type: {})


def _load_aoti(spec: ArtifactSpec, placement: Placement) -> LoadedModel:
    from torch._inductor import aoti_load_package

    kwargs = {"device_index": placement.index} if placement.kind == "cuda" else {}
    try:
        with skip_isa_probe_builds():
            fn = aoti_load_package(spec.artifact_path, **kwargs)
    except Exception as e:  # torch raises RuntimeError with the C++ message
        raise LoadError(f"aoti_load_package failed for {spec.artifact} on {placement}: {e}") from e
    meta = fn.get_metadata() if hasattr(fn, "get_metadata") else {}
    built_for = meta.get("AOTI_DEVICE_KEY")
    if built_for and built_for != placement.kind:
        raise IncompatibleArtifact(f"{spec.artifact} was compiled for {built_for} "
                                   f"(AOTI_DEVICE_KEY) but this worker serves on {placement}")
    return LoadedModel(fn, spec, placement.torch_device, "aoti_package")


def _load_aoti_so(spec: ArtifactSpec, placement: Placement) -> LoadedModel:
    """A bare AOTInductor shared library (the pre-package format of field report 000), run by
    the container runner that matches the device kind it was compiled for, with its cubins."""
    runners = torch._C._aoti
    so = spec.artifact_path
    try:
        if placement.kind == "cuda":
            cubin_dir = os.path.join(spec.variant_dir, spec.extra.get("cubin_dir", "cubin"))
            if not glob.glob(os.path.join(cubin_dir, "*.cubin")):
                raise LoadError(f"{spec.artifact} is a CUDA AOTInductor library but {cubin_dir} holds "
                                "no .cubin files; archive its kernel directory beside it")
            runner = runners.AOTIModelContainerRunnerCuda(so, 1, str(placement), cubin_dir)
        else:
            runner = runners.AOTIModelContainerRunnerCpu(so, 1)
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"the AOTInductor container runner failed to load {spec.artifact} on "
                        f"{placement}: {e}") from e
    return LoadedModel(runner.run, spec, placement.torch_device, "aoti_so", flat_outputs=True)


def _load_export(spec: ArtifactSpec, placement: Placement) -> LoadedModel:
    try:
        ep = torch.export.load(spec.artifact_path)
    except Exception as e:
        raise LoadError(f"torch.export.load failed for {spec.artifact}: {e}. The file may be "
                        f"corrupt or saved by an incompatible torch (built with {spec.torch_version}, "
                        f"this is {torch.__version__}).") from e
    ep = relocate(ep, placement.torch_device)
    return LoadedModel(ep.module(), spec, placement.torch_device, "exported_program")


def load_artifact(spec: ArtifactSpec, placement: Placement, config=None) -> LoadedModel:
    verify_integrity(spec)
    if placement.kind == "cuda":
        # Field report 004: everything that creates CUDA state must see the assigned device.
        torch.cuda.set_device(placement.index)
    if spec.backend == "aoti":
        return _load_aoti(spec, placement)
    if spec.backend == "aoti_so":
        return _load_aoti_so(spec, placement)
    if spec.backend == "export":
        return _load_export(spec, placement)
    if spec.backend == "tensorrt":
        from .tensorrt import load_tensorrt

        return load_tensorrt(spec, placement, config)
    raise LoadError(f"unknown backend {spec.backend!r}")
