"""The engine process: `python -m handlers.engine.serve SOCKET (--model-dir DIR | --factory
MODULE:FUNCTION) [--max-rows N]`.

With --model-dir (what a worker starts, handlers/engine/link.py), the archive's artifact is
loaded on this process's device (handlers/engine/artifact.py); with --factory, FUNCTION()
returns the runner (handlers/engine/model.py's module_runner for a plain module: the tests).
The process prints one JSON line on stdout once it listens ({"pid": N}) or could not load
({"error": "..."}), and logs to stderr. It exits when its TorchServe frontend is gone
(--frontend PID) or no worker was connected for --idle-exit-s seconds. It listens on
SOCKET (a Unix stream socket, mode 0600: only this user's workers connect), takes each worker's
Hello with its arena's descriptor (the accept thread), answers Ready, and from then on reads
every worker's messages, launches their jobs and answers on one thread (`Loop`). SIGTERM or SIGINT stops it; a worker
whose socket closes (it exited or was killed) is disconnected (handlers/engine/core.py Engine.disconnect)
and the others go on.
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import threading
import time

from handlers import process
from handlers.engine import protocol as p
from handlers.engine.arena import Arena
from handlers.engine.core import Engine, Session
from handlers.engine.sampler import Profile, Sampler
from handlers.errors import ProtocolError

logger = logging.getLogger("engine.serve")
HELLO_TIMEOUT = 10.0  # seconds a connecting worker has to send its Hello
# one read's buffer: a worker's messages are small (offsets), and recv allocates the whole buffer
# before it trims it to what came (a MiB cost a fresh mapping each read)
READ_BYTES = 65536


def load_factory(spec: str):
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)


def listen(path: str) -> socket.socket:
    if os.path.exists(path):
        os.unlink(path)  # a socket left by a killed predecessor; connecting to it would fail
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # created 0600, never briefly wider
    try:
        with p.unix_address(path) as address:
            sock.bind(address)
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


def handshake(conn: p.Connection) -> tuple:
    """(Hello, the engine's mapping of its arena) of a new worker, within HELLO_TIMEOUT."""
    conn.sock.settimeout(HELLO_TIMEOUT)
    msgs, fds = conn.recv(want_fds=1)
    if not msgs or not isinstance(msgs[0], p.Hello) or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("a worker's first frame must be a Hello carrying its arena's descriptor")
    hello = msgs[0]
    if hello.protocol != p.VERSION:
        os.close(fds[0])
        raise ProtocolError(f"the worker speaks protocol {hello.protocol}, this engine {p.VERSION}")
    conn.sock.settimeout(None)
    return hello, Arena.attach(fds[0], hello.worker_bytes, hello.engine_bytes)


class Loop:
    """The engine's one thread: it reads every worker's socket (epoll), queues their jobs, runs
    what is queued, and answers, in turn. One thread, not a reader per worker: the engine's
    Python runs under one interpreter lock, and reader threads waking for every message fought
    the loop for it (sampled on an H200: readers waiting on the lock longer than the loop ran).
    The accept thread does the Hello handshake (bounded by HELLO_TIMEOUT) and hands each new
    connection over through `adopt`; a self-pipe wakes the loop for it."""

    def __init__(self, engine: Engine, ready, spin_s: float = 0.0):
        """`spin_s` (handler.engine_spin_us): how long the loop keeps polling after its last work
        before it sleeps in epoll (a message to a sleeping loop waits for its core to wake)."""
        self.engine, self.ready, self.spin_s = engine, ready, spin_s
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._new: collections.deque = collections.deque()

    def adopt(self, conn: p.Connection, session: Session) -> None:
        """A connection whose Hello was read (the accept thread): served from the loop's next turn."""
        self._new.append((conn, session))
        os.write(self._wake_w, b"\0")

    def run(self, stop: threading.Event, poll: float = 0.1) -> None:
        profile = Profile.from_env()  # CS_ENGINE_PROFILE: a benchmark's aid (handlers/engine/sampler.py)
        last = 0.0  # when the loop last had work
        while not stop.is_set() and not self.engine.dead:
            # jobs queued or a step on the device (or work within spin_s): the sockets are only
            # looked at (a step is answered the turn after the device finishes it); else the
            # loop sleeps in epoll
            t0 = time.perf_counter()
            working = bool(self.engine.queue) or bool(self.engine.flights)
            if working:
                last = t0
            busy = working or t0 - last < self.spin_s
            ready = self.selector.select(0 if busy else poll)
            t1 = time.perf_counter()
            if ready:
                last = t1
            for key, _ in ready:
                if key.data is None:
                    self._take_new()
                else:
                    self._read(*key.data)
            clock = self.engine.clock
            clock["poll" if busy else "idle"] += t1 - t0
            clock["read"] += time.perf_counter() - t1
            self.engine.step(0)
            if profile is not None:
                profile.tick(self.engine.calls)

    def _take_new(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        while self._new:
            conn, session = self._new.popleft()
            try:
                self.engine.connect(session)
                conn.send(self.ready())
            except Exception as e:  # noqa: BLE001 - this worker alone fails to join
                logger.warning("worker %s not served: %s", session.name, e)
                self._drop(conn, session)
                continue
            # the socket stays blocking: it is read only when epoll says it is ready (a read
            # then returns at once), and a send to a worker whose buffer is full waits for it
            self.selector.register(conn.sock, selectors.EVENT_READ, (conn, session))
            logger.info("worker %s connected", session.name)

    def _read(self, conn: p.Connection, session: Session) -> None:
        try:
            msgs, eof = conn.read_available(READ_BYTES)
            for msg in msgs:
                self.engine.on_message(session, msg)
        except Exception as e:  # noqa: BLE001 - one worker's broken socket ends only its session
            logger.warning("worker %s: connection ended: %s", session.name, e)
            eof = True
        if eof:
            self.selector.unregister(conn.sock)
            self._drop(conn, session)

    def _drop(self, conn: p.Connection, session: Session) -> None:
        self.engine.disconnect(session)
        conn.close()


def _reply(conn: p.Connection, msg) -> None:
    """Sends where the worker may be gone: the loop sees its socket's end and disconnects it;
    the loop must not fail for it. A full socket buffer waits (the worker reads its answers
    on a thread of its own)."""
    if msg is None:
        return
    try:
        conn.send(msg)
    except OSError:
        pass


def accept_forever(loop: Loop, listener: socket.socket) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:  # the listener closed: the process is stopping
            return
        conn = p.Connection(sock)
        try:
            hello, arena = handshake(conn)
        except Exception as e:  # noqa: BLE001 - a peer that is not a worker of this protocol
            logger.warning("a connection was refused: %s", e)
            conn.close()
            continue
        loop.adopt(conn, Session(f"{hello.worker}[{hello.pid}]", arena, functools.partial(_reply, conn)))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m handlers.engine.serve", description=__doc__.splitlines()[0])
    ap.add_argument("socket")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--model-dir", help="the archive's model directory: its artifact is loaded here")
    what.add_argument("--factory", help="MODULE:FUNCTION returning the runner")
    ap.add_argument("--config-json", default="null", help="the archive's model-config.yaml as JSON (--model-dir)")
    ap.add_argument("--gpu-id", type=int, default=None, help="the GPU this process places on (--model-dir)")
    ap.add_argument("--verdict-root", default=None,
                    help="the workers' private shared directory (--model-dir): digest checks, and the GPU-room "
                         "ledger in its engines/ (handlers/engine/room.py)")
    ap.add_argument("--max-rows", type=int, default=None, help="rows per call at most (default: the spec's batch_max)")
    ap.add_argument("--frontend", type=int, default=0, help="exit once this pid is gone (0: not watched)")
    ap.add_argument("--idle-exit-s", type=float, default=0.0, help="exit after this long with no worker (0: never)")
    ap.add_argument("--name", default="engine")
    ap.add_argument("--spin-us", type=float, default=0.0,
                    help="--factory: the loop's spin after its last work (--model-dir: handler.engine_spin_us)")
    return ap.parse_args(argv)


def build(args) -> tuple:
    """(Engine, Ready's variant and describe, the loop's spin seconds) from the arguments."""
    if args.factory:
        return Engine(load_factory(args.factory)(), args.max_rows, args.name), "", "", args.spin_us / 1e6
    from handlers.engine import artifact

    # a wait for other engines' loads on the GPU is told on stdout before the ready line: the
    # worker that started this engine waits that much longer for it (handlers/engine/link.py)
    model = artifact.load(args.model_dir, json.loads(args.config_json), args.gpu_id, args.verdict_root,
                          notice=lambda event: print(json.dumps(event), flush=True))
    if model.budget is not None:  # a decoder (slots or lanes): the engine generates
        from handlers.engine.generation import Generation

        gen = Generation(model.runner, model.config, *model.budget)
        return Engine(model.runner, 1, args.name, generation=gen), model.variant_dir, model.describe, 0.0
    engine = Engine(model.runner, args.max_rows or model.spec.batch_max, args.name, launch=model.config.engine_launch)
    # an engine on the CPU never spins: its cores run the model
    spin_s = model.config.engine_spin_us / 1e6 if args.gpu_id is not None else 0.0
    describe = model.describe + (f"; its loop polls {model.config.engine_spin_us:g} us after its last work before "
                                 "it sleeps (handler.engine_spin_us)" if spin_s else "")
    return engine, model.variant_dir, describe, spin_s


def watch_lifetime(engine: Engine, stop: threading.Event, frontend: int, idle_exit_s: float) -> None:
    """Sets `stop` once the frontend is gone (TorchServe's workers are its children; `torchserve
    --stop` and a killed frontend end them, not this process, which runs in a session of its
    own) or no worker has been connected for idle_exit_s seconds (the model was unregistered or
    scaled to zero; a killed worker's restart reconnects within a few seconds)."""
    idle_since = time.monotonic()
    while not stop.wait(0.5):
        if frontend > 1 and not process.alive(frontend):
            logger.info("%s: exits: its TorchServe frontend (pid %d) is gone", engine.name, frontend)
            stop.set()
        if engine.sessions:
            idle_since = time.monotonic()
        elif idle_exit_s and time.monotonic() - idle_since > idle_exit_s:
            logger.info("%s: exits: no worker connected for %.0f s", engine.name, idle_exit_s)
            stop.set()


def replay_costs(runner) -> tuple:
    """The runner's graphs' replay times for the workers' Ready (none without graphs)."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        return ()
    return tuple(p.ReplayCost(tuple(sizes), rows, float(ms)) for sizes, rows, ms in graphs.table.entries())


def totals(engine: Engine) -> dict:
    """The engine's counts and its loop's clock (seconds by phase), for the sampler."""
    device = engine.device
    return {"calls": engine.calls, "jobs": engine.jobs, "rows": engine.rows,
            "replays": device.replays if device else None,
            "device_busy_s": round(device.busy_ms / 1e3, 4) if device else None,
            "clock_s": {k: round(v, 4) for k, v in dict(engine.clock).items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine, variant, describe, spin_s = build(args)
    except Exception as e:  # noqa: BLE001 - the starting worker fails its load with this text
        logger.exception("the engine could not load")
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 2
    gen = engine.generation
    ready = functools.partial(p.Ready, engine.name, os.getpid(), engine.max_rows, variant=variant, describe=describe,
                              costs=() if gen else replay_costs(engine.runner), generation=gen and gen.info())
    if gen is not None:
        gen.start()
    listener = listen(args.socket)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    loop = Loop(engine, ready, spin_s)
    threading.Thread(target=accept_forever, args=(loop, listener), daemon=True).start()
    threading.Thread(target=watch_lifetime, args=(engine, stop, args.frontend, args.idle_exit_s), daemon=True).start()
    logger.info("%s: listening on %s, max %d rows per call; %s", engine.name, args.socket, engine.max_rows, describe)
    print(json.dumps({"pid": os.getpid()}), flush=True)
    # CS_ENGINE_SAMPLE: where the time goes (a benchmark's aid), with the device's steps timed
    sampler = Sampler.from_env(functools.partial(totals, engine), engine.name)
    if sampler is not None and engine.device is not None:
        engine.device.timing = True
    try:
        loop.run(stop)
    finally:
        listener.close()
        if os.path.exists(args.socket):
            os.unlink(args.socket)
        logger.info("%s: stops after %d calls, %d jobs, %d rows", engine.name, engine.calls, engine.jobs, engine.rows)
        if sampler is not None:
            sampler.write(**totals(engine))
        tmp = os.environ.get("TMPDIR", "")
        if os.path.basename(tmp).startswith("cs-engine-"):  # its own (handlers/engine/link.py), never a worker's
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if engine.dead else 0


if __name__ == "__main__":
    raise SystemExit(main())
