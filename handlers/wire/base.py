"""What a wire format is: one object that owns both directions, decode and encode.

A format is either binary (chosen by its media type, or recognised from the bytes), a JSON
envelope (chosen by the shape of the parsed JSON object), or bound to a transport (chosen by how
the request arrived, before its body is looked at: `transport`, `arrival`; TorchServe's Open
Inference Protocol gRPC service is one, handlers/wire/oip_grpc.py). A transport's format also
writes the error answers of its requests. What a format answers is an `Encoded`, or a `Failed`
for an error; the registry and the choice are wire/__init__.py."""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Optional

JSON_MEDIA = "application/json"


class WireName(str, Enum):
    """Names of the built-in wire formats (a registered format may use any other string)."""

    OURS_JSON = "json"
    KSERVE_V1 = "v1"
    KSERVE_V2 = "v2"
    SAFETENSORS = "safetensors"


class Encoded(NamedTuple):
    """One encoded response: its body, Content-Type and any headers it needs (v2 binary)."""

    body: object  # str or bytes-like
    media_type: str
    headers: dict


class Failed(NamedTuple):
    """The answer to a request that failed: its error (the status and type TorchServe sets), the
    error's encoded answer, and the transport it arrived over (None: plain REST), for the
    TorchServe adapter's batch failures (handlers/torchserve/replies.py)."""

    error: object  # handlers.errors.ServingError
    encoded: Encoded
    transport: Optional[str]


class Arrival(NamedTuple):
    """A request as its transport delivered it: the body its format decodes (the bytes, or the
    JSON the format parsed to tell its transport) and the transport's request id (for an error
    answered before the body is decoded)."""

    body: object  # None: the payload as TorchServe handed it over
    request_id: Optional[str]


class WireFormat:
    name = ""  # a WireName, or any other string for a registered format
    media_type = JSON_MEDIA  # Content-Type of its bodies
    binary = False  # True: chosen by media type / bytes; False: a JSON envelope
    transport = None  # a name: chosen by the transport a request arrived over (arrival), nothing else

    def arrival(self, request, headers, max_json_bytes: int) -> Optional[Arrival]:
        """Transport formats: the request as this transport delivered it, or None where it came
        otherwise. `headers` is the request's handlers.torchserve.headers.RequestHeaders; a body
        parsed to tell the transport comes back in the Arrival (never past max_json_bytes), and
        `request` is never changed."""
        return None

    def matches_bytes(self, payload) -> bool:
        """Binary formats: whether bytes without a Content-Type are this format."""
        return False

    def matches_json(self, body: dict) -> bool:
        """JSON formats: whether a parsed JSON object is this envelope."""
        return False

    def for_request(self, body) -> "WireFormat":
        """The format that decodes and answers this one request: itself, or a fresh instance
        holding per-request state (KServe v2: binary framing, requested outputs)."""
        return self

    def decode(self, body, spec) -> tuple:
        """Body (bytes for binary formats, the parsed object for JSON ones) -> ({input name:
        CPU tensor}, request id or None). The admission step checks the tensors against spec."""
        raise NotImplementedError

    def encode(self, outputs: dict, request_id: Optional[str], model_name: str, model_version: str = "") -> Encoded:
        """{output name: CPU tensor} -> the reply: its body (str or bytes-like), media type and
        any headers it needs (KServe v2 binary)."""
        raise NotImplementedError

    def error(self, err, request_id: Optional[str], model_name: str, model_version: str = "") -> Encoded:
        """The answer to a request that failed with `err` (a ServingError): its JSON error
        object, unless the format's transport needs another shape (asked of transport formats
        only: any other request's errors are answered with the JSON error object)."""
        import json  # an error object holds text and integers only: the standard writer

        return Encoded(json.dumps(err.to_dict()), JSON_MEDIA, {})


def dump_json(body) -> str:
    """Every JSON response goes through strict_json.dumps (no bare NaN/Infinity tokens)."""
    from handlers.wire.strict_json import dumps

    return dumps(body)
