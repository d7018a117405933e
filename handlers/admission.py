"""Admission: one request, as its wire format read it (handlers/wire: `wire.read`), decoded and
checked into CPU tensors, or the typed error that answers it.

Steps, once per request, after wire.read (payload, body size, format, JSON size and parse): what
reading raised, raised here; decode; the tensors against the artifact's input contract (400);
their values against the value contract (400, handlers/values.py); the row count against the
limits (413).
"""
from __future__ import annotations

from dataclasses import dataclass

from handlers.artifact.metadata import ArtifactSpec, row_bytes
from handlers.config import HandlerConfig
from handlers.errors import PayloadTooLarge
from handlers.values import ValueContract
from handlers.wire.request import Request
from handlers.wire.tensors import check_inputs


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int  # any body handed over as bytes (handler.max_body_mb)
    max_rows: int  # rows in one request (handler.max_rows_per_request)
    batch_max: int  # the artifact's rows per call
    split_oversized: bool  # rows beyond batch_max: split into several calls, else refuse
    max_json_bytes: int = 8 << 20  # JSON bodies, checked before parsing (handler.max_json_mb)
    values: ValueContract = ValueContract()  # valid input values (handlers/values.py)

    @classmethod
    def of(cls, config: HandlerConfig, spec: ArtifactSpec) -> "Limits":
        return cls(int(config.max_body_mb * (1 << 20)), config.max_rows_per_request, spec.batch_max,
                   config.split_oversized, int(config.max_json_mb * (1 << 20)),
                   ValueContract.of(spec, config))


# What a binary body carries beside its tensors (the v2 binary extension's JSON header, a
# safetensors header, multipart framing): names, dtypes and shapes, a few hundred bytes per input.
BODY_ENVELOPE_BYTES = 64 << 10


def largest_body(limits: Limits, spec: ArtifactSpec, generates: bool = False) -> int:
    """The largest request body this model can accept, bytes: a JSON body up to its limit, or a
    binary one of the most rows a request may carry at every dimension's maximum (an input of
    unknown size: the body limit), never above handler.max_body_mb. A decoder (`generates`) takes
    JSON only. The KServe pod refuses larger bodies at its door (compiled_serving/kserve.py)."""
    if generates:
        return limits.max_json_bytes
    rows = limits.max_rows if limits.split_oversized else min(limits.max_rows, limits.batch_max)
    row = row_bytes(spec.inputs, spec.dims)
    binary = rows * row + BODY_ENVELOPE_BYTES if row else limits.max_body_bytes
    return min(limits.max_body_bytes, max(limits.max_json_bytes, binary))


def check_rows(rows: int, limits: Limits) -> None:
    if rows > limits.max_rows:
        raise PayloadTooLarge(f"request carries {rows} rows; this model accepts at most {limits.max_rows} "
                              "per request (handler.max_rows_per_request)")
    if rows > limits.batch_max and not limits.split_oversized:
        raise PayloadTooLarge(f"request carries {rows} rows but the artifact accepts at most "
                              f"{limits.batch_max} per call; send at most that many, or enable "
                              "handler.split_oversized")


def admit(req: Request, spec: ArtifactSpec, limits: Limits) -> Request:
    """The request with its checked `tensors` and `rows`; raises its typed error."""
    if req.read_error is not None:
        raise req.read_error
    tensors, rows = check_inputs(req.wire.decode(req.parsed, spec), spec)
    limits.values.check(tensors)
    check_rows(rows, limits)
    req.tensors, req.rows = tensors, rows
    return req
