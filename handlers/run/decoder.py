"""A decoder's runner (handlers/artifact/decoder.py): the prompt, then one step per token, on
the worker's own stream on a GPU. It owns the loaded artifact's KV cache, which holds one
sequence at a time: a sequence's prompt starts at position 0 and overwrites every cache entry its
later steps read (the causal mask hides the rest), so nothing of an earlier sequence reaches it.

The prompt goes in as few calls as the export allows (up to `chunk_max` tokens each), never token
by token where the program takes more than one. A step (one token at one position) is launch-bound
on a GPU (hundreds of small kernels for a fraction of a millisecond of work each), so on CUDA it
is captured once as a CUDA graph and replayed, its token and position copied into the graph's
static inputs first; the graph is kept only if its logits equal the plain call's
(handler.cuda_graphs: auto keeps the plain call where capture fails, on fails the load, off never
captures), and the load line names which one serves.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch

from handlers.artifact.decoder import Decoder
from handlers.run.capture import capture_graph, check_equal
from handlers.run.stream import worker_stream

logger = logging.getLogger(__name__)


class DecoderRunner:
    def __init__(self, model, decoder: Decoder, device: torch.device, config):
        self.model, self.dec, self.device = model, decoder, device
        self.cuda = device.type == "cuda"
        self.stream = worker_stream(device, config.stream_priority)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._static = None  # (token int64[1, 1], position int64[1] or [1, 1], logits) of the graph
        self.graph_note = "plain step calls (CPU)" if not self.cuda else "CUDA graph not captured"

    @property
    def static_logits(self) -> Optional[torch.Tensor]:
        """The step graph's output (what `step` returns while a graph serves), else None."""
        return self._static[2] if self._static is not None else None

    def stream_context(self):
        """`with runner.stream_context():` puts a generation's work on the worker's stream."""
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _call(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start, start + tokens.shape[1], device=self.device)
        return self._run(tokens, pos.view(1, -1) if self.dec.positions_rank == 2 else pos)

    def _run(self, tokens, positions) -> torch.Tensor:
        """The logits of the call's last position, float[vocab]."""
        out = self.model(tokens, positions)[self.dec.logits]
        return out[0, -1]

    def prefill(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The prompt (int64[1, n] on the device) into the cache from position `start` (0: a new
        sequence; more: the rest of a prompt whose start is in already); the logits after its
        last token."""
        n, step = ids.shape[1], self.dec.chunk_max
        logits = None
        for a in range(0, n, step):
            logits = self._call(ids[:, a:a + step], start + a)
        return logits

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """One token (int64[1, 1] on the device) at `position`; the logits after it."""
        if self.graph is None:
            return self._call(token, position)
        tok, pos, logits = self._static
        tok.copy_(token)
        pos.fill_(position)
        self.graph.replay()
        return logits

    def capture(self, mode: str) -> str:
        """The step's CUDA graph as handler.cuda_graphs says; the load line's note."""
        if not self.cuda or mode == "off":
            self.graph_note = "plain step calls" + (" (handler.cuda_graphs off)" if self.cuda else " (CPU)")
            return self.graph_note
        try:
            with torch.inference_mode(), self.stream_context():
                self.graph_note = self._capture()
        except Exception as e:  # noqa: BLE001  (a capture the model refuses, logits that differ)
            self.graph, self._static = None, None
            if mode == "on":
                raise
            self.graph_note = f"plain step calls: the step's CUDA graph was not kept ({type(e).__name__}: {e})"
            torch.cuda.empty_cache()
        return self.graph_note

    def _capture(self) -> str:
        tok = torch.ones(1, 1, dtype=torch.int64, device=self.device)
        pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        pos = pos.view(1, 1) if self.dec.positions_rank == 2 else pos
        graph, logits = capture_graph(lambda: self._run(tok, pos), self.stream, warmup=2, device=self.device)
        self.graph, self._static = graph, (tok, pos, logits)
        # verified: a prompt, then the same token at the same position by the plain call and
        # by the graph (each rewrites the same cache entry from the same cache)
        prompt = torch.arange(3, dtype=torch.int64, device=self.device).view(1, 3) % self.dec.vocab
        self.prefill(prompt)
        plain = self._call(tok, 3).clone()
        graphed = self.step(tok, 3).clone()
        self.stream.synchronize()
        check_equal(plain, graphed, "the step graph", "logits")
        return "decode steps as a CUDA graph (verified equal to the plain call)"

