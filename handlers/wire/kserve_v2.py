"""KServe v2 (Open Inference Protocol) over REST: {"id", "inputs": [{name, shape, datatype,
data}], "outputs"?: [{name, parameters?}], "parameters"?} -> {"model_name", "id", "outputs":
[{name, shape, datatype, data}]}, and its binary tensor extension (handlers.wire.v2_binary).

What a request says beyond its inputs (its binary framing, the outputs it asks for and in
which encoding) is read once by `parse` into its Parsed; the format itself holds nothing.

Inputs declared FP32 are accepted for a float16/bfloat16 input when every value converts
exactly: TorchServe 0.12's OIP gRPC frontend drops FP16/BF16 contents (it reads typed contents
only, and protobuf has no fp16 field), and tritonclient refuses BF16 in JSON, so FP32 values
are the portable way to send them; nothing is rounded silently.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from handlers.dtypes import BY_NAME, BY_TORCH, BY_V2, cast_hint
from handlers.errors import RequestError
from handlers.wire import v2_binary
from handlers.wire.base import JSON_MEDIA, Encoded, Parsed, WireFormat, WireName, dump_json
from handlers.wire.strict_json import json_values
from handlers.wire.tensors import from_nested, spec_of

HALF = ("FP16", "BF16")
NO_DATA = ("TorchServe 0.12's OIP gRPC frontend drops FP16/BF16 contents and raw_input_contents "
           "(only typed contents reach the model); send the values as FP32 (fp32_contents, "
           "datatype FP32): they are converted to the artifact's dtype when exact")


def check_item(i: int, item, spec):
    """The input's TensorSpec and its declared shape, checked against the artifact."""
    if not isinstance(item, dict) or not {"name", "shape", "datatype"} <= set(item):
        raise RequestError(f"v2 inputs[{i}] must have name, shape, datatype and data")
    if not isinstance(item["name"], str):
        raise RequestError(f"v2 inputs[{i}].name must be a string, got {type(item['name']).__name__}")
    s = spec_of(spec, item["name"])
    where = f"input {item['name']!r}"
    want, got = BY_NAME[s.dtype].v2, item["datatype"]
    if not isinstance(got, str) or got not in BY_V2:  # a list or dict is not hashable
        raise RequestError(f"{where}: unknown v2 datatype {got!r}; expected {want}")
    if got != want and not (got == "FP32" and want in HALF):
        raise RequestError(f"{where}: datatype {got} does not match the artifact's {want} ({s.describe()}); "
                           f"{cast_hint(s.dtype)}")
    shape = item["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise RequestError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    return s, shape


def narrow(t: torch.Tensor, s, where: str) -> torch.Tensor:
    """FP32 values for a float16/bfloat16 input, converted only when exact."""
    want = BY_NAME[s.dtype].torch
    if t.dtype == want:
        return t
    out = t.to(want)
    if not torch.equal(out.to(t.dtype), t):
        raise RequestError(f"{where}: FP32 values are not exactly representable as {s.dtype} "
                           f"({s.describe()}); round them to {s.dtype} before sending")
    return out


def _decode_item(i: int, item, spec):
    if isinstance(item, dict) and "data" not in item and {"name", "shape", "datatype"} <= set(item):
        raise RequestError(f"input {item['name']!r} has no data. {NO_DATA}")
    s, shape = check_item(i, item, spec)
    name, where = item["name"], f"input {item['name']!r}"
    as_sent = replace(s, dtype="float32") if item["datatype"] == "FP32" else s
    t = from_nested(as_sent, item["data"] if isinstance(item["data"], list) else [item["data"]], where)
    if t.numel() != math.prod(shape):
        raise RequestError(f"{where}: shape {shape} needs {math.prod(shape)} values, data holds {t.numel()}")
    return name, narrow(t.reshape(shape), s, where)


def output_entry(name: str, t: torch.Tensor, widen_half: bool = False) -> dict:
    """One reply output with flat JSON data; widen_half sends FP16/BF16 as FP32 (exact)."""
    if widen_half and BY_TORCH[t.dtype].v2 in HALF:
        t = t.float()
    return {"name": name, "shape": list(t.shape), "datatype": BY_TORCH[t.dtype].v2,
            "data": json_values(t.reshape(-1))}


def reply(outputs: dict, request_id, model_name: str, model_version=None, widen_half=False) -> dict:
    body = {"model_name": model_name,
            "outputs": [output_entry(n, t, widen_half) for n, t in outputs.items()]}
    if model_version is not None:
        body["model_version"] = model_version
    if request_id is not None:
        body["id"] = request_id
    return body


class KServeV2(WireFormat):
    name = WireName.KSERVE_V2

    def matches_json(self, body):
        return isinstance(body.get("inputs"), list)

    def parse(self, body, headers=None):
        """The binary extension when the request header v2_binary.HEADER announces it (the
        body is then bytes: the JSON part, then the raw one), else a plain JSON object."""
        length = None if headers is None else headers.v2_header_length
        request = v2_binary.Request(body, None) if length is None else v2_binary.split(body, length)
        rid = request.header.get("id")
        return Parsed(request, rid if isinstance(rid, str) else None, request.wanted, request.all_binary)

    def decode(self, parsed, spec):
        request = parsed.message
        header, raw = request.header, request.raw
        if not isinstance(header.get("inputs"), list):
            raise RequestError("KServe v2 `inputs` must be a list of {name, shape, datatype, data}")
        if len(header["inputs"]) > len(spec.inputs):
            raise RequestError(f"v2 request has {len(header['inputs'])} inputs; the artifact takes "
                               f"{len(spec.inputs)} ({', '.join(spec.input_names)})")
        offsets = v2_binary.Offsets(raw)
        tensors = {}
        for i, item in enumerate(header["inputs"]):
            if v2_binary.is_binary(item):
                s, shape = check_item(i, item, spec)
                t = offsets.take(i, item, shape)
                tensors[item["name"]] = narrow(t, s, f"input {item['name']!r}")
            else:
                name, t = _decode_item(i, item, spec)
                tensors[name] = t
        offsets.check_consumed()
        v2_binary.check_wanted(parsed.wanted, spec)
        return tensors

    def encode(self, outputs, parsed, model_name, model_version=""):
        outputs = v2_binary.select(outputs, parsed.wanted)
        binary = v2_binary.binary_names(parsed, outputs)
        body = reply({n: t for n, t in outputs.items() if n not in binary}, parsed.request_id, model_name)
        if not binary:
            return Encoded(dump_json(body), JSON_MEDIA, {})
        raws = {n: v2_binary.raw_bytes(outputs[n]) for n in binary}
        entries = {e["name"]: e for e in body["outputs"]}
        body["outputs"] = [entries.get(n) or v2_binary.binary_entry(n, t, len(raws[n]))
                           for n, t in outputs.items()]  # the model's output order
        framed, header_length = v2_binary.frame(body, [raws[n] for n in outputs if n in binary])
        return Encoded(framed, v2_binary.MEDIA, {v2_binary.HEADER: str(header_length)})


FORMAT = KServeV2()
