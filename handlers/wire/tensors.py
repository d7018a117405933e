"""Request values to CPU tensors, checked against the artifact's input contract. Shared by the
wire formats; every failure raises RequestError naming the input, what the artifact expects
and what came."""
from __future__ import annotations

import torch

from handlers.artifact.metadata import ArtifactSpec, TensorSpec
from handlers.dtypes import BY_NAME, cast_hint
from handlers.errors import RequestError

try:  # numpy builds arrays from nested lists ~5x faster than torch.tensor
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is a declared dependency
    _np = None


def _kind(dtype) -> str:
    if dtype in (torch.bool, getattr(_np, "bool_", None)):
        return "bool"
    if isinstance(dtype, torch.dtype):
        return "float" if dtype.is_floating_point else "int"
    return {"f": "float", "i": "int", "u": "int", "b": "bool"}.get(dtype.kind, dtype.name)


def from_nested(spec: TensorSpec, value, where: str) -> torch.Tensor:
    """A nested list of JSON values as a tensor of the input's dtype."""
    want = BY_NAME[spec.dtype].torch
    if not isinstance(value, list):
        raise RequestError(f"{where}: expected a nested list of {spec.dtype} for {spec.describe()}, "
                           f"got {type(value).__name__}")
    try:
        t = _np.array(value) if _np is not None else torch.tensor(value)
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:  # RecursionError is a RuntimeError
        raise RequestError(f"{where}: {_not_rectangular(value) or f'not a numeric array ({e})'}; expected "
                           f"{spec.describe()}") from None
    got = _kind(t.dtype)
    size = t.size if _np is not None else t.numel()
    if size == 0:
        got = _kind(want)
    # JSON numbers carry no width: integers are valid floats, floats are never integers.
    ok = got == _kind(want) or (_kind(want) == "float" and got == "int")
    if not ok:
        _refuse_out_of_range(spec, value, where)  # integers too large for any numpy int become floats or objects
        shown = {"float": "floating-point", "int": "integer", "bool": "bool"}.get(got, f"non-numeric ({got})")
        raise RequestError(f"{where}: expected {spec.dtype} values for {spec.describe()}, got {shown} values")
    if got == "int" and _kind(want) == "int" and t.dtype != _np_dtype(want):
        # numpy chose another width (uint64 past int64's top, int64 for a narrower input):
        # a cast would wrap silently
        info = torch.iinfo(want)
        if size and (t.min() < info.min or t.max() > info.max):
            _refuse_out_of_range(spec, value, where)
    t = (torch.from_numpy(t) if _np is not None else t).to(want)
    if want.is_floating_point and not bool(torch.isfinite(t).all()):
        # JSON has no NaN or Infinity (RFC 8259); Python's parser accepts the tokens and turns
        # literals such as 1e400 into inf, and 1e40 becomes inf as float32. Binary formats
        # carry non-finite values exactly.
        raise RequestError(f"{where}: holds a non-finite number (NaN, Infinity, or a literal beyond "
                           f"{spec.dtype}'s range such as 1e400); JSON numbers must be finite. Send "
                           "non-finite values in the binary encoding (application/x-safetensors)")
    return t


def _not_rectangular(value, limit: int = 100_000) -> str:
    """Where nested lists stop being rectangular, in words ("" where they are, or the walk ends
    at `limit` values): the first element whose length or depth differs from what element 0 at
    each depth sets. Only on a failure path (numpy's own message names its internals)."""
    shape, v = [], value
    while isinstance(v, list):
        shape.append(len(v))
        v = v[0] if v else None
    stack, seen = [(value, ())], 0
    while stack and seen < limit:
        v, path = stack.pop()
        seen, d = seen + 1, len(path)
        at = "".join(f"[{i}]" for i in path)
        if isinstance(v, list) and d < len(shape) and len(v) != shape[d]:
            first = "[0]" * d  # what set the length at this depth
            return (f"not a rectangular array: {at} has {len(v)} entries where {first} has {shape[d]}; every "
                    "row must have the same length (pad them, or send rows of other lengths as separate requests)")
        if isinstance(v, list) and d >= len(shape) or not isinstance(v, list) and d < len(shape):
            return (f"not a rectangular array: {at} is {'a list' if isinstance(v, list) else 'a single value'} "
                    f"where the first element at that depth is {'a value' if d >= len(shape) else 'a list'}")
        if isinstance(v, list):
            stack.extend((x, path + (i,)) for i, x in reversed(list(enumerate(v))))
    return ""


def _np_dtype(want: torch.dtype):
    return getattr(_np, str(want).replace("torch.", ""), None) if _np is not None else want


def _refuse_out_of_range(spec: TensorSpec, value, where: str) -> None:
    """Raises naming the first integer of `value` (nested lists) outside the input's integer
    dtype, where it is an integer input and one is; returns otherwise. Only on a failure path."""
    want = BY_NAME[spec.dtype].torch
    if want.is_floating_point or want == torch.bool:
        return
    info = torch.iinfo(want)
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(reversed(v))
        elif isinstance(v, int) and not isinstance(v, bool) and not info.min <= v <= info.max:
            raise RequestError(f"{where}: {v} is out of {spec.dtype} range ({info.min} to {info.max}) for "
                               f"{spec.describe()}")


def spec_of(spec: ArtifactSpec, name: str) -> TensorSpec:
    for s in spec.inputs:
        if s.name == name:
            return s
    raise RequestError(f"unknown input {name!r}; the artifact takes "
                       f"{', '.join(s.describe() for s in spec.inputs)}")


def check_tensor(spec: TensorSpec, t: torch.Tensor, where: str, dims: dict = {}, seen: dict = None) -> None:
    """dtype, rank and every dimension against the contract; a named dimension within its range
    in `dims` and equal to the size it had in earlier inputs (`seen`: name -> (size, where))."""
    want = BY_NAME[spec.dtype].torch
    if t.dtype != want:
        raise RequestError(f"{where}: dtype {str(t.dtype).replace('torch.', '')} does not match the "
                           f"artifact's {spec.describe()}; {cast_hint(spec.dtype)}")
    if t.dim() != spec.rank:
        raise RequestError(f"{where}: shape {list(t.shape)} has rank {t.dim()}, expected rank "
                           f"{spec.rank} ({spec.describe()}, batch first)")
    seen = seen if seen is not None else {}
    for axis, (got, exp) in enumerate(zip(t.shape, spec.shape)):
        if axis > 0 and isinstance(exp, str):  # a named dimension: in its range, equal across inputs
            lo, hi = dims[exp]
            if not lo <= got <= hi:
                raise RequestError(f"{where}: dimension {axis} ({exp}) is {got}; this artifact accepts {exp} "
                                   f"from {lo} to {hi} ({spec.describe()})")
            if exp in seen and seen[exp][0] != got:
                raise RequestError(f"{where}: dimension {axis} ({exp}) is {got} but {seen[exp][1]} has {exp} = "
                                   f"{seen[exp][0]}; inputs sharing {exp} must agree")
            seen.setdefault(exp, (got, where))
        elif axis > 0 and exp is not None and got != exp:
            raise RequestError(f"{where}: shape {list(t.shape)} has {got} at dimension {axis}, the "
                               f"artifact needs {exp} ({spec.describe()})")
    if t.shape[0] == 0:
        raise RequestError(f"{where}: batch dimension is 0; send at least one row")


def check_inputs(tensors: dict, spec: ArtifactSpec) -> tuple:
    """Every input present and matching the contract, one batch size. Returns (tensors in the
    artifact's input order, rows)."""
    for name in tensors:
        spec_of(spec, name)
    missing = [s.describe() for s in spec.inputs if s.name not in tensors]
    if missing:
        raise RequestError(f"missing input(s): {'; '.join(missing)}")
    seen = {}
    for s in spec.inputs:
        check_tensor(s, tensors[s.name], f"input {s.name!r}", spec.dims, seen)
    rows = {t.shape[0] for t in tensors.values()}
    if len(rows) != 1:
        sizes = ", ".join(f"{n}={t.shape[0]}" for n, t in tensors.items())
        raise RequestError(f"inputs disagree on the batch dimension ({sizes}); all must have the same rows")
    return {s.name: tensors[s.name] for s in spec.inputs}, rows.pop()
