"""The engine: one queue of Infer jobs from every connected worker, one loop running them.

Whenever the loop is free it takes every queued job, oldest first, while their rows add up to
at most `max_rows` (the largest batch the runner makes one call of: the spec's batch_max, the
largest graph bucket on a GPU), and runs them as one `Runner.run` call; there is no timer, so a
lone request runs at once and a burst that arrived while the GPU was busy runs together. The
runner groups the jobs as the model can run them (equal shapes, chunks of batch_max rows) and
gives each job exactly its own rows, which are copied into that worker's arena (the engine's
half) before the next call reuses the runner's buffers. A failed call is run again one job at a
time, so only the job that fails alone gets Failed, with the status of its error; a fault that
leaves the device unusable (handlers/faults.is_sticky) ends the engine: every worker gets
EngineDead.

On a CUDA runner with graphs, a step goes through handlers/engine/device.py instead: launched
straight from and into the arenas, answered when the device has finished it (`_land`), with the
next step launched meanwhile; what it cannot plan takes the runner's call as above. When that
next step is launched is the `launch` policy (handler.engine_launch): `eager`, as soon as a job
is queued; `late`, once the queued rows fill a step or the step on the device is about to end
(its graphs' replay times say when, less what a launch takes), so the jobs arriving meanwhile
join it. A graph replay costs a fixed part before its first row (BERT on an H200, 0.27 ms of
0.36 at 8 rows, docs/results/engine_bert_fp16_h200_s73): eager steps at 64 clients held 9 rows
with the device 0.92 busy.

Threads: the loop (`step`, `serve_forever`) runs on one thread, the only one that calls the
model; handlers/engine/serve.py calls `on_message` and `connect`/`disconnect` there too (with
DeviceSteps they must be: pinning and unpinning an arena is ordered against the stream by it);
in-process (the tests, CPU only) they come from the worker's own thread. `Session.reply` must be
thread-safe (protocol.Connection.send is).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from handlers.engine import protocol as p
from handlers.engine.arena import Arena
from handlers.engine.device import DEPTH, DeviceSteps
from handlers.errors import EngineUnavailable, RequestError, ServingError
from handlers.faults import OutOfDeviceMemory, client_fault, is_oom, is_sticky, plain_message

logger = logging.getLogger(__name__)
ABORTED = 499  # the worker gave up on the request (nginx's "client closed request")
LAUNCHES = ("eager", "late")  # when a step is launched behind one on the device (Engine's `launch`)
LATE_MARGIN_S = 100e-6  # late: launched this much before the device is due to run dry, beside the launch's own time


@dataclass(eq=False)
class Session:
    """One worker as the engine sees it: its arena (the engine's mapping), how to answer it,
    its Results not released yet (id -> output refs) and the ids it aborted while they ran."""

    name: str
    arena: Arena
    reply: Callable[[p.Message], None]
    held: dict = field(default_factory=dict)
    running: set = field(default_factory=set)
    aborted: set = field(default_factory=set)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class Job:
    session: Session
    id: int
    inputs: dict  # name -> tensor viewing the worker's arena
    rows: int
    t: float = 0.0  # time.perf_counter() when it was queued, then when its step was launched


class Engine:
    def __init__(self, runner, max_rows: Optional[int] = None, name: str = "engine", device="auto",
                 generation=None, launch: str = "eager"):
        """`device`: the DeviceSteps a step is launched through ("auto": the runner's where it is
        a CUDA runner with graphs; None: every step through the runner's own call, waited for).
        `generation`: an engine of a decoder (handlers/engine/generation.Generation),
        which answers Generate and takes no Infer; its batch runs on a thread of its own.
        `launch`: one of LAUNCHES (the module's docstring)."""
        if launch not in LAUNCHES:
            raise ValueError(f"launch {launch!r}: expected one of {', '.join(LAUNCHES)}")
        self.launch, self._launch_s = launch, 0.0  # the policy; a launch's own duration (moving average)
        self.runner, self.generation = runner, generation
        if generation is not None:
            generation.on_fault = lambda reason: self.die(reason)
        self.device = None if generation is not None else DeviceSteps.for_runner(runner) if device == "auto" else device
        self.flights = collections.deque()  # launched steps (device.Flight), oldest first
        self.spec = None if generation is not None else runner.spec
        self.max_rows = max_rows or (self.spec.batch_max if self.spec is not None else 1)
        self._names = sorted(self.spec.input_names) if self.spec is not None else []  # what an Infer must name
        self.name = name
        self.queue = collections.deque()
        self.cv = threading.Condition()
        self.sessions = set()
        self.calls = 0  # Runner.run calls (each one or more model calls: chunks, shape groups)
        self.rows = 0
        self.jobs = 0  # jobs answered by those calls
        self.dead: Optional[str] = None
        # the loop's wall time by phase, seconds (handlers/engine/serve.py adds its waits; the
        # sampler reports them): land (answering finished steps), launch, run (the runner's call)
        self.clock = collections.Counter()

    # --- any thread ---

    def connect(self, session: Session) -> None:
        with self.cv:
            if self.dead:
                raise EngineUnavailable(f"the engine is dead: {self.dead}")
            self.sessions.add(session)
        if self.device is not None:
            self.device.register(session.arena)

    def disconnect(self, session: Session) -> None:
        """The worker is gone (its socket closed, or it closed in-process): its queued jobs are
        dropped, its held Results freed and its arena unmapped (a running job's views keep the
        mapping until the call ends: handlers/engine/arena.py Arena.close)."""
        with self.cv:
            self.sessions.discard(session)
            mine = [j for j in self.queue if j.session is session]
            for j in mine:
                self.queue.remove(j)
        if self.generation is not None:
            self.generation.disconnect(session)
        with session.lock:
            session.closed = True
            session.held.clear()
            if self.device is not None:
                self.device.unregister(session.arena)
            session.arena.close()
        logger.info("%s: worker %s gone; %d queued job(s) dropped", self.name, session.name, len(mine))

    def on_message(self, session: Session, msg: p.Message) -> None:
        if isinstance(msg, p.Infer):
            for done in msg.release:
                self._release(session, done)
            self.submit(session, msg)
        elif isinstance(msg, p.Release):
            self._release(session, msg.id)
        elif isinstance(msg, p.Generate):
            self._generate(session, msg)
        elif isinstance(msg, p.Abort):
            if self.generation is None or not self.generation.abort(session, msg.id):
                self._abort(session, msg.id)
        elif isinstance(msg, p.State):
            with self.cv:
                queued, clients = len(self.queue), len(self.sessions)
            gauges = self.generation.gauges.now if self.generation is not None else (-1, -1, -1)
            session.reply(p.State(msg.id, queued, clients, self.calls, self.rows, len(session.held), *gauges))
        else:
            raise RequestError(f"the engine takes no {type(msg).__name__} here")

    def _generate(self, session: Session, msg: p.Generate) -> None:
        if self.dead:
            session.reply(_failed(msg.id, EngineUnavailable(f"the engine is dead: {self.dead}")))
        elif self.generation is None:
            session.reply(_failed(msg.id, RequestError("this engine runs a model that does not generate: send Infer")))
        else:
            self.generation.submit(session, msg)

    def submit(self, session: Session, msg: p.Infer) -> None:
        """Queues the job, or answers Failed at once (a ref the arena does not hold, inputs that
        are not the model's: 400; a dead engine: 503)."""
        if self.generation is not None:
            session.reply(_failed(msg.id, RequestError("this engine generates (a decoder): send Generate")))
            return
        try:
            job = self._job(session, msg)
        except ServingError as e:
            session.reply(_failed(msg.id, e))
            return
        with self.cv:
            if self.dead:
                session.reply(_failed(msg.id, EngineUnavailable(f"the engine is dead: {self.dead}")))
                return
            self.queue.append(job)
            self.cv.notify()

    def _job(self, session: Session, msg: p.Infer) -> Job:
        names = [r.name for r in msg.inputs]
        if sorted(names) != self._names:
            raise RequestError(f"inputs {names} are not the model's {self.spec.input_names}")
        try:
            inputs = {r.name: session.arena.view(r) for r in msg.inputs}
        except (ValueError, TypeError) as e:
            raise RequestError(f"an input is not in the arena: {e}") from None
        rows = {t.shape[0] if t.dim() else -1 for t in inputs.values()}
        if len(rows) != 1 or min(rows) < 1:
            raise RequestError(f"inputs must share one batch dimension of at least one row, not {sorted(rows)}")
        return Job(session, msg.id, inputs, rows.pop(), time.perf_counter())

    def _release(self, session: Session, job_id: int) -> None:
        with session.lock:
            for ref in session.held.pop(job_id, ()):
                session.arena.release(ref)

    def _abort(self, session: Session, job_id: int) -> None:
        """A queued job is dropped and answered 499; a running one is answered 499 when its call
        ends; a held Result is released (the worker will not)."""
        with self.cv:
            queued = next((j for j in self.queue if j.session is session and j.id == job_id), None)
            if queued is not None:
                self.queue.remove(queued)
        if queued is not None:
            session.reply(p.Failed(job_id, ABORTED, "Aborted", "the worker aborted the request"))
            return
        with session.lock:
            if job_id in session.running:
                session.aborted.add(job_id)
        self._release(session, job_id)

    # --- the loop's thread ---

    def take(self, timeout: float = 0.0) -> list:
        """Every queued job, oldest first, while the rows add up to max_rows (the first job
        always: the runner cuts one larger than max_rows into chunks); waits up to `timeout`
        for the first."""
        with self.cv:
            if not self.queue and timeout > 0:
                self.cv.wait(timeout)
            jobs, rows = [], 0
            while self.queue and (not jobs or rows + self.queue[0].rows <= self.max_rows):
                job = self.queue.popleft()
                jobs.append(job)
                rows += job.rows
            for job in jobs:
                job.session.running.add(job.id)
            return jobs

    def step(self, timeout: float = 0.0) -> int:
        """Answers the launched steps the device has finished, then takes the queued jobs and
        launches them where fewer than DEPTH are in flight (or, without DeviceSteps, runs them,
        waited for); returns how many jobs it took."""
        if self.device is None:
            jobs = self.take(timeout)
            if jobs:
                self.run(jobs)
            return len(jobs)
        t0 = time.perf_counter()
        self._land()
        t1 = time.perf_counter()
        self.clock["land"] += t1 - t0
        if self.dead or len(self.flights) >= DEPTH or (self.flights and not self._launch_now(t1)):
            return 0
        jobs = self.take(0.0 if self.flights else timeout)
        if jobs:
            for job in jobs:  # the jobs' time in the queue, summed (the sampler's mean wait)
                self.clock["job_queued"] += t1 - job.t
                job.t = t1
            self._launch(jobs)
            took = time.perf_counter() - t1
            self.clock["launch"] += took
            self._launch_s += 0.2 * (took - self._launch_s)
        return len(jobs)

    def _launch_now(self, now: float) -> bool:
        """With a step on the device: whether the queued jobs go behind it now (eager: yes; late:
        once they fill a step, or the device is due to finish what it has within a launch's time)."""
        if self.launch == "eager":
            return True
        with self.cv:
            rows = sum(j.rows for j in self.queue)
        full = min(self.max_rows, self.device.largest)  # the most rows one replay takes
        return rows >= full or now >= self.flights[-1].due - self._launch_s - LATE_MARGIN_S

    def _launch(self, jobs: list) -> None:
        try:
            replays = self.device.plan(jobs)
        except Exception as e:  # noqa: BLE001 - a job the plan cannot place (a peer's odd shape): the runner's call answers it
            logger.info("%s: a step could not be planned (%s); running it through the runner's call", self.name, e)
            replays = None
        if replays is not None:
            try:
                with torch.inference_mode():  # the graphs' buffers are inference tensors
                    flight = self.device.launch(replays, self._alloc, self._free)
                # the stream runs steps in launch order: this one starts when the one before ends
                ahead = self.flights[-1].due if self.flights else 0.0
                flight.due = max(time.perf_counter(), ahead) + flight.device_ms / 1000.0
                self.flights.append(flight)
                return
            except Exception as e:  # noqa: BLE001 - a sticky fault ends the engine; else the plain path
                if is_sticky(e):
                    self.die(f"a device fault that poisons the process: {plain_message(str(e))}", jobs)
                    return
                logger.info("%s: launching a step failed (%s); running it through the runner's call", self.name, e)
        self.run(jobs)  # on the same stream, after the steps in flight

    def _land(self) -> None:
        """Answers every launched step the device has finished, oldest first."""
        try:
            while self.flights and self.flights[0].done():
                flight = self.flights.popleft()
                self.device.landed(flight)
                self._count(flight.jobs)
                now = time.perf_counter()
                for job in flight.jobs:
                    self.clock["job_flight"] += now - job.t  # launched to answered, summed
                    self._settle(job, flight.outs[job])
        except Exception as e:  # noqa: BLE001 - an error the device reports late (a fault in a kernel)
            self.die(f"the device failed a step: {plain_message(str(e))}")

    def _count(self, jobs: list) -> None:
        """One call (or launched step) of these jobs, in the totals State and the log report."""
        self.calls += 1
        self.rows += sum(j.rows for j in jobs)
        self.jobs += len(jobs)

    def _alloc(self, job: Job, name: str, dtype, shape: tuple) -> tuple:
        s = job.session
        with s.lock:
            if s.closed:
                raise EngineUnavailable("the worker is gone")
            return s.arena.alloc(name, dtype, shape)

    def _free(self, job: Job, ref) -> None:
        s = job.session
        with s.lock:
            if not s.closed:
                s.arena.release(ref)

    def serve_forever(self, stop: threading.Event, poll: float = 0.1) -> None:
        """Runs batches until `stop` is set or the engine dies (`poll`: how often it looks)."""
        while not stop.is_set() and not self.dead:
            self.step(poll)

    def run(self, jobs: list) -> None:
        """One call for all the jobs; after a failure, one call per job (retry) so only the
        job that fails alone is answered Failed."""
        t0 = time.perf_counter()
        if self.device is not None:
            self.device.forget()  # the runner's call writes the graphs' inputs the steps pad
        try:
            # as a worker runs its model (handlers/pipeline.py): the warm-up made the runner's
            # buffers inference tensors, which only inference mode may write in place
            with torch.inference_mode():
                outs = self.runner.run([j.inputs for j in jobs])
        except Exception as e:  # noqa: BLE001 - every failure is answered, typed
            if is_sticky(e):
                self.die(f"a device fault that poisons the process: {plain_message(str(e))}", jobs)
            elif len(jobs) == 1:
                self._answer_failed(jobs[0], self.failure(e))
            else:
                logger.info("%s: a call of %d jobs failed (%s); retrying one at a time", self.name, len(jobs), e)
                for job in jobs:
                    self.run([job])
            return
        self._count(jobs)
        for job, out in zip(jobs, outs):
            self._answer(job, out)
        self.clock["run"] += time.perf_counter() - t0

    def failure(self, e: BaseException) -> ServingError:
        """The typed error one job's failed run is answered with."""
        if isinstance(e, ServingError):
            return e
        fault = client_fault(e, self.spec)
        if fault is not None:
            return fault
        if is_oom(e):
            return OutOfDeviceMemory.for_request(e)
        return ServingError(f"the model failed on this request: {type(e).__name__}: {plain_message(str(e))}")

    def _answer(self, job: Job, out: dict) -> None:
        """Copies the job's rows into its worker's arena, then answers (_settle)."""
        s = job.session
        with s.lock:
            outcome = None if s.closed or job.id in s.aborted else self._write(s, out)
        self._settle(job, outcome)

    def _settle(self, job: Job, outcome) -> None:
        """Answers a job that ran: Result with its blocks (`outcome`: their refs), Failed with
        `outcome` where that is a ServingError (its arena was full), 499 where its worker
        aborted it meanwhile (its blocks freed); nothing where its worker is gone."""
        s = job.session
        with s.lock:
            s.running.discard(job.id)
            if s.closed:
                return
            if job.id in s.aborted:
                s.aborted.discard(job.id)
                for ref in outcome if isinstance(outcome, tuple) else ():
                    s.arena.release(ref)
                msg = p.Failed(job.id, ABORTED, "Aborted", "the worker aborted the request")
            elif isinstance(outcome, ServingError):
                msg = _failed(job.id, outcome)
            else:
                s.held[job.id] = outcome
                msg = p.Result(job.id, outcome)
        s.reply(msg)

    @staticmethod
    def _write(s: Session, out: dict):
        """The outputs copied into new blocks of the worker's arena: their refs, or ArenaFull
        (this worker's Results not released yet) with no block kept."""
        refs = []
        try:
            for name, t in out.items():
                refs.append(s.arena.put(name, t))
        except EngineUnavailable as e:
            for ref in refs:
                s.arena.release(ref)
            return e
        return tuple(refs)

    def _answer_failed(self, job: Job, e: ServingError) -> None:
        s = job.session
        with s.lock:
            s.running.discard(job.id)
            s.aborted.discard(job.id)
            if s.closed:
                return
        s.reply(_failed(job.id, e))

    def die(self, reason: str, jobs: list = ()) -> None:
        """The engine cannot serve again: the jobs at hand get 500 with the reason, queued ones
        and every worker EngineDead (they reconnect to the engine's successor)."""
        logger.error("%s: dead: %s", self.name, reason)
        if self.generation is not None:
            self.generation.stop()
        flights, self.flights = list(self.flights), collections.deque()
        for job in list(jobs) + [j for f in flights for j in f.jobs]:
            self._answer_failed(job, ServingError(reason))
        with self.cv:
            self.dead = reason
            queued, self.queue = list(self.queue), collections.deque()
            sessions = list(self.sessions)
        for job in queued:
            self._answer_failed(job, EngineUnavailable(f"the engine is dead: {reason}"))
        for s in sessions:
            s.reply(p.EngineDead(reason))


def _failed(job_id: int, e: ServingError) -> p.Failed:
    return p.Failed(job_id, e.status, e.error_type, e.message, bool(getattr(e, "retryable", False)))


def start(engine: Engine) -> tuple:
    """The engine's loop on a daemon thread: (thread, stop event). Tests' and the in-process
    engine's way to run it; handlers/engine/serve.py runs it on its main thread."""
    stop = threading.Event()
    thread = threading.Thread(target=engine.serve_forever, args=(stop,), name=f"{engine.name}-loop", daemon=True)
    thread.start()
    return thread, stop

