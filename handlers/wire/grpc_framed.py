"""A gRPC call's own body, passed on by the pod's nginx (kserve/nginx.conf) from its h2c port to
TorchServe over HTTP/1.1 with the call's `Content-Type: application/grpc`: the gRPC length-prefixed
message (1 byte compressed-flag, 4 bytes big-endian length, then a serialized
`inference.ModelInferRequest`), decoded by handlers/wire/kserve_v2_grpc.py. The answer is framed
the same way; nginx adds the `grpc-status` trailer (0). An error is answered with its HTTP status
and its message in the `X-Grpc-Message` header, percent-encoded as gRPC's grpc-message is; nginx
turns both into the call's trailers (kserve/nginx.conf maps the status to the gRPC code).

Bound to its transport: chosen by the Content-Type alone, before the body is read, so its errors
are always answered in this shape. nginx routes a call here only where the pod serves one model;
a request naming another model or version is refused (404, NOT_FOUND), one naming none
(empty model_name) is INVALID_ARGUMENT, as the bridge of a several-model pod answers them.
"""
from __future__ import annotations

from urllib.parse import quote

from typing import Optional

from handlers.errors import ModelNotFound, RequestError
from handlers.wire.base import Arrival, Encoded, Parsed
from handlers.wire.kserve_v2_grpc import KServeV2Grpc

MEDIA = "application/grpc"
MESSAGE_HEADER = "X-Grpc-Message"


def unframe(body) -> memoryview:
    """The one message of a gRPC request body (a unary call sends exactly one)."""
    if not isinstance(body, (bytes, bytearray, memoryview)) or len(body) < 5:
        raise RequestError("a gRPC request body starts with a 5-byte message prefix; this one is shorter")
    view = memoryview(body)
    if view[0] != 0:
        raise RequestError("compressed gRPC messages are not accepted; call without compression")
    n = int.from_bytes(view[1:5], "big")
    if n != len(view) - 5:
        raise RequestError(f"the gRPC message prefix says {n} bytes, the body holds {len(view) - 5}; "
                           "send one ModelInferRequest per call")
    return view[5:]


class GrpcFramed(KServeV2Grpc):
    name = "v2-grpc-framed"
    media_type = MEDIA
    transport = "grpc-through-nginx"

    def arrival(self, request, headers, max_json_bytes: int) -> Optional[Arrival]:
        ct = headers.content_type
        if not (isinstance(ct, str) and ct.split(";")[0].strip().lower() in (MEDIA, MEDIA + "+proto")):
            return None
        return Arrival(None, None)  # the body: the framed message as TorchServe hands it over

    def parse(self, body, headers=None) -> Parsed:
        return super().parse(unframe(body), headers)

    def encode(self, outputs, parsed, model_name, model_version=""):
        check_names(parsed, model_name, model_version)
        message = super().encode(outputs, parsed, model_name, model_version).body
        return Encoded(b"\0" + len(message).to_bytes(4, "big") + message, MEDIA, {})

    def error(self, err, request_id, model_name, model_version=""):
        return Encoded(b"", MEDIA, {MESSAGE_HEADER: quote(err.message[:4000], safe=" !\"#$&'()*+,/:;=?@[]{}")})


def check_names(parsed: Parsed, model_name: str, model_version: str) -> None:
    """The call names this worker's model, and its version if it names one (as the pod's gRPC
    bridge checks them for a pod of several models): never answered by another."""
    if parsed.names is None:
        return
    name, version = parsed.names
    if not name:
        raise RequestError(f"the ModelInferRequest's model_name is empty; name the model: {model_name!r}")
    if name != model_name:
        raise ModelNotFound(f"model {name!r} is not served on this route; it serves {model_name!r}")
    if version and model_version and version != model_version:
        raise ModelNotFound(f"model {model_name!r} version {version!r} is not served here; it serves "
                            f"version {model_version!r} (or leave model_version empty)")


FORMAT = GrpcFramed()
