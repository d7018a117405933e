"""The KServe v2 / Triton binary tensor extension over REST (used by wire.kserve_v2).

Request: header `Inference-Header-Content-Length: N`; the body is N bytes of the v2 JSON
request followed by the raw bytes of every input whose parameters carry `binary_data_size`, in
input order, each exactly that many bytes (row-major; little-endian, the byte order of every
platform torch serves on; BOOL one byte per element, 0 or 1). Inputs without it carry JSON
`data` as usual. tritonclient sends no Content-Type for such bodies, so TorchServe hands them
over as bytes.

Response: the same layout when the request asks for binary outputs: `parameters.
binary_data_output: true` (every output; tritonclient sets it when it names no outputs) or
`outputs[i].parameters.binary_data: true` (that output; false overrides binary_data_output).
Binary outputs carry `parameters.binary_data_size` and no `data`; the response header
`Inference-Header-Content-Length` gives the JSON part's length (tritonclient reads it).

Every size is checked against the declared shape and datatype and against the body before
any byte is interpreted; every failure is the request's own 400.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from handlers.dtypes import BY_TORCH, BY_V2
from handlers.errors import RequestError
from handlers.wire import strict_json
from handlers.wire.base import dump_json

HEADER = "Inference-Header-Content-Length"
MEDIA = "application/octet-stream"


def requested(header: dict) -> tuple:
    """((output name, binary: True/False/None), ...) from `outputs`; () asks for all."""
    outs = header.get("outputs")
    if outs is None:
        return ()
    if not isinstance(outs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                             for o in outs):
        raise RequestError("KServe v2 `outputs` must be a list of {name, parameters?}")
    wanted = []
    for o in outs:
        params = o.get("parameters") if isinstance(o.get("parameters"), dict) else {}
        flag = params.get("binary_data")
        wanted.append((o["name"], flag if isinstance(flag, bool) else None))
    return tuple(wanted)


class Request:
    """One v2 request: the JSON header, the raw bytes after it (None: plain JSON), the outputs
    asked for and the request-level parameters."""

    def __init__(self, header: dict, raw: Optional[memoryview]):
        if not isinstance(header, dict):
            raise RequestError("KServe v2 request header must be a JSON object")
        self.header, self.raw = header, raw
        self.wanted = requested(header)
        params = header.get("parameters")
        self.all_binary = isinstance(params, dict) and params.get("binary_data_output") is True


def split(payload, header_length) -> Request:
    """Body and header value -> Request, bounds-checked."""
    if isinstance(payload, dict):  # TorchServe parsed a JSON body: there is no binary part
        return Request(payload, None)
    if isinstance(payload, str):
        payload = bytes(payload, "utf-8")
    if not isinstance(payload, (bytes, bytearray)):
        raise RequestError(f"{HEADER} needs a binary body")
    text = str(header_length).strip()
    # at most 20 digits: int() refuses over 4300 (sys.int_info), and no body is that long anyway
    if not (text.isascii() and text.isdigit() and len(text) <= 20) or not 0 < int(text) <= len(payload):
        raise RequestError(f"{HEADER} is {header_length!r:.40}; expected the JSON part's length in "
                           f"bytes, 1 to {len(payload)} (the body's length)")
    n = int(text)
    header = strict_json.loads(payload[:n], f"JSON header (the first {n} bytes, {HEADER})")
    if not isinstance(header, dict):
        raise RequestError(f"the first {n} bytes ({HEADER}) are not a JSON object")
    return Request(header, memoryview(payload)[n:])


def is_binary(item) -> bool:
    return isinstance(item, dict) and isinstance(item.get("parameters"), dict) and \
        "binary_data_size" in item["parameters"]


class Offsets:
    """Walks the raw part: each binary input takes its declared bytes, in order."""

    def __init__(self, raw: Optional[memoryview]):
        self.raw, self.pos = raw, 0

    def take(self, i: int, item: dict, shape: list) -> torch.Tensor:
        where = f"input {item['name']!r}"
        if "data" in item:
            raise RequestError(f"{where} has both data and parameters.binary_data_size; send one")
        size = item["parameters"]["binary_data_size"]
        dtype = BY_V2[item["datatype"]].torch  # datatype already checked against the artifact
        need = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if type(size) is not int or size != need:
            raise RequestError(f"{where}: binary_data_size is {size!r}; shape {shape} of "
                               f"{item['datatype']} needs {need} bytes")
        left = 0 if self.raw is None else len(self.raw) - self.pos
        if size > left:
            raise RequestError(f"{where}: needs {size} bytes after the JSON header, the body has "
                               f"{left} left")
        chunk = bytearray(self.raw[self.pos:self.pos + size])
        self.pos += size
        if dtype == torch.bool:
            u = torch.frombuffer(chunk, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
            if bool((u > 1).any()):
                raise RequestError(f"{where}: BOOL bytes must be 0 or 1")
            return u.bool().reshape(shape)
        t = torch.frombuffer(chunk, dtype=dtype) if size else torch.empty(0, dtype=dtype)
        return t.reshape(shape)

    def check_consumed(self) -> None:
        if self.raw is not None and self.pos != len(self.raw):
            raise RequestError(f"body has {len(self.raw) - self.pos} bytes after the last binary "
                               "input; binary_data_size values must add up to the binary part")


def check_wanted(wanted: tuple, spec) -> None:
    names = spec.output_names
    unknown = [n for n, _ in wanted if n not in names]
    if unknown:
        raise RequestError(f"unknown output(s) {', '.join(map(repr, unknown))} requested; the "
                           f"artifact returns {', '.join(names)}")


def select(outputs: dict, wanted: tuple) -> dict:
    return {n: outputs[n] for n, _ in wanted} if wanted else outputs


def binary_names(parsed, outputs: dict) -> set:
    """The outputs a request (its wire.base.Parsed) asks for in binary."""
    flags = dict(parsed.wanted)
    return {n for n in outputs if (flags.get(n) if flags.get(n) is not None else parsed.all_binary)}


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, row-major, without a copy where it is contiguous (bfloat16 through
    an int16 view: numpy has no bfloat16; the bytes are the same). The one writer of raw tensor
    bytes: the v2 binary extension here, raw_output_contents in kserve_v2_grpc."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def binary_entry(name: str, t: torch.Tensor, size: int) -> dict:
    return {"name": name, "shape": list(t.shape), "datatype": BY_TORCH[t.dtype].v2,
            "parameters": {"binary_data_size": size}}


def frame(header: dict, raws: list) -> tuple:
    """(JSON header bytes + raw outputs in order, the header's length)."""
    head = dump_json(header).encode("utf-8")
    return b"".join([head, *raws]), len(head)
