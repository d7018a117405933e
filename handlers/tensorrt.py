"""Torch-TensorRT artifacts: recognised without importing torch_tensorrt, loaded through it.

NOT EXECUTED on this project's machines: NVIDIA TensorRT cannot be installed on any of them
(BRIEF.md section 3). The loading path follows Torch-TensorRT's documented API
(torch_tensorrt.load, torch_tensorrt.runtime.set_multi_device_safe_mode); detection, metadata
and the missing-package error are tested in CI.
"""
from __future__ import annotations

import zipfile

import torch

from .device import Placement
from .errors import IncompatibleArtifact, LoadError
from .metadata import ArtifactSpec

# Names under which TensorRT engine calls appear in a serialized ExportedProgram / AOTI package.
ENGINE_MARKERS = (b"tensorrt.execute_engine", b"tensorrt::execute_engine", b"torch_tensorrt")


def has_tensorrt_engines(path: str) -> bool:
    """True when a .pt2 archive's serialized graph calls TensorRT engines. Reads the archive's
    JSON/text members only: nothing is unpickled or loaded."""
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.file_size > 64 << 20 or not info.filename.endswith((".json", ".py", ".txt", ".cpp")):
                    continue
                data = z.read(info.filename)
                if any(m in data for m in ENGINE_MARKERS):
                    return True
    except (zipfile.BadZipFile, OSError):
        return False
    return False


def missing_package_message(spec: ArtifactSpec) -> str:
    tt = spec.extra.get("torch_tensorrt_version")
    trt = spec.extra.get("tensorrt_version")
    return (f"{spec.artifact} is a Torch-TensorRT artifact (TensorRT engine calls in its graph), but the "
            f"torch_tensorrt package is not installed on this worker. Fix: pip install "
            f"torch-tensorrt{'==' + tt if tt else ' (the release built for torch ' + spec.torch_version + ')'}"
            f"{' with TensorRT ' + trt if trt else ''} on a CUDA machine, then restart TorchServe.")


def load_tensorrt(spec: ArtifactSpec, placement: Placement, config=None):
    from .load import LoadedModel
    from .relocate import relocate

    try:
        import torch_tensorrt
    except ImportError:
        raise IncompatibleArtifact(missing_package_message(spec)) from None
    if placement.kind != "cuda":
        raise IncompatibleArtifact(f"{spec.artifact} holds TensorRT engines, which run only on NVIDIA GPUs; "
                                   "this worker has none. Fix: serve it on a GPU worker.")
    # Field report 004: engines deserialize on the current device; set it before anything else.
    torch.cuda.set_device(placement.index)
    if config is not None and config.trt_multi_device_safe_mode:
        # Checks the device before every engine call: safe with several GPUs in one process,
        # at a per-call cost (documented in README).
        torch_tensorrt.runtime.set_multi_device_safe_mode(True)
    fmt = spec.extra.get("format", "exported_program")
    try:
        if fmt == "aot_inductor":
            from torch._inductor import aoti_load_package

            from .load import skip_isa_probe_builds

            with skip_isa_probe_builds():
                fn = aoti_load_package(spec.artifact_path, device_index=placement.index)
            return LoadedModel(fn, spec, placement.torch_device, "tensorrt_aoti")
        ep = torch_tensorrt.load(spec.artifact_path)
    except Exception as e:
        raise LoadError(f"torch_tensorrt could not load {spec.artifact} on {placement}: {e}") from e
    ep = relocate(ep, placement.torch_device)
    return LoadedModel(ep.module(), spec, placement.torch_device, "tensorrt_exported_program")
