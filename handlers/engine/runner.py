"""The runner of a worker served by the engine: the requests of a batch padded to their length
buckets (the archive's padding) and sent as one Infer per shape (the engine batches them with
every other worker's), each answered with its own rows or its own typed error, so one bad
request fails alone (the engine retries a failed call one job at a time, this runner a failed
job one request at a time).

A Result's outputs are views of the worker's arena, valid until this runner's next `run` (as a
runner's reused output buffers are: handlers/run/base.py); they are released then. Where the
engine is gone, every request is answered EngineDead (503, retryable) at once while a thread
connects to its successor (`reconnect`: handlers/engine/link.py starts one where none answers).
A request past its deadline (handler.engine_timeout_s) is answered EngineTimeout (504); the engine
is then asked its State, and one that leaves it unanswered as long again (at least PROBE_S) is hung (stopped, deadlocked,
stuck in the driver): the worker kills it (SIGKILL), which its workers see as the engine gone.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

from handlers import timeline
from handlers.batch import offsets
from handlers.errors import EngineDead, EngineTimeout, ServingError
from handlers.run.base import Runner
from handlers.run.graphs import ReplayTable

logger = logging.getLogger(__name__)
WAIT_S = 60.0  # one request's answer at most (handler.engine_timeout_s); past it the request is aborted (504)
PROBE_S = 5.0  # after a timeout, the least time the engine has to answer a State before it is taken for hung
RECONNECT_S = (0.5, 1.0, 2.0, 5.0)  # waits between tries to reach the engine's successor; the last repeats


class EngineRunner(Runner):
    def __init__(self, client, spec, reconnect: Callable[[], object], pad=None, wait_s: float = WAIT_S,
                 spin_s: float = 0.0):
        """`spin_s` (handler.engine_wait_spin_us): how long a wait for the engine polls before it sleeps."""
        super().__init__(None, spec)
        self.wait_s, self.spin_s = wait_s, spin_s
        client.spin_s = spin_s
        self.client, self._reconnect = client, reconnect
        # the archive's padding (handlers/batch.PadPlan), applied here: requests padded to their
        # length buckets, or to a shared one where the engine's graphs say one job is cheaper
        # (the replay times its Ready carries), share a shape, and a batch's requests of one
        # shape go as one Infer: each job costs the engine's one loop its copies and its answer
        self.pad = pad
        self.costs = replay_table(client)
        self._held: list = []  # the last run's replies, released at the next
        self._retired: list = []  # clients of dead engines, closed once their replies are released
        self._successor = Successor(lambda: self._reconnect(), self._adopt)
        self._probing = threading.Lock()
        client.on_dead = self._engine_gone

    def run(self, requests: list) -> list:
        """Per request, its outputs ({name: tensor viewing the arena}) or its ServingError. The
        requests of one shape (after padding) go to the engine as one job, their rows one after
        the other (the engine's work per job is the same for one row or many); a job that fails
        for a reason of its own is sent again one request at a time, so only the bad one fails."""
        self._release()
        client = self.client
        if client.dead:
            return [EngineDead(f"the engine is gone ({client.dead}); a new one is starting: retry")] * len(requests)
        rows = [next(iter(r.values())).shape[0] for r in requests]
        sizes = None
        if self.pad is not None:
            sizes = [self.pad.sizes(r) for r in requests]
            targets = self.pad.targets(sizes, rows, self.costs.call_cost_ms)
            requests = [self.pad.pad(r, t) for r, t in zip(requests, targets)]
        groups = {}
        for i, r in enumerate(requests):
            groups.setdefault(tuple(tuple(t.shape[1:]) for t in r.values()), []).append(i)
        sent = [(idxs, self._submit(client, [requests[i] for i in idxs])) for idxs in groups.values()]
        if timeline.ON:
            timeline.mark("launched")  # every job in the arena and sent
        out = [None] * len(requests)
        for idxs, job in sent:
            answers = self._answers(client, job, [requests[i] for i in idxs], [rows[i] for i in idxs])
            for i, a in zip(idxs, answers):
                out[i] = a
        if timeline.ON:
            timeline.mark("synced")  # every job answered
        if sizes is not None:
            out = [o if isinstance(o, ServingError) else self.pad.cut(o, s) for o, s in zip(out, sizes)]
        return out

    @staticmethod
    def _submit(client, requests: list):
        try:
            if len(requests) == 1:
                return client.submit(requests[0])
            return client.submit({name: [r[name] for r in requests] for name in requests[0]})
        except ServingError as e:
            return e

    def _answers(self, client, job, requests: list, rows: list) -> list:
        """Each request's rows of the job's answer, or its error."""
        if not isinstance(job, ServingError):
            try:
                reply = client.wait(job, self.wait_s)
            except ServingError as e:
                job = e
                if isinstance(e, EngineTimeout):
                    self._probe(client)
            else:
                self._held.append(reply)
                return [{k: v[a:b] for k, v in reply.outputs.items()} for a, b in offsets(rows)]
        if len(requests) > 1 and not getattr(job, "retryable", False):  # the job's own fault: find whose
            return [self._answers(client, self._submit(client, [r]), [r], [n])[0] for r, n in zip(requests, rows)]
        return [job] * len(requests)

    def _release(self) -> None:
        held, self._held = self._held, []
        for reply in held:
            reply.release(defer=True)  # told with the next Infer
        while self._retired:  # no reply views their arenas any more
            self._retired.pop().close()

    def _probe(self, client) -> None:
        """After a timeout: a thread asks the engine its State, and kills an engine that does not
        answer (one probe at a time; the batch is answered meanwhile)."""
        if self._probing.acquire(blocking=False):
            threading.Thread(target=self._kill_if_hung, args=(client,), name="engine-probe", daemon=True).start()

    def _kill_if_hung(self, client) -> None:
        try:
            try:
                # the engine answers State between steps: a call may take up to a request's own wait
                client.state(max(PROBE_S, self.wait_s))
                return  # it answers: busy with long calls, not hung
            except EngineTimeout:
                pass
            except ServingError:  # gone already: its reader saw it
                return
            pid = getattr(getattr(client, "ready", None), "pid", None)
            if pid and is_engine(pid):
                logger.error("the engine (pid %d) left a State unanswered for %.0f s after a request timed out: "
                             "killed as hung; its successor starts", pid, max(PROBE_S, self.wait_s))
                os.kill(pid, signal.SIGKILL)
        finally:
            self._probing.release()

    def _engine_gone(self, reason: str) -> None:
        """The client's reader found the engine gone: connect to its successor on a thread of its
        own (the batches meanwhile get EngineDead at once)."""
        self._successor.reach(reason)

    def _adopt(self, client) -> None:
        client.on_dead = self._engine_gone
        client.spin_s = self.spin_s
        self._retired.append(self.client)
        self.client = client
        self.costs = replay_table(client)

    def describe_sync(self) -> str:
        return "requests batched with every worker's by the engine (handlers/engine)"

    def engine_state(self) -> dict:
        """The engine as this worker sees it (the worker's description): its pid, whether it
        answers, and why not (gone, its successor being reached)."""
        client = self.client
        return {"pid": getattr(getattr(client, "ready", None), "pid", None), "connected": client.dead is None,
                "reason": None if client.dead is None else f"the engine is gone ({client.dead}); its successor is "
                                                           "being reached"}


class Successor:
    """A dead engine's successor reached on a thread of its own, one attempt loop at a time:
    `connect()` tried after each of RECONNECT_S's waits (the last repeats) until it answers,
    then `adopt(client)`. The worker's side of both kinds of engine (EngineRunner and
    handlers/engine/sequences.RemoteBatch) use it; the request's own thread never waits for it."""

    def __init__(self, connect: Callable[[], object], adopt: Callable[[object], None]):
        self.connect, self.adopt = connect, adopt
        self._lock = threading.Lock()

    def reach(self, reason: str) -> None:
        logger.error("the engine is gone (%s); connecting to its successor", reason)
        if self._lock.acquire(blocking=False):
            threading.Thread(target=self._run, name="engine-reconnect", daemon=True).start()

    def _run(self) -> None:
        try:
            for attempt in range(10 ** 6):
                time.sleep(RECONNECT_S[min(attempt, len(RECONNECT_S) - 1)])
                try:
                    client = self.connect()
                except Exception as e:  # noqa: BLE001 - an engine that cannot load yet: try again
                    logger.warning("the engine's successor is not reachable yet: %s", e)
                    continue
                self.adopt(client)
                logger.info("connected to the engine's successor (pid %s)",
                            getattr(getattr(client, "ready", None), "pid", "?"))
                return
        finally:
            self._lock.release()


def replay_table(client) -> ReplayTable:
    """The replay times of the engine's graphs, from its Ready (empty without graphs, or in process)."""
    costs = getattr(getattr(client, "ready", None), "costs", ())
    return ReplayTable([(c.sizes, c.rows, c.ms) for c in costs])


def is_engine(pid: int) -> bool:
    """Whether `pid` is an engine process (its command line runs handlers.engine.serve): a pid the
    worker kills must still be the engine it was, not a process that reused the number."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"handlers.engine.serve" in f.read()
    except OSError:
        return False
