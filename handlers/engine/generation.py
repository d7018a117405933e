"""The engine's generation (issue 64): a decoder's one continuous batch per GPU (a slot-form
decoder's slots, or a one-sequence decoder's lanes: handlers/run/lanes.py), fed by
every worker over the protocol's Generate / Tokens / Abort (handlers/engine/protocol.py).

The batch is handlers/generation/engine.py's, unchanged, running on its own thread in the
engine process. What differs from a worker running it in process (handlers/continuous.py) is
where text is: nowhere here. A worker tokenizes the prompt, checks it against the model and
its own settings (400 before anything is sent), and sends the ids with the stop ids and the
sampling; the engine sends back token ids, each turn's tokens of every sequence of one worker
in one Tokens message. The worker's own handlers/generation/loop.Sequence turns them into text
and events, so the stop conditions live there; `TokenSequence` here ends a sequence only at
its stop ids or its max_tokens, which the worker's Sequence ends at too (the same ids, the same
count), so both sides agree where the engine ends one. A stop string, a client gone or a
sibling choice failed ends it at the worker, which sends Abort: the slot is freed at the
engine's next turn and nothing more is sent for it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from handlers.engine import protocol as p
from handlers.errors import ServingError
from handlers.generation import engine as batching
from handlers.generation.abandon import Marks
from handlers.generation.logprobs import TokenLogprob
from handlers.generation.metrics import Off
from handlers.generation.request import Params

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenPlan:
    """The part of handlers/generation/loop.Plan the batch reads."""
    prompt: list
    max_tokens: int
    stop_ids: frozenset


class TokenSequence:
    """A sequence as the engine holds it: ids only. The interface handlers/generation/engine.py
    calls on a job's `seq` (params, plan, reason, take, finish)."""

    __slots__ = ("params", "plan", "count", "reason")

    def __init__(self, params: Params, plan: TokenPlan):
        self.params, self.plan, self.count, self.reason = params, plan, 0, None

    def take(self, tid: int, lp: Optional[TokenLogprob] = None) -> tuple:
        self.count += 1
        if tid in self.plan.stop_ids:
            self.reason = "eos_token"
        elif self.count >= self.plan.max_tokens:
            self.reason = "length"
        return tid, lp

    def finish(self) -> list:
        return []


def sequence_of(msg: p.Generate) -> TokenSequence:
    s = msg.sampling
    params = Params(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed, logprobs=s.logprobs)
    return TokenSequence(params, TokenPlan(list(msg.prompt), msg.max_tokens, frozenset(msg.stop_ids)))


def logprob_of(lp: Optional[TokenLogprob]) -> Optional[p.Logprob]:
    return None if lp is None else p.Logprob(float(lp.logprob), tuple((int(i), float(v)) for i, v in lp.top))


class Gauges(Off):
    """The batch's running, waiting and slots in use as its thread last set them (each turn and
    when it goes idle), read by the engine's State answer: the workers emit them as their
    generation gauges (handlers/generation/metrics.py `poll`). One tuple, replaced whole: a
    reader sees one turn's three values, never a mix."""

    def __init__(self):
        self.now = (0, 0, 0)

    def state(self, running, waiting, slots) -> None:
        self.now = (running, waiting, slots)


class Generation:
    """The engine's continuous batch and the workers' sequences in it: each job's tag is
    (session, the worker's id). `on_fault(reason)` (handlers/engine/core.Engine sets its `die`)
    ends the engine after a sticky device fault."""

    def __init__(self, runner, config, budget: batching.Budget, note: str):
        self.runner, self.note = runner, note
        self.queue_size = config.queue_size
        self.on_fault: Callable[[str], None] = lambda reason: logger.error("generation: %s", reason)
        self.gauges = Gauges()
        self.batch = batching.Engine(runner, self._deliver, config.queue_size, budget, lambda r: self.on_fault(r),
                                     config.queue_timeout_s, Marks.from_env(), self.gauges)
        self.lock = threading.Lock()
        self.jobs: dict = {}  # (session, id) -> the job, until its last message is sent

    def start(self) -> "Generation":
        self.batch.start()
        return self

    def info(self) -> p.GenerationInfo:
        dec = self.runner.dec
        return p.GenerationInfo(dec.slots, dec.vocab, dec.cache_length, self.queue_size,
                                f"{dec.describe()}; {self.note}; {self.runner.graph_note}")

    def submit(self, session, msg: p.Generate) -> None:
        """Queues the sequence, or answers Failed at once (503 Busy: every slot busy and the
        queue full)."""
        job = batching.Job(sequence_of(msg), (session, msg.id), key=msg.key or None)
        with self.lock:
            self.jobs[(session, msg.id)] = job
        try:
            self.batch.submit(job)
        except ServingError as e:
            with self.lock:
                self.jobs.pop((session, msg.id), None)
            session.reply(_failed(msg.id, e))

    def abort(self, session, job_id: int) -> bool:
        """The worker ended the sequence: taken out at the batch's next turn, nothing more sent.
        False where it is not one of this worker's sequences (an Infer's Abort)."""
        with self.lock:
            job = self.jobs.pop((session, job_id), None)
        if job is not None:
            self.batch.cancel([job])
        return job is not None

    def disconnect(self, session) -> None:
        """The worker is gone: its sequences are taken out at the next turn."""
        with self.lock:
            mine = [k for k in self.jobs if k[0] is session]
            jobs = [self.jobs.pop(k) for k in mine]
        if jobs:
            self.batch.cancel(jobs)

    def stop(self) -> None:
        """The engine died: every sequence is taken out at the batch's next turn, nothing more
        sent (the workers fail theirs with EngineDead), and its thread goes idle."""
        with self.lock:
            jobs, self.jobs = list(self.jobs.values()), {}
        if jobs:
            self.batch.cancel(jobs)

    def _deliver(self, updates: list) -> None:
        """The batch's turn, on its thread: one Tokens per worker with the sequences' new ids,
        a Failed for each that failed; nothing for a sequence its worker ended."""
        out: dict = {}
        for job, events, err in updates:
            session, job_id = job.tag
            with self.lock:
                if self.jobs.get((session, job_id)) is not job:
                    continue  # aborted by its worker (or its worker is gone)
                if err is not None or job.seq.reason is not None:
                    del self.jobs[(session, job_id)]
            if err is not None:
                session.reply(_failed(job_id, err))
                continue
            ids = tuple(int(tid) for tid, _ in events)
            lps = tuple(logprob_of(lp) for _, lp in events) if job.seq.params.logprobs is not None else ()
            out.setdefault(session, []).append(p.Emitted(job_id, ids, lps, job.seq.reason or ""))
        for session, items in out.items():
            session.reply(p.Tokens(tuple(items)))


def _failed(job_id: int, e: ServingError) -> p.Failed:
    return p.Failed(job_id, e.status, e.error_type, e.message, bool(getattr(e, "retryable", False)))
