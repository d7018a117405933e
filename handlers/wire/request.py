"""One request as the wire reads it: its payload out of TorchServe's request dict, the body limits
that apply before any format looks at it, and the typed `Request` the pipeline carries from
wire.read (its format, its body, who answers it) through admission (its checked tensors) to its
answer.

The JSON limit can apply before parsing only because the worker hands JSON bodies over as
bytes: ts_entry sets TS_DECODE_INPUT_REQUEST=false at initialize (TorchServe 0.12's worker
reads it per request, ts/protocol/otf_message_handler.py). Anything TorchServe did parse
arrives as Python objects and is taken as it is.
"""
from __future__ import annotations

from typing import Optional

from handlers.errors import PayloadTooLarge, RequestError
from handlers.wire import strict_json
from handlers.wire.base import Encoded, Failed, WireFormat


class Request:
    """One request, typed: made once by wire.read, completed by admission (`tensors`, `rows`),
    answered through `encode` or `error`. Slots: one small object per request, nothing else."""

    __slots__ = ("errors_as", "request_id", "read_error", "body", "wire", "respond_as", "tensors", "rows")

    def __init__(self, errors_as: WireFormat, request_id: Optional[str]):
        self.errors_as = errors_as  # answers its errors: its transport's format, else the JSON error object
        self.request_id = request_id  # its transport's id before decode, then the decoded one (KServe v2 "id")
        self.read_error: Optional[BaseException] = None  # what reading it raised; admission raises it
        self.body = None  # bytes for binary formats, the parsed object for JSON ones
        self.wire: Optional[WireFormat] = None  # the format that decodes it (for_request's instance)
        self.respond_as: Optional[WireFormat] = None  # the format that answers it (Accept may choose)
        self.tensors: Optional[dict] = None  # input name -> CPU tensor, batch in dim 0 (admission)
        self.rows = 0

    def encode(self, outputs: dict, model_name: str, model_version: str = "") -> Encoded:
        return self.respond_as.encode(outputs, self.request_id, model_name, model_version)

    def error(self, err, model_name: str, model_version: str = "") -> Failed:
        """`err` (a ServingError) as this request's answer, in its transport's shape."""
        return Failed(err, self.errors_as.error(err, self.request_id, model_name, model_version),
                      self.errors_as.transport)


def payload_of(request: dict):
    """TorchServe puts a REST body under "body" (or "data"); gRPC uses the input map's keys."""
    if not isinstance(request, dict) or not request:
        raise RequestError("empty request: send a JSON or safetensors body")
    for key in ("body", "data"):
        if key in request:
            return request[key]
    if len(request) == 1:
        return next(iter(request.values()))
    raise RequestError(f"request has several parts ({', '.join(map(str, request))}); send one body")


def check_size(payload, limits) -> None:
    """Any body handed over as bytes or text against handler.max_body_mb, before it is read."""
    if isinstance(payload, (bytes, bytearray, str)) and len(payload) > limits.max_body_bytes:
        raise PayloadTooLarge(f"request body is {len(payload)} bytes; this model accepts at most "
                              f"{limits.max_body_bytes} (handler.max_body_mb)")


def parse_json(payload, limits):
    """A JSON body in bytes or text, within the JSON size limit, parsed strictly; a value
    TorchServe already parsed (any JSON value, scalars included) is returned as it is."""
    if not isinstance(payload, (bytes, bytearray, memoryview, str)):
        return payload
    if len(payload) > limits.max_json_bytes:
        raise PayloadTooLarge(f"JSON body is {len(payload)} bytes; this model accepts JSON bodies up to "
                              f"{limits.max_json_bytes} bytes (handler.max_json_mb). Send large tensors in "
                              "the binary encoding: Content-Type application/x-safetensors (up to "
                              f"{limits.max_body_bytes} bytes)")
    return strict_json.loads(payload)


def check_json_part(header_length, limits) -> None:
    """The JSON part of a KServe v2 binary request (its declared length) is JSON like any other:
    the JSON cap applies to it before it is parsed (the binary part may be larger)."""
    text = str(header_length).strip()
    if text.isascii() and text.isdigit() and len(text) <= 20 and int(text) > limits.max_json_bytes:
        raise PayloadTooLarge(f"the JSON part of this v2 binary request is {text} bytes; this model "
                              f"accepts JSON up to {limits.max_json_bytes} bytes (handler.max_json_mb). "
                              "Send tensor data in the binary part (binary_data)")
