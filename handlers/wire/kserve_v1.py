"""KServe v1: {"instances": [instance, ...]} -> {"predictions": [...]}. Instances are single
samples ({name: value}, or bare values for a single-input model): they gain the batch
dimension by stacking."""
from __future__ import annotations

from handlers.errors import RequestError
from handlers.wire.base import Encoded, WireFormat, WireName, dump_json
from handlers.wire.strict_json import json_values
from handlers.wire.tensors import from_nested, spec_of


def _per_input(instances: list, spec) -> dict:
    names = spec.input_names
    per_name = {n: [] for n in names}
    for i, inst in enumerate(instances):
        if isinstance(inst, dict):
            unknown = set(inst) - set(names)
            if unknown:
                raise RequestError(f"instances[{i}] has unknown input(s) {', '.join(sorted(unknown))}; "
                                   f"the artifact takes {', '.join(names)}")
            for n in names:
                if n not in inst:
                    raise RequestError(f"instances[{i}] lacks input {n!r}; the artifact takes "
                                       f"{', '.join(s.describe() for s in spec.inputs)}")
                per_name[n].append(inst[n])
        elif len(names) == 1:
            per_name[names[0]].append(inst)
        else:
            raise RequestError(f"instances[{i}] must be an object {{name: value}}: the artifact "
                               f"takes several inputs ({', '.join(names)})")
    return per_name


class KServeV1(WireFormat):
    name = WireName.KSERVE_V1

    def matches_json(self, body):
        return "instances" in body

    def decode(self, parsed, spec):
        instances = parsed.message["instances"]
        if not isinstance(instances, list) or not instances:
            raise RequestError("KServe v1 `instances` must be a non-empty list")
        per_name = _per_input(instances, spec)
        return {n: from_nested(spec_of(spec, n), vals, f"input {n!r}") for n, vals in per_name.items()}

    def encode(self, outputs, parsed, model_name, model_version=""):
        names = list(outputs)
        if len(names) == 1:
            preds = json_values(outputs[names[0]])
        else:
            lists = {n: json_values(outputs[n]) for n in names}
            preds = [{n: lists[n][i] for n in names} for i in range(len(lists[names[0]]))]
        return Encoded(dump_json({"predictions": preds}), self.media_type, {})


FORMAT = KServeV1()
