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
from handlers.weights.holder import pack

RESERVE = 0.1  # of the GPU's memory, left free by the lanes (the batch's sampling, the allocator's slack)


@dataclasses.dataclass
class Shared:
    """The weights every lane reads (what a kind's `load(..., weights=)` takes of the holder's
    HeldWeights: `.tensors`, `.library`), kept for the engine's life by each lane's model."""
    tensors: dict
    library: object = None


def load_lanes(spec, decoder, placement, config) -> tuple:
    """([DecoderRunner] of up to handler.cache_copies lanes, the note): the weights read once
    (the kind's held_weights, as the GPU's weights holder reads them), every lane a load of the
    artifact on them with a cache of its own. On a GPU, as many lanes as its free memory holds
    after the first (measured: what the first lane's load and one step took) less RESERVE of
    the device; a kind that cannot share its weights (kind.not_shared) gets one lane."""
    kind, device = kind_of(spec), placement.torch_device
    shared, caches = None, {}
    if kind.not_shared is None:
        library = kind.shared_library(spec, tempfile.mkdtemp(prefix="lanes-"))
        held = kind.held_weights(spec, placement, lambda source: pack(source, device), library)
        shared = Shared({k: v for k, v in held.items() if not _written(k, decoder)}, library)
        caches = {k: v for k, v in held.items() if _written(k, decoder)}  # a kind whose load needs every constant
    free = _free(device)
    lanes = [_lane(spec, decoder, placement, config, shared, caches)]
    want = config.cache_copies if shared else 1
    if free is not None and want > 1:
        cost = max(1, free - _free(device))
        room = _free(device) - RESERVE * torch.cuda.mem_get_info(device)[1]
        want = min(want, 1 + max(0, int(room // cost)))
    while len(lanes) < want:
        lanes.append(_lane(spec, decoder, placement, config, shared, caches))
    if len(lanes) > 1:
        check_independent(lanes[0], lanes[1])
    if shared is None:
        return lanes, f"1 lane: {kind.not_shared} (handler.cache_copies {config.cache_copies} needs shared weights)"
    nbytes = sum(t.numel() * t.element_size() for t in shared.tensors.values())
    return lanes, (f"{len(lanes)} lanes (handler.cache_copies {config.cache_copies}), each a cache of its own "
                   f"on one copy of the weights ({nbytes / 2**20:.0f} MiB)")


def _lane(spec, decoder, placement, config, shared: Optional[Shared], caches: dict) -> DecoderRunner:
    """One lane: the artifact loaded on the shared weights, with `caches` ({name: tensor}, the
    state a kind's load needs given: fresh zeros here, which a new sequence overwrites before it
    reads them, handlers/artifact/decoder.py) of its own; and one warm step where it can, so the
    next lane's room is measured after its allocations."""
    weights = None
    if shared is not None:
        weights = Shared({**shared.tensors, **{k: torch.zeros_like(v) for k, v in caches.items()}}, shared.library)
    lane = DecoderRunner(load_artifact(spec, placement, config, weights), decoder, placement.torch_device, config)
    with torch.inference_mode(), lane.stream_context():
        lane.step(torch.zeros(1, 1, dtype=torch.int64, device=placement.torch_device), 0)
    if lane.cuda:
        lane.stream.synchronize()
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
        """ids (int64[1, n]) into lane `slot`'s cache at positions start..; the logits after the last."""
        return self._on_lanes([slot], lambda lane, i: lane.prefill(ids, start))[0]

    def prefill_rows(self, slots: list, chunks: list, starts: list, spare: list = ()) -> torch.Tensor:
        """chunks[i] (token ids) into lane slots[i] from position starts[i]; float[k, vocab]."""
        ids = [torch.tensor([c], dtype=torch.int64, device=self.device) for c in chunks]
        return self._on_lanes(slots, lambda lane, i: lane.prefill(ids[i], starts[i]))

    def step(self, slots: list, tokens: torch.Tensor, positions: list, spare: list = ()) -> torch.Tensor:
        """One token per row: tokens[i] (int64[n] on the device) at positions[i] of lane slots[i];
        float[n, vocab] (a new tensor)."""
        return self._on_lanes(slots, lambda lane, i: lane.step(tokens[i:i + 1].view(1, 1), positions[i]))

    def _on_lanes(self, slots: list, call) -> torch.Tensor:
        """call(lane, i) for each row i on lane slots[i], each on its lane's stream after the
        batch's stream's work so far; their logits stacked on the batch's stream once every lane
        has finished (a graph's logits are its static output, overwritten by the lane's next
        replay, which waits for this stack: it is queued after it on the batch's stream)."""
        if not self.cuda:
            return torch.stack([call(self.lanes[s], i) for i, s in enumerate(slots)])
        main = torch.cuda.current_stream(self.device)
        ready = main.record_event()
        out = []
        for i, s in enumerate(slots):
            lane = self.lanes[s]
            lane.stream.wait_event(ready)
            with torch.cuda.stream(lane.stream):
                logits = call(lane, i)
            if lane.graph is None:  # a plain call's output, allocated on the lane's stream, is read on this one
                logits.record_stream(main)
            main.wait_stream(lane.stream)
            out.append(logits)
        return torch.stack(out)

    def capture(self, mode: str) -> str:
        """Each lane's step graph as handler.cuda_graphs says (run/decoder.py); the load line's note."""
        notes = {lane.capture(mode) for lane in self.lanes}
        self.graph_note = f"{len(self.lanes)} lanes: " + "; ".join(sorted(notes))
        return self.graph_note
