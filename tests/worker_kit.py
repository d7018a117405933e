"""An artifact spec and a started worker built by hand for in-process tests of the request pipeline: what
handlers/startup.py would build, around a runner the test supplies."""
from __future__ import annotations

import torch

from handlers import admission, wire
from handlers.admission import Limits
from handlers.artifact.metadata import ArtifactSpec, TensorSpec
from handlers.config import parse_config
from handlers.torchserve.stage_timings import StageTimes
from handlers.torchserve.headers import RequestHeaders
from handlers.loaded import Loaded
from handlers.ts_entry import CompiledModelHandler
from handlers.worker import Worker


def make_spec(batch_min=1, batch_max=8):
    return ArtifactSpec(backend="export", artifact="model.pt2", sha256="", device="cpu",
                        inputs=(TensorSpec("x", "float32", (None, 4)),),
                        outputs=(TensorSpec("y", "float32", (None, 4)),), output_structure="dict",
                        batch_min=batch_min, batch_max=batch_max, torch_version=torch.__version__)


def admit(request: dict, spec, limits: Limits, content_type=None, accept=None, v2_header_length=None):
    """Admission of one REST request carrying these headers, read as the pipeline reads it
    (wire.read, then admission.admit): the admitted wire.Request, or its typed error raised."""
    headers = RequestHeaders(content_type, accept, v2_header_length)
    return admission.admit(wire.read(request, headers, limits), spec, limits)


def make_worker(spec, runner, limits=None, config=None, name: str = "model", version: str = "") -> Worker:
    """A worker that has started: `runner` loaded, its health ready."""
    config = config or parse_config({})

    def metric(name, ms):
        pass

    worker = Worker(name, version)
    worker.loaded = Loaded(config=config, spec=spec, limits=limits or Limits.of(config, spec), model=None,
                           runner=runner, device=torch.device("cpu"), stages=StageTimes(metric, config.stage_metrics_s))
    worker.health.ready()
    return worker


def serving_handler(worker: Worker) -> CompiledModelHandler:
    """The TorchServe entry class as it stands after a successful initialize."""
    h = CompiledModelHandler()
    h.worker = worker
    h.initialized = True
    return h
