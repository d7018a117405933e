"""Abandoned generations: how a worker learns that a request's client has gone, and ends it.

TorchServe 0.12's frontend never tells a worker that a client closed its connection
(docs/generation.md), so the KServe pod tells it beside TorchServe: its nginx names every
generation request with a key of its own making (`$request_id`, 32 random hex digits, sent in
the HEADER that nginx always sets, so a client's value never arrives), logs the key of each such
request it finalized unanswered (the client closed before or during the answer) to the pod's
listener (pod/aborts.py), and the listener marks it: an empty file named by the key in the
pod-private directory that pod/start.py hands TorchServe's workers in ENV. The generation engines
look at the marks of the sequences they hold once per step (`Marks.gone`: one stat while none
changed) or per token (`Marks.is_gone`: one stat) and end a marked one: its slot or its worker is free for the
next request, and the answer it gets (ClientGone) is written by TorchServe to a closed connection.

Without ENV (TorchServe run directly, no pod) nothing is marked and nothing is checked: there the
slot form's queue deadline (handler.queue_timeout_s) is the bound.
"""
from __future__ import annotations

import os
import re
import time
from typing import Iterable, Optional

from handlers.errors import ServingError

HEADER = "X-Pod-Request-Id"  # set by the pod's nginx on the generate routes, never the client's
ENV = "CS_ABORT_DIR"  # the marks' directory, in the workers' environment (pod/start.py)
KEY = re.compile(r"[0-9a-f]{32}")  # nginx's $request_id: 16 random bytes in hex


class ClientGone(ServingError):
    """The request's client closed its connection; the answer goes nowhere (nginx's 499)."""

    status = 499
    error_type = "ClientClosedRequest"


def key_of(value: Optional[str]) -> Optional[str]:
    """The request's key where the header holds one nginx could have made, else None."""
    return value if isinstance(value, str) and KEY.fullmatch(value) else None


def mark(directory: str, key: str) -> bool:
    """Marks `key` gone (the pod's side); False for a value that is no key."""
    if key_of(key) is None:
        return False
    with open(os.path.join(directory, key), "wb"):
        pass
    return True


class Marks:
    """The marks a worker reads: `directory` None (no pod) reads nothing, at no cost.

    `gone` costs one stat of the directory per call while nothing changed in it, whatever the
    number of marks (an attack may leave thousands: pod/aborts.py keeps each for as long as its
    request may live), plus one stat per key not yet looked at since the directory last changed.
    A change (a new mark, or the listener's sweep) changes the directory's mtime; the kernel
    stamps it from a clock that moves in ticks (a few ms), so a directory changed within
    SETTLE_NS of now is never taken as unchanged."""

    SETTLE_NS = 50_000_000

    def __init__(self, directory: Optional[str]):
        self.directory = directory or None
        self._mtime, self._clean = None, set()  # the directory's mtime when `_clean` was known unmarked

    @classmethod
    def from_env(cls) -> "Marks":
        return cls(os.environ.get(ENV))

    def gone(self, keys: Iterable) -> set:
        """The keys of `keys` that are marked (None keys never are)."""
        wanted = {k for k in keys if k is not None}
        if not wanted or self.directory is None:
            return set()
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:  # the directory gone (the pod stopping): nothing is known to be gone
            return set()
        if mtime != self._mtime or time.time_ns() - mtime < self.SETTLE_NS:
            self._mtime, self._clean = mtime, set()
        ask = wanted - self._clean
        found = {k for k in ask if os.path.exists(os.path.join(self.directory, k))}
        self._clean = (self._clean & wanted) | (ask - found)
        return found

    def is_gone(self, key: Optional[str]) -> bool:
        """One key's mark: one stat."""
        return key is not None and self.directory is not None and os.path.exists(os.path.join(self.directory, key))

    def error(self, what: str) -> ClientGone:
        return ClientGone(f"the client closed its connection {what}; the generation was stopped")
