"""What a wire format is: one object that owns both directions, decode and encode.

A format is either binary (chosen by its media type, or recognised from the bytes), a JSON
envelope (chosen by the shape of the parsed JSON object), or bound to a transport (chosen by how
the request arrived, before its body is looked at: `transport`, `arrival`; TorchServe's Open
Inference Protocol gRPC service is one, handlers/wire/oip_grpc.py). A transport's format also
writes the error answers of its requests. Formats are stateless codecs: `parse` reads a body
into a `Parsed`, the one neutral value every format's `decode` and `encode` take (nothing
about a request is kept in a format). What a format answers is an `Encoded`, or a `Failed` for
an error; the registry is wire/registry.py, the choice wire/request.py."""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Optional

JSON_MEDIA = "application/json"
FORM_MEDIA = "application/x-www-form-urlencoded"  # what curl -d sends when not told otherwise


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


class Parsed(NamedTuple):
    """One request's body as its format read it, the same value for every format: what decode
    reads (`message`: the bytes of a binary format, the parsed JSON object, or a protocol's
    parsed message), the id the request gives itself, the outputs it asks for and how, and the
    model it names (where its protocol names one). Any format answers any Parsed: Accept may
    pick another format than the one that read it."""

    message: object
    request_id: Optional[str] = None
    wanted: tuple = ()  # ((output name, binary: True/False/None), ...); (): every output
    all_binary: bool = False  # every output in binary unless wanted says otherwise (v2 binary)
    names: Optional[tuple] = None  # (model_name, model_version) the request names; None: it names none


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

    def reader(self, body) -> "WireFormat":
        """The format that parses and decodes a body this format answers: itself, or for a
        transport whose bodies come in another format's envelope, that format."""
        return self

    def parse(self, body, headers) -> Parsed:
        """Body (bytes for binary formats, the parsed object for JSON ones) -> its Parsed;
        `headers` (handlers.torchserve.headers.RequestHeaders) for a format framed by one
        (KServe v2 binary). Raises the request's RequestError."""
        return Parsed(body)

    def decode(self, parsed: Parsed, spec) -> dict:
        """Parsed -> {input name: CPU tensor}. The admission step checks them against spec."""
        raise NotImplementedError

    def encode(self, outputs: dict, parsed: Parsed, model_name: str, model_version: str = "") -> Encoded:
        """{output name: CPU tensor} -> the reply to `parsed` (its id, the outputs it asks
        for): its body (str or bytes-like), media type and any headers (KServe v2 binary)."""
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
