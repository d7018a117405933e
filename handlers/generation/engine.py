"""Continuous batching: many sequences on a slot-form decoder's one cache
(handlers/run/slots.py), or on a one-sequence decoder's lanes in the engine (handlers/run/lanes.py,
a lane standing for a slot), run by one thread that owns the runner.

Each turn of the loop:
1. newcomers take free slots (the lowest first, so busy slots stay packed and the step sizes
   small), oldest first; the rest wait in a queue of `queue_size` (a full queue refuses at once:
   `submit` raises Busy, a 503 with a retry hint);
2. one decode step for every sequence past its prompt, a row each, in one call, launched before
   the last step's tokens are read (its inputs are those tokens, still on the device), so the GPU
   runs a step while the host reads, sends and prepares the turn;
3. one prompt call for the oldest sequences still filling their slots: a chunk of each of up to
   `budget.rows` of them, of up to `budget.tokens` tokens each, in one call (a row per sequence,
   the weights read once for all), the budget measured at load so that the call takes no longer
   than a decode step of every slot (`measure_budget`): newcomers' prompts delay the running
   sequences' next token by at most about one step. With no sequence decoding, every waiting
   prompt goes in whole, as many sequences per call as the runner takes;
4. the last turn's step's tokens read back (one copy and one wait for all rows, while this
   turn's step and prompt chunk run on the GPU; with the log probabilities of the rows whose
   request asked, in the same copy: handlers/generation/logprobs.py), each turned into its sequence's event
   (handlers/generation/loop.Sequence) and handed to `deliver`; a sequence that stops frees its slot.

A sequence's tokens do not depend on what runs beside it: its rows read only its own slot, and
its sampling draws from its own generator (handlers/generation/sampling.py).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from handlers import faults
from handlers.errors import ServingError
from handlers.generation import logprobs, sampling
from handlers.generation.abandon import Marks
from handlers.generation.loop import Sequence
from handlers.generation.metrics import OFF

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1


class Busy(ServingError):
    """Every slot is busy and the queue is full: the client should retry (503, Retry-After)."""

    status = 503
    error_type = "ServiceUnavailable"


@dataclass(eq=False)
class Job:
    """One sequence: its request's Sequence, its generator, and where it is in the cache."""
    seq: Sequence
    tag: object  # the serving side's handle (handlers/continuous.py)
    gen: Optional[torch.Generator] = None
    slot: int = -1
    filled: int = 0  # prompt tokens in the cache
    pos: int = 0  # the position the next decode step writes
    token: Optional[torch.Tensor] = None  # int64[1] on the device: the next step's input
    queued: float = 0.0  # time.monotonic() at submit
    key: Optional[str] = None  # the pod's name for its request, whose mark says its client went (abandon.py)
    first: Optional[torch.Tensor] = None  # its first token's logprobs.pack row, where its request asked
    cancelled: bool = False  # `Engine.cancel`: its request was answered without it (a sibling choice failed)


@dataclass(frozen=True)
class Budget:
    """The prompt work of one turn while sequences decode: a chunk of up to `tokens` tokens of
    each of up to `rows` sequences, in one call."""
    rows: int
    tokens: int


@dataclass
class Step:
    """A launched decode step: its rows, their tokens' host copy (int64[n], or the float64 table of
    handlers/generation/logprobs.py where a row asked for log probabilities) and the event
    recorded after it."""
    rows: list
    host: torch.Tensor
    event: Optional[object]


class Engine:
    """`deliver(updates)`: [(job, events, error)] after each turn, events a list of loop.Token
    and, last for a sequence that ended, loop.Finished; error a ServingError when its generation
    failed. `metrics` (handlers/generation/metrics.py) is given the gauges each turn."""

    def __init__(self, runner, deliver: Callable, queue_size: int, budget: Budget, broken: Callable = None,
                 queue_timeout_s: float = 0.0, marks: Optional[Marks] = None, metrics=OFF):
        self.runner, self.deliver, self.queue_size, self.budget = runner, deliver, queue_size, budget
        self.metrics = metrics
        self.queue_timeout_s = queue_timeout_s
        self.marks = marks or Marks(None)
        self.broken = broken
        self.slots = runner.dec.slots
        self.free = list(range(self.slots))
        self.waiting: collections.deque = collections.deque()
        self.filling: list = []
        self.ready: list = []  # prompt whole, first token on the device: joins the next step
        self.inflight: Optional[Step] = None  # the step launched last turn, its tokens not read yet
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="continuous-batching", daemon=True)
        # a step's tokens come back through one of two pinned buffers, taken in turn: step t is
        # read (after a wait on its event) in turn t + 1, before step t + 2 copies into its buffer
        cuda = runner.cuda
        self.hosts = [torch.empty(self.slots, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        # and, in a turn where a row asked for log probabilities, its table through one of these
        self.tables = [torch.empty(self.slots * (2 + 2 * logprobs.MAX_TOP), dtype=torch.float64, pin_memory=cuda)
                       for _ in range(2)]
        self.cancels = 0  # jobs marked cancelled and not yet taken out (`cancel`)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.launched = 0
        self.stats = TurnStats()

    def start(self) -> "Engine":
        self.thread.start()
        return self

    def submit(self, *jobs: Job) -> None:
        """Queues `jobs` (a request's choices: all or none); raises Busy when every slot is busy
        and the queue has no room for them."""
        for job in jobs:
            job.gen = sampling.generator(job.seq.params, self.runner.device)
            job.queued = time.monotonic()
        with self.cond:
            if len(self.waiting) + len(jobs) - len(self.free) > self.queue_size:  # every slot taken, and the queue
                raise Busy(f"all {self.slots} sequence slots are busy and {len(self.waiting)} sequences wait "
                           f"(handler.queue_size {self.queue_size}); retry after {RETRY_AFTER_S} s")
            self.waiting.extend(jobs)
            self.cond.notify()

    def cancel(self, jobs: list) -> None:
        """Takes `jobs` out at the next turn, wherever they are (as `_abandon` takes out those whose
        client went): their request has been answered without them."""
        with self.cond:
            for job in jobs:
                if not job.cancelled and job.seq.reason is None:
                    job.cancelled = True
                    self.cancels += 1

    def _run(self) -> None:
        """The engine's thread: turns while there is work. It never ends on an error: a failed
        turn fails the sequences in the cache, and a failure to tell them is logged."""
        with torch.inference_mode(), self.runner.stream_context():
            while True:
                with self.cond:
                    if not self._busy():
                        self.stats.log_and_reset()
                        self._gauges()
                    while not self._busy():
                        self.cond.wait()
                    expired = self._begin()
                    self._gauges()
                try:
                    updates = expired + (self._turn() if self._busy() else [])
                    t = time.perf_counter()
                    self.deliver(updates)
                    self.stats.lap("deliver", t)
                except Exception as e:  # noqa: BLE001  (every sequence in the cache is told)
                    self._fail_all(e)

    def _gauges(self) -> None:
        """Under the lock: the sequences decoding (holding a slot, prompt whole), those waiting
        for a slot, and the slots held (decoding or filling a prompt)."""
        held = self.slots - len(self.free)
        self.metrics.state(held - len(self.filling), len(self.waiting), held)

    def _busy(self) -> bool:
        return bool(self.waiting or self.filling or self.ready or self.inflight)

    def _begin(self) -> list:
        """A turn's start, under the lock: the failed updates of the waiting sequences past their
        deadline and of those whose clients went, taken out first; then newcomers into the free
        slots."""
        out = self._expire() + self._abandon()
        self._admit()
        return out

    def _expire(self) -> list:
        """Failed updates for the waiting sequences that waited past queue_timeout_s, taken out
        of the queue before they start: TorchServe never says whether their clients are still
        there (docs/generation.md), and a client that went would still cost a slot's time."""
        if not self.queue_timeout_s:
            return []
        now, out = time.monotonic(), []
        while self.waiting and now - self.waiting[0].queued > self.queue_timeout_s:
            job = self.waiting.popleft()
            out.append((job, [], Busy(f"the sequence waited {now - job.queued:.1f} s for one of the {self.slots} "
                                      f"slots, longer than handler.queue_timeout_s {self.queue_timeout_s:g}, "
                                      f"and was not started; retry after {RETRY_AFTER_S} s")))
        return out

    def _abandon(self) -> list:
        """Failed updates (ClientGone) for the sequences whose clients went (abandon.py: one
        listing of the marks per turn), each taken out wherever it is and its slot freed before
        this turn's step is launched, so that step and the prompt call no longer run it. Last
        turn's step, already on the stream, still writes its slot: a newcomer given the slot
        writes that position (its prompt, or its own step, which writes before it attends)
        before it reads it, as for any sequence that stopped. The sequences `cancel` named are
        taken out the same way."""
        if self.marks.directory is None and not self.cancels:  # no pod: nothing is ever marked
            return []
        decoding = [j for j in (self.inflight.rows if self.inflight else []) if j.seq.reason is None]
        held = list(self.waiting) + self.filling + self.ready + decoding
        gone = self.marks.gone(j.key for j in held)
        if not gone and not self.cancels:
            return []
        out, self.cancels = [], 0
        for job in held:
            if (job.key not in gone and not job.cancelled) or job.seq.reason is not None:
                continue
            job.seq.reason = "abandoned"  # the read of last turn's step passes it by (_turn)
            for queue in (self.waiting, self.filling, self.ready):
                if job in queue:
                    queue.remove(job)
            if job.slot >= 0:
                self._release(job)
            out.append((job, [], self.marks.error("before its generation ended")))
        return out

    def _admit(self) -> None:
        self.free.sort()
        while self.waiting and self.free:
            job = self.waiting.popleft()
            job.slot = self.free.pop(0)
            self.filling.append(job)

    def _turn(self) -> list:
        """Launch this turn's step, fill prompts, then read the last turn's step (module docstring).
        A sequence that stopped at the last step runs in this one too, its slot freed only after
        the launch: it writes its own slot at a position a later holder writes before reading."""
        prev, updates = self.inflight, []
        rows = [j for j in (prev.rows if prev else []) if j.seq.reason is None] + self.ready
        t = self.stats.start(len(rows))
        self.inflight = self._launch(rows) if rows else None
        self.ready = []  # in the step now (cleared after the launch: a failed launch still finds them to fail)
        t = self.stats.lap("step", t)
        started = self._fill(budget=self.budget if rows else None)
        t = self.stats.lap("prompts", t)
        if prev is not None:
            if prev.event is not None:
                prev.event.synchronize()
            tids, lps = logprobs.read(prev.host, [j.seq.params.logprobs for j in prev.rows])
            updates += self._take([(j, tid, lp) for j, tid, lp in zip(prev.rows, tids, lps) if j.seq.reason is None])
        if started:
            host = logprobs.stacked([j.token for j in started], [j.first for j in started])
            updates += self._take(list(zip(started, *logprobs.read(host, [j.seq.params.logprobs for j in started]))))
            self.ready = [j for j in self.ready if j.seq.reason is None]
        self.stats.lap("wait", t)
        return updates

    def _launch(self, rows: list) -> Step:
        """One decode step of `rows`, padded (on a graph) onto free slots at position 0 and onto
        slots whose prompt is being filled at their next prompt position; its tokens' copy out."""
        spare = [(s, 0) for s in sorted(self.free)] + [(j.slot, j.filled) for j in self.filling]
        logits = self.runner.step([j.slot for j in rows], torch.cat([j.token for j in rows]), [j.pos for j in rows],
                                  spare)
        nxt, table = self._pick(logits, rows)
        for i, j in enumerate(rows):
            j.token, j.pos = nxt[i:i + 1], j.pos + 1
        k, self.launched = self.launched % 2, self.launched + 1
        out = nxt if table is None else table
        if not self.runner.cuda:
            return Step(rows, out, None)
        host = (self.hosts[k] if table is None else self.tables[k])[:out.numel()].view(out.shape)
        host.copy_(out, non_blocking=True)
        self.events[k].record()
        return Step(rows, host, self.events[k])

    def _pick(self, logits: torch.Tensor, rows: list) -> tuple:
        """(int64[n]: each row's next token (greedy rows in one argmax, sampled rows by their own
        generator), and the table of log probabilities where a row's request asked, else None).
        A row None is passed by (a prompt not yet whole: its generator draws nothing)."""
        out = logits.argmax(-1)
        for i, j in enumerate(rows):
            if j is not None and j.gen is not None:
                out[i:i + 1] = sampling.pick(logits[i], j.seq.params, j.gen).view(1)
        return out, logprobs.pack(out, logits, [j.seq.params.logprobs if j is not None else None for j in rows])

    def _fill(self, budget: Optional[Budget]) -> list:
        """Prompt chunks of the filling sequences, oldest first: with sequences decoding, one call
        within `budget`; else (None) every waiting prompt whole, in calls of as many sequences as
        the runner takes, chunks of at most its `chunk_limit`. The sequences whose prompt is now
        whole, each with its first token sampled, moved to `ready` (where a failure later in the
        turn still finds them)."""
        started, runner = [], self.runner
        rows, tokens = (budget.rows, budget.tokens) if budget else (runner.prompt_rows, runner.chunk_limit)
        while self.filling:
            jobs = self.filling[:rows]
            chunks = [j.seq.plan.prompt[j.filled:j.filled + tokens] for j in jobs]
            logits = runner.prefill_rows([j.slot for j in jobs], chunks, [j.filled for j in jobs], self._spare(jobs))
            for job, chunk in zip(jobs, chunks):
                job.filled += len(chunk)
            whole = [j if j.filled == len(j.seq.plan.prompt) else None for j in jobs]
            if any(whole):
                started += self._first_tokens(whole, logits)
            if budget is not None:
                break
        return started

    def _first_tokens(self, jobs: list, logits: torch.Tensor) -> list:
        """The first tokens of the `jobs` whose prompts are whole (None: a row whose is not;
        `logits` the prompt call's rows), picked as a step's are; each moved to `ready`."""
        tokens, table = self._pick(logits, jobs)
        out = []
        for i, job in enumerate(jobs):
            if job is not None:
                job.token, job.first = tokens[i:i + 1], table[i] if table is not None else None
                job.pos = job.filled
                self.filling.remove(job)
                self.ready.append(job)
                out.append(job)
        return out

    def _spare(self, jobs: list) -> list:
        """Where a prompt call's padding rows may write (handlers/run/slots.py), outside `jobs`:
        free slots from position 0, the other filling prompts from their next position, and the
        sequences past their prompt from the position their next step writes (a step writes its
        position before it attends, and attends no further)."""
        inside = {j.slot for j in jobs}
        decoding = (self.inflight.rows if self.inflight else []) + self.ready
        return ([(s, 0) for s in sorted(self.free)]
                + [(j.slot, j.filled) for j in self.filling if j.slot not in inside]
                + [(j.slot, j.pos) for j in decoding if j.slot >= 0])

    def _take(self, read: list) -> list:
        """The updates of [(job, token id, TokenLogprob or None)] read back."""
        updates = []
        for job, tid, lp in read:
            events = [job.seq.take(tid, lp)]
            if job.seq.reason is not None:
                events += job.seq.finish()
                self._release(job)
            updates.append((job, events, None))
        return updates

    def _release(self, job: Job) -> None:
        with self.cond:
            self.free.append(job.slot)
            job.slot = -1

    def _fail_all(self, e: Exception) -> None:
        err = e if isinstance(e, ServingError) else ServingError(f"generation failed: {type(e).__name__}: {e}")
        failed = self.filling + self.ready + [j for j in (self.inflight.rows if self.inflight else [])
                                              if j.seq.reason is None]
        logger.exception("a continuous-batching turn failed; the %d sequences in the cache fail with it", len(failed))
        self.filling, self.ready, self.inflight = [], [], None
        for job in failed:
            self._release(job)
        if self.runner.cuda:  # the dropped step's copies out of the pinned buffers end before they are written again
            try:
                self.runner.stream.synchronize()
            except Exception:  # noqa: BLE001  (a sticky device error: `broken` below takes the worker out)
                logger.exception("the worker's stream did not synchronize after the failed turn")
        try:
            self.deliver([(job, [], err) for job in failed])
        except Exception:  # noqa: BLE001  (the frontend gone: nobody left to tell)
            logger.exception("could not answer the %d failed sequences", len(failed))
        if faults.is_sticky(e) and self.broken is not None:
            self.broken(f"generation: {type(e).__name__}: {e}")


class TurnStats:
    """Where the engine's turns went since it was last idle, logged once when it goes idle: the
    operator's (and bench/bench_slots.py's) view of a busy period without a per-token log line."""

    PARTS = ("step", "prompts", "wait", "deliver")

    def __init__(self):
        self.turns, self.rows, self.began = 0, 0, None
        self.ms = dict.fromkeys(self.PARTS, 0.0)

    def start(self, rows: int) -> float:
        now = time.perf_counter()
        self.began = self.began or now
        self.turns, self.rows = self.turns + 1, self.rows + rows
        return now

    def lap(self, part: str, since: float) -> float:
        now = time.perf_counter()
        self.ms[part] += (now - since) * 1e3
        return now

    def log_and_reset(self) -> None:
        if self.turns:
            wall = (time.perf_counter() - self.began) * 1e3
            each = ", ".join(f"{k} {v / self.turns:.3f}" for k, v in self.ms.items())
            logger.info("continuous batching: %d turns in %.1f ms, %.1f decoding rows per turn; ms per turn: %s",
                        self.turns, wall, self.rows / self.turns, each)
        self.__init__()


def warm(runner) -> None:
    """A slot decoder's warm-up before it serves: a prompt of the longest chunk one call takes
    and a step of every slot (its kernels and its allocator's blocks)."""
    dec = runner.dec
    with torch.inference_mode(), runner.stream_context():
        n = max(1, min(dec.chunk_max, dec.cache_length - 4))
        runner.prefill(0, torch.arange(n, device=runner.device).view(1, n) % dec.vocab, 0)
        runner.step(list(range(dec.slots)), torch.zeros(dec.slots, dtype=torch.int64, device=runner.device),
                    [n] * dec.slots)


def measure_budget(runner, repeats: int = 3) -> tuple:
    """(Budget, the note): the prompt call that takes no longer than a decode step of every slot,
    timed on this device: the most tokens of one chunk (powers of two up to the runner's chunk
    limit, at least 1), then, where the longest chunk fits, the most sequences of such chunks in
    one call (powers of two up to the runner's `prompt_rows`)."""
    dec, dev = runner.dec, runner.device

    def timed(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            if runner.cuda:
                runner.stream.synchronize()
            t0 = time.perf_counter()
            fn()
            if runner.cuda:
                runner.stream.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    def prompts(rows: int, n: int) -> float:
        return timed(lambda: runner.prefill_rows(list(range(rows)), [[0] * n] * rows, [0] * rows))

    with torch.inference_mode(), runner.stream_context():
        tokens = torch.zeros(dec.slots, dtype=torch.int64, device=dev)
        step = timed(lambda: runner.step(list(range(dec.slots)), tokens, [0] * dec.slots))
        longest, budget, n = min(runner.chunk_limit, dec.cache_length), Budget(1, 1), 1
        while n <= longest and prompts(1, n) <= step:
            budget, n = Budget(1, n), n * 2
        rows = 2
        while n > longest and rows <= runner.prompt_rows and prompts(rows, budget.tokens) <= step:
            budget, rows = Budget(rows, budget.tokens), rows * 2
    return budget, (f"prompt chunks of up to {budget.tokens} tokens of up to {budget.rows} sequences per turn "
                    f"(a {dec.slots}-row decode step took {step * 1e3:.2f} ms here)")
