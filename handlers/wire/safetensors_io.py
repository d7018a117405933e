"""The safetensors wire format, read and written with torch alone.

The format is an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}} and the raw little-endian bytes. We keep
our own reader so the worker needs no extra package (stock TorchServe + torch) and so every
offset is bounds-checked before a byte is interpreted: the payload comes from the network.
"""
from __future__ import annotations

import ctypes
import json
import math
import struct
import warnings

import torch

from handlers.dtypes import TABLE
from handlers.errors import RequestError

CONTENT_TYPE = "application/x-safetensors"

_TO_TORCH = {d.safetensors: d.torch for d in TABLE}
_FROM_TORCH = {d.torch: d.safetensors for d in TABLE}
_ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in _FROM_TORCH}
MAX_HEADER = 1 << 20
MAX_RANK = 32  # torch allows 64 dimensions; no model input needs more than a few


def looks_like(payload) -> bool:
    if not isinstance(payload, (bytes, bytearray, memoryview)) or len(payload) < 10:
        return False
    (n,) = struct.unpack_from("<Q", payload, 0)
    return 2 <= n <= min(MAX_HEADER, len(payload) - 8) and payload[8:9] == b"{"


def _int(x) -> int:
    """A JSON integer (not a bool, float or string)."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"expected an integer, got {type(x).__name__}")
    return x


# Layouts of headers already validated (decode) and headers already written (encode). Clients
# send the same header with every request and a model answers with the same shapes, so both
# are keyed by what determines them: the header bytes, and (name, dtype, shape) per output.
# Parsing and writing a header's JSON is the largest Python cost of a binary request (~15 and
# ~10 us each on the CI CPU). Bounded: small headers only, a few entries, oldest dropped first.
_CACHE_ENTRIES = 64
_CACHE_HEADER_BYTES = 4096
_layouts: dict = {}  # header bytes -> ([(name, dtype, shape, begin, count)], bytes the data needs)
_headers: dict = {}  # ((name, dtype, shape), ...) -> (padded header bytes, [(offset, nbytes)])


def _remember(cache: dict, key, value) -> None:
    if len(cache) >= _CACHE_ENTRIES:
        del cache[next(iter(cache))]
    cache[key] = value


def _layout(raw: bytes) -> tuple:
    """The validated entries of header `raw` and the data length they need; RequestError when
    the header is not a safetensors header a tensor can be read from."""
    try:
        header = json.loads(raw)
    except RecursionError:  # CPython's scanner guards nesting with the recursion limit
        raise RequestError("safetensors header is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the int-string digit limit
        raise RequestError(f"safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise RequestError("safetensors header must be a JSON object")
    entries, need = [], 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:  # any JSON value may stand anywhere: unhashable dtypes, strings, floats, nan, inf
            dtype = _TO_TORCH[info["dtype"]]
            shape = [_int(d) for d in info["shape"]][:MAX_RANK + 1]
            begin, end = (_int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise RequestError(f"safetensors entry {name!r} is malformed: expected dtype (one of "
                               f"{', '.join(_TO_TORCH)}), shape and data_offsets") from None
        if len(shape) > MAX_RANK:
            raise RequestError(f"safetensors entry {name!r} has more than {MAX_RANK} dimensions")
        if any(d < 0 for d in shape):
            raise RequestError(f"safetensors entry {name!r} has a negative dimension {shape}")
        count = math.prod(shape)
        size = count * _ITEMSIZE[dtype]
        if not 0 <= begin <= end or end - begin != size:
            raise RequestError(f"safetensors entry {name!r}: data_offsets [{begin}, {end}] do not hold "
                               f"{shape} {info['dtype']} ({size} bytes)")
        entries.append((name, dtype, tuple(shape), begin, count))
        need = max(need, end)
    return entries, need


def loads(payload) -> dict:
    buf = memoryview(payload)
    if len(buf) < 8:
        raise RequestError("safetensors payload shorter than its 8-byte header length")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > MAX_HEADER or 8 + n > len(buf):
        raise RequestError(f"safetensors header length {n} exceeds the payload ({len(buf)} bytes)")
    raw = bytes(buf[8:8 + n])
    known = _layouts.get(raw)
    if known is None:
        known = _layout(raw)
        if n <= _CACHE_HEADER_BYTES:
            _remember(_layouts, raw, known)
    entries, need = known
    data = buf[8 + n:]
    if need > len(data):  # checked per payload: the same header may come with a short body
        raise RequestError(f"safetensors data_offsets reach byte {need}, past the {len(data)}-byte body")
    out = {}
    for name, dtype, shape, begin, count in entries:
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        if buf.readonly:
            with warnings.catch_warnings():
                # torch warns that a read-only buffer could be written through the tensor; we
                # only read it (it is copied into staging). TorchServe hands us a bytearray.
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(data, dtype=dtype, count=count, offset=begin)
        else:
            t = torch.frombuffer(data, dtype=dtype, count=count, offset=begin)
        out[name] = t.reshape(shape)
    return out


def _header_for(key: tuple) -> tuple:
    """The padded JSON header and each tensor's (offset, nbytes) for tensors described by `key`."""
    header, spans, offset = {}, [], 0
    for name, dtype, shape in key:
        if dtype not in _FROM_TORCH:
            raise ValueError(f"dtype {dtype} has no safetensors name")
        n = math.prod(shape) * _ITEMSIZE[dtype]
        header[name] = {"dtype": _FROM_TORCH[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        spans.append((offset, n))
        offset += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the format pads the header to 8 bytes
    return h, spans


def dumps(tensors: dict) -> bytearray:
    parts = []
    for t in tensors.values():
        t = t.detach()  # made contiguous below, and kept referenced until its bytes are copied
        if t.device.type != "cpu":
            raise ValueError("safetensors encoding expects CPU tensors")
        parts.append(t)
    key = tuple((name, t.dtype, tuple(t.shape)) for name, t in zip(tensors, parts))
    known = _headers.get(key)
    if known is None:
        known = _header_for(key)
        if len(known[0]) <= _CACHE_HEADER_BYTES:
            _remember(_headers, key, known)
    h, spans = known
    size = spans[-1][0] + spans[-1][1] if spans else 0
    # One buffer of the final size, each tensor copied into it once (a 4K fp32 output is
    # ~100 MB: joining byte strings would copy it three times).
    out = bytearray(8 + len(h) + size)
    struct.pack_into("<Q", out, 0, len(h))
    out[8:8 + len(h)] = h
    base = ctypes.addressof(ctypes.c_char.from_buffer(out)) + 8 + len(h)
    for t, (at, n) in zip(parts, spans):
        if n:
            t = t.contiguous()
            ctypes.memmove(base + at, t.data_ptr(), n)
    return out
