"""Run staged batches through the model and bring outputs back to host memory.

CUDA path (field report 002): one dedicated stream per worker. The stream first waits for
the current stream (weights were uploaded there), inputs go from pinned buffers to the device
non-blocking on our stream, the model runs with our stream current, outputs are copied into
pinned host buffers non-blocking, and the host waits on an event recorded on our stream
before anything reads them. Nothing of a request is queued on the default stream.
CPU path: plain calls, no CUDA API touched.
"""
from __future__ import annotations

import torch

from .batch import offsets, plan_chunks
from .stage import StagingBuffers


class Executor:
    def __init__(self, model, spec, device: torch.device, stream_priority: int = 0):
        self.model = model
        self.spec = spec
        self.device = device
        self.cuda = device.type == "cuda"
        self.inputs = StagingBuffers(pinned=self.cuda)
        self.outputs = StagingBuffers(pinned=self.cuda)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device, priority=stream_priority)
            self.done = torch.cuda.Event()
        else:
            self.stream = None

    def _forward(self, staged: list) -> dict:
        """One call of the artifact on staged host tensors; returns host tensors that stay valid
        until the next call (they live in the reused output buffers)."""
        if not self.cuda:
            return {k: v.contiguous() for k, v in self.model(*staged).items()}
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dev = [t.to(self.device, non_blocking=True) for t in staged]
            out = self.model(*dev)
            host = {}
            for name, t in out.items():
                buf = self.outputs.view(name, t.shape, t.dtype)
                buf.copy_(t, non_blocking=True)
                host[name] = buf
            self.done.record(self.stream)
        # Device tensors `dev`/`out` were allocated on our stream and die here; the caching
        # allocator reuses their blocks only on that same stream, in order.
        self.done.synchronize()
        return host

    def run(self, requests: list) -> list:
        """requests: list of {input name: CPU tensor} with equal rows per request.
        Returns, per request, {output name: CPU tensor holding exactly its rows}."""
        counts = [next(iter(r.values())).shape[0] for r in requests]
        total = sum(counts)
        chunks = plan_chunks(total, self.spec.batch_min, self.spec.batch_max)
        names = self.spec.input_names
        joined = {n: torch.cat([r[n] for r in requests]) if len(requests) > 1 else requests[0][n]
                  for n in names} if len(chunks) > 1 else None
        results = []
        for c in chunks:
            if joined is None:
                staged = [self.inputs.stage(n, [r[n] for r in requests], c.run_rows) for n in names]
            else:
                staged = [self.inputs.stage(n, [joined[n][c.start:c.start + c.rows]], c.run_rows)
                          for n in names]
            out = self._forward(staged)
            self._check_batched(out, c.run_rows)
            # With several chunks the reused output buffers are overwritten by the next call.
            results.append({k: (v[:c.rows].clone() if len(chunks) > 1 else v[:c.rows])
                            for k, v in out.items()})
        full = results[0] if len(results) == 1 else {
            k: torch.cat([r[k] for r in results]) for k in results[0]}
        return [{k: v[a:b] for k, v in full.items()} for a, b in offsets(counts)]

    def _check_batched(self, out: dict, rows: int) -> None:
        for k, v in out.items():
            if v.dim() == 0 or v.shape[0] != rows:
                raise RuntimeError(f"output {k!r} has shape {list(v.shape)}, not batch-first with "
                                   f"{rows} rows; this handler needs batch-first outputs")

    def staging_bytes(self) -> int:
        return self.inputs.nbytes() + self.outputs.nbytes()
