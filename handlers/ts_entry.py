"""TorchServe entry point: a thin adapter over the started worker's one owner
(handlers/worker.py). initialize starts it; handle hands it each batch through the TorchServe
exchange (handlers/torchserve/exchange.py: headers read from the context, answers set back).

TorchServe needs only a class with initialize(context) and handle(data, context)
(ts/model_loader.py takes the one class defined in this file). It does not inherit
ts.torch_handler.base_handler.BaseHandler: importing that module switches fp32 matmuls to TF32
on Ampere and newer GPUs, and of its behaviour only the describe check is used here.

The archive copies this file to the model directory's top level (TorchServe imports the
handler by file name) next to the `handlers` package, hence the absolute imports.
"""
from __future__ import annotations

import json
from typing import Optional

from handlers import continuous, timeline
from handlers.torchserve import exchange, frontend_frames
from handlers.worker import Worker


class CompiledModelHandler:
    def __init__(self):
        self.initialized = False
        self.worker: Optional[Worker] = None
        self.async_worker = frontend_frames.async_worker()

    def initialize(self, context):
        self.worker = Worker.of(context)
        self.worker.start(context)  # loaded, or answering every request with the load error
        self.initialized = True

    def handle(self, data, context):
        """Exactly one reply per request; the describe call of the management API gets the
        worker's health. TorchServe's async worker (model-config asyncCommunication: a slot
        decoder's continuous batching, handlers/continuous.py) awaits what this returns."""
        if self.async_worker:
            return self._handle_async(data, context)
        if _is_describe(context):
            return [self.describe_handle()]
        if continuous.serves(self.worker):
            return continuous.handle_sync(self.worker, data, context)
        if not timeline.ON:
            return exchange.handle(self.worker, data, context)
        timeline.mark("handle")
        replies = exchange.handle(self.worker, data, context)
        timeline.mark("replied")
        return replies

    async def _handle_async(self, data, context):
        if _is_describe(context):
            return [self.describe_handle()]
        return await continuous.handle_async(self.worker, data, context)

    def describe_handle(self):
        """`GET /models/NAME?customized=true` (management API) shows this as customizedMetadata."""
        return json.dumps(self.worker.describe())


def _is_describe(context) -> bool:
    """The management API's `GET /models/NAME?customized=true` arrives as one request whose
    header `describe` is "True" (as TorchServe's BaseHandler._is_describe reads it)."""
    try:
        return context.get_request_header(0, "describe") == "True"
    except (AttributeError, IndexError, KeyError, TypeError):
        return False
