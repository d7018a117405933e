"""A slot-form decoder's runner (handlers/artifact/decoder.py): many sequences on the loaded
artifact's one cache, a row per slot, on the worker's own stream on a GPU.

- `prefill_rows(slots, chunks, starts, spare)`: a prompt chunk of each of several sequences, each
  into its own slot from its own position, in as few calls as the graphs allow (a row per
  sequence: one call reads the weights once for all of them); `prefill(slot, ids, start)`: one.
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

Prompt chunks of up to PROMPT_SIZES tokens, PROMPT_ROWS sequences at a time, are also graph
replays (a plain call launches every kernel of every layer from the host, one by one; a replay
is one launch). Each row is padded to the graph's length with token 0
at the positions after its chunk: those are positions of the same slot that the sequence writes
before any of its calls reads them (each call writes its keys before it attends, and attends only
up to its own positions), so the padding never reaches an answer either. Rows past the call's
sequences go to spare places as a step's do, each a run of the graph's length. Each row's logits
are read at its chunk's last real token, inside the graph (so a graph keeps [rows, vocab], not
[rows, length, vocab]); a program that returns only the last position's logits gets no prompt
graphs, and its rows share a call only when their chunks are equally long.
"""
from __future__ import annotations

import contextlib

import torch

from handlers.artifact.decoder import Decoder
from handlers.run.capture import capture_graph, mismatch
from handlers.run.stream import worker_stream

PROMPT_SIZES = (16, 32, 64, 128)
PROMPT_ROWS = (1, 2, 4, 8, 16)  # sequences per prompt call (up to the slot count)


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
        self.stream = worker_stream(device, config.stream_priority)
        self.graphs: dict = {}  # rows -> (graph, tokens [n, 1], positions [n, 1], slots [n], logits [n, vocab])
        # (rows, length) -> (graph, tokens [r, c], positions [r, c], slots [r], last [r], logits [r, vocab],
        # rows [r]: each graph's every static tensor stays referenced here: a freed one's memory is
        # reused, and the replay reads whatever is there then)
        self.prompt_graphs: dict = {}
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
        return max(c for _, c in self.prompt_graphs) if self.prompt_graphs else self.dec.chunk_max

    @property
    def prompt_rows(self) -> int:
        """The most sequences one prompt call takes: the largest prompt graph's rows where there
        are any, else the largest of PROMPT_ROWS within the slot count."""
        if self.prompt_graphs:
            return max(r for r, _ in self.prompt_graphs)
        return max(r for r in PROMPT_ROWS if r <= self.dec.slots)

    def stream_context(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _run(self, tokens, positions, slots) -> torch.Tensor:
        """The logits of each row's last position, float[B, vocab]."""
        return self.model(tokens, positions, slots)[self.dec.logits][:, -1]

    def prefill(self, slot: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids (int64[1, n]) into `slot` at positions start..start+n-1; the logits after the last,
        float[vocab]."""
        return self.prefill_rows([slot], [ids.view(-1).tolist()], [start])[0]

    def prefill_rows(self, slots: list, chunks: list, starts: list, spare: list = ()) -> torch.Tensor:
        """chunks[i] (token ids) into slots[i] at positions starts[i].., each chunk within the cache
        and at most `chunk_limit` long; the logits after each chunk's last token, float[k, vocab].
        `spare`: (slot, position) places outside the call where a padding row may write a run of
        tokens from that position (module docstring); with too few, fewer rows go per call."""
        out, i = [], 0
        while i < len(slots):
            take, key, pad = self._prompt_plan(chunks[i:], starts[i:], spare)
            rows = slice(i, i + take)
            out.append(self._prompt_call(key, slots[rows], chunks[rows], starts[rows], pad))
            i += take
            if i < len(slots):  # a later replay of the same graph overwrites its output
                out[-1] = out[-1].clone()
        return out[0] if len(out) == 1 else torch.cat(out)

    def _prompt_plan(self, chunks: list, starts: list, spare: list) -> tuple:
        """(rows from the front in the next call, (rows, length) of its graph or (None, length)
        for a plain call, padding places): the longest front whose chunks share a length within
        the cache, on the graph with the fewest rows that holds them where `spare` pads it."""
        graphs, cap = self.prompt_graphs, self.dec.cache_length
        lengths = sorted({c for _, c in graphs})
        take, length = 0, 0
        for k in range(1, min(len(chunks), self.prompt_rows) + 1):
            n = max(len(c) for c in chunks[:k])
            c = next((c for c in lengths if c >= n), None) if graphs else n
            same = self.dec.all_positions or len(chunks[k - 1]) == len(chunks[0])
            if c is None or not same or any(s + c > cap for s in starts[:k]):
                break
            take, length = k, c
        if take == 0:  # past the graphs' lengths or the cache's end: the first chunk alone, as it is
            return 1, (None, len(chunks[0])), []
        if not graphs:
            return take, (None, length), []
        rows = sorted(r for r, c in graphs if c == length)
        r = next((r for r in rows if r >= take), None)
        pad = [(s, p) for s, p in spare if p + length <= cap][:r - take] if r else []
        if r is None or len(pad) < r - take:
            r = max(x for x in rows if x <= take)
            take, pad = r, []
        return take, (r, length), pad

    def _prompt_call(self, key: tuple, slots: list, chunks: list, starts: list, pad: list) -> torch.Tensor:
        """One prompt call (`_prompt_plan`'s key): float[len(slots), vocab], each row's logits after
        its chunk (a graph's output: valid until that graph's next replay)."""
        r, c = key
        k = len(slots) + len(pad)
        tokens = [t for ch in chunks for t in ch + [0] * (c - len(ch))] + [0] * (c * len(pad))
        positions = [p for s in starts + [p for _, p in pad] for p in range(s, s + c)]
        last = [len(ch) - 1 for ch in chunks] + [0] * len(pad)
        # one copy in; each input a contiguous piece of it starting at a 16-byte boundary (an
        # AOTInductor model reads its inputs as contiguous, and its kernels assume aligned
        # inputs: strided views gave other logits and failed the graphs' check on an H200)
        pieces = [tokens, positions, slots + [s for s, _ in pad], last]
        at = [0]
        for piece in pieces:
            at.append(at[-1] + len(piece) + len(piece) % 2)
        both = torch.tensor([v for piece in pieces for v in piece + [0] * (len(piece) % 2)], dtype=torch.int64)
        both = both.to(self.device, non_blocking=True)
        tok, pos, rows, ends = (both[at[i]:at[i] + len(pieces[i])] for i in range(4))
        tok, pos = tok.view(k, c), pos.view(k, c)
        if r is None:
            logits = self.model(tok, pos, rows)[self.dec.logits]
            if not self.dec.all_positions:
                return logits[:, -1]
            return logits[torch.arange(k, device=self.device), ends]
        graph, tok_in, pos_in, row_in, idx_in, logits, _ = self.prompt_graphs[key]
        tok_in.copy_(tok)
        pos_in.copy_(pos)
        row_in.copy_(rows)
        idx_in.copy_(ends)
        graph.replay()
        return logits[:len(slots)]

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
        """The prompt chunks' graphs (module docstring), one-row graphs of every length first, then
        the graphs of several rows: where only those fail, prompts go in one sequence per call
        as before them; what serves prompts, for the load line."""
        if not self.dec.all_positions:
            return "prompts by plain calls (the program returns the last position's logits only)"
        lengths = [c for c in PROMPT_SIZES if c <= min(self.dec.chunk_max, self.dec.cache_length)]
        several = [r for r in PROMPT_ROWS if 1 < r <= self.dec.slots]
        try:
            with torch.inference_mode(), self.stream_context():
                for c in lengths:
                    self._capture_prompt(1, c)
        except Exception as e:  # noqa: BLE001
            self.prompt_graphs = {}
            if mode == "on":
                raise
            torch.cuda.empty_cache()
            return f"prompts by plain calls: their CUDA graphs were not kept ({type(e).__name__}: {e})"
        rows_note = ""
        try:
            with torch.inference_mode(), self.stream_context():
                for c in lengths:
                    for r in several:
                        self._capture_prompt(r, c)
        except Exception as e:  # noqa: BLE001
            self.prompt_graphs = {k: v for k, v in self.prompt_graphs.items() if k[0] == 1}
            if mode == "on":
                raise
            torch.cuda.empty_cache()
            rows_note = f"; the graphs of several rows were not kept ({type(e).__name__}: {e})"
        return (f"prompt chunks of up to {self.chunk_limit} tokens of up to {self.prompt_rows} sequences per call "
                f"as CUDA graphs of {', '.join(map(str, sorted({c for _, c in self.prompt_graphs})))} tokens by "
                f"{', '.join(map(str, sorted({r for r, _ in self.prompt_graphs})))} rows (verified likewise){rows_note}")

    def _capture(self, n: int) -> None:
        dev = self.device
        tok = torch.ones(n, 1, dtype=torch.int64, device=dev)
        pos = torch.zeros(n, 1, dtype=torch.int64, device=dev)
        rows = torch.arange(n, dtype=torch.int64, device=dev)
        graph, logits = capture_graph(lambda: self._run(tok, pos, rows), self.stream, self.pool, warmup=2, device=dev)
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
        problem = mismatch(plain, graphed, f"the {n}-row step graph", "logits")
        if problem is not None:
            del self.graphs[n]
            raise problem

    def _capture_prompt(self, r: int, c: int) -> None:
        dev = self.device
        tok = torch.ones(r, c, dtype=torch.int64, device=dev)
        pos = self.arange[:c].repeat(r, 1)
        row = torch.arange(r, dtype=torch.int64, device=dev)
        last = torch.full((r,), c - 1, dtype=torch.int64, device=dev)
        each = torch.arange(r, dtype=torch.int64, device=dev)  # made before the capture: no copy in it

        def last_logits():  # each row's logits at its `last` position, read inside the graph
            return self.model(tok, pos, row)[self.dec.logits][each, last]

        graph, logits = capture_graph(last_logits, self.stream, self.pool, warmup=2, device=dev)
        # verified: a chunk of c - 1 - (i % 3) tokens in each row's slot (i), padded as
        # `prefill_rows` pads them, by the plain call and by the graph (each writes the same cache
        # entries); the graph with fewer rows or a shorter length was captured before, so exactly
        # this one serves these chunks
        chunks = [[(7 * i + k) % self.dec.vocab for k in range(c - 1 - i % 3)] for i in range(r)]
        starts = [0] * r
        plain = self._prompt_call((None, c), list(range(r)), chunks, starts, []).clone()
        self.prompt_graphs[(r, c)] = (graph, tok, pos, row, last, logits, each)
        graphed = self.prefill_rows(list(range(r)), chunks, starts).clone()
        self.stream.synchronize()
        problem = mismatch(plain, graphed, f"the {r}-row {c}-token prompt graph", "logits")
        if problem is not None:
            del self.prompt_graphs[(r, c)]
            raise problem
