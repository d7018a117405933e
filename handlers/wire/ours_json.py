"""Our JSON: {"inputs": {NAME: nested list}} -> {"outputs": {NAME: nested list}}."""
from __future__ import annotations

from handlers.wire.base import Encoded, WireFormat, WireName, dump_json
from handlers.wire.strict_json import json_values
from handlers.wire.tensors import from_nested, spec_of


class OursJson(WireFormat):
    name = WireName.OURS_JSON

    def matches_json(self, body):
        return isinstance(body.get("inputs"), dict)

    def decode(self, parsed, spec):
        return {name: from_nested(spec_of(spec, name), value, f"input {name!r}")
                for name, value in parsed.message["inputs"].items()}

    def encode(self, outputs, parsed, model_name, model_version=""):
        return Encoded(dump_json({"outputs": {n: json_values(t) for n, t in outputs.items()}}), self.media_type, {})


FORMAT = OursJson()
