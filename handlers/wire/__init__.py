"""The wire formats, listed once (BUILT_IN), and the calls that read a request: `arrival` (its
transport, its body unread) and `read` (its format chosen, its body parsed), wire/request.py.

A request is read in this order, its first failure being its answer: the transport it arrived
over (a transport-bound format is asked first and, where it says yes, reads and answers the
request whatever its headers say); the payload (400 when there is none); the body size (413);
for a KServe v2 binary request the declared size of its JSON part (413); a binary format by
Content-Type, or recognised from the bytes (415 for any other declared media type); for JSON,
its size (413) and strict parse (400), then the envelope by its shape (400); the body parsed by
its format into the neutral wire.base.Parsed (its framing, id, requested outputs); the response
format from Accept. Formats hold no request state: the Request carries the Parsed.
"""
from __future__ import annotations

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
from handlers.wire.base import JSON_MEDIA, Arrival, Encoded, Failed, Parsed, WireFormat, WireName  # noqa: F401  (the interface)
from handlers.wire.registry import ERRORS, FORMATS, TRANSPORTS, register  # noqa: F401  (the registry)
from handlers.wire.request import Request, arrival, json_format, read, read_arrived  # noqa: F401  (reading a request)

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

for _fmt in BUILT_IN:
    register(_fmt)
