"""Torch-TensorRT artifacts: recognised from their files without importing torch_tensorrt,
loaded through it on the worker's GPU.

NOT EXECUTED on this project's machines: NVIDIA TensorRT cannot be installed on any of them.
The load and compile paths follow Torch-TensorRT's documented API (torch_tensorrt.load,
torch_tensorrt.runtime.set_multi_device_safe_mode, torch_tensorrt.dynamo.compile,
torch_tensorrt.save); recognition, rules and the missing-package error are tested in CI.
"""
from __future__ import annotations

import inspect
import zipfile

from handlers import process
from handlers.artifact.device import use_device
from handlers.artifact.kinds.aoti_package import load_aoti_package
from handlers.artifact.kinds.base import ArtifactKind, LoadedModel
from handlers.artifact.machine import cc_tuple, package_version, version_mm
from handlers.artifact.metadata import ArtifactSpec
from handlers.artifact.relocate import relocate
from handlers.artifact.rules import cc_fix
from handlers.errors import IncompatibleArtifact, LoadError

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


def container_of(spec: ArtifactSpec) -> str:
    """How the engines are packaged: "exported_program" (torch_tensorrt.save) or "aot_inductor"
    (an AOTInductor package). Artifacts written before the key was named `container` carry it
    as `format`."""
    return spec.extra.get("container") or spec.extra.get("format") or "exported_program"


class TorchTensorRT(ArtifactKind):
    name = "tensorrt"
    compile_needs = ("torch_tensorrt",)

    def claims(self, spec):
        return spec.backend in ("export", "aoti") and has_tensorrt_engines(spec.artifact_path)

    def adopt(self, spec):
        container = "aot_inductor" if spec.backend == "aoti" else "exported_program"
        return ArtifactSpec(**{**spec.__dict__, "backend": self.name, "extra": {"container": container, **spec.extra}})

    def requirements(self, spec):
        # Named first: without the package nothing else about this artifact matters.
        return [] if package_version("torch_tensorrt") else [missing_package_message(spec)]

    def rules(self, spec, placement, m, fatal, warn):
        if not m.packages.get("torch_tensorrt"):
            fatal.append(missing_package_message(spec))
        want_trt, have_trt = spec.extra.get("tensorrt_version"), m.packages.get("tensorrt")
        if m.packages.get("torch_tensorrt") and want_trt and have_trt and version_mm(want_trt) != version_mm(have_trt):
            fatal.append(f"engines serialized with TensorRT {want_trt}, this worker has TensorRT "
                         f"{have_trt}: rebuild the engines with this TensorRT or install tensorrt=={want_trt}")
        if placement.kind != "cuda" or not spec.compute_capability or not m.compute_capability:
            return
        # Engines run only on the compute capability they were built for, unless built
        # hardware-compatible (Ampere and later).
        if spec.extra.get("hardware_compatible"):
            if cc_tuple(m.compute_capability) < (8, 0):
                fatal.append(f"hardware-compatible TensorRT engines need compute capability >= 8.0; "
                             f"this GPU is {m.compute_capability}")
        elif cc_tuple(spec.compute_capability) != cc_tuple(m.compute_capability):
            fatal.append(f"TensorRT engines were built for compute capability {spec.compute_capability}, "
                         f"the assigned GPU ({m.gpu_name}) is {m.compute_capability}: {cc_fix(m)}, or "
                         "compile with --hardware-compatible")

    # TensorRT engines embed their weights in the serialized engine, which has no API to
    # point them at memory another process owns.
    not_shared = "a TensorRT engine keeps its weights inside the engine"

    def load(self, spec, placement, config=None, weights=None):
        try:
            import torch_tensorrt
        except ImportError:
            raise IncompatibleArtifact(missing_package_message(spec)) from None
        if placement.kind != "cuda":
            raise IncompatibleArtifact(f"{spec.artifact} holds TensorRT engines, which run only on NVIDIA "
                                       "GPUs; this worker has none. Fix: serve it on a GPU worker.")
        use_device(placement)  # engines deserialize on the current device
        if config is not None and config.trt_multi_device_safe_mode:
            # Checks the device before every engine call: safe with several GPUs in one process,
            # at a per-call cost (documented in README).
            torch_tensorrt.runtime.set_multi_device_safe_mode(True)
            process.record("Torch-TensorRT", "multi-device safe mode on")
        if container_of(spec) == "aot_inductor":
            return load_aoti_package(spec, placement, "tensorrt_aoti")
        try:
            ep = torch_tensorrt.load(spec.artifact_path)
        except Exception as e:
            raise LoadError(f"torch_tensorrt could not load {spec.artifact} on {placement}: {e}") from e
        ep = relocate(ep, placement.torch_device)
        return LoadedModel(ep.module(), spec, placement.torch_device, "tensorrt_exported_program")

    def compile(self, ep, inputs, path, options) -> dict:
        """Dynamo path. `options`: compile.py's arguments (inputs, dyn, precision, device_str,
        hardware_compatible)."""
        import tensorrt
        import torch
        import torch_tensorrt

        trt_inputs = [_trt_input(torch_tensorrt, t, s, options.dyn) for t, s in zip(inputs, options.inputs)]
        # Newer releases take arg_inputs= and type engines from the graph's dtypes (the model was
        # already halved for fp16); older ones need enabled_precisions to allow fp16 kernels.
        params = inspect.signature(torch_tensorrt.dynamo.compile).parameters
        kwargs = {"hardware_compatible": options.hardware_compatible, "device": torch.device(options.device_str)}
        kwargs["arg_inputs" if "arg_inputs" in params else "inputs"] = trt_inputs
        if "use_explicit_typing" not in params:
            kwargs["enabled_precisions"] = ({torch.float32} if options.precision == "fp32"
                                            else {torch.float16, torch.float32})
        trt_gm = torch_tensorrt.dynamo.compile(ep, **kwargs)
        save_params = inspect.signature(torch_tensorrt.save).parameters
        torch_tensorrt.save(trt_gm, path, output_format="exported_program",
                            **{("arg_inputs" if "arg_inputs" in save_params else "inputs"): inputs})
        return {"tensorrt_version": tensorrt.__version__, "torch_tensorrt_version": torch_tensorrt.__version__,
                "hardware_compatible": bool(options.hardware_compatible), "precision": options.precision,
                "container": "exported_program"}


def _trt_input(torch_tensorrt, t, s, dyn):
    if not dyn:
        return torch_tensorrt.Input(shape=s.shape, dtype=t.dtype)
    lo, hi = dyn
    opt = min(max(s.shape[0], lo), hi)
    return torch_tensorrt.Input(min_shape=(lo,) + s.shape[1:], opt_shape=(opt,) + s.shape[1:],
                                max_shape=(hi,) + s.shape[1:], dtype=t.dtype)


KIND = TorchTensorRT()
