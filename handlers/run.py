"""Run staged batches through the model and bring outputs back to host memory.

CUDA path (field report 002): one dedicated stream per worker. The stream first waits for
the current stream (weights were uploaded there), inputs are copied into pinned buffers and
go to the device non-blocking on our stream (optionally in pieces, each upload overlapping the
host copy of the next), the model runs with our stream current, outputs are copied into
pinned host buffers non-blocking, and the host waits on an event recorded on our stream
before anything reads them. Nothing of a request is queued on the default stream.
CPU path: plain calls, no CUDA API touched.
"""
from __future__ import annotations

import torch

from .batch import offsets, plan_chunks
from .stage import StagingBuffers


def rows_of(requests: list, names, start: int, rows: int) -> dict:
    """{input name: [row blocks]} covering rows [start, start + rows) of the requests laid end
    to end, as views: no concatenation copy before staging."""
    parts = {n: [] for n in names}
    at = 0
    for r in requests:
        n_rows = next(iter(r.values())).shape[0]
        a, b = max(start, at), min(start + rows, at + n_rows)
        if a < b:
            for n in names:
                parts[n].append(r[n][a - at:b - at])
        at += n_rows
    return parts


class Executor:
    def __init__(self, model, spec, device: torch.device, stream_priority: int = 0,
                 piece_bytes: int = 0):
        self.model = model
        self.spec = spec
        self.device = device
        self.cuda = device.type == "cuda"
        self.piece_bytes = piece_bytes
        self.inputs = StagingBuffers(pinned=self.cuda)
        self.outputs = StagingBuffers(pinned=self.cuda)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device, priority=stream_priority)
            self.done = torch.cuda.Event()
        else:
            self.stream = None

    def _forward(self, parts: dict, run_rows: int) -> dict:
        """One call of the artifact on the request rows `parts` ({input: [row blocks]}), padded
        to `run_rows`; returns host tensors that stay valid until the next call (they live in
        the reused output buffers)."""
        names = self.spec.input_names
        if not self.cuda:
            staged = [self.inputs.stage(n, parts[n], run_rows) for n in names]
            return {k: v.contiguous() for k, v in self.model(*staged).items()}
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                dev = [self.inputs.upload(n, parts[n], run_rows, self.device, self.piece_bytes)
                       for n in names]
                out = self.model(*dev)
                host = {}
                for name, t in out.items():
                    buf = self.outputs.view(name, t.shape, t.dtype)
                    buf.copy_(t, non_blocking=True)
                    host[name] = buf
        finally:
            # Also after a failure: pinned input pieces may still be in flight, and the next
            # request rewrites them.
            self.done.record(self.stream)
            self.done.synchronize()
        # Device tensors `dev`/`out` were allocated on our stream and die here; the caching
        # allocator reuses their blocks only on that same stream, in order.
        return host

    def run(self, requests: list) -> list:
        """requests: list of {input name: CPU tensor} with equal rows per request.
        Returns, per request, {output name: CPU tensor holding exactly its rows}."""
        counts = [next(iter(r.values())).shape[0] for r in requests]
        chunks = plan_chunks(sum(counts), self.spec.batch_min, self.spec.batch_max)
        names = self.spec.input_names
        if len(chunks) == 1:
            c = chunks[0]
            out = self._forward({n: [r[n] for r in requests] for n in names}, c.run_rows)
            self._check_batched(out, c.run_rows)
            full = {k: v[:c.rows] for k, v in out.items()}
        else:
            full = None
            for c in chunks:
                out = self._forward(rows_of(requests, names, c.start, c.rows), c.run_rows)
                self._check_batched(out, c.run_rows)
                if full is None:  # the reused output buffers are overwritten by the next chunk
                    full = {k: torch.empty((sum(counts),) + tuple(v.shape[1:]), dtype=v.dtype)
                            for k, v in out.items()}
                for k, v in out.items():
                    full[k][c.start:c.start + c.rows].copy_(v[:c.rows])
        return [{k: v[a:b] for k, v in full.items()} for a, b in offsets(counts)]

    def _check_batched(self, out: dict, rows: int) -> None:
        for k, v in out.items():
            if v.dim() == 0 or v.shape[0] != rows:
                raise RuntimeError(f"output {k!r} has shape {list(v.shape)}, not batch-first with "
                                   f"{rows} rows; this handler needs batch-first outputs")

    def staging_bytes(self) -> int:
        return self.inputs.nbytes() + self.outputs.nbytes()
