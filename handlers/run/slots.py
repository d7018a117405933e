"""A slot-form decoder's runner (handlers/artifact/decoder.py): many sequences on the loaded
artifact's one cache, a row per slot, on the worker's own stream on a GPU.

- `prefill(slot, ids, start)`: a chunk of one sequence's prompt into its slot from `start`.
- `step(slots, tokens, positions)`: one token for each of several sequences at once, a row per
  busy slot; the logits of every row.

A decode step is launch-bound on a GPU (hundreds of small kernels), so on CUDA each step size of
`sizes()` (1, 2, 4, ... up to the slot count) is captured once as a CUDA graph and replayed with the
rows copied into its static inputs. A step of n busy rows replays the smallest graph of at least n
rows; the rows past n are padding, each written at a place the caller names as spare: a slot
outside the step at a position its holder writes before any call reads it (position 0 of a free
slot; the next prompt position of a slot whose prompt is still being filled), so the padding never
reaches an answer. Every slot outside the step has such a place and the graph has at most as many
rows as there are slots, so there are always enough. (Position 0 of any slot outside the step was
wrong: a prompt filled over several turns had its first position overwritten, tests/test_continuous.py.)
Each graph is kept only if its logits equal the plain call's (handler.cuda_graphs as for the
one-sequence runner).

A prompt chunk of up to PROMPT_SIZES tokens is also a graph replay (a plain call of a 28-layer
0.5 B model costs about 4 ms in launches alone: docs/results/slots_llama05b_fp16_h100.md), padded
to the graph's length with token 0 at the positions after it: those are positions of the same
slot that the sequence writes before any of its calls reads them (each call writes its keys
before it attends), so the padding never reaches an answer either. The chunk's logits are read at
its last real token; a program that returns only the last position's logits gets no prompt graphs.
"""
from __future__ import annotations

import contextlib

import torch

from handlers.artifact.decoder import Decoder

PROMPT_SIZES = (16, 32, 64, 128)


def sizes(slots: int) -> list:
    """The step sizes captured: powers of two below the slot count, and the slot count."""
    out, n = [], 1
    while n < slots:
        out.append(n)
        n *= 2
    return out + [slots]


class SlotRunner:
    def __init__(self, model, decoder: Decoder, device: torch.device, config):
        self.model, self.dec, self.device = model, decoder, device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device, priority=config.stream_priority) if self.cuda else None
        self.graphs: dict = {}  # rows -> (graph, tokens [n, 1], positions [n, 1], slots [n], logits [n, vocab])
        self.prompt_graphs: dict = {}  # length -> (graph, tokens [1, c], positions [1, c], slot [1], logits [1, c, vocab])
        self.pool = None  # the graphs' one memory pool (capture)
        self.arange = torch.arange(decoder.cache_length, dtype=torch.int64, device=device)
        self.graph_note = "plain step calls (CPU)" if not self.cuda else "CUDA graphs not captured"
        # a graph step's positions and slots go in through one of two pinned buffers, taken in
        # turn: the engine waits on step t's tokens (copied out after its inputs were copied in)
        # before it launches step t + 2, which writes the same buffer
        self.hosts = [torch.empty(2, decoder.slots, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self.steps = 0

    @property
    def chunk_limit(self) -> int:
        """The longest prompt chunk the engine sends: the largest prompt graph where there are
        any (AOTInductor's first plain call at a length not seen before took 0.7-0.9 s on an H100,
        8 layers, stalling every stream; a replay does not), else the export's limit."""
        return max(self.prompt_graphs) if self.prompt_graphs else self.dec.chunk_max

    def stream_context(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _run(self, tokens, positions, slots) -> torch.Tensor:
        """The logits of each row's last position, float[B, vocab]."""
        return self.model(tokens, positions, slots)[self.dec.logits][:, -1]

    def prefill(self, slot: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids (int64[1, n] on the device) into `slot` at positions start..start+n-1; the logits
        after the last, float[vocab]."""
        n = ids.shape[1]
        size = next((c for c in sorted(self.prompt_graphs) if c >= n), None)
        if size is None or start + size > self.dec.cache_length:
            pos = self.arange[start:start + n].view(1, -1)
            return self._run(ids, pos, torch.tensor([slot], device=self.device))[0]
        graph, tok, pos, row, logits = self.prompt_graphs[size]
        tok.zero_()
        tok[:, :n].copy_(ids)
        pos.copy_(self.arange[start:start + size].view(1, size))
        row.fill_(slot)
        graph.replay()
        return logits[0, n - 1]

    def step(self, slots: list, tokens: torch.Tensor, positions: list, spare: list = ()) -> torch.Tensor:
        """One token per row: `tokens` int64[n] on the device, row i at positions[i] of slots[i];
        the logits float[n, vocab] (a view valid until the next step). `spare`: (slot, position)
        places a padding row may write (module docstring), at least one per slot outside the step."""
        n = len(slots)
        size = next((s for s in sorted(self.graphs) if s >= n), None)
        if size is None:
            pos = torch.tensor(positions, device=self.device).view(n, 1)
            return self._run(tokens.view(n, 1), pos, torch.tensor(slots, device=self.device))
        graph, tok, pos, rows, logits = self.graphs[size]
        pad = list(spare[:size - n])
        if len(pad) < size - n:
            raise RuntimeError(f"a {n}-row step padded to {size} rows needs {size - n} spare places, got {len(pad)}")
        host = self.hosts[self.steps % 2][:, :size]
        self.steps += 1
        host.copy_(torch.tensor([positions + [p for _, p in pad], slots + [s for s, _ in pad]], dtype=torch.int64))
        both = host.to(self.device, non_blocking=True)
        pos.copy_(both[0].view(size, 1))
        rows.copy_(both[1])
        tok[:n, 0].copy_(tokens)
        graph.replay()
        return logits[:n]

    def capture(self, mode: str) -> str:
        """Each step size's CUDA graph as handler.cuda_graphs says; the load line's note."""
        if not self.cuda or mode == "off":
            self.graph_note = "plain step calls" + (" (handler.cuda_graphs off)" if self.cuda else " (CPU)")
            return self.graph_note
        # one memory pool for every step and prompt graph: they replay one at a time on this
        # stream, and each graph's outputs stay referenced (self.graphs), so no capture takes
        # memory another graph's outputs hold; the temporaries are shared (vLLM captures its
        # decode graphs into one pool the same way). The worker of the 0.5 B slot decoder on an
        # H100 held 5,852 MiB with a pool per graph and 5,672 with one (4,605 of them weights and cache).
        self.pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode(), self.stream_context():
                for n in sizes(self.dec.slots):
                    self._capture(n)
            self.graph_note = (f"decode steps as CUDA graphs of {', '.join(map(str, sorted(self.graphs)))} rows "
                               f"(each verified equal to the plain call); {self._capture_prompts(mode)}")
        except Exception as e:  # noqa: BLE001  (a capture the model refuses, logits that differ)
            self.graphs, self.prompt_graphs = {}, {}
            if mode == "on":
                raise
            self.graph_note = f"plain step calls: the steps' CUDA graphs were not kept ({type(e).__name__}: {e})"
            torch.cuda.empty_cache()
        return self.graph_note

    def _capture_prompts(self, mode: str) -> str:
        """The prompt chunks' graphs (module docstring); what serves prompts, for the load line."""
        if not self.dec.all_positions:
            return "prompts by plain calls (the program returns the last position's logits only)"
        try:
            with torch.inference_mode(), self.stream_context():
                for c in PROMPT_SIZES:
                    if c <= min(self.dec.chunk_max, self.dec.cache_length):
                        self._capture_prompt(c)
        except Exception as e:  # noqa: BLE001
            self.prompt_graphs = {}
            if mode == "on":
                raise
            torch.cuda.empty_cache()
            return f"prompts by plain calls: their CUDA graphs were not kept ({type(e).__name__}: {e})"
        return (f"prompt chunks of up to {max(self.prompt_graphs)} tokens as CUDA graphs of "
                f"{', '.join(map(str, sorted(self.prompt_graphs)))} tokens (verified likewise)")

    def _capture(self, n: int) -> None:
        dev = self.device
        tok = torch.ones(n, 1, dtype=torch.int64, device=dev)
        pos = torch.zeros(n, 1, dtype=torch.int64, device=dev)
        rows = torch.arange(n, dtype=torch.int64, device=dev)
        for _ in range(2):  # lazy initialisation (cuBLAS workspaces) before the capture
            self._run(tok, pos, rows)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            logits = self._run(tok, pos, rows)
        # verified: a prompt in each row's slot, then one step by the plain call and by the graph
        # (each rewrites the same cache entries from the same cache)
        prompt = torch.arange(3, dtype=torch.int64, device=dev).view(1, 3) % self.dec.vocab
        for s in range(n):
            self.prefill(s, prompt, 0)
        slots, positions = list(range(n)), [3] * n
        plain = self._run(tok, torch.full((n, 1), 3, device=dev), rows).clone()
        self.graphs[n] = (graph, tok, pos, rows, logits)
        graphed = self.step(slots, tok.view(n).clone(), positions).clone()
        self.stream.synchronize()
        if not torch.equal(plain, graphed):
            del self.graphs[n]
            diff = (plain.float() - graphed.float()).abs().max().item()
            raise RuntimeError(f"the {n}-row graph's logits differ from the plain call's by {diff:.3g}")

    def _capture_prompt(self, c: int) -> None:
        dev = self.device
        tok = torch.ones(1, c, dtype=torch.int64, device=dev)
        pos = self.arange[:c].view(1, c).clone()
        row = torch.zeros(1, dtype=torch.int64, device=dev)
        for _ in range(2):
            self.model(tok, pos, row)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            logits = self.model(tok, pos, row)[self.dec.logits]
        # verified: a prompt three tokens short of the graph's length, padded as `prefill` pads
        # it, by the plain call and by the graph (each writes the same cache entries)
        ids = (torch.arange(c - 3, dtype=torch.int64, device=dev) % self.dec.vocab).view(1, c - 3)
        padded = torch.zeros(1, c, dtype=torch.int64, device=dev)
        padded[:, :c - 3] = ids
        plain = self.model(padded, self.arange[:c].view(1, c), row)[self.dec.logits][0, c - 4].clone()
        self.prompt_graphs[c] = (graph, tok, pos, row, logits)
        graphed = self.prefill(0, ids, 0).clone()
        self.stream.synchronize()
        if not torch.equal(plain, graphed):
            del self.prompt_graphs[c]
            diff = (plain.float() - graphed.float()).abs().max().item()
            raise RuntimeError(f"the {c}-token prompt graph's logits differ from the plain call's by {diff:.3g}")
