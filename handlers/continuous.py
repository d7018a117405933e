"""The third way a worker serves (beside batches, handlers/pipeline.py, and one sequence at a time,
handlers/generating.py): continuous batching of a slot-form decoder (handlers/artifact/decoder.py)
by handlers/generation/engine.py, whose thread owns the cache and answers every request as its
sequence goes.

The archive serves such a model with TorchServe 0.12's `asyncCommunication` (cs-archive writes it
in model-config.yaml): the frontend writes each request to the worker as it arrives, without
waiting for the answers to earlier ones, and TorchServe's async worker (ts/async_service.py) awaits
what `handle` returns; so `handle_async` parses and queues a batch's requests and awaits their
last answers while the engine runs, and sequences that arrive later join the running batch.
Without `--async` (a model-config that drops the setting) `serve` waits for its batch instead:
the same engine, with as many sequences at once as TorchServe's batch holds.

Facts of TorchServe 0.12 this relies on:
- every answer's chunks are frames marked ts_stream_next true, and its last frame carries
  ts_stream_next false; the async frontend (AsyncBatchAggregator.sendResponse) forgets a request
  only on that false, and keeps every other request it was sent for the worker's lifetime;
- a REST answer marked false that follows no chunk loses its status line (RestJob.response
  writes it as a stream's end), so an answer with no token chunks goes out as a frame of its own
  first (a chunk with its status, headers and body; an error whole, replies.send_chunks) and the
  last frame is empty;
- a non-200 code for a whole batch reply fails every request the worker holds, so nothing here
  raises out of `handle_async`: each request gets its own status.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Callable, Optional

from handlers.errors import ServingError
from handlers.generation import engine as engines
from handlers.generation import loop
from handlers.generation.abandon import Marks, key_of
from handlers.generation.formats import Route
from handlers.generation.metrics import OFF
from handlers.generation.openai import route_for
from handlers.generation.request import choices
from handlers.torchserve import headers as ts_headers
from handlers.torchserve import guardian, replies
from handlers.wire.base import Encoded, Failed

logger = logging.getLogger(__name__)
LOCK = replies.FRAME_LOCK  # this worker's own frame writers (replies.send_chunks)


class Client:
    """One request's side of its sequences (one per choice, OpenAI's n: each engine Job's tag is
    (client, choice)): how its answer is encoded, the chunks sent so far, each choice's Finished,
    and the future that its last answer resolves."""

    __slots__ = ("route", "streaming", "rest", "request_id", "future", "sent", "own_chunk", "jobs", "dones", "over")

    def __init__(self, route: Route, rest: bool, request_id: str, own_chunk: bool):
        self.route, self.rest, self.request_id = route, rest, request_id
        self.streaming, self.sent = False, 0
        self.own_chunk = own_chunk and rest  # async REST: an answer without chunks goes as one (module docstring)
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs, self.dones, self.over = [], [], False  # over: its last answer is out

    def event(self, ev, index: int) -> tuple:
        """(a chunk to send or None, the last answer or None) for choice `index`'s event: a
        token's chunk where it streams; at a Finished, the last answer once every choice is done,
        else (streaming) the chunk that ends this choice."""
        route = self.route
        if isinstance(ev, loop.Finished):
            self.dones[index] = ev
            if all(d is not None for d in self.dones):
                self.over = True
                return None, Encoded(route.final(self.dones, self.streaming), route.media_type(self.streaming), {})
            body = route.choice_end(ev, index) if self.streaming else ""
        else:
            body = route.token(ev, index) if self.streaming else ""
        if not body:
            return None, None
        if self.sent == 0:
            guardian.streaming(self.request_id, route.error_event(guardian.DIED), route.media_type())
        self.sent += 1
        return (self.request_id, Encoded(body, route.media_type(), {})), None

    def last(self, answer) -> tuple:
        """(the chunk to send first or None, the last answer)."""
        if self.own_chunk and self.sent == 0:
            self.sent = 1
            guardian.answering(self.request_id, answer)
            encoded = answer.encoded if type(answer) is Failed else answer
            return (self.request_id, answer), Encoded("", encoded.media_type, {})
        return None, answer


class Continuous:
    """What a slot-decoder worker keeps: its runner, tokenizer, settings and the engine."""

    def __init__(self, runner, text, config, max_body_bytes: int):
        self.runner, self.text, self.config = runner, text, config
        self.max_body_bytes = max_body_bytes
        self.engine: Optional[engines.Engine] = None
        self.budget_note = ""
        self.sock = None
        self.metrics = OFF  # handlers/generation/metrics.py, set by the worker before the engine starts

    def use(self, metrics) -> None:
        """Counts and times generation in `metrics`, given the gauges by the engine `start` makes,
        or, where the batch is the engine process's (`serve_through` came first), asked of it at
        each of the metrics' flushes (every worker reports the one batch of its GPU)."""
        self.metrics = metrics
        remote_gauges = getattr(self.engine, "gauges", None)
        if remote_gauges is not None and hasattr(metrics, "poll"):
            metrics.poll = remote_gauges

    def start(self, budget: "engines.Budget", note: str, broken: Callable) -> None:
        self.budget_note = note
        self.engine = engines.Engine(self.runner, self._deliver, self.config.queue_size, budget, broken,
                                     self.config.queue_timeout_s, Marks.from_env(), self.metrics).start()

    def serve_through(self, remote, note: str) -> None:
        """The batch is the engine's (handlers/engine/sequences.RemoteBatch: the same submit and
        cancel, the same updates to `_deliver`), not a thread of this worker's."""
        self.budget_note, self.engine = note, remote

    def describe(self) -> str:
        return (f"{self.runner.dec.describe()}; continuous batching of up to {self.runner.dec.slots} sequences, "
                f"{self.config.queue_size} more waiting; {self.budget_note}; {self.runner.graph_note}; "
                + ("tokenizer.json" if self.text else "token ids only (no tokenizer.json in the archive)")
                + f"; end-of-sequence ids {list(loop.eos_ids(self.config, self.text))}")

    def serve(self, worker, data: list, heads: list, send=None) -> list:
        """The batch's last answers, its sequences run together (the warm-up and tests: no chunks)."""
        return [c.future.result() for c in self.submit(worker, data, heads, None, own_chunk=False)]

    def submit(self, worker, data: list, heads: list, context, own_chunk: bool) -> list:
        """A Client per request, its sequence queued (or its last answer already set)."""
        refusal = worker.health.refusal()
        clients = []
        for idx, (request, h) in enumerate(zip(data, heads)):
            started = self.metrics.clock()  # the request has reached the worker
            rid = context.request_ids[idx] if context is not None else str(idx)
            c = Client(route_for(h, worker.name, worker.version), h.rest, rid, own_chunk)
            if context is not None:
                self.sock = context.cl_socket
            clients.append(c)
            try:
                if refusal is not None:
                    raise refusal
                c.route.check()
                direct = c.route.direct()
                if direct is not None:
                    self._finish([(c, direct)])
                    continue
                self._queue(c, c.route.parse(request, h.content_type, self.max_body_bytes, self.text), started,
                            key_of(h.request_key))
            except Exception as e:  # noqa: BLE001  (a raise here would fail every request the async frontend holds)
                if not isinstance(e, ServingError):
                    logger.exception("request %s could not be queued", rid)
                    e = ServingError(f"generation failed: {type(e).__name__}: {e}")
                self._finish([(c, _failed(e, c.route))])
        return clients

    def _queue(self, c: Client, req, started: float, key) -> None:
        """The request's sequences, one per choice, queued together (Busy for all where there is
        no room for all); a plan of no tokens (echo with max_tokens 0) answered without the engine."""
        dec = self.runner.dec
        plan = loop.plan(req, self.text, dec.vocab, dec.cache_length, self.config)
        c.streaming = c.route.streams(req.params.stream)
        c.jobs = [engines.Job(loop.Sequence(r, plan, self.text, self.metrics, started), (c, i), key=key)
                  for i, r in enumerate(choices(req))]
        c.dones = [None] * len(c.jobs)
        if plan.max_tokens == 0:
            self._deliver([(job, job.seq.finish(), None) for job in c.jobs])
        else:
            self.engine.submit(*c.jobs)

    def _deliver(self, updates: list) -> None:
        """The engine's turn, on its thread: every token chunk of the turn in one frame, then the
        last answers. A choice that failed fails its request, whose other choices are cancelled."""
        chunks, last = [], []
        for job, events, err in updates:
            c, index = job.tag
            if c.over:
                continue
            if err is not None:
                c.over = True
                others = [j for j in c.jobs if j is not job]
                if others:
                    self.engine.cancel(others)
                last.append((c, _failed(err, c.route) if c.sent == 0 else
                             Encoded(c.route.error_event(err), c.route.media_type(), {})))
                continue
            for ev in events:
                chunk, answer = c.event(ev, index)
                if chunk is not None:
                    chunks.append(chunk)
                if answer is not None:
                    last.append((c, answer))
        self._finish(last, chunks)

    def _finish(self, last: list, chunks: list = ()) -> None:
        answers = _lasts(self.sock, last, chunks)
        for (c, _), answer in zip(last, answers):
            c.future.set_result(answer)


def _lasts(sock, last: list, chunks=()) -> list:
    """The last answers to return for [(client, answer)], after one frame to `sock` (None: no
    frontend) with `chunks` and each answer that must go out as a chunk of its own first."""
    chunks, answers, own = list(chunks), [], []
    for c, answer in last:
        first, answer = c.last(answer)
        if first is not None:
            chunks.append(first)
            own.append((c.request_id, answer.media_type))
        answers.append(answer)
    if chunks and sock is not None:
        replies.send_chunks(sock, LOCK, chunks)
    for rid, media_type in own:
        guardian.answered(rid, media_type)
    return answers


def _failed(err: ServingError, route: Route) -> Failed:
    encoded = route.error(err)
    if isinstance(err, engines.Busy):
        encoded = Encoded(encoded.body, encoded.media_type, {**encoded.headers, "Retry-After": str(engines.RETRY_AFTER_S)})
    return Failed(err, encoded, None)


def serves(worker) -> bool:
    return worker.loaded is not None and isinstance(worker.loaded.generation, Continuous)


def handle_sync(worker, data: list, context) -> list:
    """TorchServe's batch protocol: the batch's sequences run, and their answers return, together.
    The guardian (its sync mode, handlers/torchserve/guardian.py ends_streams) is told the batch's
    requests ended before TorchServe writes their last frames (ts/model_service_worker.py, after
    this returns), as handlers/torchserve/exchange.py tells it: the sync frontend's
    BatchAggregator.sendResponse raises IllegalStateException on a frame for a request it no longer
    holds, and its WorkerThread then ends the stream under way with a whole new HTTP response
    (RestJob.sendError), which cuts the client's connection."""
    cont: Continuous = worker.loaded.generation
    try:
        clients = cont.submit(worker, data, [ts_headers.read(context, i) for i in range(len(data))], context,
                              own_chunk=False)
        return _reply(context, clients, [c.future.result() for c in clients])
    finally:
        guardian.ended(tuple(context.request_ids.values()))


async def handle_async(worker, data: list, context) -> list:
    """TorchServe's async worker: the batch's sequences queued, their last answers awaited (while
    other batches' sequences join), each answer's status set on `context`, every last frame
    marked ts_stream_next false. A worker that serves no slot decoder (its load failed, or
    asyncCommunication on another model) answers the batch at once, each answer as a chunk of its own."""
    heads = [ts_headers.read(context, i) for i in range(len(data))]
    if not serves(worker):
        clients = [Client(Route("predictions", worker.name, worker.version), h.rest, context.request_ids[i], True)
                   for i, h in enumerate(heads)]
        answers = _lasts(context.cl_socket, list(zip(clients, worker.serve(data, heads))))
        return _reply(context, clients, answers, every=True)
    cont: Continuous = worker.loaded.generation
    clients = cont.submit(worker, data, heads, context, own_chunk=True)
    return _reply(context, clients, [await asyncio.wrap_future(c.future) for c in clients], every=True)


def _reply(context, clients: list, answers: list, every: bool = False) -> list:
    """The last answers' bodies, set on `context`; the last frame of every request the async
    frontend holds (`every`), or of each that streamed, marked ts_stream_next false."""
    bodies = replies.write(context, answers)
    for i, c in enumerate(clients):
        if every or c.sent:
            context.set_response_header(i, replies.STREAM_NEXT, "false")
    return bodies
