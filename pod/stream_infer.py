"""ModelStreamInfer on the pod's gRPC port, for a decoder (handlers/generating.py): what
tritonclient's `start_stream` / `async_stream_infer` call (Triton serves decoupled models this way).

Each ModelInferRequest on the stream is one generation: its prompt is the input `text_input`
(BYTES, one element) or `input_ids` (INT64 or INT32), its generation parameters the request's
`parameters` map (max_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids, ignore_eos).
It is POSTed as the handler's JSON request to TorchServe's /predictions/NAME, whose answer streams
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

from handlers import protowire

PARAMETERS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos")


class BadRequest(ValueError):
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


def _tensor(buf) -> tuple:
    """(name, datatype, contents fields {number: [values]}) of an InferInputTensor."""
    name = dtype = ""
    contents: dict = {}
    for n, _, v in protowire.fields(buf):
        if n == 1:
            name = bytes(v).decode("utf-8")
        elif n == 2:
            dtype = bytes(v).decode("utf-8")
        elif n == 5:
            for cn, _, cv in protowire.fields(v):
                contents.setdefault(cn, []).append(cv)
    return name, dtype, contents


def _raw_values(dtype: str, raw: bytes):
    if dtype == "BYTES":  # each element: a 4-byte little-endian length, then its bytes
        (n,) = struct.unpack_from("<I", raw, 0)
        return raw[4:4 + n].decode("utf-8")
    fmt = {"INT64": "q", "INT32": "i"}.get(dtype)
    if fmt is None:
        raise BadRequest(f"input_ids is {dtype}; send INT64 or INT32 token ids")
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(fmt)}{fmt}", raw))


def _input_value(name: str, dtype: str, contents: dict):
    if name == "text_input":
        if dtype != "BYTES" or not contents.get(8):
            raise BadRequest("text_input must be a BYTES tensor of one element")
        return bytes(contents[8][0]).decode("utf-8")
    if dtype not in ("INT64", "INT32"):
        raise BadRequest(f"input_ids is {dtype}; send INT64 or INT32 token ids")
    field = 3 if dtype == "INT64" else 2
    values = protowire.repeated_varints(contents.get(field, []), dtype="int64").tolist()
    return values


def generation_body(request: bytes) -> tuple:
    """(model name, version, request id, the handler's JSON body) of a ModelInferRequest."""
    name = version = rid = ""
    params, inputs, raw = {}, [], []
    for n, _, v in protowire.fields(request):
        if n in (1, 2, 3):
            text = bytes(v).decode("utf-8")
            name, version, rid = (text, version, rid) if n == 1 else (name, text, rid) if n == 2 else (name, version, text)
        elif n == 4:
            entry = dict((en, ev) for en, _, ev in protowire.fields(v))
            params[bytes(entry.get(1, b"")).decode("utf-8")] = _param(entry.get(2, b""))
        elif n == 5:
            inputs.append(_tensor(v))
        elif n == 7:
            raw.append(bytes(v))
    body: dict = {}
    for i, (tname, dtype, contents) in enumerate(inputs):
        if tname not in ("text_input", "input_ids"):
            raise BadRequest(f"unknown input {tname!r}; a language model takes text_input (BYTES) or input_ids (INT64)")
        body[tname] = _raw_values(dtype, raw[i]) if i < len(raw) else _input_value(tname, dtype, contents)
    params = {k: v for k, v in params.items() if not k.startswith("triton_")}  # the client library's own flags
    unknown = sorted(set(params) - set(PARAMETERS))
    if unknown:
        raise BadRequest(f"unknown parameter(s) {', '.join(unknown)}; this model takes {', '.join(PARAMETERS)}")
    if params:
        body["parameters"] = {k: (json.loads(v) if k in ("stop", "stop_token_ids") and isinstance(v, str)
                                  and v.startswith("[") else v) for k, v in params.items()}
    return name, version, rid, body


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


async def lines(host: str, port: int, path: str, body: bytes, timeout_s: float):
    """POST `body` to TorchServe and yield (status, line) for each JSON line of its answer as it
    arrives (a chunked answer), or once (status, whole body) for an answer with a Content-Length."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write((f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body)
        async with asyncio.timeout(timeout_s):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            status = int(head[0].split(" ", 2)[1])
            fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in head[1:] if ln)}
            if "content-length" in fields:
                yield status, await reader.readexactly(int(fields["content-length"]))
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
                        yield status, line
            if pending.strip():
                yield status, pending
    finally:
        writer.close()


def path_of(name: str, version: str) -> str:
    return f"/predictions/{quote(name, safe='')}" + (f"/{quote(version, safe='')}" if version else "")
