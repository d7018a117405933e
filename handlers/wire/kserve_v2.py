"""KServe v2 (Open Inference Protocol) JSON: {"id", "inputs": [{name, shape, datatype, data}]}
-> {"model_name", "id", "outputs": [{name, shape, datatype, data}]}."""
from __future__ import annotations

from ..dtypes import BY_NAME, BY_TORCH, BY_V2
from ..errors import RequestError
from .base import WireFormat, WireName, dump_json
from .strict_json import json_values
from .tensors import from_nested, spec_of


def _decode_item(i: int, item, spec):
    if not isinstance(item, dict) or not {"name", "shape", "datatype", "data"} <= set(item):
        raise RequestError(f"v2 inputs[{i}] must have name, shape, datatype and data")
    name = item["name"]
    if not isinstance(name, str):
        raise RequestError(f"v2 inputs[{i}].name must be a string, got {type(name).__name__}")
    s = spec_of(spec, name)
    where = f"input {name!r}"
    want = BY_NAME[s.dtype].v2
    if not isinstance(item["datatype"], str) or item["datatype"] not in BY_V2:
        raise RequestError(f"{where}: unknown v2 datatype {item['datatype']!r}; expected {want}")
    if item["datatype"] != want:
        raise RequestError(f"{where}: datatype {item['datatype']} does not match the artifact's "
                           f"{want} ({s.describe()})")
    shape = item["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise RequestError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    t = from_nested(s, item["data"] if isinstance(item["data"], list) else [item["data"]], where)
    count = 1
    for d in shape:
        count *= d
    if t.numel() != count:
        raise RequestError(f"{where}: shape {shape} needs {count} values, data holds {t.numel()}")
    return name, t.reshape(shape)


class KServeV2(WireFormat):
    name = WireName.KSERVE_V2

    def matches_json(self, body):
        return isinstance(body.get("inputs"), list)

    def decode(self, body, spec):
        if len(body["inputs"]) > len(spec.inputs):
            raise RequestError(f"v2 request has {len(body['inputs'])} inputs; the artifact takes "
                               f"{len(spec.inputs)} ({', '.join(spec.input_names)})")
        tensors = dict(_decode_item(i, item, spec) for i, item in enumerate(body["inputs"]))
        return tensors, body.get("id") if isinstance(body.get("id"), str) else None

    def encode(self, outputs, request_id, model_name):
        body = {"model_name": model_name, "outputs": [
            {"name": n, "shape": list(t.shape), "datatype": BY_TORCH[t.dtype].v2,
             "data": json_values(t.reshape(-1))} for n, t in outputs.items()]}
        if request_id:
            body["id"] = request_id
        return dump_json(body)


FORMAT = KServeV2()
