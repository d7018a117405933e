"""Decode one request into CPU tensors and validate them against the artifact's contract.

Formats (chosen by the request's Content-Type, else by the envelope):
  json         {"inputs": {NAME: nested list}}                      (ours)
  v1           {"instances": [instance, ...]}                       (KServe v1)
  v2           {"inputs": [{name, shape, datatype, data}, ...]}     (KServe v2 / Open Inference)
  safetensors  application/x-safetensors body                       (binary, for large inputs)
Every failure raises RequestError naming the input, what the artifact expects and what came.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch

from . import safetensors_io
from .errors import RequestError, UnsupportedMediaType
from .metadata import ArtifactSpec, TensorSpec

V2_TO_TORCH = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16,
    "INT32": torch.int32, "INT64": torch.int64, "FP16": torch.float16, "FP32": torch.float32,
    "FP64": torch.float64, "BF16": torch.bfloat16,
}
TORCH_TO_V2 = {v: k for k, v in V2_TO_TORCH.items()}
JSON_TYPES = ("application/json",)


@dataclass
class Decoded:
    fmt: str  # json, v1, v2, safetensors
    tensors: dict  # name -> CPU tensor with the batch in dim 0
    rows: int
    request_id: Optional[str] = None  # v2 "id", echoed back
    accept: Optional[str] = None


def _payload(request: dict):
    """TorchServe puts a REST body under "body" (or "data"); gRPC uses the input map's keys."""
    if not isinstance(request, dict) or not request:
        raise RequestError("empty request: send a JSON or safetensors body")
    for key in ("body", "data"):
        if key in request:
            return request[key]
    if len(request) == 1:
        return next(iter(request.values()))
    raise RequestError(f"request has several parts ({', '.join(map(str, request))}); send one body")


def _parse_json(payload):
    if isinstance(payload, (dict, list)):
        return payload
    if isinstance(payload, (bytes, bytearray)):
        try:
            payload = bytes(payload).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("body is neither UTF-8 JSON nor a safetensors payload") from None
    try:
        return json.loads(payload)
    except json.JSONDecodeError as e:
        raise RequestError(f"malformed JSON body: {e.msg} at line {e.lineno} column {e.colno}") from None


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


def _from_nested(spec: TensorSpec, value, where: str) -> torch.Tensor:
    want = getattr(torch, spec.dtype)
    if not isinstance(value, list):
        raise RequestError(f"{where}: expected a nested list of {spec.dtype} for {spec.describe()}, "
                           f"got {type(value).__name__}")
    try:
        t = _np.array(value) if _np is not None else torch.tensor(value)
    except (ValueError, TypeError, RuntimeError) as e:
        raise RequestError(f"{where}: not a rectangular numeric array ({e}); expected "
                           f"{spec.describe()}") from None
    got = _kind(t.dtype)
    size = t.size if _np is not None else t.numel()
    if size == 0:
        got = _kind(want)
    # JSON numbers carry no width: integers are valid floats, floats are never integers.
    ok = got == _kind(want) or (_kind(want) == "float" and got == "int")
    if not ok:
        shown = {"float": "floating-point", "int": "integer", "bool": "bool"}.get(got, f"non-numeric ({got})")
        raise RequestError(f"{where}: expected {spec.dtype} values for {spec.describe()}, got {shown} values")
    return (torch.from_numpy(t) if _np is not None else t).to(want)


def _check(spec: TensorSpec, t: torch.Tensor, where: str) -> None:
    want = getattr(torch, spec.dtype)
    if t.dtype != want:
        raise RequestError(f"{where}: dtype {str(t.dtype).replace('torch.', '')} does not match the "
                           f"artifact's {spec.describe()}")
    if t.dim() != spec.rank:
        raise RequestError(f"{where}: shape {list(t.shape)} has rank {t.dim()}, expected rank "
                           f"{spec.rank} ({spec.describe()}, batch first)")
    for axis, (got, exp) in enumerate(zip(t.shape, spec.shape)):
        if axis > 0 and exp is not None and got != exp:
            raise RequestError(f"{where}: shape {list(t.shape)} has {got} at dimension {axis}, the "
                               f"artifact needs {exp} ({spec.describe()})")
    if t.shape[0] == 0:
        raise RequestError(f"{where}: batch dimension is 0; send at least one row")


def _decode_ours(body: dict, spec: ArtifactSpec) -> dict:
    inputs = body["inputs"]
    return {name: _from_nested(_spec_of(spec, name), value, f"input {name!r}")
            for name, value in inputs.items()}


def _decode_v1(body: dict, spec: ArtifactSpec) -> dict:
    instances = body["instances"]
    if not isinstance(instances, list) or not instances:
        raise RequestError("KServe v1 `instances` must be a non-empty list")
    names = spec.input_names
    per_name = {n: [] for n in names}
    for i, inst in enumerate(instances):
        if isinstance(inst, dict):
            unknown = set(inst) - set(names)
            if unknown:
                raise RequestError(f"instances[{i}] has unknown input(s) {', '.join(sorted(unknown))}; "
                                   f"the artifact takes {', '.join(names)}")
            for n in names:
                if n not in inst:
                    raise RequestError(f"instances[{i}] lacks input {n!r}; the artifact takes "
                                       f"{', '.join(s.describe() for s in spec.inputs)}")
                per_name[n].append(inst[n])
        elif len(names) == 1:
            per_name[names[0]].append(inst)
        else:
            raise RequestError(f"instances[{i}] must be an object {{name: value}}: the artifact "
                               f"takes several inputs ({', '.join(names)})")
    # Instances are single samples: they gain the batch dimension by stacking.
    return {n: _from_nested(_spec_of(spec, n), vals, f"input {n!r}") for n, vals in per_name.items()}


def _decode_v2(body: dict, spec: ArtifactSpec) -> dict:
    out = {}
    for i, item in enumerate(body["inputs"]):
        if not isinstance(item, dict) or not {"name", "shape", "datatype", "data"} <= set(item):
            raise RequestError(f"v2 inputs[{i}] must have name, shape, datatype and data")
        name = item["name"]
        s = _spec_of(spec, name)
        where = f"input {name!r}"
        dt = V2_TO_TORCH.get(item["datatype"])
        if dt is None:
            raise RequestError(f"{where}: unknown v2 datatype {item['datatype']!r}; expected "
                               f"{TORCH_TO_V2[getattr(torch, s.dtype)]}")
        if dt != getattr(torch, s.dtype):
            raise RequestError(f"{where}: datatype {item['datatype']} does not match the artifact's "
                               f"{TORCH_TO_V2[getattr(torch, s.dtype)]} ({s.describe()})")
        shape = item["shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise RequestError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        t = _from_nested(s, item["data"] if isinstance(item["data"], list) else [item["data"]], where)
        count = 1
        for d in shape:
            count *= d
        if t.numel() != count:
            raise RequestError(f"{where}: shape {shape} needs {count} values, data holds {t.numel()}")
        out[name] = t.reshape(shape)
    return out


def _spec_of(spec: ArtifactSpec, name: str) -> TensorSpec:
    for s in spec.inputs:
        if s.name == name:
            return s
    raise RequestError(f"unknown input {name!r}; the artifact takes "
                       f"{', '.join(s.describe() for s in spec.inputs)}")


def detect_format(payload, content_type: Optional[str]) -> str:
    ct = (content_type or "").split(";")[0].strip().lower()
    if ct == safetensors_io.CONTENT_TYPE:
        return "safetensors"
    if isinstance(payload, (bytes, bytearray)) and ct not in JSON_TYPES and safetensors_io.looks_like(payload):
        return "safetensors"
    if ct and ct not in JSON_TYPES and not ct.startswith("text/") and ct != "application/octet-stream":
        raise UnsupportedMediaType(f"Content-Type {ct!r} is not supported; send application/json "
                                   f"(our JSON, KServe v1 or v2) or {safetensors_io.CONTENT_TYPE}")
    return "json"


def decode(request: dict, spec: ArtifactSpec, content_type: Optional[str] = None,
           max_rows: int = 1024, accept: Optional[str] = None) -> Decoded:
    payload = _payload(request)
    fmt = detect_format(payload, content_type)
    request_id = None
    if fmt == "safetensors":
        tensors = safetensors_io.loads(payload)
        for name in tensors:
            _spec_of(spec, name)
    else:
        body = _parse_json(payload)
        if not isinstance(body, dict):
            raise RequestError("JSON body must be an object: {\"inputs\": {...}} (ours), "
                               "{\"instances\": [...]} (KServe v1) or {\"inputs\": [...]} (KServe v2)")
        if isinstance(body.get("inputs"), dict):
            fmt, tensors = "json", _decode_ours(body, spec)
        elif isinstance(body.get("inputs"), list):
            fmt, tensors = "v2", _decode_v2(body, spec)
            request_id = body.get("id") if isinstance(body.get("id"), str) else None
        elif "instances" in body:
            fmt, tensors = "v1", _decode_v1(body, spec)
        else:
            raise RequestError("JSON body has neither `inputs` nor `instances`; expected "
                               "{\"inputs\": {NAME: nested list}} (ours), {\"instances\": [...]} "
                               "(KServe v1) or {\"inputs\": [{name, shape, datatype, data}]} (KServe v2)")
    missing = [s.describe() for s in spec.inputs if s.name not in tensors]
    if missing:
        raise RequestError(f"missing input(s): {'; '.join(missing)}")
    for s in spec.inputs:
        _check(s, tensors[s.name], f"input {s.name!r}")
    rows = {t.shape[0] for t in tensors.values()}
    if len(rows) != 1:
        sizes = ", ".join(f"{n}={t.shape[0]}" for n, t in tensors.items())
        raise RequestError(f"inputs disagree on the batch dimension ({sizes}); all must have the same rows")
    n = rows.pop()
    if n > max_rows:
        raise RequestError(f"request carries {n} rows; this model accepts at most {max_rows} per "
                           "request (handler.max_rows_per_request)")
    return Decoded(fmt, {s.name: tensors[s.name] for s in spec.inputs}, n, request_id, accept)
