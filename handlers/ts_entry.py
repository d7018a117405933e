"""TorchServe entry point: starts the worker once (handlers/startup.py) and hands each batch to
the request pipeline (handlers/pipeline.py), its headers read from the context
(handlers/torchserve/headers.py) and its answers written back (handlers/torchserve/replies.py).

TorchServe needs only a class with initialize(context) and handle(data, context)
(ts/model_loader.py takes the one class defined in this file). It does not inherit
ts.torch_handler.base_handler.BaseHandler: importing that module switches fp32 matmuls to TF32
on Ampere and newer GPUs, and of its behaviour only the describe check is used here.

The archive copies this file to the model directory's top level (TorchServe imports the
handler by file name) next to the `handlers` package, hence the absolute imports.
"""
from __future__ import annotations

import json
import logging
from typing import Optional

from handlers import pipeline, startup
from handlers.torchserve import headers, replies
from handlers.worker import Health, Worker

logger = logging.getLogger(__name__)


class CompiledModelHandler:
    def __init__(self):
        self.initialized = False
        self.context = None
        self.health = Health()
        self.worker: Optional[Worker] = None
        self.model_name, self.model_version = "model", ""
        self.profile = None  # ENABLE_TORCH_PROFILER: a torch.profiler per batch (stage_timings.py)

    def initialize(self, context):
        startup.enter_process()  # TorchServe's settings for this worker, its scratch directory
        self.context = context
        self.model_name = context.manifest.get("model", {}).get("modelName", "model")
        self.model_version = str(context.manifest.get("model", {}).get("modelVersion") or "")
        try:
            startup.start(context, self._metric, self._serving, self.handle)
        except Exception as e:  # noqa: BLE001  (every cause, named: startup.load_failure)
            err = startup.load_failure(e)
            # It would fail the same way on every restart (an incompatible, corrupt or
            # misconfigured artifact): raising makes TorchServe restart the worker with back-off
            # while requests wait unanswered (measured: none answered in 420 s). Come up instead
            # and answer each request 503 with the reason; TorchServe lists the worker READY, the
            # handler's description says ready: false (README, "A model that cannot load").
            if not err.recurs or not startup.answers_load_failure(context):
                logger.error("load failed (%s); TorchServe restarts the worker: %s", type(e).__name__, err)
                if err is e:
                    raise
                raise err from e
            logger.error("load failed (%s); every request will be answered 503 with the reason: %s",
                         type(e).__name__, err)
            self.worker = None
            self.health.load_failed(self.model_name, err.message)
            self._metric("ModelLoadFailed", 1.0)
        self.profile = pipeline.batch_profiler(self.model_name)  # after the warm-up: clients' batches only
        self.initialized = True  # last: loaded, or answering with the load error

    def _serving(self, worker: Worker) -> None:
        self.worker = worker
        self.health.ready()

    def handle(self, data, context):
        """Exactly one reply per request (handlers/pipeline.py); the describe call of the
        management API gets the worker's health."""
        self.context = context
        if _is_describe(context):
            return [self.describe_handle()]
        each = [headers.read(context, i) for i in range(len(data))]  # once per request
        return replies.write(context, pipeline.serve(self.worker, self.health, data, each, self.model_name,
                                                     self.model_version, self.profile))

    def describe_handle(self):
        """`GET /models/NAME?customized=true` (management API) shows this as customizedMetadata."""
        return json.dumps(self.health.describe())

    def _metric(self, name, ms):
        try:
            self.context.metrics.add_time(name, ms, None, "ms")
        except Exception as e:  # metrics must never fail a load or a request
            logger.debug("metric %s not recorded: %s", name, e)

    # What scripts and tests read of a started worker (bench/bench.py times its runner).
    runner = property(lambda self: self.worker.runner)
    model = property(lambda self: self.worker.model)
    device = property(lambda self: self.worker.device)
    spec = property(lambda self: self.worker.spec)
    load_error = property(lambda self: self.health.reason if self.health.state == "load_failed" else None)


def _is_describe(context) -> bool:
    """The management API's `GET /models/NAME?customized=true` arrives as one request whose
    header `describe` is "True" (as TorchServe's BaseHandler._is_describe reads it)."""
    try:
        return context.get_request_header(0, "describe") == "True"
    except (AttributeError, IndexError, KeyError, TypeError):
        return False
