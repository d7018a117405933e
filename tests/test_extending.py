"""A new artifact kind or a new wire format is one module plus one registration line: both are
defined and registered here, from this file alone, and served by the real handler class with
TorchServe's own Context."""
import json

import pytest
import torch

from handlers import wire
from handlers.artifact import kinds
from handlers.artifact.kinds import ArtifactKind, LoadedModel
from handlers.artifact.metadata import ArtifactSpec, TensorSpec, sha256_file, write_spec
from handlers.wire import WireFormat


class ScaleKind(ArtifactKind):
    """Toy kind: the artifact is a JSON file {"scale": s}; the model multiplies by s."""

    name = "toy_scale"
    native = False  # plain data: relocatable to any device
    zipped = False
    compile_needs = None

    def load(self, spec, placement, config=None):
        with open(spec.artifact_path) as f:
            scale = json.load(f)["scale"]
        return LoadedModel(lambda x: x * scale, spec, placement.torch_device, self.name)


class CsvFormat(WireFormat):
    """Toy format: one row of comma-separated numbers per line, for a single-input model."""

    name = "csv"
    media_type = "text/csv"
    binary = True  # chosen by its media type

    def decode(self, parsed, spec):
        rows = [[float(v) for v in line.split(",")] for line in bytes(parsed.message).decode().splitlines() if line]
        return {spec.inputs[0].name: torch.tensor(rows)}

    def encode(self, outputs, parsed, model_name, model_version=""):
        (t,) = outputs.values()
        return wire.base.Encoded("\n".join(",".join(f"{v:g}" for v in row) for row in t.tolist()), self.media_type, {})


class PigeonFormat(WireFormat):
    """Toy transport-bound format: requests that arrived by "pigeon" (here, a request dict that
    carries a `pigeon` part instead of a body; a real transport is told apart by what TorchServe
    hands over, as handlers/wire/oip_grpc.py does) hold a JSON list of rows and are answered,
    errors included, as {"ring": ..., "rows"/"error": ...}, whatever their headers say."""

    name = "pigeon"
    transport = "pigeon"

    def arrival(self, request, headers, max_json_bytes):
        if isinstance(request, dict) and "pigeon" in request:
            return wire.Arrival(request["pigeon"], request["pigeon"]["ring"])
        return None

    def parse(self, body, headers):  # body: the request's one part, {"ring", "rows"}
        return wire.Parsed(body, body["ring"])

    def decode(self, parsed, spec):
        return {spec.inputs[0].name: torch.tensor(parsed.message["rows"])}

    def encode(self, outputs, parsed, model_name, model_version=""):
        (t,) = outputs.values()
        return wire.base.Encoded(json.dumps({"ring": parsed.request_id, "rows": t.tolist()}), "application/json", {})

    def error(self, err, request_id, model_name, model_version=""):
        return wire.base.Encoded(json.dumps({"ring": request_id, "error": err.message}), "application/json", {})


@pytest.fixture
def registered():
    kinds.register(ScaleKind())
    wire.register(CsvFormat())
    wire.register(PigeonFormat())
    yield
    del kinds.KINDS["toy_scale"], wire.FORMATS["csv"], wire.TRANSPORTS["pigeon"]


class Metrics:
    def __init__(self):
        self.times = []

    def add_time(self, name, value, idx=None, unit="ms"):
        self.times.append(name)


def toy_artifact(d):
    d.mkdir()
    (d / "scale.json").write_text(json.dumps({"scale": 3.0}))
    write_spec(ArtifactSpec(
        backend="toy_scale", artifact="scale.json", sha256=sha256_file(str(d / "scale.json")), device="cpu",
        inputs=(TensorSpec("x", "float32", (None, 2)),), outputs=(TensorSpec("y", "float32", (None, 2)),),
        output_structure="tensor", batch_min=1, batch_max=4, torch_version=torch.__version__,
        extra={"state": {"mutated": [], "checked": "a scale has no state"}}), str(d))
    return d


def test_toy_kind_and_format_are_served(registered, tmp_path):
    from ts.context import Context, RequestProcessor

    from handlers.ts_entry import CompiledModelHandler

    # the probe child is a fresh Python: it knows only the built-in kinds
    ctx = Context("toy", str(toy_artifact(tmp_path / "toy")), {"model": {"modelName": "toy"}}, 2, None,
                  "0.12.0", model_yaml_config={"handler": {"crash_safe_load": False, "stage_metrics_s": 0}})
    ctx.metrics = Metrics()
    handler = CompiledModelHandler()
    handler.initialize(ctx)
    assert handler.worker.loaded.model.loader == "toy_scale"
    ctx.request_processor = [RequestProcessor({"Content-Type": "text/csv"}),
                             RequestProcessor({"Content-Type": "application/json"})]
    ctx.metrics = Metrics()
    out = handler.handle([{"body": bytearray(b"1,2\n3,4\n")}, {"body": {"inputs": {"x": [[0.5, 1]]}}}], ctx)
    assert out[0] == "3,6\n9,12"
    assert json.loads(out[1]) == {"outputs": {"y": [[1.5, 3.0]]}}
    assert ctx.get_response_content_type(0) == "text/csv"
    # one metric per stage per batch (stage_metrics_s: 0)
    assert ctx.metrics.times == ["HandlerDecodeTime", "HandlerRunTime", "HandlerEncodeTime", "HandlerTime"]

    # the transport-bound format: chosen by how the request arrived, though it says text/csv;
    # a bad one fails alone, answered in its transport's own error shape
    ctx.request_processor = [RequestProcessor({"Content-Type": "text/csv"}) for _ in range(3)]
    out = handler.handle([{"pigeon": {"ring": "a1", "rows": [[1.0, 2.0]]}},
                          {"pigeon": {"ring": "b2", "rows": [[1.0, 2.0, 3.0]]}},
                          {"body": bytearray(b"2,2\n")}], ctx)
    assert json.loads(out[0]) == {"ring": "a1", "rows": [[3.0, 6.0]]}
    bad = json.loads(out[1])
    assert bad["ring"] == "b2" and "x" in bad["error"] and ctx.get_response_status(1)[0] == 400
    assert out[2] == "6,6" and ctx.get_response_content_type(2) == "text/csv"


def test_unknown_kind_is_refused_with_the_known_ones(tmp_path):
    from handlers.artifact.variants import open_variant
    from handlers.errors import LoadError

    d = toy_artifact(tmp_path / "toy")
    with pytest.raises(LoadError, match="unknown backend 'toy_scale'.*aoti"):
        open_variant(str(d))
