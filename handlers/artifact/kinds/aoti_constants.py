"""An AOTInductor package whose constants are outside its library: the slot-form decoder's as
cs-export-lm compiles it (torch/_inductor/config.py `aot_inductor.package_constants_in_so=False`,
`package_constants_on_disk_format="pickle_weights"`), its weights in the package's `data/weights/`
(each a `torch.save`d tensor) named by `data/aotinductor/model/weights_config.json` ({fqn: [file,
shape, stride, storage offset]}) and its KV cache left out of them (handlers/artifact/cache.py). The
load reads the weights onto the serving device, allocates the cache that artifact.json records, and
gives both to the package's loader with `load_constants(map, use_inactive=False,
check_full_update=True, user_managed=True)`, as torch's own `load_pt2(load_weights_from_disk=True)`
gives the weights alone: the loader keeps pointers to those tensors, which the loaded model holds.

Facts this relies on (torch 2.13 on the CPU, tests/test_export_lm.py runs the package so loaded):
- a run before every constant is loaded crashes the process (a segmentation fault), and
  check_full_update only warns where a buffer is left out ("Found constant or module state buffer
  ... but not provided by user"): so every fqn of `get_constant_fqns()` is checked here first;
- load_constants checks neither shape nor dtype (a cache of half the positions, or float16 for
  float32, was taken without a word): so the record is checked against the package's own constants
  table, its wrapper.cpp's `constants_info_[i]` `.original_fqn`, `.dtype`, `.shape` and `.stride`
  lines (compiled_serving/weight_bytes.py reads the same table's `.data_size`).
"""
from __future__ import annotations

import io
import json
import pickle
import re
import zipfile

from handlers.artifact import cache
from handlers.errors import LoadError

WEIGHTS_CONFIG = "data/aotinductor/model/weights_config.json"
WEIGHTS_DIR = "data/weights/"
FIELD = re.compile(r"constants_info_\[(\d+)\]\.(original_fqn|dtype|shape|stride) = (.*?);")


def _member(names: list, suffix: str):
    """The archive entry for `suffix` (a .pt2 prefixes its entries with its own directory name), or None."""
    return next((n for n in names if n == suffix or n.endswith("/" + suffix)), None)


def outside(path: str) -> bool:
    """Whether the package at `path` keeps its constants outside its library (a weights_config.json)."""
    with zipfile.ZipFile(path) as z:
        return _member(z.namelist(), WEIGHTS_CONFIG) is not None


def weights(z: zipfile.ZipFile, device) -> dict:
    """{fqn: tensor on `device`} of the package's weights (each file read once: tensors that shared
    storage at export share one here, as_strided over it as weights_config.json says)."""
    import torch

    names = z.namelist()
    config = json.loads(z.read(_member(names, WEIGHTS_CONFIG)))
    files, out = {}, {}
    for fqn, (file, shape, stride, offset) in config.items():
        if file not in files:
            member = _member(names, WEIGHTS_DIR + file)
            if member is None:
                raise LoadError(f"the package's weights_config.json names {file} for {fqn}, which it does not hold")
            files[file] = torch.load(io.BytesIO(z.read(member)), weights_only=True, map_location=device)
        out[fqn] = files[file].as_strided(shape, stride, offset)
    return out


def contiguous(shape: tuple) -> tuple:
    stride, n = [], 1
    for d in reversed(shape):
        stride.append(n)
        n *= d
    return tuple(reversed(stride))


def table(z: zipfile.ZipFile) -> dict:
    """{fqn: (dtype name, shape)} of the package's constants, from its wrapper.cpp; a constant whose
    stride is not its shape's contiguous one is listed with shape None (a fresh zeros cannot stand in)."""
    source = next((n for n in z.namelist() if n.endswith(".wrapper.cpp")), None)
    if source is None:
        raise LoadError("the package holds no wrapper.cpp, whose constants table the cache record is checked against")
    fields: dict = {}
    for i, key, value in FIELD.findall(z.read(source).decode(errors="replace")):
        fields.setdefault(i, {})[key] = value
    out = {}
    for f in fields.values():
        if not {"original_fqn", "dtype", "shape", "stride"} <= set(f):
            continue
        shape = tuple(int(d) for d in re.findall(r"-?\d+", f["shape"]))
        stride = tuple(int(d) for d in re.findall(r"-?\d+", f["stride"]))
        out[f["original_fqn"].strip('"')] = (f["dtype"].removeprefix("cached_torch_dtype_"),
                                            shape if stride == contiguous(shape) else None)
    return out


def supply(loader, spec, placement) -> dict:
    """Loads the package's weights and a fresh cache into `loader` (torch._C._aoti.AOTIModelPackageLoader),
    every constant it reads accounted for first; returns the tensors it now reads, which must outlive it.
    LoadError naming what is missing or does not match, before anything runs."""
    device = placement.torch_device
    try:
        with zipfile.ZipFile(spec.artifact_path) as z:
            given = weights(z, device)
            fresh = cache.allocate(cache.read(spec), table(z), device, spec.artifact)
    except (KeyError, ValueError, OSError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise LoadError(f"{spec.artifact}: reading the package's weights failed ({type(e).__name__}: {e})") from e
    constants = {**given, **fresh}
    missing = sorted(set(loader.get_constant_fqns()) - set(constants))
    if missing:
        raise LoadError(f"{spec.artifact} keeps its constants outside its library, and neither its weights "
                        f"(data/weights/) nor artifact.json's cache record (extra.cache) give {len(missing)} of "
                        f"them: {', '.join(missing[:6])}; a run without them would crash. {cache.FIX}")
    try:
        loader.load_constants(constants, False, True, True)  # active buffer, full update, user-managed
    except Exception as e:  # noqa: BLE001  (torch raises RuntimeError with the C++ check's text)
        raise LoadError(f"{spec.artifact}: the package's loader refused its constants: {e}") from e
    return constants


def refuse_record(spec) -> None:
    """A package whose library holds its constants (the cache among them) with a cache record: the record
    belongs to another artifact."""
    if cache.read(spec):
        raise LoadError(f"{spec.artifact}: artifact.json records a cache allocated at load (extra.cache), but the "
                        f"package's library holds its constants, the cache among them. {cache.FIX}")
