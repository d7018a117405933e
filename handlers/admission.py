"""Admission: one request's body in, checked CPU tensors out, or the typed error that answers it.

Steps, once per request: the payload out of TorchServe's request dict; the body size against
the limit (413); the wire format, chosen once (415 for an unsupported media type); decode; the
tensors against the artifact's input contract (400); the row count against the limits (413);
the response format from Accept.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from .config import HandlerConfig
from .errors import PayloadTooLarge, RequestError
from .metadata import ArtifactSpec
from .wire import WireFormat, binary_format, json_format, response_format
from .wire.tensors import check_inputs


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int  # bodies handed over as bytes; TorchServe parses JSON bodies before us
    max_rows: int  # rows in one request (handler.max_rows_per_request)
    batch_max: int  # the artifact's rows per call
    split_oversized: bool  # rows beyond batch_max: split into several calls, else refuse

    @classmethod
    def of(cls, config: HandlerConfig, spec: ArtifactSpec) -> "Limits":
        return cls(int(config.max_body_mb * (1 << 20)), config.max_rows_per_request, spec.batch_max,
                   config.split_oversized)


@dataclass
class Admitted:
    tensors: dict  # input name -> CPU tensor with the batch in dim 0, in the artifact's order
    rows: int
    wire: WireFormat  # the request's wire format
    respond_as: WireFormat  # the response's wire format (the request's unless Accept says otherwise)
    request_id: Optional[str] = None  # KServe v2 "id", echoed back

    def encode(self, outputs: dict, model_name: str):
        """Returns (body, content type)."""
        return self.respond_as.encode(outputs, self.request_id, model_name), self.respond_as.media_type


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


def parse_json(payload):
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


def check_rows(rows: int, limits: Limits) -> None:
    if rows > limits.max_rows:
        raise PayloadTooLarge(f"request carries {rows} rows; this model accepts at most {limits.max_rows} "
                              "per request (handler.max_rows_per_request)")
    if rows > limits.batch_max and not limits.split_oversized:
        raise PayloadTooLarge(f"request carries {rows} rows but the artifact accepts at most "
                              f"{limits.batch_max} per call; send at most that many, or enable "
                              "handler.split_oversized")


def admit(request: dict, spec: ArtifactSpec, limits: Limits, content_type: Optional[str] = None,
          accept: Optional[str] = None, v2_header_length: Optional[str] = None) -> Admitted:
    payload = payload_of(request)
    if isinstance(payload, (bytes, bytearray, str)) and len(payload) > limits.max_body_bytes:
        raise PayloadTooLarge(f"request body is {len(payload)} bytes; this model accepts at most "
                              f"{limits.max_body_bytes} (handler.max_body_mb)")
    wire = binary_format(payload, content_type, v2_header_length)
    body = payload if wire is not None else parse_json(payload)
    wire = (wire or json_format(body)).for_request(body)
    tensors, request_id = wire.decode(body, spec)
    tensors, rows = check_inputs(tensors, spec)
    check_rows(rows, limits)
    return Admitted(tensors, rows, wire, response_format(wire, accept), request_id)
