"""The one owner of a started TorchServe worker. Like a Triton python_backend model it has two
verbs: `start(context)` once (the engine's worker, handlers/engine_worker.py, on a GPU; else
handlers/startup.py's steps on the CPU; then handlers/warmup.py's) and `serve(data, headers)` per
batch (handlers/pipeline.py). It holds the model's name and version, its health and what the
start loaded (handlers/loaded.py); the TorchServe entry (handlers/ts_entry.py) is a thin adapter
over it."""
from __future__ import annotations

import logging
from typing import Callable, Optional

from handlers import continuous, engine_worker, generating, pipeline, startup, warmup
from handlers.health import Health
from handlers.loaded import Loaded
from handlers.torchserve import frontend_frames, guardian, restart
from handlers.generation import metrics
from handlers.torchserve.stage_timings import batch_profiler, generation_sink, metric_sink

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, name: str = "model", version: str = ""):
        self.name, self.version = name, version
        self.health = Health()
        self.loaded: Optional[Loaded] = None
        self.profile = None  # ENABLE_TORCH_PROFILER: a torch.profiler per batch (stage_timings.py)

    @classmethod
    def of(cls, context) -> "Worker":
        """A worker for the model TorchServe's context names (its manifest)."""
        model = context.manifest.get("model", {})
        return cls(model.get("modelName", "model"), str(model.get("modelVersion") or ""))

    def start(self, context) -> None:
        """Loads and warms up; a load failure that would recur on every restart (an incompatible,
        corrupt or misconfigured artifact) is kept as the answer to every request (503 with the
        reason; TorchServe lists the worker READY, the description says ready: false), since
        raising makes TorchServe restart the worker with back-off while requests wait unanswered
        (measured: none answered in 420 s). Raises the others, and where the archive says
        handler.answer_load_failure: false."""
        # from here the start's steps are the handler's own: the process's age so far is its
        # interpreter and imports; "variant" covers the settings, the variant's choice and its
        # integrity check and the thread budget (startup.load)
        steps = startup.StartSteps()
        startup.enter_process()  # TorchServe's settings for this worker, its scratch directory
        startup.warn_retired(context)
        emit, answer_failure = metric_sink(context), True  # a config that failed to parse: answer
        try:
            engine_config = engine_worker.wanted(context)
            if engine_config is not None:  # the model runs in the engine of this worker's GPU
                answer_failure = engine_config.answer_load_failure
                self._load_served(engine_config, context, emit, steps)
            else:
                plan = startup.plan(context)
                answer_failure = plan.config.answer_load_failure
                self._load(plan, context, emit, steps)
        except Exception as e:  # noqa: BLE001  (every cause, named: startup.load_failure)
            err = startup.load_failure(e)
            if not err.recurs or not answer_failure:
                logger.error("load failed (%s); TorchServe restarts the worker: %s", type(e).__name__, err)
                if err is e:
                    raise
                raise err from e
            logger.error("load failed (%s); every request will be answered 503 with the reason: %s",
                         type(e).__name__, err)
            self.loaded = None
            self.health.load_failed(self.name, err.message)
            emit("ModelLoadFailed", 1.0)
        self.profile = batch_profiler(self.name)  # after the warm-up: clients' batches only

    def _load(self, plan: startup.StartPlan, context, emit, steps: startup.StartSteps) -> None:
        """A worker that runs the model itself, on the CPU (handlers/startup.py)."""
        guardian.gathers_batches(plan.config.max_batch_delay_ms)
        self.loaded = startup.load(plan, emit, steps)
        if self.loaded.generation is not None:  # a decoder: no batches, no request-path warm-up
            self.loaded.generation.use(metrics.for_worker(generation_sink(context, self.name),
                                                          plan.config.generation_metrics_s))
            if continuous.serves(self):
                warmup.slots(self.loaded, steps, self.broken)
            else:
                warmup.decoder(self.loaded, steps)
                guardian.ends_streams()  # its streams end with an error event if it dies
            self.health.ready()
            startup.log_decoder(self.loaded, plan.placement, steps, frontend_frames.install(plan.config.buffered_reader))
            startup.emit_times(emit, steps)
            return
        self.health.ready()  # from here the request-path warm-up's requests are served
        reader = frontend_frames.install(plan.config.buffered_reader)
        warmup.model_and_graphs(self.loaded, steps)
        if plan.config.warmup:
            warmup.request_path(self, context)
            steps.done("request-path warm-up")
        startup.log_loaded(self.loaded, plan.placement, steps, reader)
        startup.emit_times(emit, steps)

    def _load_served(self, config, context, emit, steps: startup.StartSteps) -> None:
        """A worker served by the engine (handlers/engine_worker.py): connected, then ready, then
        requests through its whole path to the engine and back."""
        guardian.gathers_batches(config.max_batch_delay_ms)
        self.loaded = engine_worker.load(context, config, emit, steps)
        if self.loaded.generation is not None:  # a decoder: the engine's batch, streamed from here
            self.loaded.generation.use(metrics.for_worker(generation_sink(context, self.name),
                                                          config.generation_metrics_s))
            guardian.ends_streams()  # in the sync form, its streams end with an error event if it dies
            self.health.ready()
            engine_worker.log_loaded(self.loaded, steps, frontend_frames.install(config.buffered_reader))
            startup.emit_times(emit, steps)
            return
        self.health.ready()
        reader = frontend_frames.install(config.buffered_reader)
        if config.warmup:
            warmup.request_path(self, context)
            steps.done("request-path warm-up")
        engine_worker.log_loaded(self.loaded, steps, reader)
        startup.emit_times(emit, steps)

    def serve(self, data: list, headers: list, send: Optional[Callable] = None) -> list:
        """One answer per request of a TorchServe batch (`headers`: each request's
        handlers.torchserve.headers.RequestHeaders), an Encoded or a Failed; a decoder streams
        its tokens through `send(idx, Encoded, ending)` (handlers/generating.py: `ending`, with a
        stream's first chunk, makes its error event) before its last answer."""
        if continuous.serves(self):
            return self.loaded.generation.serve(self, data, headers)
        if self.loaded is not None and self.loaded.generation is not None:
            return generating.serve(self, data, headers, send)
        return pipeline.serve(self, data, headers)

    def broken(self, reason: str) -> None:
        """A sticky device fault: every later request is refused and the process exits once its
        answers are sent, so TorchServe starts a fresh worker (handlers/faults.py)."""
        self.health.broken(reason)
        restart.exit_soon(reason)

    def describe(self) -> dict:
        """`GET /models/NAME?customized=true` shows this (the management API's describe). A worker
        served by the engine adds the engine's state, and is not ready while its engine is gone
        (every request gets EngineDead 503 until the successor answers): the pod's readiness
        (pod/state.py) reads it."""
        info = self.health.describe()
        state = getattr(getattr(self.loaded, "runner", None), "engine_state", None)
        if callable(state):
            info["engine"] = engine = state()
            if info["ready"] and not engine["connected"]:
                info["ready"], info["engine_down"] = False, engine["reason"]
        return info
