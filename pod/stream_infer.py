"""ModelStreamInfer on the pod's gRPC port, for a decoder (handlers/generating.py): what
tritonclient's `start_stream` / `async_stream_infer` call (Triton serves decoupled models this way).

Each ModelInferRequest on the stream is one generation: its prompt is the input `text_input`
(BYTES, one element) or `input_ids` (INT64 or INT32), its generation parameters the request's
`parameters` map (max_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids, ignore_eos).
It is read with handlers/oip_request.py (what the
ModelInfer path's wire format reads it with) and POSTed as the handler's JSON request to TorchServe's /predictions/NAME
through nginx's gate (its /generate/ location: its bound on large bodies, TorchServe's inference
key, the answer unbuffered; kserve/nginx.conf), named to the worker in X-Pod-Request-Id by a key
of the bridge's making (marked when the call ends early: pod/grpc_bridge.py), whose answer streams
one JSON line per token (HTTP/1.1 chunked); each line becomes a ModelStreamInferResponse carrying
a ModelInferResponse with outputs `text_output` (BYTES [1], the token's text) and `token_ids`
(INT64), in raw_output_contents (field 6). The last response of a request has no new token, and the parameters `finish_reason`,
`prompt_tokens`, `completion_tokens` and `triton_final_response: true` (Triton's flag for a
decoupled model's last response). A request that fails gets a response with its `error_message`
(the handler's reason); the stream stays open for the next request, as Triton's does.

Field numbers (kserve/open-inference-protocol grpc_service.proto, Triton's alike): ModelInferRequest
1 model_name, 2 model_version, 3 id, 4 parameters (map), 5 inputs; InferInputTensor 1 name,
2 datatype, 3 shape, 5 contents; InferTensorContents 2 int_contents, 3 int64_contents,
8 bytes_contents; InferParameter 1 bool, 2 int64, 3 string, 4 double; ModelInferResponse 1, 2, 3
as the request, 4 parameters, 5 outputs; ModelStreamInferResponse 1 error_message, 2 infer_response.
"""
from __future__ import annotations

import asyncio
import json
import struct
from urllib.parse import quote

import numpy as np

from handlers import protowire
from handlers.errors import RequestError
from handlers.generation import abandon
from handlers.oip_request import Input, parse_input, parse_request


class BadRequest(RequestError):
    """The request's own fault, answered in its stream response's error_message."""


def _param(value) -> object:
    for n, wire, v in protowire.fields(value):
        if n == 1:
            return bool(v)
        if n == 2:
            return v - (1 << 64) if v >= 1 << 63 else v
        if n == 3:
            return bytes(v).decode("utf-8")
        if n == 4:
            return struct.unpack("<d", bytes(v))[0]
    return None


def _raw_values(dtype: str, raw: bytes):
    """A raw content's values; a length the datatype cannot hold is the client's fault (BadRequest),
    never a struct.error that would end the stream."""
    if dtype == "BYTES":  # each element: a 4-byte little-endian length, then its bytes
        if len(raw) < 4:
            raise BadRequest(f"raw BYTES content of {len(raw)} bytes: each element is a 4-byte length, then its bytes")
        (n,) = struct.unpack_from("<I", raw, 0)
        if n > len(raw) - 4:
            raise BadRequest(f"raw BYTES element claims {n} bytes; the content holds {len(raw) - 4} after its length")
        return raw[4:4 + n].decode("utf-8")
    fmt = {"INT64": "q", "INT32": "i"}[dtype]
    size = struct.calcsize(fmt)
    if len(raw) % size:
        raise BadRequest(f"raw {dtype} content of {len(raw)} bytes is not a whole number of {size}-byte elements")
    return list(struct.unpack(f"<{len(raw) // size}{fmt}", raw))


def _input_value(inp: Input, raw):
    """The prompt an input holds: text_input's text (BYTES, one element) or input_ids' ids
    (INT64 or INT32), from its raw contents or its typed ones."""
    want = ("BYTES",) if inp.name == "text_input" else ("INT64", "INT32")
    if inp.datatype not in want:
        raise BadRequest(f"{inp.name} is {inp.datatype}; send {' or '.join(want)}")
    if raw is not None:
        return _raw_values(inp.datatype, bytes(raw))
    contents = inp.contents or {}
    if inp.name == "text_input":
        if not contents.get(8):
            raise BadRequest("text_input must be a BYTES tensor of one element")
        return bytes(contents[8][0][1]).decode("utf-8")
    return protowire.repeated_varints(contents.get(3 if inp.datatype == "INT64" else 2, []), np.int64).tolist()


def generation_body(request: bytes) -> tuple:
    """(model name, version, request id, the handler's JSON body) of a ModelInferRequest. Its
    parameters go on as they are (the handler refuses unknown ones, naming them), except the
    client library's own `triton_` flags."""
    parsed = parse_request(request)
    body: dict = {}
    for i, view in enumerate(parsed.inputs):
        inp = parse_input(i, view)
        if inp.name not in ("text_input", "input_ids"):
            raise BadRequest(f"unknown input {inp.name!r}; a language model takes text_input (BYTES) or input_ids (INT64)")
        body[inp.name] = _input_value(inp, parsed.raws[i] if i < len(parsed.raws) else None)
    params = {}
    for entry in parsed.parameters:
        fields = {n: v for n, _, v in protowire.fields(entry)}
        key = bytes(fields.get(1, b"")).decode("utf-8")
        if not key.startswith("triton_"):
            params[key] = _param(fields.get(2, b""))
    if params:
        body["parameters"] = {k: (json.loads(v) if k in ("stop", "stop_token_ids") and isinstance(v, str)
                                  and v.startswith("[") else v) for k, v in params.items()}
    return parsed.model_name, parsed.model_version, parsed.id, body


def _string_param(key: str, value) -> bytes:
    p = protowire.Writer()
    if isinstance(value, bool):
        p.varint(1, int(value))
    elif isinstance(value, int):
        p.varint(2, value)
    else:
        p.string(3, str(value))
    entry = protowire.Writer()
    entry.string(1, key)
    entry.message(2, p.bytes())
    return entry.bytes()


def response(name: str, version: str, rid: str, text: str, ids: list, params: dict | None = None) -> bytes:
    """A ModelStreamInferResponse carrying one token's (or the last) ModelInferResponse."""
    w = protowire.Writer()
    w.string(1, name)
    w.string(2, version)
    w.string(3, rid)
    for key, value in (params or {}).items():
        w.message(4, _string_param(key, value))
    piece = text.encode("utf-8")
    outputs = (("text_output", "BYTES", [1], struct.pack("<I", len(piece)) + piece),
               ("token_ids", "INT64", [len(ids)], struct.pack(f"<{len(ids)}q", *ids)))
    for oname, dtype, shape, _ in outputs:
        t = protowire.Writer()
        t.string(1, oname)
        t.string(2, dtype)
        t.packed_varints(3, shape)
        w.message(5, t.bytes())
    for *_, raw in outputs:  # raw_output_contents, in the outputs' order (an empty text is 4 bytes)
        w.bytes_field(6, raw)
    out = protowire.Writer()
    out.message(2, w.bytes())
    return out.bytes()


def error(message: str) -> bytes:
    return protowire.encode_string(1, message)


async def lines(socket_path: str, path: str, body: bytes, timeout_s: float, key: str = ""):
    """POST `body` to TorchServe through nginx's gate (its unix socket) and yield (status, line,
    header fields) for each JSON line of its answer as it arrives (a chunked answer), or once
    (status, whole body, fields) for an answer with a Content-Length. `key`: the generation's name
    to the worker (handlers/generation/abandon.HEADER; the gate passes it on as it passes the
    public server's)."""
    reader, writer = await asyncio.open_unix_connection(socket_path)
    named = f"{abandon.HEADER}: {key}\r\n" if key else ""
    try:
        writer.write((f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      f"{named}Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body)
        async with asyncio.timeout(timeout_s):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            status = int(head[0].split(" ", 2)[1])
            fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in head[1:] if ln)}
            if "content-length" in fields:
                yield status, await reader.readexactly(int(fields["content-length"])), fields
                return
            pending = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                pending += chunk[:-2]
                *done, pending = pending.split(b"\n")
                for line in done:
                    if line.strip():
                        yield status, line, fields
            if pending.strip():
                yield status, pending, fields
    finally:
        writer.close()


GATE_PREFIX = "/generate/"  # the gate's location for generations (kserve/nginx.conf): unbuffered


def path_of(name: str, version: str) -> str:
    """The gate's path of a generation on TorchServe's /predictions/NAME[/VERSION]."""
    return f"{GATE_PREFIX}{quote(name, safe='')}" + (f"/{quote(version, safe='')}" if version else "")
