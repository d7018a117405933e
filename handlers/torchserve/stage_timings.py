"""Per-stage timings of a batch (decode, run, encode, and the whole batch as HandlerTime, the
metric TorchServe's BaseHandler records): TorchServe gauges, torch.profiler labels, and
TorchServe's profiler switch (ENABLE_TORCH_PROFILER).

Each TorchServe metric the handler adds is printed at once as a line on the worker's stdout
(ts/metrics/caching_metric.py, `emit_metrics`), which the frontend's reader thread parses, and,
with TorchServe's stock log configuration, also writes to ts_log.log twice. A gauge shows a
scraper (Prometheus, every 15 s or so) only its latest value, so emitting three per batch, a
thousand batches a second, buys nothing. The handler therefore adds up each stage's time and
emits the mean over the batches since its last emission, at most once per `interval_s`
(handler.stage_metrics_s; 0 emits every batch). A worker that goes idle keeps its last means
until its next batch.

The labels: `torch.profiler.record_function` costs about 10 us per use even when no profiler
records (CI CPU, torch 2.13), three per batch, so the stages are labelled only while one does
(`torch.autograd._profiler_enabled()`, 0.1 us).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from typing import Callable, Optional

import torch
from torch.profiler import record_function

logger = logging.getLogger(__name__)

# stage -> (TorchServe metric name, torch.profiler label)
STAGES = {"decode": ("HandlerDecodeTime", "handler.decode"),
          "run": ("HandlerRunTime", "handler.run"),
          "encode": ("HandlerEncodeTime", "handler.encode"),
          "total": ("HandlerTime", "handler.handle")}
# Where TorchServe's BaseHandler writes a profiled batch's trace, one folder per model
PROFILE_ROOT = "/tmp/pytorch_profiler"


def batch_profiler(model_name: str) -> Optional[Callable]:
    """With ENABLE_TORCH_PROFILER set (any value, as TorchServe's BaseHandler reads it): a
    factory of torch.profiler.profile for one batch, CPU and CUDA activity with shapes, each
    batch's trace written for TensorBoard under PROFILE_ROOT/MODEL; else None."""
    if not os.environ.get("ENABLE_TORCH_PROFILER"):
        return None
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    path = os.path.join(PROFILE_ROOT, model_name)
    return lambda: profile(activities=activities, record_shapes=True, on_trace_ready=tensorboard_trace_handler(path))


def label(stage: str):
    """A context manager that labels `stage` in a torch.profiler trace while one records."""
    if torch.autograd._profiler_enabled():
        return record_function(STAGES[stage][1])
    return contextlib.nullcontext()


class StageTimes:
    """Sums of milliseconds per stage, emitted as means through `emit(metric_name, ms)`."""

    def __init__(self, emit: Callable[[str, float], None], interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._emit, self.interval_s, self._clock = emit, interval_s, clock
        self._last = None  # no emission yet: the first batch emits
        self.reset()

    def reset(self) -> None:
        """Forget what was recorded and not emitted (the warm-up's batches)."""
        self._sums = dict.fromkeys(STAGES, 0.0)
        self._counts = dict.fromkeys(STAGES, 0)

    def record(self, **ms: float) -> None:
        """One batch's milliseconds per stage (a batch refused in admission has no run or encode),
        emitted now if `interval_s` has passed since the last emission."""
        for stage, value in ms.items():
            self._sums[stage] += value
            self._counts[stage] += 1
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            return
        self._last = now
        for stage, (metric, _) in STAGES.items():
            if self._counts[stage]:
                self._emit(metric, self._sums[stage] / self._counts[stage])
        self.reset()


def metric_sink(context) -> Callable[[str, float], None]:
    """`emit(name, ms)` adding a time metric through TorchServe's context (its metrics object is
    the worker's for its whole life); a metric that cannot be recorded never fails a load or a
    request."""
    def emit(name: str, ms: float) -> None:
        try:
            context.metrics.add_time(name, ms, None, "ms")
        except Exception as e:  # noqa: BLE001
            logger.debug("metric %s not recorded: %s", name, e)

    return emit


def generation_sink(context, model_name: str) -> Callable[[str, str, float], None]:
    """`emit(name, kind, value)` for handlers/generation/metrics.py: a counter, gauge or histogram
    (`kind`) through TorchServe's `context.metrics.add_metric`, labelled ModelName and Level
    (the frontend adds Hostname). Both dimensions are passed each time: add_metric adds only the
    defaults that are missing, and a metric emitted once with other dimension names than those it
    was first cached with is refused (ts/metrics/caching_metric.py, `add_or_update`). A metric that
    cannot be recorded never fails a request.

    The metrics are added to a copy of the context's metrics cache of the sink's own, made here
    (at load, before TorchServe's threads serve): `emit` runs on the flusher's thread, and the
    first emission of each name adds it to the cache's dicts, while TorchServe 0.12's async
    worker deep-copies the service's context for every batch (ts/async_service.py predict,
    `copy.deepcopy(self.context)`, on its event loop and outside its try). A name added to the
    context's own cache during such a copy makes it raise RuntimeError ("dictionary changed size
    during iteration"), which call_predict's future, never read, swallows: that request got no
    frame and its client waited forever (one of a 96-request burst, tests/test_continuous.py).
    The line a metric prints is the same from either cache."""
    from ts.metrics.dimension import Dimension
    from ts.metrics.metric_type_enum import MetricTypes

    kinds = {"counter": MetricTypes.COUNTER, "gauge": MetricTypes.GAUGE, "histogram": MetricTypes.HISTOGRAM}
    units = {"counter": "count", "gauge": "count", "histogram": "seconds"}
    metrics = copy.deepcopy(getattr(context, "metrics", None))

    def emit(name: str, kind: str, value: float) -> None:
        try:
            dims = [Dimension("ModelName", model_name), Dimension("Level", "Model")]
            metrics.add_metric(name, value, units[kind], None, dims, kinds[kind])
        except Exception as e:  # noqa: BLE001
            logger.debug("metric %s not recorded: %s", name, e)

    return emit
