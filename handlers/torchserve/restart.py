"""The worker's exit after a sticky device fault, so TorchServe starts a fresh one (it restarts
workers that die; handlers/faults.py says which faults are sticky). The exit waits until this
batch's answers are sent and no next message has begun to arrive (frontend_frames.retrieve_msg
asks at that moment)."""
from __future__ import annotations

import logging
import os
import socket
import threading

from handlers import process

logger = logging.getLogger(__name__)
EXIT_DELAY_S = 1.0  # the latest exit after a sticky fault (see exit_soon)
_exit_reason = None  # set once a sticky fault was seen: the process exits soon
# the process's exit; tests/conftest.py puts a recorder in its place for the pytest process, where
# a worker runs in process and an os._exit would end the test run without a report
_exit = os._exit


def exit_soon(reason: str, delay_s: float = EXIT_DELAY_S) -> None:
    """Exit the process soon, without running Python cleanup that could touch the broken CUDA
    context (atexit-registered directories are removed first). With the buffered frame reader
    in TorchServe's loop, the exit comes as soon as the loop is back for its next message with
    none arrived (frontend_frames.retrieve_msg asks exit_if_idle): the answers of this batch have
    been sent and no batch is half-read, so the frontend loses no request. A daemon timer exits
    after delay_s in any case (without that reader, it is the only exit)."""
    global _exit_reason
    _exit_reason = reason
    logger.critical("worker exits when its answers are sent (at most %.1fs) so TorchServe restarts it: %s",
                    delay_s, reason)
    process.record("exit", f"os._exit after a sticky device fault, once idle (at most {delay_s:.1f}s)")
    t = threading.Timer(delay_s, _exit_now)
    t.daemon = True
    t.start()


def exiting() -> bool:
    """Whether an exit is pending (nothing more should start in this process)."""
    return _exit_reason is not None


def exit_if_idle(conn) -> None:
    """Called by the frame reader when the worker's loop is back for its next message with nothing
    buffered: exits now if an exit is pending and nothing of a next message waits on `conn`."""
    if _exit_reason is None:
        return
    if not waiting(conn):
        # at once: anything slower here (removing the scratch directory, which holds the
        # extracted artifact) would widen the window for a next batch to arrive; the reaper
        # process scratch.enter started removes that directory when this process is gone
        _exit(70)


def waiting(conn) -> bool:
    """Whether any byte of a next message has arrived on `conn` (peeked without blocking); a
    frontend that is gone has nothing left to answer."""
    try:
        return bool(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # BlockingIOError: nothing has arrived; any other: the frontend is gone
        return False


def _exit_now() -> None:
    from handlers.torchserve import scratch

    scratch.remove_now()
    _exit(70)
