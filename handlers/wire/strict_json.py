"""Strict, bounded JSON: the one place request JSON is parsed and response JSON is written.

In: bytes or text -> Python objects, every failure a RequestError (400) naming what was wrong.
Bounds, and the facts they rely on:
  - size: admission refuses a JSON body over handler.max_json_mb before this runs (413);
  - nesting depth: CPython's json scanner enters the interpreter's recursion guard once per
    nesting level, so a deeper document raises RecursionError (no C stack overflow) -> 400;
  - integer size: CPython refuses int literals over sys.get_int_max_str_digits() digits (4300
    by default) with ValueError -> 400; smaller integers beyond the input dtype are refused by
    wire.tensors (non-numeric / overflow).
Non-finite numbers (NaN, Infinity, -Infinity tokens, or literals like 1e400 that overflow to
inf) are not JSON (RFC 8259 section 6). They are parsed here and refused by wire.tensors with a
400 naming the input, where the input is known.

Out: non-finite floats are written as the strings "NaN", "Infinity" and "-Infinity" (the
proto3 JSON mapping's spelling, which numpy also reads back: np.array(["NaN"], np.float32));
every JSON response is written with allow_nan=False, so a bare NaN token can never leave.
"""
from __future__ import annotations

import json
import math

import torch

from handlers.errors import RequestError

NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def loads(payload, what: str = "JSON body"):
    """payload: bytes, bytearray, memoryview or str."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        try:
            # bytes and bytearray decode in place (no copy of a body of many MB first)
            payload = (payload.tobytes() if isinstance(payload, memoryview) else payload).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{what} is not UTF-8 (byte {e.start}); send UTF-8 JSON or a "
                               "safetensors payload") from None
    try:
        return json.loads(payload)
    except json.JSONDecodeError as e:
        raise RequestError(_decode_error(payload, what, e)) from None
    except RecursionError:
        raise RequestError(f"{what} is nested too deeply; tensors need at most a few levels") from None
    except ValueError as e:  # CPython's int-string limit: "Exceeds the limit (4300 digits) ..."
        raise RequestError(f"{what} holds a number literal that is too long ({e})") from None


def _decode_error(text: str, what: str, e: json.JSONDecodeError) -> str:
    """Three cases a sender fixes differently: nothing sent, something that is not JSON at all,
    and JSON that breaks off or goes wrong part way. Runs only on the error path."""
    body = text.lstrip()
    if not body:
        return (f"empty {what}: send a JSON object such as {{\"inputs\": ...}} (Content-Type "
                "application/json) or a safetensors payload (Content-Type application/x-safetensors)")
    if e.pos == len(text) - len(body):  # the very first non-blank character is not JSON
        return (f"{what} is not JSON at all (it starts with {body[:16]!r}); send JSON (Content-Type "
                "application/json) or a safetensors payload (Content-Type application/x-safetensors)")
    return f"malformed {what}: {e.msg} at line {e.lineno} column {e.colno}"


def _finite_or_name(x):
    return x if math.isfinite(x) else NON_FINITE[repr(x)]


def json_values(t: torch.Tensor):
    """A CPU tensor as nested lists for JSON: non-finite floats as "NaN"/"Infinity"/"-Infinity"."""
    if not t.dtype.is_floating_point or bool(torch.isfinite(t).all()):
        return t.tolist()
    flat = [_finite_or_name(x) for x in t.reshape(-1).tolist()]
    if t.dim() == 0:
        return flat[0]
    for d in reversed(t.shape[1:]):  # regroup; no dimension is 0 (an empty tensor is finite)
        flat = [flat[i:i + d] for i in range(0, len(flat), d)]
    return flat


def dumps(body) -> str:
    """Compact, standards-conforming JSON; raises ValueError on a bare non-finite float (a bug:
    tensors go through json_values first)."""
    return json.dumps(body, separators=(",", ":"), allow_nan=False)
