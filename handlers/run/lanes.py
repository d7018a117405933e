"""A one-sequence decoder (handlers/artifact/decoder.py) as the engine runs it: `lanes`, copies of
the loaded model that share one copy of the weights, each with a KV cache of its own and its own
handlers/run/decoder.DecoderRunner (its stream, its step's CUDA graph). A lane holds one sequence,
so the engine generates as many sequences at once as it has lanes (issue 64 item 3).

`LaneRunner` has the interface of handlers/run/slots.SlotRunner, a lane standing for a slot, so
handlers/generation/engine.py's continuous batch (and the engine's generation, the workers'
streams) serve it unchanged: a step of n busy lanes is n one-token calls, a prompt call of k
lanes k prompt chunks. Lanes never share a tensor they write, so nothing of one sequence reaches
another, and no padding row is needed (`spare` is ignored).

On a GPU each lane's calls go on its own stream, so the device runs the lanes' steps side by side:
a one-sequence decode step is launch- and latency-bound (hundreds of small kernels that leave most
of the device idle), which is why one process of several streams outruns time-slicing between
processes (six workers with a copy each: 773 tokens/s at 8 streams against 875 for one stream
alone, issue 64). Each lane's stream waits for the batch's stream (`stream`: the sampled tokens
it reads were made there) and the batch's stream waits for every lane before it reads their
logits, so the order is the one a single stream would give.
"""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from typing import Optional

import torch

from handlers.artifact.kinds import kind_of
from handlers.artifact.load import load_artifact
from handlers.errors import LoadError
from handlers.run.decoder import DecoderRunner
from handlers.run.stream import worker_stream
from handlers.weights.pack import pack

RESERVE = 0.1  # of the GPU's memory, left free by the lanes (the batch's sampling, the allocator's slack)


@dataclasses.dataclass
class Shared:
    """The weights every lane reads (what a kind's `load(..., weights=)` takes: `.tensors`,
    `.library`), kept for the engine's life by each lane's model."""
    tensors: dict
    library: object = None


def load_lanes(spec, decoder, placement, config) -> tuple:
    """([DecoderRunner] of up to handler.cache_copies lanes, the note): the weights read once
    (the kind's held_weights, packed: handlers/weights/pack.py), every lane a load of the
    artifact on them with a cache of its own. On a GPU, as many lanes as its free memory holds
    after the first (`_room`); one plain lane where the kind cannot share its weights
    (kind.not_shared), where reading them for sharing fails, or with cache_copies 1."""
    kind = kind_of(spec)
    shared, caches, why = None, {}, None
    if config.cache_copies == 1:
        why = "handler.cache_copies 1"
    elif kind.not_shared is not None:
        why = kind.not_shared
    else:
        try:
            shared, caches = _shared(kind, spec, placement, decoder)
        except LoadError as e:  # e.g. a package whose constants are outside its library
            why = f"its weights could not be read for sharing ({e})"
    lanes = [_lane(spec, decoder, placement, config, shared, caches)]
    want = _room(lanes[0], shared, kind, config) if shared is not None else 1
    while len(lanes) < want:
        try:
            lanes.append(_lane(spec, decoder, placement, config, shared, caches))
        except torch.cuda.OutOfMemoryError:  # the room was overestimated: serve with the lanes loaded
            torch.cuda.empty_cache()
            break
    if len(lanes) > 1:
        check_independent(lanes[0], lanes[1])
    if shared is None:
        return lanes, f"1 lane ({why})"
    nbytes = sum(t.numel() * t.element_size() for t in shared.tensors.values())
    return lanes, (f"{len(lanes)} lanes (handler.cache_copies {config.cache_copies}), each a cache of its own "
                   f"on one copy of the weights ({nbytes / 2**20:.0f} MiB)")


def _shared(kind, spec, placement, decoder) -> tuple:
    """(Shared: the read-only weights packed on the device, {name: (shape, dtype)} of the state
    the decoder writes that the kind's load wants given: each lane gets zeros of its own)."""
    device, written = placement.torch_device, {}

    def keep(source: dict) -> dict:
        written.update({k: (tuple(v.shape), v.dtype) for k, v in source.items() if _written(k, decoder)})
        return pack({k: v for k, v in source.items() if not _written(k, decoder)}, device)
    library = kind.shared_library(spec, tempfile.mkdtemp(prefix="lanes-"))
    tensors = kind.held_weights(spec, placement, keep, library)
    if device.type == "cuda":  # the packing copies ran on the default stream; the lanes' streams do not wait for it
        torch.cuda.synchronize(device)
    return Shared(tensors, library), written


def _room(first: DecoderRunner, shared: Shared, kind, config) -> int:
    """Lanes to load, the first included: cache_copies, fewer where the GPU's free memory less
    RESERVE of the device holds fewer at what the first took (its load, and a prompt of the
    longest chunk: `_lane`), and less one copy of the weights where a kind's load fills a copy
    of its own before it takes the shared one (kind.load_copies_weights)."""
    if first.device.type != "cuda" or config.cache_copies <= 1:
        return config.cache_copies
    free, total = torch.cuda.mem_get_info(first.device)
    room = free - RESERVE * total
    if kind.load_copies_weights:
        room -= sum(t.numel() * t.element_size() for t in shared.tensors.values())
    return min(config.cache_copies, 1 + max(0, int(room // max(1, first.cost))))


def _lane(spec, decoder, placement, config, shared: Optional[Shared], caches: dict) -> DecoderRunner:
    """One lane: the artifact loaded on the shared weights, with `caches` ({name: (shape, dtype)},
    the state a kind's load wants given: zeros of its own here, which a new sequence overwrites
    before it reads them, handlers/artifact/decoder.py); then a prompt of the longest chunk, so
    what it holds of the device (`cost`, bytes: `_room`) counts its largest calls' memory too."""
    device = placement.torch_device
    before = _free(device)
    weights = None
    if shared is not None:
        own = {k: torch.zeros(shape, dtype=dtype, device=device) for k, (shape, dtype) in caches.items()}
        weights = Shared({**shared.tensors, **own}, shared.library)
    lane = DecoderRunner(load_artifact(spec, placement, config, weights), decoder, device, config)
    n = max(1, min(decoder.chunk_max, decoder.cache_length))
    with torch.inference_mode(), lane.stream_context():
        lane.prefill(torch.zeros(1, n, dtype=torch.int64, device=device))
    if lane.cuda:
        lane.stream.synchronize()
    lane.cost = max(0, before - _free(device)) if before is not None else 0
    return lane


def check_independent(a: DecoderRunner, b: DecoderRunner) -> None:
    """Raises LoadError where two lanes share state they write: lane `a`'s step after its prompt
    must give the same logits whether or not lane `b` filled its own cache with another prompt
    in between (a cache the kind's load did not give each lane its own copy of would hold b's
    prompt then). A lane is never left to answer from another's cache."""
    dev, vocab = a.device, a.dec.vocab
    n = max(1, min(4, a.dec.cache_length // 2 - 1))
    prompt = (torch.arange(n, device=dev).view(1, n) * 7 + 3) % vocab
    other = (torch.arange(min(2 * n + 2, a.dec.cache_length), device=dev).view(1, -1) * 5 + 1) % vocab
    token = torch.full((1, 1), 2 % vocab, dtype=torch.int64, device=dev)
    with torch.inference_mode():
        a.prefill(prompt)
        alone = a._call(token, n).clone()
        a.prefill(prompt)
        b.prefill(other)
        beside = a._call(token, n).clone()
    if not torch.equal(alone, beside):
        raise LoadError("the decoder's lanes share the state they write: a lane's step changed when another lane "
                        "filled its own cache, so the artifact's load did not give each lane a cache of its own "
                        f"(the decoder's state tensors: {', '.join(a.dec.mutated)}). Fix: set handler.cache_copies "
                        "to 1, and report the artifact's kind")


def _written(name: str, decoder) -> bool:
    """Whether held weight `name` is state the decoder writes (its cache): a kind names it as the
    program does (AOTInductor's constant fqns) or prefixed with where the program keeps it
    (kinds/exported_program.read_only: "state:NAME", "constant:NAME"; a cache held as a lifted
    tensor constant is not among the program's buffers_to_mutate, so read_only keeps it)."""
    return name in decoder.mutated or name.split(":", 1)[-1] in decoder.mutated


def _free(device) -> Optional[int]:
    """Free bytes on a CUDA device, None elsewhere."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


class LaneRunner:
    def __init__(self, lanes: list, config):
        """`lanes`: DecoderRunners of one decoder on one device, each on a model with its own cache."""
        first = lanes[0]
        self.lanes, self.device, self.cuda = lanes, first.device, first.cuda
        self.dec = dataclasses.replace(first.dec, slots=len(lanes))
        self.stream = worker_stream(self.device, config.stream_priority)
        self.graph_note = "plain step calls (CPU)" if not self.cuda else "CUDA graphs not captured"

    @property
    def chunk_limit(self) -> int:
        return self.dec.chunk_max

    @property
    def prompt_rows(self) -> int:
        return len(self.lanes)

    def stream_context(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def prefill(self, slot: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids (int64[1, n] on the device) into lane `slot`'s cache at positions start..; the
        logits after the last."""
        return self._on_lanes([slot], lambda lane, i: lane.prefill(ids, start))[0]

    def prefill_rows(self, slots: list, chunks: list, starts: list, spare: list = ()) -> torch.Tensor:
        """chunks[i] (token ids) into lane slots[i] from position starts[i]; float[k, vocab]. Each
        chunk goes up from pinned memory on its lane's stream, which waits for nothing of the
        batch's stream (a prompt reads only its own ids and writes only its own lane's cache,
        whose earlier work is on the same stream): the prompts run beside the step just launched,
        and the host does not wait for the copy (from pageable memory it would: a stream sync first)."""
        def call(lane, i):
            host = torch.tensor([chunks[i]], dtype=torch.int64)
            ids = host.pin_memory().to(self.device, non_blocking=True) if self.cuda else host
            return lane.prefill(ids, starts[i])
        return self._on_lanes(slots, call, after_batch=False)

    def step(self, slots: list, tokens: torch.Tensor, positions: list, spare: list = ()) -> torch.Tensor:
        """One token per row: tokens[i] (int64[n] on the device) at positions[i] of lane slots[i];
        float[n, vocab] (a new tensor)."""
        def call(lane, i):
            token = tokens[i:i + 1].view(1, 1)
            # a graph copies it into its own input; a plain call gets a copy of its own (an
            # AOTInductor model may assume 16-byte aligned inputs: handlers/run/slots.py)
            return lane.step(token if lane.graph is not None else token.clone(), positions[i])
        return self._on_lanes(slots, call)

    def _on_lanes(self, slots: list, call, after_batch: bool = True) -> torch.Tensor:
        """call(lane, i) for each row i on lane slots[i], each on its lane's stream (after the
        batch's stream's work so far, where `after_batch`: a step's tokens were made there);
        their logits stacked on the batch's stream once every lane has finished. A graph's
        logits are its static output, overwritten by the lane's next replay, which waits for
        this stack (queued after it on the batch's stream); a plain call's, allocated on the
        lane's stream, are marked as used on the batch's too."""
        if not self.cuda:
            return torch.stack([call(self.lanes[s], i) for i, s in enumerate(slots)])
        main = torch.cuda.current_stream(self.device)
        ready = main.record_event() if after_batch else None
        out = []
        for i, s in enumerate(slots):
            lane = self.lanes[s]
            if ready is not None:
                lane.stream.wait_event(ready)
            with torch.cuda.stream(lane.stream):
                logits = call(lane, i)
            if lane.graph is None or logits is not lane.static_logits:
                logits.record_stream(main)
            main.wait_stream(lane.stream)
            out.append(logits)
        return torch.stack(out)

    def capture(self, mode: str) -> str:
        """Each lane's step graph as handler.cuda_graphs says (run/decoder.py); the load line's note."""
        notes = {lane.capture(mode) for lane in self.lanes}
        self.graph_note = f"{len(self.lanes)} lanes: " + "; ".join(sorted(notes))
        return self.graph_note
