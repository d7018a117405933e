"""Admission: one request's body in, checked CPU tensors out, or the typed error that answers it.

Steps, once per request: the payload out of TorchServe's request dict; the body size against
the limit (413); the wire format, chosen once (415 for an unsupported media type); for JSON,
the body size against the (smaller) JSON limit before anything is parsed (413), then the
strict, bounded parse (wire/strict_json.py); decode; the tensors against the artifact's input
contract (400); their values against the value contract (400, handlers/values.py); the row count
against the limits (413); the response format from Accept.

The JSON limit can apply before parsing only because the worker hands JSON bodies over as
bytes: ts_entry sets TS_DECODE_INPUT_REQUEST=false at initialize (TorchServe 0.12's worker
reads it per request, ts/protocol/otf_message_handler.py). Anything TorchServe did parse
arrives as Python objects and is taken as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from handlers.artifact.metadata import ArtifactSpec
from handlers.config import HandlerConfig
from handlers.errors import PayloadTooLarge, RequestError
from handlers.values import ValueContract
from handlers.wire import (
    WireFormat,
    binary_format,
    json_format,
    response_format,
    strict_json,
)
from handlers.wire.base import Encoded
from handlers.wire.tensors import check_inputs


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int  # any body handed over as bytes (handler.max_body_mb)
    max_rows: int  # rows in one request (handler.max_rows_per_request)
    batch_max: int  # the artifact's rows per call
    split_oversized: bool  # rows beyond batch_max: split into several calls, else refuse
    max_json_bytes: int = 8 << 20  # JSON bodies, checked before parsing (handler.max_json_mb)
    values: ValueContract = ValueContract()  # valid input values (handlers/values.py)

    @classmethod
    def of(cls, config: HandlerConfig, spec: ArtifactSpec) -> "Limits":
        return cls(int(config.max_body_mb * (1 << 20)), config.max_rows_per_request, spec.batch_max,
                   config.split_oversized, int(config.max_json_mb * (1 << 20)),
                   ValueContract.of(spec, config))


@dataclass
class Admitted:
    tensors: dict  # input name -> CPU tensor with the batch in dim 0, in the artifact's order
    rows: int
    wire: WireFormat  # the request's wire format
    respond_as: WireFormat  # the response's wire format (the request's unless Accept says otherwise)
    request_id: Optional[str] = None  # KServe v2 "id", echoed back

    def encode(self, outputs: dict, model_name: str, model_version: str = "") -> Encoded:
        return self.respond_as.encoded(outputs, self.request_id, model_name, model_version)


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


def parse_json(payload, limits: "Limits"):
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


def check_json_part(header_length, limits: "Limits") -> None:
    """The JSON part of a KServe v2 binary request (its declared length) is JSON like any other:
    the JSON cap applies to it before it is parsed (the binary part may be larger)."""
    text = str(header_length).strip()
    if text.isascii() and text.isdigit() and len(text) <= 20 and int(text) > limits.max_json_bytes:
        raise PayloadTooLarge(f"the JSON part of this v2 binary request is {text} bytes; this model "
                              f"accepts JSON up to {limits.max_json_bytes} bytes (handler.max_json_mb). "
                              "Send tensor data in the binary part (binary_data)")


def check_rows(rows: int, limits: Limits) -> None:
    if rows > limits.max_rows:
        raise PayloadTooLarge(f"request carries {rows} rows; this model accepts at most {limits.max_rows} "
                              "per request (handler.max_rows_per_request)")
    if rows > limits.batch_max and not limits.split_oversized:
        raise PayloadTooLarge(f"request carries {rows} rows but the artifact accepts at most "
                              f"{limits.batch_max} per call; send at most that many, or enable "
                              "handler.split_oversized")


def admit(request: dict, spec: ArtifactSpec, limits: Limits, content_type: Optional[str] = None,
          accept: Optional[str] = None, v2_header_length: Optional[str] = None,
          transport: Optional[WireFormat] = None) -> Admitted:
    """`transport`: the format bound to the transport the request arrived over
    (wire.transport_format), which then decodes and answers it whatever its headers say."""
    payload = payload_of(request)
    if isinstance(payload, (bytes, bytearray, str)) and len(payload) > limits.max_body_bytes:
        raise PayloadTooLarge(f"request body is {len(payload)} bytes; this model accepts at most "
                              f"{limits.max_body_bytes} (handler.max_body_mb)")
    if transport is not None:
        body = payload if transport.binary else parse_json(payload, limits)
        wire = transport.for_request(body)
        tensors, request_id = wire.decode(body, spec)
        return _checked(tensors, request_id, spec, limits, wire, wire)
    if v2_header_length is not None:
        check_json_part(v2_header_length, limits)
    wire = binary_format(payload, content_type, v2_header_length)
    body = payload if wire is not None else parse_json(payload, limits)
    wire = (wire or json_format(body)).for_request(body)
    tensors, request_id = wire.decode(body, spec)
    return _checked(tensors, request_id, spec, limits, wire, response_format(wire, accept))


def _checked(tensors, request_id, spec: ArtifactSpec, limits: Limits, wire, respond_as) -> Admitted:
    """The decoded tensors against the input contract, the value contract and the row limits."""
    tensors, rows = check_inputs(tensors, spec)
    limits.values.check(tensors)
    check_rows(rows, limits)
    return Admitted(tensors, rows, wire, respond_as, request_id)
