"""The worker's side of the engine: submit tensors, wait for their rows, release them.

Two clients with one API (`Client`): `InProcessEngine` calls an `engine.core.Engine` of this
process directly (unit tests: no sockets, no second process), `EngineClient` talks to an engine
process (`python -m handlers.engine.serve`) over its Unix socket. Both write inputs once into the
worker's arena (handlers/engine/arena.py) and send offsets; a Result's outputs are views of the arena
until `Reply.release()`.

Every wait has a deadline. A request past it is aborted (the engine answers it 499 later, and
its arena blocks are freed then) and raises EngineTimeout (504). The engine's socket closing
with requests in flight (the engine died: SIGKILL, a crash) or an EngineDead message fails
every one of them with EngineDead (503, retryable) at once, and every later call too.

Who reads an engine process's socket: the thread that waits for an answer reads it itself
(`EngineClient._await`), so an answer wakes one thread, not a reader thread that then wakes the
waiter (the MLP through an engine on the CI CPU, handle() in process, A/B in one session: the
worker's CPU 5-15% less, 12-30 µs per request at batches of 4 and 1, and its wall time 5-9%
less). A watch thread sleeps in poll() for the socket's hang-up only (POLLRDHUP: data arriving
does not wake it), so an engine that dies while nobody waits is still found at once. A
generating worker, whose Tokens come unasked, turns the watch thread into a reader of every
message (`read_continuously`). Two threads waiting at once (a request and the hung-engine probe)
take turns: the one reading delivers the other's answer, which looks for the socket free every
SHARED_WAIT_S.
"""
from __future__ import annotations

import itertools
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from handlers.engine import protocol as p
from handlers.engine.arena import Arena
from handlers.engine.core import Engine, Session
from handlers import errors
from handlers.faults import OutOfDeviceMemory

DEFAULT_ARENA = 64 << 20  # bytes of each half of a worker's arena
READ_BYTES = 65536  # one read's buffer: answers are small (offsets), and a larger one costs its allocation each read
SHARED_WAIT_S = 0.002  # a waiter while another reads the socket: how often it looks for the socket free


@dataclass(eq=False)
class _Pending:
    refs: tuple  # the inputs' blocks, freed when the one answer arrives
    done: threading.Event = field(default_factory=threading.Event)
    answer: object = None  # Result, Failed or State; an exception where the engine died
    abandoned: bool = False  # timed out: nobody reads the answer


class Reply:
    """A Result's outputs as views of the worker's arena; release() hands the blocks back to
    the engine (once; also on leaving a `with`)."""

    def __init__(self, client: "Client", result: p.Result):
        self._client, self.id = client, result.id
        self.outputs = {r.name: client.arena.view(r) for r in result.outputs}
        self.released = False

    def release(self, defer: bool = False) -> None:
        """`defer`: told to the engine with this client's next Infer (one message less per
        request under load; the blocks stay the engine's until then)."""
        if not self.released:
            self.released = True
            self.outputs = {}
            if defer:
                self._client.done_with(self.id)
            else:
                self._client._send_quiet(p.Release(self.id))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class Client:
    """What the two clients share: the arena, the requests in flight, the answers' dispatch."""

    def __init__(self, arena: Arena, name: str):
        self.arena, self.name = arena, name
        self._ids = itertools.count(1)
        self._done: list = []  # Results released here and not yet told to the engine (sent with the next Infer)
        self._pending = {}
        self._lock = threading.Lock()
        self.dead: Optional[str] = None
        self.on_dead = None  # called once, with the reason, when the engine is found gone
        self.streams = None  # a generating worker's handlers/engine/sequences.RemoteBatch (Tokens, their Failed)
        self.spin_s = 0.0  # a waiter polls the socket this long before it sleeps (handler.engine_wait_spin_us)

    def _send(self, msg: p.Message) -> None:
        raise NotImplementedError

    def _send_quiet(self, msg: p.Message) -> None:
        """Sends where a dead engine changes nothing (Release, Abort)."""
        try:
            self._send(msg)
        except (OSError, errors.EngineUnavailable):
            pass

    send_quiet = _send_quiet

    def new_id(self) -> int:
        """An id for a message whose answers `streams` takes (a Generate)."""
        with self._lock:
            return next(self._ids)

    def send_stream(self, msg: p.Message) -> None:
        """Sends a Generate; a dead engine raises EngineDead (and a failed send fails every
        sequence in flight, this one too, through `streams`)."""
        self._check_alive()
        try:
            self._send(msg)
        except OSError as e:
            self.engine_dead(f"sending to the engine failed: {e}")

    def submit(self, inputs: dict) -> int:
        """Writes `inputs` ({name: tensor, or a list of row blocks sent as one tensor}) into the
        arena and sends the Infer; returns its id. ArenaFull (503) where the arena has no room
        now; EngineDead where the engine is gone."""
        self._check_alive()
        refs = []
        try:
            for name, t in inputs.items():
                refs.append(self.arena.put(name, t) if isinstance(t, torch.Tensor) else self.arena.put_rows(name, t))
        except BaseException:
            for ref in refs:
                self.arena.release(ref)
            raise
        job_id = self._track(tuple(refs))
        with self._lock:
            done, self._done = tuple(self._done), []
        self._send_or_fail(job_id, p.Infer(job_id, tuple(refs), done))
        return job_id

    def done_with(self, result_id: int) -> None:
        """A Result's blocks are free again on the engine's side: told with the next Infer, or
        at once where `flush` is called (the engine keeps them in its half until then)."""
        with self._lock:
            self._done.append(result_id)

    def flush(self) -> None:
        """Tells the engine every released Result now (a Release each)."""
        with self._lock:
            done, self._done = self._done, []
        for result_id in done:
            self._send_quiet(p.Release(result_id))

    def wait(self, job_id: int, timeout: float) -> Reply:
        """The job's Reply; raises its typed error (Failed's status), EngineDead, or
        EngineTimeout after `timeout` seconds (the job is then aborted)."""
        answer = self._answer(job_id, timeout)
        if isinstance(answer, p.Result):
            return Reply(self, answer)
        raise remote_error(answer)

    def infer(self, inputs: dict, timeout: float = 30.0) -> dict:
        """submit + wait, the outputs copied out of the arena and released."""
        with self.wait(self.submit(inputs), timeout) as reply:
            return {k: v.clone() for k, v in reply.outputs.items()}

    def state(self, timeout: float = 5.0) -> p.State:
        self._check_alive()
        job_id = self._track(())
        self._send_or_fail(job_id, p.State(job_id))
        return self._answer(job_id, timeout)

    def _track(self, refs: tuple) -> int:
        with self._lock:
            job_id = next(self._ids)
            self._pending[job_id] = _Pending(refs)
        return job_id

    def _send_or_fail(self, job_id: int, msg: p.Message) -> None:
        try:
            self._send(msg)
        except OSError as e:
            self.engine_dead(f"sending to the engine failed: {e}")

    def read_continuously(self) -> None:
        """Answers come unasked from now on (Tokens): here the engine's thread delivers them."""

    def _await(self, pending: _Pending, timeout: float) -> bool:
        """Whether the answer came within `timeout` (here the engine's thread delivers it)."""
        return pending.done.wait(timeout)

    def _answer(self, job_id: int, timeout: float):
        pending = self._pending[job_id]
        if not self._await(pending, timeout):
            with self._lock:
                pending.abandoned = not pending.done.is_set()
            if pending.abandoned:  # its answer, when it comes, frees the inputs (on_message)
                self._send_quiet(p.Abort(job_id))
                raise errors.EngineTimeout(f"the engine did not answer within {timeout:g} s; request aborted")
        with self._lock:
            self._pending.pop(job_id, None)
        if isinstance(pending.answer, BaseException):
            raise pending.answer
        return pending.answer

    def _check_alive(self) -> None:
        if self.dead:
            raise errors.EngineDead(f"the engine is gone: {self.dead}")

    def on_message(self, msg: p.Message) -> None:
        """An answer from the engine (in process its thread; else whichever thread reads the
        socket: a waiter, or the watch); the waiter takes it (_answer), or nobody where the wait
        timed out."""
        if isinstance(msg, p.EngineDead):
            self.engine_dead(msg.reason)
            return
        if isinstance(msg, p.Tokens):
            if self.streams is not None:
                self.streams.tokens(msg)
            return
        if isinstance(msg, p.Failed) and self.streams is not None and self.streams.failed(msg):
            return
        with self._lock:
            pending = self._pending.get(msg.id)
            if pending is None or pending.done.is_set():
                return
            self._settle(pending, msg)
            if pending.abandoned:
                del self._pending[msg.id]
        if pending.abandoned and isinstance(msg, p.Result):
            self._send_quiet(p.Release(msg.id))

    def _settle(self, pending: _Pending, answer) -> None:
        """The one answer of a request (self._lock held): the engine is done reading its
        inputs, so their blocks are free again."""
        for ref in pending.refs:
            self.arena.release(ref)
        pending.answer = answer
        pending.done.set()

    def engine_dead(self, reason: str) -> None:
        """Every request in flight fails with EngineDead (nobody reads their inputs any more)."""
        with self._lock:
            first = self.dead is None
            self.dead = self.dead or reason
            for job_id, pending in list(self._pending.items()):
                if not pending.done.is_set():
                    self._settle(pending, errors.EngineDead(f"the engine is gone: {reason}"))
                if pending.abandoned:
                    del self._pending[job_id]
        if self.streams is not None:
            self.streams.dead(reason)
        if first and self.on_dead is not None:
            self.on_dead(reason)

    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        with self._lock:
            return sum(not pend.done.is_set() for pend in self._pending.values())


_ERRORS = {c.error_type: c for c in (
    errors.RequestError, errors.PayloadTooLarge, errors.ServingError, errors.EngineUnavailable,
    errors.ArenaFull, errors.EngineDead, OutOfDeviceMemory)}


def remote_error(f: p.Failed) -> errors.ServingError:
    """The typed error a Failed stands for: its class where known, else a ServingError with
    the engine's status and type."""
    cls = _ERRORS.get(f.error_type)
    e = cls(f.message) if cls is not None and cls.status == f.status else errors.ServingError(f.message)
    e.status, e.error_type, e.retryable = f.status, f.error_type, f.retryable
    return e


class InProcessEngine(Client):
    """The worker's side of an Engine running in this process: messages are method calls (the
    engine answers from its loop's thread), the arena is the same memfd both sides map."""

    def __init__(self, engine: Engine, name: str = "worker", worker_bytes: int = DEFAULT_ARENA,
                 engine_bytes: int = DEFAULT_ARENA):
        super().__init__(Arena.create(worker_bytes, engine_bytes, f"cs-arena-{name}"), name)
        self.engine = engine
        theirs = Arena.attach(os.dup(self.arena.fd), worker_bytes, engine_bytes)
        self.session = Session(name, theirs, self.on_message)
        engine.connect(self.session)

    def _send(self, msg: p.Message) -> None:
        self._check_alive()
        self.engine.on_message(self.session, msg)

    def close(self) -> None:
        self.on_dead = None  # closed on purpose: nobody is to reconnect
        self.engine.disconnect(self.session)
        self.engine_dead("the client closed")
        self.arena.close()


class EngineClient(Client):
    """The worker's side of an engine process, over its Unix socket."""

    def __init__(self, path: str, name: str = "worker", worker_bytes: int = DEFAULT_ARENA,
                 engine_bytes: int = DEFAULT_ARENA, connect_timeout: float = 10.0):
        super().__init__(Arena.create(worker_bytes, engine_bytes, f"cs-arena-{name}"), name)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(connect_timeout)
            with p.unix_address(path) as address:
                sock.connect(address)
            self.conn = p.Connection(sock)
            self.conn.send(p.Hello(name, os.getpid(), worker_bytes, engine_bytes), fds=(self.arena.fd,))
            self.ready = self._handshake(connect_timeout)
            sock.settimeout(None)  # reads block or follow poll(); every wait has its own deadline
        except BaseException:
            sock.close()
            self.arena.close()
            raise
        self._read_lock = threading.Lock()  # held by whoever reads the socket: a waiter, or the watch turned reader
        self._readable = select.poll()  # used only under _read_lock
        self._readable.register(sock, select.POLLIN)
        self._continuous = False
        self._wake_r, self._wake_w = os.pipe()
        self._reader = threading.Thread(target=self._watch, name=f"{name}-engine-watch", daemon=True)
        self._reader.start()

    def _handshake(self, timeout: float) -> p.Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msgs, _ = self.conn.recv()
            except socket.timeout:
                break
            if not msgs:
                raise errors.EngineDead("the engine closed the socket before Ready")
            if isinstance(msgs[0], p.EngineDead):
                raise errors.EngineDead(f"the engine refused: {msgs[0].reason}")
            if isinstance(msgs[0], p.Ready):
                return msgs[0]
            raise errors.ProtocolError(f"expected Ready, got {type(msgs[0]).__name__}")
        raise errors.EngineTimeout(f"the engine did not answer Hello within {timeout:g} s")

    def read_continuously(self) -> None:
        """The watch thread becomes the reader of every message (a generating worker's Tokens
        arrive with nobody waiting for them); waiters then wait for it to deliver."""
        if not self._continuous:
            self._continuous = True
            os.write(self._wake_w, b"\0")

    def _watch(self) -> None:
        """Sleeps until the engine hangs up (POLLRDHUP; POLLHUP is always reported), this client
        closes, or read_continuously asks; then reads every message to the end of the stream,
        once no waiter is reading (the lock)."""
        poller = select.poll()
        poller.register(self.conn.sock, select.POLLRDHUP)
        poller.register(self._wake_r, select.POLLIN)
        try:
            poller.poll()
        except (OSError, ValueError):  # the socket closed under it (close())
            pass
        with self._read_lock:
            self._read()

    def _await(self, pending: _Pending, timeout: float) -> bool:
        """Waits for the answer by reading the socket itself where no other thread reads it (its
        answers to others are delivered on the way); else for the reader to deliver it."""
        deadline = time.monotonic() + timeout
        while not pending.done.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._continuous or not self._read_lock.acquire(blocking=False):
                pending.done.wait(left if self._continuous else min(left, SHARED_WAIT_S))
                continue
            try:
                self._read_for(pending, deadline)
            finally:
                self._read_lock.release()
        return True

    def _read_for(self, pending: _Pending, deadline: float) -> None:
        """Reads and delivers messages until `pending` is answered, the deadline, or the end."""
        spin_until = time.monotonic() + self.spin_s
        while not pending.done.is_set() and not self.dead:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return
            if now < spin_until:  # polled without sleeping: the answer wakes no core (spin_s)
                if not self._readable.poll(0):
                    continue
            elif not self._readable.poll(left * 1000.0):
                return
            try:
                msgs, end = self.conn.read_available(READ_BYTES)
            except (OSError, errors.ProtocolError) as e:
                self.engine_dead(f"the engine's socket failed: {e}")
                return
            for msg in msgs:
                self.on_message(msg)
            if end:
                self.engine_dead("the engine's socket closed")
                return

    def _read(self) -> None:
        reason = "the engine's socket closed"
        try:
            while True:
                msgs, _ = self.conn.recv()
                if not msgs:
                    break
                for msg in msgs:
                    self.on_message(msg)
        except (OSError, errors.ProtocolError) as e:
            reason = f"the engine's socket failed: {e}"
        self.engine_dead(reason)

    def _send(self, msg: p.Message) -> None:
        self._check_alive()
        self.conn.send(msg)

    def close(self) -> None:
        self.on_dead = None  # closed on purpose: nobody is to reconnect
        self.conn.close()  # shut down first: the watch's poll and a blocked read return
        os.write(self._wake_w, b"\0")
        self._reader.join(5.0)
        self.engine_dead("the client closed")
        self.arena.close()
        if not self._reader.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

