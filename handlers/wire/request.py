"""One request as the wire reads it (the order: wire/__init__.py): `arrival` (its transport, its
body unread), `read` (its payload out of TorchServe's request dict, the body limits that apply
before any format looks at it, its format chosen from wire/registry.py's formats: by media type
or bytes, by JSON shape (`json_format`), the answering one by Accept; a transport's own format
names the one reading its bodies; its body parsed into a wire.base.Parsed), and the typed
`Request` the pipeline carries from there through admission (its checked tensors) to its answer.

The JSON limit can apply before parsing only because the worker hands JSON bodies over as
bytes: ts_entry sets TS_DECODE_INPUT_REQUEST=false at initialize (TorchServe 0.12's worker
reads it per request, ts/protocol/otf_message_handler.py). Anything TorchServe did parse
arrives as Python objects and is taken as it is.
"""
from __future__ import annotations

import logging
from typing import Optional

from handlers.errors import PayloadTooLarge, RequestError, UnsupportedMediaType
from handlers.wire import registry, strict_json
from handlers.wire.base import FORM_MEDIA, JSON_MEDIA, Encoded, Failed, Parsed, WireFormat, WireName

logger = logging.getLogger(__name__)


class Request:
    """One request, typed: made once by wire.read, completed by admission (`tensors`, `rows`),
    answered through `encode` or `error`. Slots: one small object per request, nothing else."""

    __slots__ = ("errors_as", "request_id", "arrived", "read_error", "parsed", "wire", "respond_as",
                 "tensors", "rows")

    def __init__(self, errors_as: WireFormat, request_id: Optional[str], arrived=None):
        self.errors_as = errors_as  # answers its errors: its transport's format, else the JSON error object
        self.request_id = request_id  # its transport's id, then the one its body gives (KServe v2 "id")
        self.arrived = arrived  # a body its transport parsed to tell it (wire.base.Arrival); None: not yet read
        self.read_error: Optional[BaseException] = None  # what reading it raised; admission raises it
        self.parsed: Optional[Parsed] = None  # its body as its format read it (wire.read)
        self.wire: Optional[WireFormat] = None  # the format that read it and decodes it
        self.respond_as: Optional[WireFormat] = None  # the format that answers it (Accept may choose)
        self.tensors: Optional[dict] = None  # input name -> CPU tensor, batch in dim 0 (admission)
        self.rows = 0

    def encode(self, outputs: dict, model_name: str, model_version: str = "") -> Encoded:
        return self.respond_as.encode(outputs, self.parsed, model_name, model_version)

    def error(self, err, model_name: str, model_version: str = "") -> Failed:
        """`err` (a ServingError) as this request's answer, in its transport's shape."""
        return Failed(err, self.errors_as.error(err, self.request_id, model_name, model_version),
                      self.errors_as.transport)


def arrival(request, headers, max_json_bytes: int) -> Request:
    """The request as it arrived, its body not yet read: its transport's format, which answers
    its errors, and its id; a plain REST request is answered with the JSON error object."""
    fmt, arrived = _transport_of(request, headers, max_json_bytes)
    return Request(fmt, None) if arrived is None else Request(fmt, arrived.request_id, arrived.body)


def read(request, headers, limits) -> Request:
    """The one choice of a request's wire format, its body parsed (wire/__init__.py: the order).
    `headers`: its handlers.torchserve.headers.RequestHeaders; `limits`: handlers.admission.Limits.
    Never raises: what reading raised is kept in `read_error`, raised by admission, and answered
    by the request's `errors_as`."""
    return read_arrived(arrival(request, headers, limits.max_json_bytes), request, headers, limits)


def read_arrived(req: Request, request, headers, limits) -> Request:
    """`read` for a request whose `arrival` is known."""
    try:
        if not request and headers.content_type:
            # TorchServe's frontend decodes a form's body into parameters, and a JSON body sent
            # as a form (curl -d without a Content-Type) arrives as none: the media type is the fault
            binary_format(b"", headers.content_type, None)
        payload = payload_of(request)
        check_size(payload, limits)
        if req.errors_as.transport:  # its transport's format reads and answers it, whatever its headers say
            transport = req.errors_as
            arrived = payload if req.arrived is None else req.arrived
            body = arrived if transport.binary else parse_json(arrived, limits)
            req.wire, req.respond_as = transport.reader(body), transport
        else:
            if headers.v2_header_length is not None:
                check_json_part(headers.v2_header_length, limits)
            fmt = binary_format(payload, headers.content_type, headers.v2_header_length)
            body = payload if fmt is not None else parse_json(payload, limits)
            req.wire = fmt or json_format(body)
            req.respond_as = response_format(req.wire, headers.accept)
        req.parsed = req.wire.parse(body, headers)
        if req.parsed.request_id is not None:
            req.request_id = req.parsed.request_id
    except Exception as e:  # noqa: BLE001  (the request's own answer: admission raises it)
        req.read_error = e
    return req


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


def _transport_of(request, headers, max_json_bytes: int) -> tuple:
    """(the format bound to the transport the request arrived over, its Arrival), or (ERRORS,
    None) for plain REST; a request whose transport cannot be told (malformed) is answered as REST."""
    try:
        for f in registry.TRANSPORTS.values():
            arrived = f.arrival(request, headers, max_json_bytes)
            if arrived is not None:
                return f, arrived
    except Exception:  # a malformed transport request: answered as REST, with its error
        logger.exception("could not tell a request's transport")
    return registry.ERRORS, None


def json_format(body) -> WireFormat:
    """The JSON envelope of a parsed body, by its shape."""
    if not isinstance(body, dict):
        raise RequestError("JSON body must be an object: {\"inputs\": {...}} (ours), "
                           "{\"instances\": [...]} (KServe v1) or {\"inputs\": [...]} (KServe v2)")
    for f in registry.FORMATS.values():
        if not f.binary and f.matches_json(body):
            return f
    raise RequestError("JSON body has neither `inputs` nor `instances`; expected "
                       "{\"inputs\": {NAME: nested list}} (ours), {\"instances\": [...]} "
                       "(KServe v1) or {\"inputs\": [{name, shape, datatype, data}]} (KServe v2)")


def _media(content_type) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def binary_format(payload, content_type, v2_header_length=None) -> Optional[WireFormat]:
    """The binary format named by the Content-Type, or recognised from bytes sent without a
    JSON one; None: the body is JSON. Raises 415 for any other declared media type. The v2
    binary extension is announced by its header (v2_binary.HEADER), whatever the media type:
    KServe v2, whose parse splits the body by it."""
    if v2_header_length is not None:
        return registry.FORMATS[WireName.KSERVE_V2]
    ct = _media(content_type)
    for f in registry.FORMATS.values():
        if f.binary and ct == f.media_type:
            return f
    if isinstance(payload, (bytes, bytearray)) and ct != JSON_MEDIA:
        for f in registry.FORMATS.values():
            if f.binary and f.matches_bytes(payload):
                return f
    if ct and ct != JSON_MEDIA and not ct.startswith("text/") and ct != "application/octet-stream":
        hint = (" (curl -d sends this unless told otherwise: add -H 'Content-Type: application/json')"
                if ct == FORM_MEDIA else "")
        raise UnsupportedMediaType(f"Content-Type {ct!r} is not supported{hint}; send {JSON_MEDIA} "
                                   "(our JSON, KServe v1 or v2) or "
                                   + " or ".join(f.media_type for f in registry.FORMATS.values() if f.binary))
    return None


def response_format(request_format: WireFormat, accept) -> WireFormat:
    """The request's own format unless Accept prefers another media type: binary media types
    first (large tensors), then JSON, which answers in our JSON."""
    if not accept:
        return request_format
    accept = accept.lower()
    for f in sorted(registry.FORMATS.values(), key=lambda f: not f.binary):
        if f.media_type in accept:
            return request_format if f.media_type == request_format.media_type else f
    return request_format
