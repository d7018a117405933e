"""The artifact's metadata file (`artifact.json`): what was compiled, for what, and its contract.

Written by scripts/compile.py beside the artifact, read by the handler before anything is
loaded. It is the single source of the input contract (names, ranks, dtypes, static dims,
the batch range) that requests are validated against.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from .dtypes import NAMES, dtype_name, torch_dtype  # noqa: F401  (re-exported)
from .errors import LoadError

METADATA_FILE = "artifact.json"
# Version of the artifact.json layout (stored under its "format" key): bumped when fields change
# meaning, so an old handler refuses a newer file instead of misreading it.
LAYOUT_VERSION = 1
FORMAT_VERSION = LAYOUT_VERSION  # the earlier name, kept for callers on other branches
DTYPES = NAMES  # torch's dtype names, from the one table in dtypes.py


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    # Dimension 0 is the batch dimension; None marks a dimension that varies (the batch when
    # the artifact was exported with a dynamic batch range).
    shape: tuple

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        dims = "x".join("B" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"

    def zeros(self, rows: int, device=None):
        """A zero tensor of this input with `rows` rows (warm-up, graph capture, the probe)."""
        import torch

        return torch.zeros((rows,) + tuple(self.shape[1:]), dtype=torch_dtype(self.dtype), device=device)


@dataclass(frozen=True)
class ArtifactSpec:
    backend: str  # the artifact kind's name (see kinds/); "backend" is artifact.json's key
    artifact: str  # file name, relative to the metadata file's directory
    sha256: str
    device: str  # "cpu" or "cuda": what the artifact was compiled for
    inputs: tuple  # of TensorSpec, in the order the artifact takes them
    outputs: tuple  # of TensorSpec
    output_structure: str  # "tensor", "tuple" or "dict": how the model returns them
    batch_min: int
    batch_max: int
    torch_version: str
    compute_capability: Optional[str] = None  # "9.0"; None for CPU artifacts
    cuda_archs: tuple = ()  # e.g. ("sm_90",): architectures of the kernels it carries
    cpu_isa: Optional[str] = None
    platform: str = ""
    machine: str = ""
    compiler: str = ""
    extra: dict = field(default_factory=dict)  # kind-specific facts (TensorRT versions, ...)
    variant_dir: str = ""  # set at read time: the directory the metadata came from

    @property
    def input_names(self):
        return [s.name for s in self.inputs]

    @property
    def output_names(self):
        return [s.name for s in self.outputs]

    @property
    def dynamic_batch(self) -> bool:
        return self.batch_min != self.batch_max

    @property
    def artifact_path(self) -> str:
        return os.path.join(self.variant_dir, self.artifact)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("variant_dir")
        d["format"] = LAYOUT_VERSION
        for key in ("inputs", "outputs"):
            d[key] = [{"name": s["name"], "dtype": s["dtype"], "shape": list(s["shape"])} for s in d[key]]
        d["cuda_archs"] = list(self.cuda_archs)
        return d


def _tensor_specs(raw, where: str):
    specs = []
    for i, item in enumerate(raw):
        try:
            specs.append(TensorSpec(str(item["name"]), str(item["dtype"]), tuple(item["shape"])))
        except (KeyError, TypeError) as e:
            raise LoadError(f"{where}[{i}] in {METADATA_FILE} is malformed ({e}); "
                            "expected {name, dtype, shape}. Re-run scripts/compile.py.") from e
    return tuple(specs)


def read_spec(directory: str) -> ArtifactSpec:
    path = os.path.join(directory, METADATA_FILE)
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise LoadError(f"no {METADATA_FILE} in {directory}: the archive must carry the metadata "
                        "written by scripts/compile.py next to the artifact") from None
    except json.JSONDecodeError as e:
        raise LoadError(f"{path} is not valid JSON ({e}); rebuild it with scripts/compile.py") from e
    if raw.get("format") != LAYOUT_VERSION:
        raise LoadError(f"{path} has layout version (key `format`) {raw.get('format')!r}; this handler "
                        f"reads {LAYOUT_VERSION}. Recompile with this version of scripts/compile.py.")
    missing = [k for k in ("backend", "artifact", "sha256", "device", "inputs", "outputs",
                           "output_structure", "batch_min", "batch_max", "torch_version") if k not in raw]
    if missing:
        raise LoadError(f"{path} lacks {', '.join(missing)}; recompile with scripts/compile.py")
    artifact = raw["artifact"]
    # The artifact must be a plain file name: metadata must not point outside the model dir.
    if os.path.basename(artifact) != artifact or artifact in ("", ".", ".."):
        raise LoadError(f"{path}: artifact {artifact!r} must be a file name inside the model "
                        "directory, not a path")
    for s in _tensor_specs(raw["inputs"], "inputs") + _tensor_specs(raw["outputs"], "outputs"):
        if s.dtype not in DTYPES:
            raise LoadError(f"{path}: {s.name} has dtype {s.dtype!r}; expected one of {', '.join(DTYPES)}")
    return ArtifactSpec(
        backend=raw["backend"], artifact=artifact, sha256=raw["sha256"], device=raw["device"],
        inputs=_tensor_specs(raw["inputs"], "inputs"), outputs=_tensor_specs(raw["outputs"], "outputs"),
        output_structure=raw["output_structure"], batch_min=int(raw["batch_min"]),
        batch_max=int(raw["batch_max"]), torch_version=raw["torch_version"],
        compute_capability=raw.get("compute_capability"), cuda_archs=tuple(raw.get("cuda_archs") or ()),
        cpu_isa=raw.get("cpu_isa"), platform=raw.get("platform", ""), machine=raw.get("machine", ""),
        compiler=raw.get("compiler", ""), extra=dict(raw.get("extra") or {}),
        variant_dir=directory,
    )


def write_spec(spec: ArtifactSpec, directory: str) -> str:
    path = os.path.join(directory, METADATA_FILE)
    with open(path, "w") as f:
        json.dump(spec.to_json(), f, indent=2, sort_keys=True)
        f.write("\n")
    return path


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def find_variants(model_dir: str) -> list:
    """Metadata directories in a model dir: the dir itself, or one sub-directory per variant
    (one artifact per compute capability or CPU ISA)."""
    found = []
    if os.path.isfile(os.path.join(model_dir, METADATA_FILE)):
        found.append(model_dir)
    vroot = os.path.join(model_dir, "variants")
    if os.path.isdir(vroot):
        for name in sorted(os.listdir(vroot)):
            d = os.path.join(vroot, name)
            if os.path.isfile(os.path.join(d, METADATA_FILE)):
                found.append(d)
    return found
