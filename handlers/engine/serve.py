"""The engine process: `python -m handlers.engine.serve SOCKET --factory MODULE:FUNCTION [--max-rows N]`.

FUNCTION() returns the runner the engine runs (handlers/engine/model.py's module_runner for a plain
module; step 2: the runner built from the artifact on the engine's GPU). The process listens on
SOCKET (a Unix stream socket, mode 0600: only this user's workers connect), takes each worker's
Hello with its arena's descriptor, answers Ready, and reads that worker's messages on a thread
of its own; the engine's loop runs on the main thread. SIGTERM or SIGINT stops it; a worker
whose socket closes (it exited or was killed) is disconnected (handlers/engine/core.py Engine.disconnect)
and the others go on.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import socket
import threading

from handlers.engine import protocol as p
from handlers.engine.arena import Arena
from handlers.engine.core import Engine, Session
from handlers.errors import ProtocolError

logger = logging.getLogger("engine.serve")
HELLO_TIMEOUT = 10.0  # seconds a connecting worker has to send its Hello


def load_factory(spec: str):
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)


def listen(path: str) -> socket.socket:
    if os.path.exists(path):
        os.unlink(path)  # a socket left by a killed predecessor; connecting to it would fail
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # created 0600, never briefly wider
    try:
        sock.bind(path)
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


def serve_connection(engine: Engine, sock: socket.socket) -> None:
    """One worker, from Hello to its socket's end (a reader thread's whole life)."""
    conn = p.Connection(sock)
    session = None
    try:
        hello, arena = handshake(conn)
        session = Session(f"{hello.worker}[{hello.pid}]", arena, lambda msg: _reply(conn, msg))
        engine.connect(session)
        conn.send(p.Ready(engine.name, os.getpid(), engine.max_rows))
        logger.info("worker %s connected", session.name)
        while True:
            msgs, _ = conn.recv()
            if not msgs:
                break
            for msg in msgs:
                engine.on_message(session, msg)
    except Exception as e:  # noqa: BLE001 - one worker's broken socket ends only its session
        logger.warning("worker connection ended: %s", e)
        _reply(conn, p.EngineDead(str(e)) if engine.dead else None)
    finally:
        if session is not None:
            engine.disconnect(session)
        conn.close()


def _reply(conn: p.Connection, msg) -> None:
    """Sends where the worker may be gone: its reader thread sees the socket's end and
    disconnects it; the loop must not fail for it."""
    if msg is None:
        return
    try:
        conn.send(msg)
    except OSError:
        pass


def accept_forever(engine: Engine, listener: socket.socket) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:  # the listener closed: the process is stopping
            return
        threading.Thread(target=serve_connection, args=(engine, sock), daemon=True).start()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m handlers.engine.serve", description=__doc__.splitlines()[0])
    ap.add_argument("socket")
    ap.add_argument("--factory", required=True, help="MODULE:FUNCTION returning the runner")
    ap.add_argument("--max-rows", type=int, default=None, help="rows per call at most (default: the spec's batch_max)")
    ap.add_argument("--name", default="engine")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = Engine(load_factory(args.factory)(), args.max_rows, args.name)
    listener = listen(args.socket)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=accept_forever, args=(engine, listener), daemon=True).start()
    logger.info("%s: listening on %s, max %d rows per call", engine.name, args.socket, engine.max_rows)
    try:
        engine.serve_forever(stop)
    finally:
        listener.close()
        if os.path.exists(args.socket):
            os.unlink(args.socket)
    return 1 if engine.dead else 0


if __name__ == "__main__":
    raise SystemExit(main())
