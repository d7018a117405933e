"""The artifact's metadata file (`artifact.json`): what was compiled, for what, and its contract.

Written by cs-compile beside the artifact, read by the handler before anything is
loaded. It is the single source of the input contract (names, ranks, dtypes, static dims,
the batch range) that requests are validated against.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from handlers.dtypes import NAMES, dtype_name, torch_dtype  # noqa: F401  (re-exported)
from handlers.errors import LoadError

METADATA_FILE = "artifact.json"
# Version of the artifact.json layout (stored under its "format" key): bumped when fields change
# meaning, so an old handler refuses a newer file instead of misreading it. Layout 2 added named
# dynamic dimensions ("dims", names in shapes) and per-input "values"; layout 3 added a range per
# column ("values": "axis", "columns"), written only where an input has them (every other file
# stays layout 2, which older handlers read); layout 4 a KV cache left out of the artifact and
# allocated at load ("extra": {"cache": ...}, handlers/artifact/cache.py), written only where the
# artifact leaves one out: an older handler would run the artifact's one-element placeholder as the
# cache, or its package without the constants it lacks, so it must refuse the file; layout 1 files
# (only the batch varies, nothing else recorded) read as before.
LAYOUT_VERSION = 2
COLUMNS_LAYOUT = 3
CACHE_LAYOUT = 4
READS = (1, 2, 3, 4)
DTYPES = NAMES  # torch's dtype names, from the one table in dtypes.py


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    # Dimension 0 is the batch dimension; None marks it when it varies (the batch range is
    # ArtifactSpec.batch_min..batch_max). Other dimensions: an int (fixed) or the name of a
    # dynamic dimension whose range is in ArtifactSpec.dims.
    shape: tuple
    # Valid values of an integer or bool input: {"min", "max", "source"} (inclusive bounds and
    # where they come from), or {"checked": False, "why"} where the values reach an indexing
    # operation no bound could be derived for; None where no check applies. Where the positions
    # along one fixed dimension index different tables (a recommender's sparse features, column
    # j into table j), also "axis" (that dimension) and "columns": per position along it
    # {"min", "max", "source"}, or None where that column indexes nothing; "min"/"max" are then
    # the values every column accepts (the intersection, for readers of one range).
    values: Optional[dict] = None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def value_range(self) -> Optional[tuple]:
        v = self.values or {}
        return (int(v["min"]), int(v["max"])) if "min" in v and "max" in v else None

    @property
    def columns(self) -> Optional[tuple]:
        """(axis, per position along it (lo, hi) or None) where the contract holds a range per
        column; None where one range covers the input."""
        v = self.values or {}
        if v.get("columns") is None:
            return None
        return int(v["axis"]), tuple(None if c is None else (int(c["min"]), int(c["max"])) for c in v["columns"])

    def describe(self) -> str:
        dims = "x".join("B" if d is None else str(d) for d in self.shape)
        head = f"{self.name}: {self.dtype}[{dims}]"
        cols, r = self.columns, self.value_range
        if cols:
            return f"{head} per column of dimension {cols[0]}: {describe_columns(cols[1])}"
        return head + (f" in [{r[0]}, {r[1]}]" if r else "")

    def _check_values(self) -> None:
        """Raises ValueError/TypeError/KeyError where "values" is malformed."""
        self.value_range  # noqa: B018  (min/max must be integers)
        cols = self.columns
        if cols is None:
            return
        axis, ranges = cols
        if not 0 < axis < len(self.shape) or not isinstance(self.shape[axis], int) or len(ranges) != self.shape[axis]:
            raise ValueError(f"values.axis {axis} must name a fixed dimension of {list(self.shape)} with one "
                             "entry in values.columns per position")
        if any(c is not None and c[0] > c[1] for c in ranges):
            raise ValueError("a column's min exceeds its max")

    def concrete(self, rows: int, sizes: Optional[dict] = None) -> tuple:
        """The shape with `rows` rows and each named dimension at `sizes[name]`."""
        return (rows,) + tuple(sizes[d] if isinstance(d, str) else d for d in self.shape[1:])

    def draw_ints(self, shape, g, span: Optional[int] = None, default: tuple = (0, 99)):
        """Integers of this input's dtype inside its value range, drawn with `g`: per column
        where the contract has columns (`default` for a column or input without a range), each
        from the lowest `span` + 1 values of its range where `span` is given."""
        import torch

        def draw(lo_hi, size):
            lo, hi = lo_hi or default
            hi = hi if span is None else min(hi, lo + span)
            return torch.randint(lo, hi + 1, size, generator=g)

        cols, dt = self.columns, torch_dtype(self.dtype)
        if cols is None:
            return draw(self.value_range, shape).to(dt)
        axis, ranges = cols
        one = tuple(1 if a == axis else n for a, n in enumerate(shape))
        return torch.cat([draw(r, one) for r in ranges], dim=axis).to(dt)

    def example(self, rows: int, device=None, sizes: Optional[dict] = None, g=None):
        """A valid request value of this input with `rows` rows and named dimensions at `sizes`
        (warm-up, graph capture, the probe): an input named like a mask all ones (no row all
        padding: a fully masked row is a case attention kernels handle badly); integers with a
        value range drawn inside it, per column (`g`, else seeded), so ids are valid and not all
        one value, such as a padding id; anything else zeros."""
        import torch

        dt, shape = torch_dtype(self.dtype), self.concrete(rows, sizes)
        lo, hi = self.value_range or (0, 1)
        if is_mask(self.name) and lo <= 1 <= hi:
            t = torch.ones(shape, dtype=dt)
        elif (self.values or {}).get("checked") is not False and not dt.is_floating_point and dt != torch.bool \
                and (self.value_range or self.columns):
            t = self.draw_ints(shape, g if g is not None else torch.Generator().manual_seed(0))
        else:
            t = torch.zeros(shape, dtype=dt)
        return t.to(device) if device is not None else t


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
    # Named dynamic dimensions other than the batch: name -> (min, max), inclusive.
    dims: dict = field(default_factory=dict)
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

    def min_sizes(self) -> dict:
        """Each named dimension at its smallest valid size."""
        return {name: lo for name, (lo, _hi) in self.dims.items()}

    def example(self, rows: int, device=None, sizes: Optional[dict] = None) -> dict:
        """{input: a valid request value (TensorSpec.example)} with `rows` rows, named dimensions
        at `sizes` (default: their minimum); the same values on every call."""
        import torch

        sizes = sizes or self.min_sizes()
        g = torch.Generator().manual_seed(0)
        return {s.name: s.example(rows, device, sizes, g) for s in self.inputs}

    @property
    def artifact_path(self) -> str:
        return os.path.join(self.variant_dir, self.artifact)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("variant_dir")
        d["format"] = (CACHE_LAYOUT if "cache" in self.extra else COLUMNS_LAYOUT if any(s.columns for s in self.inputs)
                       else LAYOUT_VERSION)
        for key in ("inputs", "outputs"):
            d[key] = [{"name": s["name"], "dtype": s["dtype"], "shape": list(s["shape"]),
                       **({"values": s["values"]} if s["values"] else {})} for s in d[key]]
        d["cuda_archs"] = list(self.cuda_archs)
        d["dims"] = {k: {"min": lo, "max": hi} for k, (lo, hi) in self.dims.items()}
        return d


def is_mask(name: str) -> bool:
    """An input named like a mask (attention_mask, padding_mask): 1 keeps a position."""
    return "mask" in name.lower()


def describe_columns(ranges) -> str:
    """Per-column ranges, runs of equal ones together: `0 in [0, 99] | 1-4 in [0, 19] | 5 any`."""
    runs = []
    for i, r in enumerate(ranges):
        if runs and runs[-1][2] == r:
            runs[-1][1] = i
        else:
            runs.append([i, i, r])
    return " | ".join((f"{a}" if a == b else f"{a}-{b}") + (f" in [{r[0]}, {r[1]}]" if r else " any")
                      for a, b, r in runs)


def row_bytes(tensors, dims: dict) -> int:
    """Bytes one row (every dimension but the batch) of `tensors` (TensorSpecs) takes at most,
    a named dimension at its maximum in `dims`; 0 where a dimension is not known there."""
    total = 0
    for t in tensors:
        n = torch_dtype(t.dtype).itemsize
        for d in t.shape[1:]:
            if isinstance(d, str) and d not in dims:
                return 0
            n *= dims[d][1] if isinstance(d, str) else d
        total += n
    return total


def _tensor_specs(raw, where: str, dims: dict, batch_first: bool = True):
    """`batch_first`: dimension 0 is the batch (a one-sequence decoder's positions [S] are not
    batched; the slot form's rows are: handlers/artifact/decoder.py)."""
    specs = []
    for i, item in enumerate(raw):
        try:
            shape = tuple(item["shape"])
            values = item.get("values")
            spec = TensorSpec(str(item["name"]), str(item["dtype"]), shape, dict(values) if values else None)
            spec._check_values()
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LoadError(f"{where}[{i}] in {METADATA_FILE} is malformed ({e}); "
                            "expected {name, dtype, shape[, values]}. Re-run cs-compile.") from e
        rest = shape[1:] if batch_first else shape
        bad = [d for d in rest if not (isinstance(d, int) and d >= 0) and not (isinstance(d, str) and d in dims)]
        if bad or (batch_first and shape and shape[0] is not None and not isinstance(shape[0], int)):
            raise LoadError(f"{where}[{i}] ({spec.name}) in {METADATA_FILE} has shape {list(shape)}: "
                            "dimension 0 must be the batch (null or an integer), the others integers or "
                            f"names listed under \"dims\" ({sorted(dims) or 'none'}). Re-run cs-compile.")
        specs.append(spec)
    return tuple(specs)


def _dims(raw, path: str) -> dict:
    try:
        dims = {str(k): (int(v["min"]), int(v["max"])) for k, v in (raw or {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LoadError(f"{path}: \"dims\" is malformed ({e}); expected {{NAME: {{min, max}}}}") from e
    for k, (lo, hi) in dims.items():
        if not 0 <= lo <= hi:
            raise LoadError(f"{path}: dimension {k!r} has range [{lo}, {hi}]; need 0 <= min <= max")
    return dims


def read_spec(directory: str) -> ArtifactSpec:
    path = os.path.join(directory, METADATA_FILE)
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise LoadError(f"no {METADATA_FILE} in {directory}: the archive must carry the metadata "
                        "written by cs-compile next to the artifact") from None
    except json.JSONDecodeError as e:
        raise LoadError(f"{path} is not valid JSON ({e}); rebuild it with cs-compile") from e
    return spec_from_dict(raw, path, directory)


def spec_from_dict(raw: dict, path: str = METADATA_FILE, directory: str = "") -> ArtifactSpec:
    """artifact.json's content (read from `path`, in `directory`) as an ArtifactSpec, checked."""
    if raw.get("format") not in READS:
        raise LoadError(f"{path} has layout version (key `format`) {raw.get('format')!r}; this handler "
                        f"reads {', '.join(map(str, READS))}. Recompile with this version of cs-compile.")
    missing = [k for k in ("backend", "artifact", "sha256", "device", "inputs", "outputs",
                           "output_structure", "batch_min", "batch_max", "torch_version") if k not in raw]
    if missing:
        raise LoadError(f"{path} lacks {', '.join(missing)}; recompile with cs-compile")
    artifact = raw["artifact"]
    # The artifact must be a plain file name: metadata must not point outside the model dir.
    if os.path.basename(artifact) != artifact or artifact in ("", ".", ".."):
        raise LoadError(f"{path}: artifact {artifact!r} must be a file name inside the model "
                        "directory, not a path")
    dims = _dims(raw.get("dims"), path)
    state = (raw.get("extra") or {}).get("state")
    decoder = state.get("decoder") if isinstance(state, dict) else None
    batch_first = not decoder or bool(decoder.get("slot_input"))  # the slot form's rows are a batch
    inputs = _tensor_specs(raw["inputs"], "inputs", dims, batch_first)
    outputs = _tensor_specs(raw["outputs"], "outputs", dims, batch_first)
    for s in inputs + outputs:
        if s.dtype not in DTYPES:
            raise LoadError(f"{path}: {s.name} has dtype {s.dtype!r}; expected one of {', '.join(DTYPES)}")
    return ArtifactSpec(
        backend=raw["backend"], artifact=artifact, sha256=raw["sha256"], device=raw["device"],
        inputs=inputs, outputs=outputs,
        output_structure=raw["output_structure"], batch_min=int(raw["batch_min"]),
        batch_max=int(raw["batch_max"]), torch_version=raw["torch_version"],
        compute_capability=raw.get("compute_capability"), cuda_archs=tuple(raw.get("cuda_archs") or ()),
        cpu_isa=raw.get("cpu_isa"), platform=raw.get("platform", ""), machine=raw.get("machine", ""),
        compiler=raw.get("compiler", ""), extra=dict(raw.get("extra") or {}),
        dims=dims, variant_dir=directory,
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
