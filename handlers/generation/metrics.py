"""Generation metrics for Prometheus: tokens generated (a counter), time to first token and each
sequence's mean inter-token time (histograms, one observation per sequence), and the running and
waiting sequences and the slots in use (gauges), for both decoder forms (handlers/generating.py,
handlers/continuous.py). It imports nothing of TorchServe: `emit(name, kind, value)` is injected
(handlers/torchserve/stage_timings.generation_sink puts it on TorchServe's `context.metrics`).

Why nothing is emitted per token: TorchServe 0.12's Python worker emits a metric as a line on its
stdout (ts/metrics/caching_metric.py, `emit_metrics`: a `logger.info` with the hostname looked up
each time), which the frontend's reader thread parses; one emission took 18-27 us of the worker's
CPU (CI CPU, `add_metric` to a pipe), as much as a slot-form turn's host work for a few rows. So
the loop's thread only adds to plain numbers and appends to deques (`Timing`, `tokens`,
`state`), and a thread of this module (`start`) emits what changed at most once per
`interval_s`: the counter's increase since its last emission, each pending histogram
observation, each gauge whose value changed. The loop never waits for it: it writes only
numbers, tuples and deque appends, each one step under CPython's interpreter lock, read by the
flusher without a lock (one writer per value: the loop's thread; one reader: the flusher).

The histograms are in seconds: TorchServe 0.12 registers an auto-detected histogram with the
Prometheus client's default buckets (io.prometheus.client.Histogram: 0.005 to 10, in the
frontend's jar), which fit seconds, not milliseconds.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

TOKENS = "generation_tokens_total"  # a counter's name ends in _total (Prometheus's naming rule)
TIME_TO_FIRST_TOKEN = "generation_time_to_first_token_seconds"
INTER_TOKEN = "generation_inter_token_seconds"
RUNNING = "generation_running_sequences"
WAITING = "generation_waiting_sequences"
SLOTS_IN_USE = "generation_slots_in_use"
GAUGES = (RUNNING, WAITING, SLOTS_IN_USE)


class Timing:
    """One sequence's clock: when its request reached the worker, its first and last token, and
    how many it has generated. Written by the loop's thread alone."""

    __slots__ = ("start", "first", "last", "n")

    def __init__(self, start: float):
        self.start, self.first, self.last, self.n = start, None, None, 0


class GenerationMetrics:
    """A worker's generation metrics: recorded by the thread that runs the loop, emitted by
    `flush` (the thread `start` runs, or a test)."""

    def __init__(self, emit: Callable[[str, str, float], None], interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._emit, self.interval_s, self.clock = emit, interval_s, clock
        self._tokens = 0  # every token generated since the worker started
        self._emitted_tokens = 0
        self._ttft: collections.deque = collections.deque()
        self._gaps: collections.deque = collections.deque()
        self._state: tuple = (None, None, None)  # running, waiting, slots in use; None: not known here
        self._emitted_state: tuple = (None, None, None)
        self._thread: Optional[threading.Thread] = None
        # where the batch runs in another process (handlers/engine/sequences.RemoteBatch.gauges):
        # its (running, waiting, slots) asked at each flush, None where it did not answer
        self.poll: Optional[Callable[[], Optional[tuple]]] = None

    def begin(self, at: Optional[float] = None) -> Timing:
        """A sequence's clock, started `at` (this clock's time its request reached the worker) or now."""
        return Timing(self.clock() if at is None else at)

    def token(self, t: Timing) -> None:
        """One token of the sequence `t` is generated (read on the host) now."""
        now = self.clock()
        if t.first is None:
            t.first = now
            self._ttft.append(now - t.start)
        t.last, t.n = now, t.n + 1
        self._tokens += 1

    def end(self, t: Timing) -> None:
        """The sequence `t` has ended: its mean gap between tokens is observed (two tokens at least)."""
        if t.n >= 2:
            self._gaps.append((t.last - t.first) / (t.n - 1))

    def state(self, running: Optional[int], waiting: Optional[int], slots: Optional[int]) -> None:
        """The gauges' values now (None: a value this form does not know)."""
        self._state = (running, waiting, slots)

    def flush(self) -> int:
        """Emits what changed since the last flush; the number of metrics emitted."""
        polled = self.poll() if self.poll is not None else None
        if polled is not None:
            self.state(*polled)
        out = []
        tokens = self._tokens
        if tokens != self._emitted_tokens:
            out.append((TOKENS, "counter", tokens - self._emitted_tokens))
            self._emitted_tokens = tokens
        for name, queue in ((TIME_TO_FIRST_TOKEN, self._ttft), (INTER_TOKEN, self._gaps)):
            while queue:
                out.append((name, "histogram", queue.popleft()))
        state, last = self._state, self._emitted_state
        out += [(name, "gauge", v) for name, v, old in zip(GAUGES, state, last) if v != old]  # None: never emitted
        self._emitted_state = state
        for name, kind, value in out:
            self._emit(name, kind, value)
        return len(out)

    def start(self) -> "GenerationMetrics":
        """Flushes every `interval_s` on a daemon thread of its own (none when interval_s is 0)."""
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="generation-metrics", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                self.flush()
            except Exception:  # noqa: BLE001  (a metric never stops the flusher, nor a request)
                logger.exception("generation metrics not emitted")


class Off:
    """The metrics of a worker that emits none (handler.generation_metrics_s 0, tests): every
    call a no-op."""

    def clock(self) -> float:
        return 0.0

    def begin(self, at=None) -> None:
        return None

    def token(self, t) -> None:
        pass

    def end(self, t) -> None:
        pass

    def state(self, running, waiting, slots) -> None:
        pass


OFF = Off()


def for_worker(emit: Callable[[str, str, float], None], interval_s: float):
    """A started worker's metrics, flushed every `interval_s`; OFF where that is 0 (nothing would
    ever take the observations out)."""
    return GenerationMetrics(emit, interval_s).start() if interval_s > 0 else OFF
