"""A request's headers as TorchServe 0.12 hands them to the handler, read once per request.

Facts this relies on (ts/context.py, ts/protocol/otf_message_handler.py): `context.
get_all_request_header(idx)` is the dict of request idx's headers. REST requests carry their HTTP
headers as str values in the client's spelling (Host at least); a body part's own headers (its
Content-Type) sit in a dict under the part's name ("body" or "data"); the frontend's Open
Inference Protocol gRPC service sends no str header at all (handlers/wire/oip_grpc.py).

Header names are matched without regard to case. The per-request cost matters at small models
(a worker's own steps are the limit there, docs/results/heavy_mlp_fp16_h100.md): the lower-cased
spelling of each header set seen is kept, so a request whose header names were seen before
costs one tuple and a few dict lookups instead of lower-casing every name.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from handlers.generation.abandon import HEADER as KEY_HEADER
from handlers.generation.formats import ROUTE_HEADER
from handlers.wire.v2_binary import HEADER as V2_HEADER_LENGTH

# url_path: what TorchServe 0.12's frontend puts in the header of that name for
# /predictions/{model}/{version}/{rest} (the path past the version; handlers/generation/openai.py)
_WANTED = ("content-type", "accept", V2_HEADER_LENGTH.lower(), ROUTE_HEADER.lower(), KEY_HEADER.lower(), "url_path")
_SPELLINGS_MAX = 256  # header-name sets remembered (clients send a handful)
_spellings: dict = {}  # tuple of header names -> {lower-cased wanted name: the name as sent}


class RequestHeaders(NamedTuple):
    content_type: Optional[str] = None  # the body part's own, else the request's
    accept: Optional[str] = None
    v2_header_length: Optional[str] = None
    generate_route: Optional[str] = None  # a decoder's route, named by the pod's nginx (generation/formats.py)
    request_key: Optional[str] = None  # the pod's nginx's name for a generation request (generation/abandon.py)
    url_path: Optional[str] = None  # the path past /predictions/NAME/VERSION/ (OpenAI's routes on a decoder)
    # any str header, or none readable: a REST request (the OIP gRPC service sends no str header)
    rest: bool = True


def _spelling(headers: dict) -> dict:
    names = tuple(headers)
    known = _spellings.get(names)
    if known is None:
        known = {k.lower(): k for k in names if isinstance(k, str) and k.lower() in _WANTED}
        if len(_spellings) < _SPELLINGS_MAX:
            _spellings[names] = known
    return known


def read(context, idx: int) -> RequestHeaders:
    try:
        headers = context.get_all_request_header(idx) or {}
    except (AttributeError, IndexError, TypeError):
        return RequestHeaders()
    if not isinstance(headers, dict):  # never from TorchServe 0.12; answered as a REST request
        return RequestHeaders()
    if not headers:
        return RequestHeaders(rest=False)
    spelling = _spelling(headers)
    parts = [p for p in (headers.get("body"), headers.get("data")) if type(p) is dict]
    values = []
    for key in _WANTED:
        value = next((p[key] for p in parts if p.get(key)), None)
        if value is None and key in spelling:
            value = headers[spelling[key]]
            value = value if isinstance(value, str) and value else None
        values.append(value)
    return RequestHeaders(*values, any(isinstance(v, str) for v in headers.values()))

