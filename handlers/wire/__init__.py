"""The wire formats, listed once (BUILT_IN), and the one call that reads a request: `read` picks
its format, reads its body and says who answers it (wire/request.py's `Request`).

A request is read in this order, its first failure being its answer: the transport it arrived
over (a transport-bound format is asked first and, where it says yes, decodes and answers the
request whatever its headers say); the payload (400 when there is none); the body size (413);
for a KServe v2 binary request the declared size of its JSON part (413); a binary format by
Content-Type, or recognised from the bytes (415 for any other declared media type); for JSON,
its size (413) and strict parse (400), then the envelope by its shape (400); the format's own
instance for this request (its framing); the response format from Accept.
"""
from __future__ import annotations

import logging

from handlers.errors import RequestError, UnsupportedMediaType
from handlers.wire import (
    grpc_framed,
    kserve_v1,
    kserve_v2,
    kserve_v2_grpc,
    oip_grpc,
    ours_json,
    safetensors,
    strict_json,  # noqa: F401  (the JSON parser and writer, for format modules)
)
from handlers.wire.base import JSON_MEDIA, Arrival, Encoded, Failed, WireFormat, WireName  # noqa: F401  (the interface)
from handlers.wire.envelopes import FORMATS, json_format  # noqa: F401  (the registry of request formats)
from handlers.wire.request import Request, check_json_part, check_size, parse_json, payload_of

logger = logging.getLogger(__name__)

# Every built-in wire format, one line each. Formats bound to a transport are asked first, in
# this order; binary ones are chosen by media type before JSON envelopes, which are tried in
# this order.
BUILT_IN = (
    safetensors.FORMAT,
    kserve_v2_grpc.FORMAT,
    ours_json.FORMAT,
    kserve_v2.FORMAT,
    kserve_v1.FORMAT,
    grpc_framed.FORMAT,  # bound to its transport: a gRPC call's body, passed on by the pod's nginx
    oip_grpc.FORMAT,  # bound to its transport: TorchServe's Open Inference Protocol gRPC service
)

TRANSPORTS = {}  # transport -> the format bound to it, asked first, in registration order
ERRORS = WireFormat()  # answers the errors of a request no transport format owns: the JSON error object


def register(fmt: WireFormat) -> WireFormat:
    if fmt.transport:
        TRANSPORTS[fmt.transport] = fmt
    else:
        FORMATS[fmt.name] = fmt
    return fmt


for _fmt in BUILT_IN:
    register(_fmt)


def arrival(request, headers, max_json_bytes: int) -> Request:
    """The request as it arrived, its body not yet read: its transport's format, which answers
    its errors, and its id; a plain REST request is answered with the JSON error object. A
    request whose transport cannot be told (malformed) is answered as REST."""
    try:
        for f in TRANSPORTS.values():
            arrived = f.arrival(request, headers, max_json_bytes)
            if arrived is not None:
                req = Request(f, arrived.request_id)
                req.body = arrived.body
                return req
    except Exception:  # a malformed transport request: answered as REST, with its error
        logger.exception("could not tell a request's transport")
    return Request(ERRORS, None)


def read(request, headers, limits) -> Request:
    """The one choice of a request's wire format (module docstring: the order). `headers`: its
    handlers.torchserve.headers.RequestHeaders; `limits`: handlers.admission.Limits. Never
    raises: what reading raised is kept in `read_error`, raised by admission, and answered by
    the request's `errors_as`."""
    req = arrival(request, headers, limits.max_json_bytes)
    try:
        payload = payload_of(request)
        check_size(payload, limits)
        if req.errors_as.transport:  # its transport's format decodes and answers it, whatever its headers say
            transport = req.errors_as
            arrived = payload if req.body is None else req.body
            body = arrived if transport.binary else parse_json(arrived, limits)
            req.wire = req.respond_as = transport.for_request(body)
        else:
            if headers.v2_header_length is not None:
                check_json_part(headers.v2_header_length, limits)
            fmt = _binary_format(payload, headers.content_type, headers.v2_header_length)
            body = payload if fmt is not None else parse_json(payload, limits)
            req.wire = (fmt or json_format(body)).for_request(body)
            req.respond_as = _response_format(req.wire, headers.accept)
        req.body = body
    except Exception as e:  # noqa: BLE001  (the request's own answer: admission raises it)
        req.read_error = e
    return req


def _media(content_type) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def _binary_format(payload, content_type, v2_header_length=None):
    """The binary format named by the Content-Type, or recognised from bytes sent without a
    JSON one; None: the body is JSON. Raises 415 for any other declared media type. The v2
    binary extension is announced by its header (v2_binary.HEADER), whatever the media type."""
    if v2_header_length is not None:
        return kserve_v2.binary(v2_header_length)
    ct = _media(content_type)
    for f in FORMATS.values():
        if f.binary and ct == f.media_type:
            return f
    if isinstance(payload, (bytes, bytearray)) and ct != JSON_MEDIA:
        for f in FORMATS.values():
            if f.binary and f.matches_bytes(payload):
                return f
    if ct and ct != JSON_MEDIA and not ct.startswith("text/") and ct != "application/octet-stream":
        raise UnsupportedMediaType(f"Content-Type {ct!r} is not supported; send {JSON_MEDIA} "
                                   "(our JSON, KServe v1 or v2) or "
                                   + " or ".join(f.media_type for f in FORMATS.values() if f.binary))
    return None


def _response_format(request_format: WireFormat, accept) -> WireFormat:
    """The request's own format unless Accept prefers another media type: binary media types
    first (large tensors), then JSON, which answers in our JSON."""
    if not accept:
        return request_format
    accept = accept.lower()
    for f in sorted(FORMATS.values(), key=lambda f: not f.binary):
        if f.media_type in accept:
            return request_format if f.media_type == request_format.media_type else f
    return request_format
