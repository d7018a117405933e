"""The runner of a worker served by the engine: each request of a batch sent as its own Infer
(the engine batches them with every other worker's), each answered with its own rows or its own
typed error, so one bad request fails alone (the engine retries a failed call one job at a
time).

A Result's outputs are views of the worker's arena, valid until this runner's next `run` (as a
runner's reused output buffers are: handlers/run/base.py); they are released then. Where the
engine is gone, every request is answered EngineDead (503, retryable) at once while a thread
connects to its successor (`reconnect`: handlers/engine/link.py starts one where none answers).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from handlers.errors import EngineDead, ServingError
from handlers.run.base import Runner

logger = logging.getLogger(__name__)
WAIT_S = 60.0  # one request's answer at most; past it the request is aborted (504)
RECONNECT_S = (0.5, 1.0, 2.0, 5.0)  # waits between tries to reach the engine's successor; the last repeats


class EngineRunner(Runner):
    def __init__(self, client, spec, reconnect: Callable[[], object]):
        super().__init__(None, spec)
        self.client, self._reconnect = client, reconnect
        self._held: list = []  # the last run's replies, released at the next
        self._retired: list = []  # clients of dead engines, closed once their replies are released
        self._reconnecting = threading.Lock()
        client.on_dead = self._engine_gone

    def run(self, requests: list) -> list:
        """Per request, its outputs ({name: tensor viewing the arena}) or its ServingError."""
        self._release()
        client = self.client
        if client.dead:
            return [EngineDead(f"the engine is gone ({client.dead}); a new one is starting: retry")] * len(requests)
        sent = []
        for r in requests:
            try:
                sent.append(client.submit(r))
            except ServingError as e:
                sent.append(e)
        return [self._wait(client, job) for job in sent]

    def _wait(self, client, job):
        if isinstance(job, ServingError):
            return job
        try:
            reply = client.wait(job, WAIT_S)
        except ServingError as e:
            return e
        self._held.append(reply)
        return reply.outputs

    def _release(self) -> None:
        held, self._held = self._held, []
        for reply in held:
            reply.release()
        while self._retired:  # no reply views their arenas any more
            self._retired.pop().close()

    def _engine_gone(self, reason: str) -> None:
        """The client's reader found the engine gone: connect to its successor on a thread of its
        own (the batches meanwhile get EngineDead at once)."""
        logger.error("the engine is gone (%s); connecting to its successor", reason)
        if self._reconnecting.acquire(blocking=False):
            threading.Thread(target=self._connect_again, name="engine-reconnect", daemon=True).start()

    def _connect_again(self) -> None:
        try:
            for attempt in range(10 ** 6):
                time.sleep(RECONNECT_S[min(attempt, len(RECONNECT_S) - 1)])
                try:
                    client = self._reconnect()
                except Exception as e:  # noqa: BLE001 - an engine that cannot load yet: try again
                    logger.warning("the engine's successor is not reachable yet: %s", e)
                    continue
                client.on_dead = self._engine_gone
                self._retired.append(self.client)
                self.client = client
                logger.info("connected to the engine's successor (pid %d)", client.ready.pid)
                return
        finally:
            self._reconnecting.release()

    def describe_sync(self) -> str:
        return "requests batched with every worker's by the engine (handlers/engine)"
