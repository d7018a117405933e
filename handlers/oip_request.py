"""A serialized Open Inference Protocol `inference.ModelInferRequest` read without decoding a
tensor: its strings, its inputs' names, datatypes, shapes and contents fields, its raw contents
and its parameters, all views of the message. A leaf of stdlib, numpy and handlers/protowire.py
(no torch): handlers/wire/kserve_v2_grpc.py turns what it reads into tensors, and the pod's gRPC
bridge (pod/stream_infer.py) reads a decoder's prompt and parameters with it.

Field numbers (grpc_predict_v2.proto, package `inference`): ModelInferRequest 1 model_name,
2 model_version, 3 id, 4 parameters (map), 5 inputs, 6 outputs, 7 raw_input_contents;
InferInputTensor 1 name, 2 datatype, 3 shape, 4 parameters, 5 contents; InferTensorContents
1 bool, 2 int, 3 int64, 4 uint, 5 uint64, 6 fp32, 7 fp64, 8 bytes contents.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import numpy as np

from handlers import protowire
from handlers.errors import RequestError
from handlers.protowire import LEN, WIRE_NAMES, ProtoError

MEDIA = "application/x-kserve-v2-protobuf"
REQUEST = {1: "model_name", 2: "model_version", 3: "id", 4: "parameters", 5: "inputs", 6: "outputs",
           7: "raw_input_contents"}
INPUT = {1: "name", 2: "datatype", 3: "shape", 4: "parameters", 5: "contents"}
CONTENTS = {1: "bool_contents", 2: "int_contents", 3: "int64_contents", 4: "uint_contents",
            5: "uint64_contents", 6: "fp32_contents", 7: "fp64_contents", 8: "bytes_contents"}
EXPECTED = f"a serialized inference.ModelInferRequest (grpc_predict_v2.proto), Content-Type {MEDIA}"


@contextmanager
def malformed(where: str):
    """A ProtoError inside becomes the request's 400, naming the message part."""
    try:
        yield
    except ProtoError as e:
        raise RequestError(f"malformed {where}: {e}; expected {EXPECTED}") from None


def _len_field(wire: int, message: str, number: int, names: dict) -> None:
    if wire != LEN:
        raise ProtoError(f"field {number} ({names[number]}) of {message} has wire type {wire} "
                         f"({WIRE_NAMES.get(wire, '?')}), expected 2 (length-delimited)")


def _text(value, where: str) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(f"{where} is not valid UTF-8 (protobuf strings are UTF-8)") from None


class InferRequest(NamedTuple):
    """A ModelInferRequest's top level: sub-messages and raw contents still views of the body."""

    model_name: str
    model_version: str
    id: str
    inputs: list  # memoryviews of the InferInputTensor messages
    wanted: tuple  # requested output names, in order (): every output
    raws: list  # memoryviews of raw_input_contents
    parameters: list  # memoryviews of the parameters map's entries (read by pod/stream_infer.py)


class Input(NamedTuple):
    index: int
    name: str
    datatype: str
    shape: list
    contents: dict | None  # InferTensorContents field -> [(wire type, value)]; None: absent


def parse_request(body) -> InferRequest:
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise RequestError(f"{MEDIA} body must arrive as bytes, got {type(body).__name__}")
    strings, inputs, wanted, raws, params = {1: "", 2: "", 3: ""}, [], [], [], []
    with malformed("ModelInferRequest"):
        for number, wire, value in protowire.fields(body):
            if number in REQUEST:
                _len_field(wire, "ModelInferRequest", number, REQUEST)
            if number in strings:
                strings[number] = _text(value, f"ModelInferRequest.{REQUEST[number]}")
            elif number == 5:
                inputs.append(value)
            elif number == 6:
                wanted.append(_output_name(value, len(wanted)))
            elif number == 7:
                raws.append(value)
            elif number == 4:
                params.append(value)
            # unknown fields are skipped, as protobuf parsers skip unknown ones
    if len(set(wanted)) != len(wanted):
        twice = sorted({n for n in wanted if wanted.count(n) > 1})
        raise RequestError(f"output(s) {', '.join(map(repr, twice))} requested more than once; name each once")
    return InferRequest(strings[1], strings[2], strings[3], inputs, tuple(wanted), raws, params)


def _output_name(view, i: int) -> str:
    where = f"ModelInferRequest.outputs[{i}]"
    name = ""
    with malformed(where):
        for number, wire, value in protowire.fields(view):
            if number == 1:
                _len_field(wire, where, number, {1: "name"})
                name = _text(value, f"{where}.name")
    return name


def parse_input(i: int, view) -> Input:
    where = f"ModelInferRequest.inputs[{i}]"
    name = datatype = ""
    shape, contents = [], None
    with malformed(where):
        for number, wire, value in protowire.fields(view):
            if number == 3:  # repeated int64: packed or not
                shape.append((wire, value))
                continue
            if number in INPUT:
                _len_field(wire, where, number, INPUT)
            if number == 1:
                name = _text(value, f"{where}.name")
            elif number == 2:
                datatype = _text(value, f"{where}.datatype")
            elif number == 5:  # a repeated singular message merges: its fields concatenate
                contents = _contents(value, {} if contents is None else contents, f"{where}.contents")
        shape = protowire.repeated_varints(shape, np.int64).tolist()
    return Input(i, name, datatype, shape, contents)


def _contents(view, into: dict, where: str) -> dict:
    with malformed(where):
        for number, wire, value in protowire.fields(view):
            if number in CONTENTS:
                into.setdefault(number, []).append((wire, value))
    return into
