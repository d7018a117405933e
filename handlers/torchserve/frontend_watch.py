"""The async worker's exit once its frontend is gone.

TorchServe 0.12's async worker (model-config asyncCommunication; ts/async_service.py) reads,
batches and writes on three threads that are not daemons and that nothing stops. When its
frontend dies (kill -9, the OOM killer, a crash) the reader's recv fails and that thread ends;
`run` returns and the process reaches interpreter shutdown, which then waits for the other two
for ever: `fetch_batches` blocks on an empty queue, `send_responses` on a future of an event loop
that no longer runs. The process keeps its model's memory until someone kills it (on the GPU
machine a 6 GiB continuous-batching worker outlived its server; tests/test_continuous.py kills
the frontend on the CPU). TorchServe's ordinary worker leaves its loop on the closed socket and
exits, so only the async worker is watched.

The watch is a daemon thread that asks every POLL_S whether the process that started this one
is still its parent: a parent that dies hands its children to init (or a subreaper), so
os.getppid() changes, and a reused pid cannot fool it. A worker forked from
compiled_serving/prefork.py's warm process has that process as its parent: it waits on a pidfd
of its frontend (handlers.process.frontend_pid), which a reused pid cannot fool either.
"""
from __future__ import annotations

import logging
import os
import select
import sys
import threading
import time

from handlers import process
from handlers.torchserve import frontend_frames, scratch

logger = logging.getLogger(__name__)
POLL_S = 0.5
EXIT_CODE = 75  # EX_TEMPFAIL: nobody reads it (the frontend is gone), but a supervisor's log may


def start() -> str:
    """Starts the watch in TorchServe's async worker; returns what it did (also recorded)."""
    main = sys.modules.get("__main__")
    if os.path.basename(getattr(main, "__file__", "") or "") != "model_service_worker.py":
        return "not a TorchServe worker process"
    if not frontend_frames.async_worker():
        return "not an async worker (its loop ends on the frontend's closed socket)"
    parent = process.frontend_pid()
    target = watch if parent == os.getppid() else watch_pid
    threading.Thread(target=target, args=(parent,), name="frontend-watch", daemon=True).start()
    how = f"exits within {POLL_S}s once its frontend (pid {parent}) is gone (TorchServe's async threads hold it)"
    process.record("frontend watch", how)
    return how


def watch(parent: int, poll_s: float = POLL_S, leave=None) -> None:
    """Returns only through `leave` (default: exit) once `parent` is no longer this process's parent."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    (leave or _leave)(parent)


def watch_pid(frontend: int, poll_s: float = POLL_S, leave=None) -> None:
    """As `watch`, for a frontend that is not this process's parent: until it ends (a pidfd;
    where none can be opened, its pid asked every `poll_s`)."""
    try:
        fd = os.pidfd_open(frontend)
        select.select([fd], [], [])
    except OSError:
        while process.alive(frontend):
            time.sleep(poll_s)
    (leave or _leave)(frontend)


def _leave(parent: int) -> None:
    logger.warning("the TorchServe frontend (pid %d) is gone; this async worker exits", parent)
    for h in logging.getLogger().handlers:  # os._exit flushes nothing
        h.flush()
    scratch.remove_now()
    os._exit(EXIT_CODE)  # not sys.exit: interpreter shutdown would wait for TorchServe's threads
