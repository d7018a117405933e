"""The registry of wire formats: those chosen by a body's bytes or JSON shape (FORMATS), those
bound to a transport (TRANSPORTS), and the writer of plain REST errors (ERRORS). Filled by
wire/__init__.py (BUILT_IN) and `register`; the choices made from it are wire/request.py's. It
imports no format, so a format may import what reads requests without a cycle."""
from __future__ import annotations

from handlers.wire.base import WireFormat

FORMATS: dict = {}  # name -> format chosen by its bytes or JSON shape, in registration order
TRANSPORTS: dict = {}  # transport -> the format bound to it, asked first, in registration order
ERRORS = WireFormat()  # answers the errors of a request no transport format owns: the JSON error object


def register(fmt: WireFormat) -> WireFormat:
    if fmt.transport:
        TRANSPORTS[fmt.transport] = fmt
    else:
        FORMATS[fmt.name] = fmt
    return fmt
