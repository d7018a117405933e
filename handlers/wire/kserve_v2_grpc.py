"""The Open Inference Protocol's gRPC messages as a REST body: a serialized
`inference.ModelInferRequest` (KServe/Triton grpc_predict_v2.proto) POSTed with Content-Type
application/x-kserve-v2-protobuf, answered with a serialized `inference.ModelInferResponse` of
the same media type. The KServe pod's gRPC bridge (pod/grpc_bridge.py) passes ModelInfer calls
through this way without decoding a tensor; anyone may POST such a body over REST. Errors are
the usual JSON error object and HTTP status (WireFormat.error), which the bridge maps to gRPC
codes.

Protocol facts relied on (grpc_predict_v2.proto, package `inference`; protobuf's own encoding
facts are in handlers/protowire.py):
- ModelInferRequest: 1 model_name, 2 model_version, 3 id (strings), 4 parameters (map),
  5 inputs (repeated InferInputTensor), 6 outputs (repeated InferRequestedOutputTensor),
  7 raw_input_contents (repeated bytes).
- InferInputTensor: 1 name, 2 datatype (strings), 3 shape (repeated int64), 4 parameters,
  5 contents (InferTensorContents). InferRequestedOutputTensor: 1 name, 2 parameters.
- InferTensorContents: 1 bool, 2 int (int32: INT8/16/32), 3 int64, 4 uint (uint32: UINT8/16/32),
  5 uint64, 6 fp32 (float), 7 fp64 (double), 8 bytes contents, all repeated. FP16 and BF16 have
  no typed field: raw only (or FP32 values for such an input, converted when exact, as in v2 JSON).
- With raw_input_contents, input i takes raw_input_contents[i] (one per input, in input order)
  and no input carries typed contents; raw bytes are row-major little-endian, BOOL one byte per
  element (0 or 1).
- ModelInferResponse: 1 model_name, 2 model_version, 3 id, 4 parameters, 5 outputs
  (InferOutputTensor: 1 name, 2 datatype, 3 shape, 4 parameters, 5 contents),
  6 raw_output_contents. Replies always use raw_output_contents (as Triton does; tritonclient and
  the kserve SDK read it), outputs in the model's order, or the requested ones in their order.
- Parameters (request, input and output maps) change nothing here and are not read. The
  request's model_name is not checked: TorchServe's URL chose the model (the bridge builds it
  from model_name); the reply names the model that answered.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from handlers import protowire
from handlers.dtypes import BY_TORCH
from handlers.errors import RequestError
from handlers.oip_request import (  # noqa: F401  (MEDIA, InferRequest, Input: this format's interface too)
    CONTENTS, MEDIA, InferRequest, Input, malformed, parse_input, parse_request,
)
from handlers.wire import v2_binary
from handlers.wire.base import Encoded, Parsed, WireFormat
from handlers.wire.kserve_v2 import check_item, narrow

FIXED = {6: "<f4", 7: "<f8"}  # float, double: little-endian fixed width
# datatype -> (its InferTensorContents field, numpy dtype the field's values are read as, the
# datatype's own numpy dtype where narrower: a range check first)
TYPED = {"BOOL": (1, np.bool_, None), "INT8": (2, np.int32, np.int8), "INT16": (2, np.int32, np.int16),
         "INT32": (2, np.int32, None), "INT64": (3, np.int64, None), "UINT8": (4, np.uint32, np.uint8),
         "FP32": (6, "<f4", None), "FP64": (7, "<f8", None)}
# datatype -> numpy dtype of its raw bytes (numpy has no bfloat16: int16, then a torch view)
RAW = {"FP32": "<f4", "FP16": "<f2", "BF16": "<i2", "FP64": "<f8", "INT64": "<i8", "INT32": "<i4",
       "INT16": "<i2", "INT8": "i1", "UINT8": "u1", "BOOL": "u1"}
def _tensor(a: np.ndarray) -> torch.Tensor:
    """torch.from_numpy without a copy; an array over read-only bytes is only read (admission
    checks it, the runner copies it into staging), so torch's warning about that is silenced."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def raw_tensor(inp: Input, raw, where: str) -> torch.Tensor:
    """raw_input_contents[i] as a flat tensor of the input's datatype, viewed in place."""
    dt = np.dtype(RAW[inp.datatype])
    need = math.prod(inp.shape) * dt.itemsize
    if len(raw) != need:
        raise RequestError(f"{where}: raw_input_contents[{inp.index}] is {len(raw)} bytes; shape "
                           f"{inp.shape} of {inp.datatype} needs {need} ({dt.itemsize} bytes per "
                           "element, row-major, little-endian)")
    a = np.frombuffer(raw, dt)
    if inp.datatype == "BOOL":
        if a.size and int(a.max()) > 1:
            raise RequestError(f"{where}: BOOL bytes in raw_input_contents[{inp.index}] must be 0 or 1 "
                               f"(one byte per element), found {int(a.max())}")
        return _tensor(a).view(torch.bool)
    t = _tensor(a)
    return t.view(torch.bfloat16) if inp.datatype == "BF16" else t


def typed_tensor(inp: Input, where: str) -> torch.Tensor:
    """The input's typed contents as a flat tensor: fp32/fp64 viewed in place (one packed run),
    varint fields decoded vectorized (handlers.protowire.varints)."""
    if inp.datatype not in TYPED:  # FP16, BF16: the protocol has no field for them
        raise RequestError(f"{where}: {inp.datatype} has no typed contents field in the protocol; "
                           f"send its bytes in raw_input_contents (or datatype FP32 in fp32_contents, "
                           "converted when exact)")
    field, read_as, narrow_to = TYPED[inp.datatype]
    contents = inp.contents or {}
    wrong = [CONTENTS[n] for n in contents if n != field]
    if wrong:
        raise RequestError(f"{where}: datatype {inp.datatype} takes its values in {CONTENTS[field]} "
                           f"(InferTensorContents field {field}); the request has {', '.join(wrong)}")
    with malformed(f"ModelInferRequest.inputs[{inp.index}].contents.{CONTENTS[field]}"):
        occurrences = contents.get(field, [])
        a = (protowire.repeated_fixed(occurrences, read_as) if field in FIXED
             else protowire.repeated_varints(occurrences, read_as))
    need = math.prod(inp.shape)
    if a.size != need:
        held = "no contents and the request has no raw_input_contents" if inp.contents is None else \
            f"{CONTENTS[field]} holds {a.size}"
        raise RequestError(f"{where}: shape {inp.shape} needs {need} values; {held}")
    if narrow_to is not None and a.size:
        info = np.iinfo(narrow_to)
        if int(a.min()) < info.min or int(a.max()) > info.max:
            raise RequestError(f"{where}: {inp.datatype} values must lie in {info.min}..{info.max}; "
                               f"{CONTENTS[field]} holds {int(a.min())}..{int(a.max())}")
        a = a.astype(narrow_to)
    return _tensor(a)


def input_tensor(inp: Input, raw, spec) -> tuple:
    """(name, tensor of the artifact's dtype and the declared shape), checked like v2 JSON."""
    item = {"name": inp.name, "shape": inp.shape, "datatype": inp.datatype}
    s, shape = check_item(inp.index, item, spec)
    where = f"input {inp.name!r}"
    if raw is None:
        t = typed_tensor(inp, where)
    elif inp.contents:
        raise RequestError(f"{where} carries typed contents ({', '.join(CONTENTS[n] for n in inp.contents)}) "
                           "but the request has raw_input_contents; with raw_input_contents every input "
                           "takes its bytes from it, in input order, and none carries contents")
    else:
        t = raw_tensor(inp, raw, where)
    return inp.name, narrow(t.reshape(shape), s, where)


def decode_inputs(parsed: InferRequest, spec) -> dict:
    if len(parsed.inputs) > len(spec.inputs):
        raise RequestError(f"ModelInferRequest has {len(parsed.inputs)} inputs; the artifact takes "
                           f"{len(spec.inputs)} ({', '.join(spec.input_names)})")
    if parsed.raws and len(parsed.raws) != len(parsed.inputs):
        raise RequestError(f"ModelInferRequest has {len(parsed.raws)} raw_input_contents for "
                           f"{len(parsed.inputs)} inputs; send one per input, in input order (or "
                           "typed contents and no raw_input_contents)")
    tensors = {}
    for i, view in enumerate(parsed.inputs):
        name, t = input_tensor(parse_input(i, view), parsed.raws[i] if parsed.raws else None, spec)
        if name in tensors:
            raise RequestError(f"input {name!r} appears more than once in ModelInferRequest.inputs")
        tensors[name] = t
    return tensors


def response(outputs: dict, request_id: str | None, model_name: str, model_version: str = "") -> bytes:
    """A serialized ModelInferResponse: every output's name, datatype and shape, and its bytes
    in raw_output_contents in the same order (proto3 leaves empty strings and shapes out)."""
    w = protowire.Writer()
    for number, text in ((1, model_name), (2, model_version), (3, request_id)):
        if text:
            w.string(number, text)
    raws = []
    for name, t in outputs.items():
        tw = protowire.Writer()
        tw.string(1, name)
        tw.string(2, BY_TORCH[t.dtype].v2)
        if t.dim():
            tw.packed_varints(3, t.shape)
        w.message(5, tw.bytes())
        raws.append(v2_binary.raw_bytes(t))
    for r in raws:
        w.bytes_field(6, r)
    return w.bytes()


class KServeV2Grpc(WireFormat):
    name = "v2-grpc"
    media_type = MEDIA
    binary = True

    def parse(self, body, headers=None) -> Parsed:
        message = parse_request(body)
        return Parsed(message, message.id or None, tuple((n, None) for n in message.wanted),
                                names=(message.model_name, message.model_version))

    def decode(self, parsed, spec) -> dict:
        tensors = decode_inputs(parsed.message, spec)
        v2_binary.check_wanted(parsed.wanted, spec)
        return tensors

    def encode(self, outputs, parsed, model_name, model_version=""):
        """The outputs the request asks for (any format's request: Accept may choose this one)."""
        outputs = v2_binary.select(outputs, parsed.wanted)
        return Encoded(response(outputs, parsed.request_id, model_name, model_version), MEDIA, {})


FORMAT = KServeV2Grpc()
