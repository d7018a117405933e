"""The runner interface: a TorchServe batch of admitted requests through the model, outputs
back in host memory, every request getting exactly its own rows. Subclasses make one call of
the artifact on one device kind (run/cpu.py, run/cuda.py)."""
from __future__ import annotations

import torch

from handlers.batch import offsets, plan_chunks, rows_of


class Runner:
    def __init__(self, model, spec):
        self.model = model
        self.spec = spec
        self.pad = None  # batch.PadPlan where the archive declares padding safe (handler.pad)

    def call(self, parts: dict, run_rows: int) -> dict:
        """One call of the artifact on the request rows `parts` ({input: [row blocks]}), padded
        to `run_rows`; returns host tensors valid until the next call (reused buffers)."""
        raise NotImplementedError

    def prepare(self, config, kind) -> str:
        """Load-time preparation after warm-up (CUDA graphs); returns a note for the load line."""
        raise NotImplementedError

    def call_cost_ms(self, rows: int, sizes: dict):
        """What one call of `rows` rows at these named-dimension sizes costs (ms), or None where
        not known (then requests are padded to their own length bucket only)."""
        return None

    def bucket_sizes(self) -> list:
        """Batch sizes with a path of their own (captured CUDA graphs), for warm-up."""
        return []

    def describe_sync(self) -> str:
        """How the host waits for the device, for the load line ("" where nothing to say)."""
        return ""

    def run(self, requests: list) -> list:
        """requests: list of {input name: CPU tensor}. Returns, per request, {output name: CPU
        tensor holding exactly its rows}. Requests whose named dynamic dimensions differ (texts
        of different lengths) run as groups of equal shape, each answered as it would be alone;
        the outputs of all but the last group are copied out of the reused buffers. With a pad
        plan, each request is first padded up to its length bucket (or a shared larger one where
        call_cost_ms says one call is cheaper) and its outputs are cut back."""
        if self.pad is not None:
            sizes = [self.pad.sizes(r) for r in requests]
            rows = [next(iter(r.values())).shape[0] for r in requests]
            targets = self.pad.targets(sizes, rows, self.call_cost_ms)
            outs = self._run_groups([self.pad.pad(r, t) for r, t in zip(requests, targets)])
            return [self.pad.cut(o, s) for o, s in zip(outs, sizes)]
        return self._run_groups(requests)

    def _run_groups(self, requests: list) -> list:
        if len(requests) > 1 and self.spec.dims:
            groups = {}
            for i, r in enumerate(requests):
                groups.setdefault(tuple(t.shape[1:] for t in r.values()), []).append(i)
            if len(groups) > 1:
                out = [None] * len(requests)
                for n, idxs in enumerate(groups.values()):
                    last = n == len(groups) - 1
                    for i, o in zip(idxs, self._run_one_shape([requests[i] for i in idxs])):
                        out[i] = o if last else {k: v.clone() for k, v in o.items()}
                return out
        return self._run_one_shape(requests)

    def _run_one_shape(self, requests: list) -> list:
        counts = [next(iter(r.values())).shape[0] for r in requests]
        chunks = plan_chunks(sum(counts), self.spec.batch_min, self.spec.batch_max)
        names = self.spec.input_names
        if len(chunks) == 1:
            c = chunks[0]
            out = self.call({n: [r[n] for r in requests] for n in names}, c.run_rows)
            _check_batched(out, c.run_rows)
            full = {k: v[:c.rows] for k, v in out.items()}
        else:
            full = None
            for c in chunks:
                out = self.call(rows_of(requests, names, c.start, c.rows), c.run_rows)
                _check_batched(out, c.run_rows)
                if full is None:  # the reused output buffers are overwritten by the next chunk
                    full = {k: torch.empty((sum(counts),) + tuple(v.shape[1:]), dtype=v.dtype)
                            for k, v in out.items()}
                for k, v in out.items():
                    full[k][c.start:c.start + c.rows].copy_(v[:c.rows])
        return [{k: v[a:b] for k, v in full.items()} for a, b in offsets(counts)]


def _check_batched(out: dict, rows: int) -> None:
    for k, v in out.items():
        if v.dim() == 0 or v.shape[0] != rows:
            raise RuntimeError(f"output {k!r} has shape {list(v.shape)}, not batch-first with "
                               f"{rows} rows; this handler needs batch-first outputs")

