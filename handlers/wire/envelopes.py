"""The request formats chosen by a request's own bytes or JSON shape (not by its transport), in
registration order (wire/__init__.py registers them), and the choice of a JSON body's envelope
by its shape: asked by wire.read and by a transport format whose bodies carry an envelope
(oip_grpc), which is why it lives apart from the registry's module."""
from __future__ import annotations

from handlers.errors import RequestError
from handlers.wire.base import WireFormat

FORMATS: dict = {}  # name -> format, in registration order (JSON envelopes are tried in this order)


def json_format(body) -> WireFormat:
    """The JSON envelope of a parsed body, by its shape (also asked by transport formats whose
    bodies carry one: oip_grpc)."""
    if not isinstance(body, dict):
        raise RequestError("JSON body must be an object: {\"inputs\": {...}} (ours), "
                           "{\"instances\": [...]} (KServe v1) or {\"inputs\": [...]} (KServe v2)")
    for f in FORMATS.values():
        if not f.binary and f.matches_json(body):
            return f
    raise RequestError("JSON body has neither `inputs` nor `instances`; expected "
                       "{\"inputs\": {NAME: nested list}} (ours), {\"instances\": [...]} "
                       "(KServe v1) or {\"inputs\": [{name, shape, datatype, data}]} (KServe v2)")
