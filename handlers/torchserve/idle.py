"""Work a worker does between batches: after it has answered one batch and before the frontend's
next message has begun to arrive (handlers/torchserve/restart.py's check, at the point where the
worker's frame reader is back for its next message). What runs here delays only a message that
arrives while it runs, by one step; the steps run on the thread that serves requests, so they
never overlap a batch. Only in a TorchServe worker whose loop reads with
frontend_frames.retrieve_msg (handlers/startup.py checks that before deferring anything).

Used for the CUDA graphs captured after the worker is ready (handlers/startup.py)."""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_steps: list = []  # callables: each call does one piece of work and returns True while more is left


def defer(step) -> None:
    """Run `step()` between batches, again and again until it returns False."""
    _steps.append(step)


def pending() -> bool:
    return bool(_steps)


def run(waiting) -> None:
    """Steps, one at a time, while `waiting()` says no message has begun to arrive. A step that
    raises is logged and dropped: the worker's loop must go on reading messages."""
    while _steps and not waiting():
        step = _steps[0]
        try:
            more = step()
        except Exception:
            logger.exception("deferred work failed and was dropped")
            more = False
        if not more:
            _steps.remove(step)
