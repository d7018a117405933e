"""The second way a worker serves (beside handlers/pipeline.py's batches): generation, for a
decoder (handlers/artifact/decoder.py). Each request of a TorchServe batch in turn: parsed and
checked (a 4xx before any native call), then generated on the one KV cache the worker's loaded
artifact holds, one sequence at a time, its tokens sent as they come (`send`: TorchServe's
intermediate responses, handlers/torchserve/replies.py) and its last answer returned.

A fault after the first token ends that stream with an error object (its status line has gone
out); a sticky device fault also breaks the worker (handlers/faults.py), anything else leaves it
serving the next request. A request whose client went (the pod's mark, generation/abandon.py) is
not started, or is stopped at its next token, and answered ClientGone: the worker takes the next.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from handlers import faults
from handlers.errors import ServingError
from handlers.generation import loop
from handlers.generation.abandon import Marks, key_of
from handlers.generation.formats import Route
from handlers.generation.metrics import OFF
from handlers.generation.openai import route_for
from handlers.generation.request import choices
from handlers.wire.base import Encoded, Failed

logger = logging.getLogger(__name__)


class Generation:
    """What a decoder worker keeps: its runner, the archive's tokenizer (or None) and settings."""

    def __init__(self, runner, text, config, max_body_bytes: int):
        self.runner, self.text, self.config = runner, text, config
        self.max_body_bytes = max_body_bytes
        self.marks = Marks.from_env()
        self.metrics = OFF  # handlers/generation/metrics.py, set by the worker after its warm-up

    def use(self, metrics) -> None:
        """Counts and times generation in `metrics` from now (after the warm-up): no sequence runs yet."""
        self.metrics = metrics
        metrics.state(0, None, 0)

    def describe(self) -> str:
        return (f"{self.runner.dec.describe()}; {self.runner.graph_note}; "
                + ("tokenizer.json" if self.text else "token ids only (no tokenizer.json in the archive)")
                + f"; end-of-sequence ids {list(loop.eos_ids(self.config, self.text))}")


def serve(worker, data: list, headers: list, send: Optional[Callable]) -> list:
    """One answer per request (an Encoded or a Failed); `send(idx, Encoded, ending)` streams a
    chunk; `ending`, given with a stream's first chunk, makes the event that ends it after an
    error (Route.error_event: the worker's adapter keeps one ready in case the worker dies)."""
    refusal = worker.health.refusal()
    answers = []
    for idx, (request, h) in enumerate(zip(data, headers)):
        route = route_for(h, worker.name, worker.version)
        if refusal is not None:
            answers.append(_failed(refusal, route))
            continue
        answers.append(_one(worker, request, h, route, (lambda body, ending=None, i=idx: send(i, body, ending)) if send else None))
        refusal = worker.health.refusal()  # a sticky fault refuses the rest of the batch
    return answers


def _failed(err: ServingError, route: Route) -> Failed:
    return Failed(err, route.error(err), None)


def _one(worker, request, h, route: Route, send) -> object:
    """One request's answer: its choices (OpenAI's n) generated one after another on the one
    cache, each streamed as it goes where the request streams."""
    gen: Generation = worker.loaded.generation
    started = gen.metrics.clock()  # the request has reached the worker
    try:
        route.check()
        direct = route.direct()
        if direct is not None:
            return direct
        req = route.parse(request, h.content_type, gen.max_body_bytes, gen.text)
        plan = loop.plan(req, gen.text, gen.runner.dec.vocab, gen.runner.dec.cache_length, gen.config)
    except ServingError as e:
        return _failed(e, route)
    out = _Out(route, send if route.streams(req.params.stream) else None)
    key = key_of(h.request_key)
    if gen.marks.is_gone(key):  # it waited in TorchServe's queue while its client went
        return _failed(gen.marks.error("before its generation started"), route)
    dones = []
    for i, one in enumerate(choices(req)):
        done = _choice(worker, gen, one, plan, out, i, key, started)
        if not isinstance(done, loop.Finished):
            return done  # the request's error answer
        dones.append(done)
        if i + 1 < req.n and out.streaming:
            out.send(route.choice_end(done, i))
    return Encoded(route.final(dones, out.streaming), route.media_type(out.streaming), {})


class _Out:
    """A request's streamed chunks (`send` None: it does not stream) and how many went out."""

    def __init__(self, route: Route, send):
        self.route, self._send, self.sent = route, send, 0
        self.streaming = send is not None

    def send(self, body: str) -> None:
        if self._send is not None and body:
            self._send(Encoded(body, self.route.media_type(), {}), self.route.error_event if self.sent == 0 else None)
            self.sent += 1

    def error(self, err) -> object:
        """The answer of a request that failed: whole before its first chunk, else its stream's last event."""
        return _failed(err, self.route) if self.sent == 0 else Encoded(self.route.error_event(err),
                                                                        self.route.media_type(), {})


def _choice(worker, gen: Generation, req, plan, out: _Out, index: int, key, started) -> object:
    """Choice `index`'s sequence, its tokens streamed: its Finished, or the request's error answer."""
    t0 = time.perf_counter()
    events = loop.generate(gen.runner, req, plan, gen.text, gen.metrics, started)
    gen.metrics.state(1, None, 1)  # one sequence running on the one cache; the queue is the frontend's
    try:
        for event in events:
            if gen.marks.is_gone(key):  # one stat per token
                err = gen.marks.error(f"after {out.sent} streamed tokens")
                logger.info("request %s: %s", key, err.message)
                return out.error(err)
            if isinstance(event, loop.Finished):
                logger.debug("generated %d tokens in %.3fs (%s)", len(event.ids), time.perf_counter() - t0, event.reason)
                return event
            if out.streaming:
                out.send(out.route.token(event, index))
    except Exception as e:  # noqa: BLE001  (the worker lives; the client is told)
        err = e if isinstance(e, ServingError) else ServingError(f"generation failed: {type(e).__name__}: {e}")
        if faults.is_sticky(e):
            worker.broken(f"generation: {type(e).__name__}: {e}")
        logger.exception("generation failed after %d streamed tokens", out.sent)
        return out.error(err)
    finally:
        events.close()  # a stopped generation leaves its inference mode and stream context now
        gen.metrics.state(0, None, 0)
    raise AssertionError("generation ended without its Finished event")
