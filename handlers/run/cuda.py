"""CUDA runner: the only code in the package that touches CUDA streams.

One dedicated stream per runner (the engine's, on its GPU). Every call: the stream first waits for the current stream
(weights were uploaded there); inputs are copied into pinned host buffers and go non-blocking
into persistent device input buffers (optionally in pieces, each upload overlapping the host
copy of the next); the model runs with our stream current; outputs are copied into pinned host
buffers non-blocking; the host waits on an event recorded on our stream before anything reads
them, also after a failure. Nothing of a request is queued on the default stream.

With CUDA graphs (run/graphs.py, on by default where they verify), a call whose rows fit a
captured bucket is uploaded into that bucket's own device inputs and replayed instead.

Device input buffers: one per input, sized for the largest batch so far, and one set of views
per batch size (`_device_inputs`), so a batch size always finds its inputs at the same
addresses; per-batch-size graph capture would replay against exactly these views.
"""
from __future__ import annotations

import logging
import time

import torch

from handlers.errors import LoadError
from handlers import timeline
from handlers.faults import is_sticky
from handlers.run import graphs
from handlers.run.base import Runner
from handlers.run.stream import worker_stream
from handlers.staging import StagingBuffers, concat_into

logger = logging.getLogger(__name__)


def upload(host: StagingBuffers, name: str, parts, dev: torch.Tensor, piece_bytes: int) -> None:
    """Stage request row-blocks `parts` in pinned memory and copy them into `dev` (its rows
    beyond theirs are zeroed) piece by piece: while piece k travels to the GPU (non-blocking, on
    the current stream), the host copies piece k+1. The request bytes TorchServe hands us are
    pageable, so this host copy cannot be skipped; pipelining hides the upload behind it where
    memory bandwidth allows (on the H100 VM it did not: docs/results), so piece_bytes defaults
    to 0, one piece. Pinned regions are rewritten only after the runner has waited for its
    stream (an event synchronize after every call)."""
    run_rows = dev.shape[0]
    h = host.view(name, dev.shape, dev.dtype)
    if piece_bytes <= 0 and (len(parts) == 1 or all(p.dtype == h.dtype for p in parts)):
        # the common case, one piece: every request block into pinned memory by one op, then
        # one upload
        n = concat_into(h, parts)
        if n == run_rows:
            dev.copy_(h, non_blocking=True)
        else:
            dev[:n].copy_(h[:n], non_blocking=True)
            dev[n:].zero_()
        return
    row_bytes = max(1, h[:1].numel() * h.element_size())
    step = max(1, piece_bytes // row_bytes) if piece_bytes > 0 else max(1, run_rows)
    at = sent = 0
    for part in parts:
        n = part.shape[0]
        a = 0
        while a < n:
            # Fill up to the next piece boundary, then send everything not yet sent.
            b = min(n, a + step - (at - sent))
            h[at:at + b - a].copy_(part[a:b])
            at += b - a
            a = b
            if at - sent >= step:
                dev[sent:at].copy_(h[sent:at], non_blocking=True)
                sent = at
    if at > sent:
        dev[sent:at].copy_(h[sent:at], non_blocking=True)
    if run_rows > at:
        dev[at:].zero_()


def cuda_wait(configured: str) -> str:
    """How the engine waits for its GPU (handler.cuda_sync): spin, block or hybrid as configured;
    `auto` spins, since the engine is the one process running the model on its GPU (the workers
    hold none). Measured where processes shared a GPU (the per-worker path, retired: one H100, 6
    workers, 64 clients; revision ca0af4a's files, in git history at 1673c9e): hybrid served
    ResNet-50 6302 req/s against block's 4953; alone on a GPU at batch 1 spin's p50 was 0.08 ms
    under block's (_b1_h100)."""
    return configured if configured in ("spin", "block", "hybrid") else "spin"


class CudaRunner(Runner):
    def __init__(self, model, spec, device: torch.device, config):
        """`config`: the engine's HandlerConfig (stream_priority, staging_piece_mb, cuda_sync
        resolved to spin, block or hybrid, cuda_spin_us)."""
        super().__init__(model, spec)
        self.device = device
        self.piece_bytes = int(config.staging_piece_mb * (1 << 20))
        self.host_inputs = StagingBuffers(pinned=True)
        self.host_outputs = StagingBuffers(pinned=True)
        self.device_buffers = StagingBuffers(device=device)
        self._views = {}  # (run_rows, row shapes) -> [device input view per input]
        self._views_grows = -1
        self.stream = worker_stream(device, config.stream_priority)
        # The stream the weights were uploaded on: the loading thread's current stream at load
        # (an engine's loop later makes its own stream current on that thread: waited for once
        # before, handlers/engine/device.py for_runner).
        self.producer = torch.cuda.current_stream(device)
        self.sync = config.cuda_sync
        self.spin_s = config.cuda_spin_us / 1e6
        # How the host waits (handler.cuda_sync). With the default schedule the CUDA runtime
        # busy-polls a core while a process waits for the GPU (it spins while the process has
        # fewer contexts than the host has cores). blocking=True creates the event with
        # cudaEventBlockingSync: synchronize() sleeps until the GPU reaches it, leaving the core
        # to the frontend and sibling workers; waking a sleeping thread costs latency. `hybrid`
        # polls the event (cudaEventQuery, which never blocks) for up to spin_us, then sleeps:
        # a short GPU call is caught while spinning, a long one does not hold a core. The only
        # host wait of a call is this event.
        self.done = torch.cuda.Event(blocking=self.sync in ("block", "hybrid"))
        self.graphs = None  # graphs.GraphSet once prepare() captured some

    def prepare(self, config, kind) -> str:
        """CUDA graphs per batch bucket as `config.cuda_graphs` says (after warm-up, before the
        engine answers its first worker); returns the note for the load line. `on`: every shape
        captured or the load fails; `auto`: the shapes whose graph replays equal."""
        mode = config.cuda_graphs if config else "off"
        if mode == "off":
            return "CUDA graphs off"
        reason = graphs.why_not_capturable(kind, self.spec, self.pad)
        if reason is None:
            args = (graphs.Target(self.model, self.spec, self.device, self.stream),
                    graphs.graph_buckets(self.spec.batch_min, self.spec.batch_max,
                                         config.cuda_graph_batch_sizes, config.cuda_graph_max_batch),
                    int(config.cuda_graph_memory_mb * 2**20))
            lengths = graphs.length_buckets(self.spec, self.pad)
            try:
                with torch.inference_mode():
                    self.graphs = graphs.build(*args, verify=True, lengths=lengths)
                if mode == "on" and self.graphs.failed:  # on: every shape captured, or the load fails
                    raise RuntimeError(self.graphs.describe())
                return self.graphs.describe()
            except Exception as e:  # capture refused (host sync, CPU op...) or outputs differ
                reason = self._failed(e)
            # after the except block: its traceback no longer holds the captured graphs
            torch.cuda.empty_cache()
        if mode == "on":
            raise LoadError(f"handler.cuda_graphs is on but this model cannot use them: {reason}. "
                            "Fix: set cuda_graphs to auto (falls back) or off.")
        logger.warning("running without CUDA graphs: %s", reason)
        return f"no CUDA graphs ({reason})"

    def _failed(self, e: Exception) -> str:
        """After a capture or check that failed for every shape: no graph is replayed again;
        re-raises a sticky CUDA error (nothing else can run in this process). The reason."""
        self.graphs = None
        if is_sticky(e):
            raise e
        self.stream.synchronize()
        return f"{type(e).__name__}: {e}"

    def _device_inputs(self, parts: dict, run_rows: int) -> list:
        """Device input tensors for a call of `run_rows` rows, the same ones for every call of
        that shape. Call with our stream current: the buffers are allocated on it and only ever
        used on it."""
        names = self.spec.input_names
        key = (run_rows,) + tuple(tuple(parts[n][0].shape[1:]) for n in names)
        views = self._views.get(key)
        if views is None:
            views = [self.device_buffers.view(n, (run_rows,) + tuple(parts[n][0].shape[1:]), parts[n][0].dtype)
                     for n in names]
            if self._views_grows != self.device_buffers.grows:  # a buffer grew: older views are stale
                self._views, self._views_grows = {}, self.device_buffers.grows
            self._views[key] = views
        return views

    def _copy_out(self, out: dict) -> dict:
        host = {}
        for name, t in out.items():
            buf = self.host_outputs.view(name, t.shape, t.dtype)
            buf.copy_(t, non_blocking=True)
            host[name] = buf
        return host

    def call(self, parts: dict, run_rows: int) -> dict:
        bucket = self.graphs.for_call(run_rows, parts, self.spec.input_names) if self.graphs else None
        self.stream.wait_stream(self.producer)
        try:
            with torch.cuda.stream(self.stream):
                dev = bucket.inputs if bucket else self._device_inputs(parts, run_rows)
                for name, d in zip(self.spec.input_names, dev):
                    upload(self.host_inputs, name, parts[name], d, self.piece_bytes)
                if bucket:  # padding rows were zeroed by upload; only ours are copied out
                    bucket.graph.replay()
                    host = self._copy_out({k: v[:run_rows] for k, v in bucket.outputs.items()})
                else:
                    host = self._copy_out(self.model(*dev))
        finally:
            # Also after a failure: pinned input pieces may still be in flight, and the next
            # request rewrites them.
            if timeline.ON:
                timeline.mark("launched")
            self.done.record(self.stream)
            self._wait()
            if timeline.ON:
                timeline.mark("synced")
        # Model outputs were allocated on our stream and die here; the caching allocator reuses
        # their blocks only on that same stream, in order.
        return host

    def _wait(self) -> None:
        if self.sync == "hybrid":
            query, clock = self.done.query, time.perf_counter
            deadline = clock() + self.spin_s
            while not query():
                if clock() > deadline:
                    break
            else:
                return
        self.done.synchronize()

    def bucket_sizes(self) -> list:
        return list(self.graphs.sizes) if self.graphs else []

    def call_cost_ms(self, rows: int, sizes: dict):
        """A graph's replay time (timed at capture) plus the call's fixed host cost; None
        without a graph for that shape."""
        return self.graphs.table.call_cost_ms(rows, sizes) if self.graphs else None

    def describe_sync(self) -> str:
        how = {"block": "sleeping (blocking sync)", "spin": "spinning",
               "hybrid": f"spinning up to {self.spin_s * 1e6:.0f} us, then sleeping (blocking sync)"}
        return f"; waits for the GPU by {how[self.sync]}"

