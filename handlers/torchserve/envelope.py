"""Refuse to load under a TorchServe request envelope (TS_SERVICE_ENVELOPE / service_envelope).

Facts this relies on (TorchServe 0.12): the frontend sends the envelope's name with the load
message; ts/model_loader.py TsModelLoader.load then wraps the handler's entry point,
`entry_point = envelope_class(entry_point).handle` (a ts.torch_handler.request_envelope.base.
BaseEnvelope), and calls our initialize from that same frame. KServe's runtime sets
TS_SERVICE_ENVELOPE=kserve|kservev2, which only applies with enable_envvars_config=true (as
KServe's docs advise). The envelopes parse only the first request of a batch (the batch's
other requests get no answer: "number of batch response mismatched") and rename outputs, while
this handler speaks KServe v1/v2 itself, with batching. So a wrapped handler cannot answer
correctly, and the load fails with the setting and the fix.
"""
from __future__ import annotations

import sys

from handlers.errors import ConfigError

MAX_FRAMES = 8  # initialize is called directly by the loader; a few frames spare


def active_envelope(start_frame=None):
    """The envelope wrapping this handler, by name (or class name); None when there is none."""
    try:
        from ts.torch_handler.request_envelope.base import BaseEnvelope
    except ImportError:  # not inside TorchServe
        return None
    frame = start_frame or sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        local = frame.f_locals
        owner = getattr(local.get("entry_point"), "__self__", None)
        if isinstance(owner, BaseEnvelope):
            name = local.get("envelope")
            return name if isinstance(name, str) and name else type(owner).__name__
        frame = frame.f_back
    return None


def refuse_envelope() -> None:
    name = active_envelope(sys._getframe(1))
    if name is not None:
        raise ConfigError(
            f"TorchServe wraps this handler in its request envelope {name!r} (TS_SERVICE_ENVELOPE="
            f"{name} / service_envelope={name} with enable_envvars_config=true, as KServe's docs "
            "advise). The envelope passes on only the first request of a batch and renames outputs; "
            "this handler speaks KServe v1 and v2 itself. Fix: set enable_envvars_config=false in "
            "config.properties (kserve/config.properties ships it so) and do not set "
            "service_envelope")
