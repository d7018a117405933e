"""Every change this worker makes to its process beyond its own objects (the environment,
Python's and torch's global state, TorchServe's worker loop), recorded by the code that makes
it, so the worker lists them all in one line at load (handlers/startup.py) and a reader finds
each one from that line. A change not recorded here is a bug."""
from __future__ import annotations

_changes: dict = {}  # what changed -> how, in the order first made


def record(what: str, how: str) -> None:
    _changes[what] = how


def describe() -> str:
    return "; ".join(f"{what}: {how}" for what, how in _changes.items()) or "none"
