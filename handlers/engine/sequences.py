"""The worker's side of the engine's generation (handlers/engine/generation.py): its sequences
sent as Generate, their token ids turned into events by the worker's own Sequence.

`RemoteBatch` has the two calls handlers/continuous.py makes of handlers/generation/engine.Engine
(`submit(*jobs)`, `cancel(jobs)`) and hands `deliver` the same updates, [(job, events, error)],
so a worker serves the same requests, answers and streams whether its batch runs in process or
in the engine. Each job's `seq` is the worker's handlers/generation/loop.Sequence (text, stop
strings, metrics); the engine holds ids only. Where the worker's Sequence ends a sequence the
engine goes on with (a stop string), the worker sends Abort. The updates are delivered on the
client's reader thread, one call per Tokens message (one per turn of the engine).

An engine that dies fails every sequence in flight with EngineDead (503, retryable), and so is
every request until its successor answers: a thread of this worker connects to it (`connect`:
handlers/engine/link.py starts one where none answers), never the request's own (TorchServe's
async worker calls `submit` on its event loop, which a connection that waits for an engine's
load would stop).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from handlers import errors
from handlers.engine import protocol as p
from handlers.engine.client import remote_error
from handlers.engine.runner import Successor
from handlers.generation import engine as batching
from handlers.generation.logprobs import TokenLogprob

logger = logging.getLogger(__name__)


def generate_message(job_id: int, job) -> p.Generate:
    """A job's Generate: its plan's ids and stops, its request's sampling, the pod's key."""
    seq, params = job.seq, job.seq.params
    sampling = p.Sampling(float(params.temperature), int(params.top_k), float(params.top_p), params.seed,
                          params.logprobs)
    return p.Generate(job_id, tuple(seq.plan.prompt), int(seq.plan.max_tokens), tuple(sorted(seq.plan.stop_ids)),
                      sampling, job.key or "")


def error_of(msg: p.Failed) -> errors.ServingError:
    """A sequence's Failed as its typed error (Busy keeps its class: its answer carries Retry-After)."""
    if msg.status == batching.Busy.status and msg.error_type == batching.Busy.error_type:
        return batching.Busy(msg.message)
    return remote_error(msg)


class RemoteBatch:
    def __init__(self, connect: Callable, deliver: Callable):
        self.connect, self.deliver = connect, deliver
        self.lock = threading.Lock()
        self.jobs: dict = {}  # the engine's id -> job, while the engine runs it
        self.ids: dict = {}  # job -> its id
        self.client = None
        self._successor = Successor(self.connect, self.attach)

    def attach(self, client) -> None:
        """Answers come from `client` from now on (a dead predecessor's no longer reach here)."""
        if self.client is not None and self.client is not client:
            self.client.streams = None
        client.streams, client.on_dead = self, self._gone
        client.read_continuously()  # Tokens come with nobody waiting for them
        self.client = client

    def _gone(self, reason: str) -> None:
        """The client found its engine gone: its successor is connected on a thread of its own."""
        self._successor.reach(reason)

    def engine_state(self) -> dict:
        """The engine as this worker sees it (handlers/worker.Worker.describe: the pod's readiness)."""
        client = self.client
        return {"pid": getattr(getattr(client, "ready", None), "pid", None), "connected": client.dead is None,
                "reason": None if client.dead is None else f"the engine is gone ({client.dead}); its successor is "
                                                           "being reached"}

    def gauges(self) -> Optional[tuple]:
        """The engine's batch now, (running, waiting, slots in use), asked with State; None where
        the engine does not answer within a second (gone, or its successor loading): a gauge
        keeps its last value rather than report a batch nobody measured."""
        client = self.client
        try:
            s = client.state(timeout=1.0)
        except Exception as e:  # noqa: BLE001  (the metrics' thread asks; a request never waits on it)
            logger.debug("engine state not read: %s", e)
            return None
        return None if s.running < 0 else (s.running, s.waiting, s.slots_in_use)

    def submit(self, *jobs) -> None:
        """Sends each job's Generate (a request's choices together); an engine found dead before
        raises EngineDead (503, retry), nothing sent; a refusal comes back as each job's Failed.
        An engine that dies while they are sent fails them through `deliver`, once: whichever
        of this call and the client's sweep (`dead`) takes a job from `jobs` answers it."""
        client = self.client
        if client.dead:
            raise errors.EngineDead(f"the engine is gone ({client.dead}); a new one is starting: retry")
        msgs = []
        with self.lock:
            for job in jobs:
                job_id = client.new_id()
                self.jobs[job_id], self.ids[job] = job, job_id
                msgs.append(generate_message(job_id, job))
        try:
            for msg in msgs:
                client.send_stream(msg)
        except errors.EngineDead:
            pass
        if client.dead:  # it died meanwhile, maybe before its sweep could see these
            self._fail([m.id for m in msgs], errors.EngineDead(f"the engine is gone ({client.dead}); retry"))

    def _fail(self, job_ids: list, err: errors.ServingError) -> None:
        """Fails the jobs of these ids still held (each answered once: taken under the lock)."""
        with self.lock:
            jobs = [self.jobs.pop(i) for i in job_ids if i in self.jobs]
            for job in jobs:
                self.ids.pop(job, None)
        if jobs:
            self.deliver([(job, [], err) for job in jobs])

    def cancel(self, jobs) -> None:
        """The worker ended these (a sibling choice failed): Abort each the engine still runs."""
        for job in jobs:
            self._forget(job, abort=True)

    def _forget(self, job, abort: bool) -> None:
        with self.lock:
            job_id = self.ids.pop(job, None)
            if job_id is not None:
                self.jobs.pop(job_id, None)
        if abort and job_id is not None and self.client is not None:
            self.client.send_quiet(p.Abort(job_id))

    # --- the client's reader thread ---

    def tokens(self, msg: p.Tokens) -> None:
        updates = []
        for item in msg.items:
            with self.lock:
                job = self.jobs.get(item.id)
            if job is not None:
                updates.append((job, self._events(job, item), None))
        if updates:
            self.deliver(updates)

    def _events(self, job, item: p.Emitted) -> list:
        """The worker's events of a sequence's tokens of one turn; at its end, the job
        forgotten (and Abort sent where only the worker ended it: a stop string)."""
        seq, events = job.seq, []
        for k, tid in enumerate(item.tokens):
            lp = item.logprobs[k] if item.logprobs else None
            events.append(seq.take(tid, None if lp is None else TokenLogprob(tid, lp.logprob, tuple(lp.top))))
            if seq.reason is not None:
                break
        if seq.reason is None and item.done:  # the engine ended it where this Sequence did not
            seq.reason = item.done
        if seq.reason is not None:
            events += seq.finish()
            self._forget(job, abort=not item.done)
        return events

    def failed(self, msg: p.Failed) -> bool:
        """A sequence's Failed (True), or not one of this worker's sequences (False)."""
        with self.lock:
            job = self.jobs.pop(msg.id, None)
            if job is not None:
                self.ids.pop(job, None)
        if job is None:
            return False
        self.deliver([(job, [], error_of(msg))])
        return True

    def dead(self, reason: str) -> None:
        """The engine is gone: every sequence in flight fails with EngineDead (503, retryable)."""
        with self.lock:
            jobs, self.jobs, self.ids = list(self.jobs.values()), {}, {}
        if jobs:
            err = errors.EngineDead(f"the engine is gone: {reason}; retry")
            self.deliver([(job, [], err) for job in jobs])


class RemoteSlots:
    """What handlers/continuous.Continuous reads of a runner, for a worker whose batch is the
    engine's: the decoder's facts (handlers/artifact/decoder.Decoder, from the spec) and the
    engine's account of its graphs and budget."""

    cuda = False

    def __init__(self, dec, note: str, remote: Optional[RemoteBatch] = None):
        self.dec, self.graph_note, self.remote = dec, note, remote

    def describe(self) -> Optional[str]:
        return self.graph_note

    def engine_state(self) -> dict:
        return self.remote.engine_state()
