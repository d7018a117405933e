"""Binary safetensors bodies (application/x-safetensors), read and written by
handlers.wire.safetensors_io straight from and into tensor memory."""
from __future__ import annotations

from handlers.wire import safetensors_io
from handlers.wire.base import Encoded, WireFormat, WireName


class Safetensors(WireFormat):
    name = WireName.SAFETENSORS
    media_type = safetensors_io.CONTENT_TYPE
    binary = True

    def matches_bytes(self, payload):
        return safetensors_io.looks_like(payload)

    def decode(self, parsed, spec):
        return safetensors_io.loads(parsed.message)

    def encode(self, outputs, parsed, model_name, model_version=""):
        return Encoded(safetensors_io.dumps(outputs), self.media_type, {})


FORMAT = Safetensors()
