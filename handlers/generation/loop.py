"""One sequence's generation: the prompt checked against the model (ids inside the vocabulary,
prompt and max_tokens inside the KV cache: 400 before any native call), then prefill, then one
step per token until max_tokens, an end-of-sequence id or a stop sequence, yielding each token as
it comes and ending with why it stopped.

On a GPU the host never waits for a step before the next one is queued: the sampled token stays on
the device as the next step's input, and only its copy to pinned host memory is waited for (an
event), while the GPU already runs the following step. At a stop, one step past it has run; it
wrote the cache only at a position the next sequence overwrites before reading (run/decoder.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

import torch

from handlers.errors import RequestError
from handlers.generation import logprobs, sampling
from handlers.generation.metrics import OFF
from handlers.generation.request import GenerateRequest
from handlers.generation.text import Detokenizer, StopText, Text


@dataclass
class Token:
    id: Optional[int]  # None: text held back for a stop sequence, released at the end
    text: str  # the text this token completes ("" without a tokenizer or inside a character)
    logprob: Optional[logprobs.TokenLogprob] = None  # where the request asked (Params.logprobs)


@dataclass
class Finished:
    reason: str  # length, eos_token, stop_sequence
    prompt_tokens: int
    ids: list = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list] = None  # a TokenLogprob per generated token, where the request asked


@dataclass(frozen=True)
class Plan:
    """A request checked against the model: its prompt ids and how many tokens it may make."""
    prompt: list
    max_tokens: int
    stop_ids: frozenset


def eos_ids(config, text: Optional[Text]) -> tuple:
    """The end-of-sequence ids: handler.eos_token_ids, else the tokenizer's own (none without one)."""
    return tuple(config.eos_token_ids) or (text.eos_ids if text else ())


def plan(req: GenerateRequest, text: Optional[Text], vocab: int, cache_length: int, config) -> Plan:
    """`req` checked against the model and the worker's settings; RequestError (400) naming what
    is wrong."""
    if req.text is not None and text is None:
        raise RequestError("this model's archive carries no tokenizer (tokenizer.json), so it takes token ids: "
                           "send {\"input_ids\": [...]} instead of text_input")
    if req.params.stop and text is None:
        raise RequestError("parameters.stop needs the archive's tokenizer (tokenizer.json); use "
                           "parameters.stop_token_ids with token ids")
    _check_stops(req.params, vocab, config)
    ids = req.ids if req.ids is not None else _encode(req.text, text, cache_length, req.special_tokens)
    if not ids:
        raise RequestError("the prompt encodes to no tokens")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise RequestError(f"input_ids hold {len(bad)} id(s) outside the vocabulary (first: {bad[0]}); "
                           f"token ids are 0..{vocab - 1}")
    room = cache_length - len(ids)
    if room < 1:
        raise RequestError(f"the prompt is {len(ids)} tokens; this model's KV cache holds {cache_length} "
                           "positions, prompt and generated tokens together: shorten the prompt")
    asked = req.params.max_tokens
    if asked is not None and asked > room:
        raise RequestError(f"the prompt ({len(ids)} tokens) plus max_tokens ({asked}) is {len(ids) + asked} "
                           f"positions; this model's KV cache holds {cache_length}: ask for at most {room}")
    eos = () if req.params.ignore_eos else eos_ids(config, text)
    return Plan(list(ids), asked if asked is not None else min(room, config.max_new_tokens),
                frozenset(eos) | frozenset(req.params.stop_token_ids))


def _check_stops(params, vocab: int, config) -> None:
    """parameters.stop and stop_token_ids within the worker's limits and the vocabulary (400)."""
    limits = (("stop", params.stop, config.max_stop_sequences, "max_stop_sequences", "strings"),
              ("stop_token_ids", params.stop_token_ids, config.max_stop_token_ids, "max_stop_token_ids", "ids"))
    for name, values, most, option, what in limits:
        if len(values) > most:
            raise RequestError(f"parameters.{name} holds {len(values)} {what}; this model takes at most {most} "
                               f"(handler.{option})")
    long = [s for s in params.stop if len(s) > config.max_stop_chars]
    if long:
        raise RequestError(f"parameters.stop holds a string of {len(long[0])} characters; each may be at most "
                           f"{config.max_stop_chars} (handler.max_stop_chars)")
    bad = [i for i in params.stop_token_ids if not 0 <= i < vocab]
    if bad:
        raise RequestError(f"parameters.stop_token_ids holds {len(bad)} id(s) outside the vocabulary (first: "
                           f"{bad[0]}); token ids are 0..{vocab - 1}")


def _encode(prompt: str, text: Text, cache_length: int, special_tokens: bool = True) -> list:
    """The prompt's ids; a text too long to fit in the cache is refused by its UTF-8 length first,
    before the tokenizer spends memory and time on it (handlers/generation/text.max_token_bytes)."""
    most = cache_length * text.max_token_bytes
    size = len(prompt.encode("utf-8", "surrogatepass"))
    if size > most:
        raise RequestError(f"text_input is {size} bytes of UTF-8; this model's KV cache holds {cache_length} "
                           f"positions and one token stands for at most {text.max_token_bytes} bytes, so a "
                           f"text of more than {most} bytes cannot fit: shorten the prompt")
    try:
        return text.encode(prompt, special_tokens)
    except Exception as e:  # noqa: BLE001  (whatever the tokenizer cannot take is the client's text)
        raise RequestError(f"text_input could not be tokenized: {type(e).__name__}: {e}") from None


class _HostToken:
    """The sampled token's copy to (pinned) host memory and the event the host waits on; where
    the request asked for log probabilities (`top`, Params.logprobs), the token's row of
    handlers/generation/logprobs.pack instead, in the same one copy."""

    def __init__(self, device, top: Optional[int] = None):
        cuda = device.type == "cuda"
        self.top = top
        shape, dtype = ((1, 1), torch.int64) if top is None else ((1, 2 + 2 * top), torch.float64)
        self.buf = torch.empty(*shape, dtype=dtype, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def send(self, token: torch.Tensor, logits: torch.Tensor) -> None:
        if self.top is not None:
            token = logprobs.pack(token.view(1), logits.view(1, -1), [self.top])
        self.buf.copy_(token, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()

    def read(self) -> tuple:
        """(the token id, its TokenLogprob or None)."""
        if self.event is not None:
            self.event.synchronize()
        tids, lps = logprobs.read(self.buf, [self.top])
        return tids[0], lps[0]


class Sequence:
    """One request's tokens as they come: each checked against its stops (end-of-sequence and
    stop ids, max_tokens, stop strings), turned into text, and why it ended. The one place a
    generated token becomes an event, for one sequence at a time (`generate`) and for many on one
    cache (handlers/generation/engine.py). `metrics` (handlers/generation/metrics.py) counts each
    token and times the sequence from `started` (its clock's time the request reached the worker)."""

    def __init__(self, req: GenerateRequest, p: Plan, text: Optional[Text], metrics=OFF,
                 started: Optional[float] = None):
        self.plan, self.params = p, req.params
        self.metrics, self.timing = metrics, metrics.begin(started)
        self.detok = Detokenizer(text, p.prompt) if text else None
        self.stops = StopText(req.params.stop) if req.params.stop else None
        self.ids, self.text, self.reason = [], [], None  # reason: None while it goes on
        self.logprobs = [] if req.params.logprobs is not None else None

    def take(self, tid: int, lp: Optional[logprobs.TokenLogprob] = None) -> Token:
        """The event for generated token `tid` (with `lp`, its log probabilities where the request
        asked); `reason` is set where it ends the sequence."""
        self.metrics.token(self.timing)
        if lp is not None:
            lp = replace(lp, prev=self.ids[-1] if self.ids else self.plan.prompt[-1])
            self.logprobs.append(lp)
        self.ids.append(tid)
        if tid in self.plan.stop_ids:
            self.reason = "eos_token"
            return Token(tid, "", lp)
        piece = self.detok.add(tid) if self.detok else ""
        if self.stops is not None:
            piece, hit = self.stops.add(piece)
            if hit:
                self.reason = "stop_sequence"
        self.text.append(piece)
        if self.reason is None and len(self.ids) >= self.plan.max_tokens:
            self.reason = "length"
        return Token(tid, piece, lp)

    def finish(self) -> list:
        """The last events: text held back for a stop sequence that never completed, then Finished."""
        self.metrics.end(self.timing)
        out = []
        if self.stops is not None and self.reason != "stop_sequence":
            tail = self.stops.flush()
            self.text.append(tail)
            if tail:
                out.append(Token(None, tail))
        return out + [Finished(self.reason or "length", len(self.plan.prompt), self.ids, "".join(self.text),
                               self.logprobs)]


def generate(runner, req: GenerateRequest, p: Plan, text: Optional[Text], metrics=OFF,
             started: Optional[float] = None) -> Iterator:
    """Yields a Token per generated token, then one Finished (`metrics`, `started`: Sequence's).
    A plan of no tokens (OpenAI's echo with max_tokens 0) runs nothing."""
    gen = sampling.generator(req.params, runner.device)
    seq = Sequence(req, p, text, metrics, started)
    top = req.params.logprobs
    # two in flight: one read while the next is sampled
    host = [_HostToken(runner.device, top), _HostToken(runner.device, top)]
    with torch.inference_mode(), runner.stream_context():
        if p.max_tokens:
            ids = torch.tensor([p.prompt], dtype=torch.int64).to(runner.device, non_blocking=True)
            logits = runner.prefill(ids)
            token = sampling.pick(logits, req.params, gen)
            host[0].send(token, logits)
        for i in range(p.max_tokens):
            if i + 1 < p.max_tokens:  # queue the next step before reading this token
                logits = runner.step(token, len(p.prompt) + i)
                nxt = sampling.pick(logits, req.params, gen)
                host[(i + 1) % 2].send(nxt, logits)
            yield seq.take(*host[i % 2].read())
            if seq.reason is not None:
                break
            token = nxt
    yield from seq.finish()
