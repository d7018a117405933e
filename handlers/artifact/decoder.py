"""A language-model decoder whose KV cache lives in the program's own state: recognised from its
signature, recorded in artifact.json (`extra.state.decoder`) and served by generation
(handlers/generating.py), never as a stateless model.

The form recognised is the one TorchChat, gpt-fast and transformers' static-cache export
(`transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM`) produce:

    forward(tokens: int[1, S], positions: int[S] or int[1, S]) -> logits: float[1, S or 1, vocab]

with the cache in buffers (or lifted tensor constants) of shape (1, heads, cache_length, head_dim)
written in place at `positions`, and S either dynamic (the prompt fills the cache in one call,
up to S's upper bound per call) or fixed at 1 (one token per call). A call at positions P reads
the cache only at positions <= max(P) (the causal mask is indexed by the positions), so a new
sequence that starts at position 0 overwrites every entry it reads: nothing of the previous
sequence reaches it, and the cache needs no clearing between sequences.

The slot form (examples/slot_decoder.py) holds many sequences on one cache, a row per slot:

    forward(tokens: int[B, S], positions: int[B, S], slots: int[B]) -> logits: float[B, S or 1, vocab]

with the cache in tensors of (slots, heads, cache_length, head_dim) and B dynamic up to the slot
count: row b writes and reads only cache row slots[b], so rows never see each other's state, and
the same argument as above keeps an earlier sequence of a slot from reaching the next. It is
served by continuous batching (handlers/continuous.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


class NotADecoder(ValueError):
    """Why a program that writes its own state is not the decoder form above."""


@dataclass(frozen=True)
class Decoder:
    tokens: str  # input names, in the program's order
    positions: str
    positions_rank: int  # 1: positions [S]; 2: [1, S]
    keywords: bool  # the program takes its inputs by keyword (transformers' export)
    logits: str
    logits_dtype: str
    all_positions: bool  # logits for every position of the call (else for the last only)
    vocab: int
    cache_length: int  # positions 0..cache_length-1
    chunk_max: int  # the most tokens one call takes (1: the prompt goes in one token per call)
    mutated: tuple  # the state it writes (the caches)
    slots: int = 1  # sequences the cache holds at once (its tensors' first dimension)
    slot_input: str = ""  # the slot form's third input (int[B]: each row's cache row); "": one sequence

    @property
    def slotted(self) -> bool:
        return bool(self.slot_input)

    def record(self) -> dict:
        return {**asdict(self), "mutated": list(self.mutated)}

    @classmethod
    def from_record(cls, record: dict) -> "Decoder":
        fields = {k: record[k] for k in cls.__dataclass_fields__ if k in record}
        return cls(**{**fields, "mutated": tuple(fields["mutated"])})

    def describe(self) -> str:
        prefill = (f"the prompt in calls of up to {self.chunk_max} tokens" if self.chunk_max > 1
                   else "the prompt one token per call (the program was exported with a sequence length of 1)")
        slots = (f"{self.slots} sequence slots of {self.cache_length} positions each" if self.slotted
                 else f"KV cache of {self.cache_length} positions")
        return f"decoder: vocabulary {self.vocab}, {slots} in {len(self.mutated)} state tensors, {prefill}"


def _val(node):
    return node.meta.get("val")


def _symbolic(d):
    return not isinstance(d, int)


def _same(a, b) -> bool:
    """Whether two dimensions of the program's fake tensors are the same (one symbol, or equal)."""
    return str(a) == str(b)


def _seq_bound(ep, d) -> int:
    """The upper bound of sequence dimension `d` (an int or a SymInt)."""
    if not _symbolic(d):
        return int(d)
    vr = ep.range_constraints.get(d.node.expr)
    try:
        return int(vr.upper)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return 1 << 30


def _cache_shape(ep, mutated: tuple) -> tuple:
    """(rows, length) of the cache: dimensions 0 and 2 of the rank-4 tensors the program writes
    (TorchChat's and transformers' (batch, heads, length, head_dim); the slot form's rows are slots)."""
    tensors = {**ep.state_dict, **ep.constants}
    shapes = {(int(tensors[m].shape[0]), int(tensors[m].shape[2])) for m in mutated
              if m in tensors and tensors[m].dim() == 4}
    if len(shapes) != 1:
        raise NotADecoder("its state is not a KV cache of one shape: the tensors it writes are not all "
                          "(batch, heads, length, head_dim) with one batch and one length "
                          f"(found (batch, length) {sorted(shapes) or 'none'})")
    return shapes.pop()


def _integer(name, v) -> None:
    if v is None or not hasattr(v, "dtype") or v.dtype.is_floating_point or v.dtype is torch.bool:
        raise NotADecoder(f"input {name} is not an integer tensor")


def _inputs(ep):
    """(user input names, tokens, positions, slots or None): the one-sequence form's two inputs
    or the slot form's three (module docstring)."""
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user = list(ep.graph_signature.user_inputs)
    if len(user) not in (2, 3):
        raise NotADecoder(f"it takes {len(user)} inputs ({', '.join(user)}), not two (token ids, positions) "
                          "or three (token ids, positions, slots)")
    vals = [_val(by_name[n]) for n in user]
    for name, v in zip(user, vals):
        _integer(name, v)
    tokens, positions = vals[0], vals[1]
    slotted = len(user) == 3
    if tokens.dim() != 2 or not (slotted or tokens.shape[0] == 1):
        raise NotADecoder(f"input {user[0]} has shape {tuple(tokens.shape)}, not "
                          + ("[B, S] (a row of token ids per sequence)" if slotted else "[1, S] (one sequence of token ids)"))
    if slotted:
        if positions.dim() != 2 or not all(_same(a, b) for a, b in zip(positions.shape, tokens.shape)):
            raise NotADecoder(f"input {user[1]} has shape {tuple(positions.shape)}, not [B, S] as {user[0]}")
        if vals[2].dim() != 1 or not _same(vals[2].shape[0], tokens.shape[0]):
            raise NotADecoder(f"input {user[2]} has shape {tuple(vals[2].shape)}, not [B] (each row's slot)")
        return user, tokens, positions, vals[2]
    fits = positions.dim() == 1 or positions.dim() == 2 and positions.shape[0] == 1
    if not fits or not _same(positions.shape[-1], tokens.shape[1]):
        raise NotADecoder(f"input {user[1]} has shape {tuple(positions.shape)}, not [S] or [1, S] with the "
                          f"S of {user[0]}")
    return user, tokens, positions, None


def _logits(ep, tokens):
    out = [n for n in ep.graph.nodes if n.op == "output"][0]
    user_outs = [a for a, s in zip(out.args[0], ep.graph_signature.output_specs) if s.kind.name == "USER_OUTPUT"]
    if len(user_outs) != 1 or _val(user_outs[0]) is None:
        raise NotADecoder(f"it returns {len(user_outs)} outputs, not one (the logits)")
    logits = _val(user_outs[0])
    if (logits.dim() != 3 or not _same(logits.shape[0], tokens.shape[0]) or not logits.dtype.is_floating_point
            or _symbolic(logits.shape[2])):
        raise NotADecoder(f"its output has shape {tuple(logits.shape)} ({logits.dtype}), not float "
                          f"[{tokens.shape[0]}, S, vocab]")
    if not (_same(logits.shape[1], tokens.shape[1]) or _same(logits.shape[1], 1)):
        raise NotADecoder(f"its logits have {logits.shape[1]} positions, neither the call's S nor 1")
    return logits


def _slot_count(ep, tokens, rows: int, slotted: bool) -> int:
    """The slot form's slot count (the cache's rows, at least the most rows a call takes);
    1 for the one-sequence form."""
    if not slotted:
        return 1
    most = _seq_bound(ep, tokens.shape[0])
    if rows < 2 or most > rows:
        raise NotADecoder(f"its cache holds {rows} row(s) but a call takes up to {most}: the slot form's cache has "
                          "a row per slot (at least 2) and a call takes at most that many rows")
    return rows


def recognise(ep, mutated: tuple) -> Decoder:
    """`ep` as a decoder (module docstring); raises NotADecoder saying what does not fit."""
    from handlers.artifact.metadata import dtype_name

    user, tokens, positions, slots = _inputs(ep)
    logits = _logits(ep, tokens)
    seq = tokens.shape[1]
    chunk_max = _seq_bound(ep, seq)
    if not _symbolic(seq) and seq != 1:
        raise NotADecoder(f"its sequence length is fixed at {seq}: export it with a dynamic length "
                          "(torch.export.Dim('seq', min=1, max=MAX_SEQ) on both inputs, as TorchChat's "
                          "--dynamic-shapes does) or with length 1")
    rows, cache = _cache_shape(ep, mutated)
    return Decoder(tokens=user[0], positions=user[1], positions_rank=positions.dim(), keywords=by_keyword(ep),
                   logits="logits", logits_dtype=dtype_name(logits.dtype), all_positions=_same(logits.shape[1], seq),
                   vocab=int(logits.shape[2]), cache_length=cache, chunk_max=min(chunk_max, cache),
                   mutated=tuple(mutated), slots=_slot_count(ep, tokens, rows, slots is not None),
                   slot_input=user[2] if slots is not None else "")


def by_keyword(ep) -> bool:
    """Whether `ep` takes its inputs by keyword only (its call spec: (args (), kwargs {...}))."""
    spec = ep.call_spec.in_spec
    if spec is None or spec.num_children != 2:
        return False
    kids = list(spec.children()) if callable(getattr(spec, "children", None)) else spec.children_specs
    return kids[0].num_children == 0 and kids[1].num_children > 0


def of(spec) -> Decoder | None:
    """The decoder artifact.json records for `spec`, or None (a stateless model)."""
    record = (spec.extra.get("state") or {}).get("decoder") if isinstance(spec.extra.get("state"), dict) else None
    return Decoder.from_record(record) if record else None
