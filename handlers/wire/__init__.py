"""The wire-format registry: one module per format, one line per format below, and the choice
of a request's format (once per request) and of its response's format."""
from __future__ import annotations

from handlers.errors import RequestError, UnsupportedMediaType
from handlers.wire import (  # noqa: F401
    grpc_framed,
    kserve_v1,
    kserve_v2,
    kserve_v2_grpc,
    ours_json,
    safetensors,
    strict_json,
)
from handlers.wire.base import JSON_MEDIA, WireFormat, WireName  # noqa: F401  (the interface, for format modules)

FORMATS = {}  # name -> format, in registration order (JSON envelopes are tried in this order)
TRANSPORTS = {}  # transport -> the format bound to it, asked first, in registration order


def register(fmt: WireFormat) -> WireFormat:
    if fmt.transport:
        TRANSPORTS[fmt.transport] = fmt
    else:
        FORMATS[fmt.name] = fmt
    return fmt


def transport_format(request, headers, max_json_bytes: int):
    """The format bound to the transport this request arrived over, or None (then its media
    type or JSON shape chooses: binary_format, json_format)."""
    for f in TRANSPORTS.values():
        if f.arrived_by(request, headers, max_json_bytes):
            return f
    return None


register(safetensors.FORMAT)
register(kserve_v2_grpc.FORMAT)
register(ours_json.FORMAT)
register(kserve_v2.FORMAT)
register(kserve_v1.FORMAT)
register(grpc_framed.FORMAT)  # bound to its transport: a gRPC call's body, passed on by the pod's nginx


def _media(content_type) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def binary_format(payload, content_type, v2_header_length=None):
    """The binary format named by the Content-Type, or recognised from bytes sent without a
    JSON one; None: the body is JSON. Raises 415 for any other declared media type. The v2
    binary extension is announced by its header (v2_binary.HEADER), whatever the media type."""
    if v2_header_length is not None:
        return kserve_v2.binary(v2_header_length)
    ct = _media(content_type)
    binaries = [f for f in FORMATS.values() if f.binary]
    for f in binaries:
        if ct == f.media_type:
            return f
    if isinstance(payload, (bytes, bytearray)) and ct != JSON_MEDIA:
        for f in binaries:
            if f.matches_bytes(payload):
                return f
    if ct and ct != JSON_MEDIA and not ct.startswith("text/") and ct != "application/octet-stream":
        raise UnsupportedMediaType(f"Content-Type {ct!r} is not supported; send {JSON_MEDIA} "
                                   "(our JSON, KServe v1 or v2) or "
                                   + " or ".join(f.media_type for f in binaries))
    return None


def json_format(body) -> WireFormat:
    if not isinstance(body, dict):
        raise RequestError("JSON body must be an object: {\"inputs\": {...}} (ours), "
                           "{\"instances\": [...]} (KServe v1) or {\"inputs\": [...]} (KServe v2)")
    for f in FORMATS.values():
        if not f.binary and f.matches_json(body):
            return f
    raise RequestError("JSON body has neither `inputs` nor `instances`; expected "
                       "{\"inputs\": {NAME: nested list}} (ours), {\"instances\": [...]} "
                       "(KServe v1) or {\"inputs\": [{name, shape, datatype, data}]} (KServe v2)")


def response_format(request_format: WireFormat, accept) -> WireFormat:
    """The request's own format unless Accept prefers another media type: binary media types
    first (large tensors), then JSON, which answers in our JSON."""
    if not accept:
        return request_format
    accept = accept.lower()
    for f in sorted(FORMATS.values(), key=lambda f: not f.binary):
        if f.media_type in accept:
            return request_format if f.media_type == request_format.media_type else f
    return request_format
