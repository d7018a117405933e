"""Every change this worker makes to its process beyond its own objects (the environment,
Python's and torch's global state, TorchServe's worker loop), recorded by the code that makes
it, so the worker lists them all in one line at load (handlers/startup.py) and a reader finds
each one from that line. A change not recorded here is a bug."""
from __future__ import annotations

import os

_changes: dict = {}  # what changed -> how, in the order first made


def record(what: str, how: str) -> None:
    _changes[what] = how


def describe() -> str:
    return "; ".join(f"{what}: {how}" for what, how in _changes.items()) or "none"


def age_s():
    """Seconds since this process began (Linux: its start time in /proc/self/stat, field 22, in
    clock ticks since boot, against /proc/uptime); None where /proc cannot tell. A worker's
    start measured from here includes the interpreter, TorchServe's and torch's imports and the
    frontend's load message, which no timer inside the handler sees."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process `pid` exists in this pid namespace (signal 0 only asks; a process of
    another user exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
