"""TorchServe 0.12's Open Inference Protocol gRPC service (ModelInfer) as a wire format bound to
its transport: the requests its frontend hands the worker, and the replies it needs back.

Facts this relies on (TorchServe 0.12, OpenInferenceProtocolImpl / GRPCJob in model-server.jar):
- The frontend turns a ModelInferRequest into the JSON {"id", "model_name", "inputs": [{name,
  shape, datatype, data}]} (one parameter "body", application/json) and sends no request
  headers; REST requests always carry their HTTP headers (Host at least). So: no string header
  and a `model_name` in the body = the gRPC path. The body arrives as bytes, since ts_entry
  turns TorchServe's JSON decoding off (TS_DECODE_INPUT_REQUEST=false): it is parsed here,
  strictly, once, and handed on in the Arrival (the request itself is never changed).
- It reads the reply as JSON and needs `id`, `model_name`, `model_version` (strings) and
  `outputs[]` with name, datatype, shape and flat data; a missing key throws in
  GRPCJob.response and the worker is killed. FP16/BF16 data come back empty (no typed field),
  so they are sent as FP32 (exact). A BYTES element is sent as its JSON text.
- It ignores per-request status codes: a request failing alone in a batch is answered with a
  complete reply holding its error; a status comes only from a failed batch, which the
  TorchServe adapter raises (handlers/torchserve/replies.py, handlers/torchserve/oip.py).
"""
from __future__ import annotations

from typing import Optional

from handlers.errors import RequestError, ServingError
from handlers.wire import kserve_v2, strict_json, v2_binary
from handlers.wire.base import JSON_MEDIA, Arrival, Encoded, WireFormat, dump_json

TRANSPORT = "torchserve-oip-grpc"


def grpc_body(request, rest: bool, max_json_bytes: Optional[int] = None):
    """The body of a request that came over the OIP gRPC service, given whether its headers say
    REST (handlers/torchserve/headers.py: any str header): the JSON object, parsed once here, or
    the bytes of one over the JSON limit (admission refuses it, answered as an OIP reply); None
    for any other request."""
    if rest:
        return None
    body = request.get("body") if isinstance(request, dict) else None
    if isinstance(body, (bytes, bytearray)):
        # The frontend's OIP body is a JSON object; a binary body (a safetensors payload starts
        # with its 8-byte header length) is never parsed here: that cost 14 ms on a 19 MB body.
        if body[:64].lstrip()[:1] != b"{":
            return None
        if max_json_bytes is not None and len(body) > max_json_bytes:
            # Not parsed here. The frontend writes "model_name" right after "id".
            return body if b'"model_name"' in body[:4096] else None
        try:
            body = strict_json.loads(body)
        except RequestError:  # not JSON: admission answers it as the request it is
            return None
    return body if isinstance(body, dict) and isinstance(body.get("model_name"), str) else None


def request_id(body) -> str:
    rid = body.get("id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) else ""


def reply(outputs: dict, rid: Optional[str], model_name: str, model_version: str) -> str:
    return dump_json(kserve_v2.reply(outputs, rid or "", model_name, model_version, widen_half=True))


def error_reply(err: ServingError, rid: str, model_name: str, model_version: str) -> str:
    """A complete reply whose one output, BYTES `error`, holds the JSON error object (the
    frontend would drop the status code of a request failing alone in a batch)."""
    return dump_json({"id": rid, "model_name": model_name, "model_version": model_version,
                      "outputs": [{"name": "error", "datatype": "BYTES", "shape": [1],
                                   "data": [err.to_dict()]}]})


class OipGrpc(WireFormat):
    """A request that arrived over the OIP gRPC service (no str header, a JSON object naming
    `model_name`) is decoded as the KServe v2 JSON the frontend rebuilt from the call, and
    answered with the complete replies above, errors included."""

    name = "oip-grpc"
    transport = TRANSPORT

    def arrival(self, request, headers, max_json_bytes: int) -> Optional[Arrival]:
        body = grpc_body(request, headers.rest, max_json_bytes)
        return None if body is None else Arrival(body, request_id(body))

    def reader(self, body) -> WireFormat:
        return kserve_v2.FORMAT  # the frontend rebuilds every call as KServe v2 JSON

    def encode(self, outputs: dict, parsed, model_name: str, model_version: str = "") -> Encoded:
        outputs = v2_binary.select(outputs, parsed.wanted)
        return Encoded(reply(outputs, parsed.request_id, model_name, model_version), JSON_MEDIA, {})

    def error(self, err, rid: Optional[str], model_name: str, model_version: str = "") -> Encoded:
        return Encoded(error_reply(err, rid or "", model_name, model_version), JSON_MEDIA, {})


FORMAT = OipGrpc()
