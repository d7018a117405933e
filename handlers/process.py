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


# set by compiled_serving/prefork.py in a worker it forked: that worker's parent is the warm
# process it was forked from, not TorchServe's frontend
FRONTEND_ENV = "CS_FRONTEND_PID"


def frontend_pid() -> int:
    """The pid of the TorchServe frontend that started this worker: its parent, or, in a worker
    forked from compiled_serving/prefork.py's warm process, the one that process names."""
    return int(os.environ.get(FRONTEND_ENV) or os.getppid())


def alive(pid: int) -> bool:
    """Whether process `pid` runs in this pid namespace (signal 0 only asks; a process of
    another user exists too). A zombie is dead: signal 0 succeeds on it until its parent reaps
    it, and one whose parent exited waits for pid 1, which in a container may never reap (a
    killed weights holder stayed "alive" so, and its directory was never swept)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not zombie(pid)


def zombie(pid: int) -> bool:
    """Whether /proc says `pid` has ended and is not reaped (state Z, or X while it goes); the
    state is the field after the command name, which is in parentheses and may hold any byte."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # gone meanwhile, or no /proc: signal 0's answer stands
        return False
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] in (b"Z", b"X")


def uncompiled_imports(module) -> "str | None":
    """Why this interpreter compiles `module`'s sources at every start (no .pyc beside them or
    under PYTHONPYCACHEPREFIX, and it writes none: PYTHONDONTWRITEBYTECODE or a read-only
    site-packages), with the fix; None when compiled bytecode is there or gets written. Measured
    on an H200 image without .pyc files (docs/results/shared_weights_big_mlp_fp16_h200, imports):
    `import torch` took 4.1 to 4.9 s, 2.3 to 2.5 s once compiled, and every worker's start,
    restarts included, pays it."""
    import importlib.util
    import sys

    source = getattr(module, "__file__", None)
    if not source or not source.endswith(".py"):
        return None
    cached = importlib.util.cache_from_source(source)
    if os.path.exists(cached):
        return None
    beside = os.access(os.path.dirname(source), os.W_OK)  # where __pycache__ goes without a prefix
    if not sys.flags.dont_write_bytecode and (sys.pycache_prefix or beside):  # Python makes the prefix's directories
        return None  # the first import writes them
    site = os.path.dirname(os.path.dirname(source))
    if sys.flags.dont_write_bytecode and beside:
        why, fix = "PYTHONDONTWRITEBYTECODE is set", f"`python -m compileall -q -j 0 {site}`"
    else:  # the bytecode cannot go beside the sources: a prefix the server's environment names
        why = ("PYTHONDONTWRITEBYTECODE is set" if sys.flags.dont_write_bytecode else "its directory is read-only")
        fix = (f"`PYTHONPYCACHEPREFIX=DIR python -m compileall -q -j 0 {site}` and PYTHONPYCACHEPREFIX=DIR in "
               "TorchServe's environment")
    return (f"{module.__name__} has no compiled bytecode ({cached} is missing) and this interpreter writes none "
            f"({why}), so every worker start, restarts included, compiles its sources again; compile them once: {fix}")


def lock_within(fd: int, wait_s: float) -> bool:
    """Takes the exclusive flock on `fd` within `wait_s` seconds; False where another process
    keeps it longer (callers name the lock and the cause: a start never waits on a stuck
    sibling for ever)."""
    import fcntl
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def json_line(proc, wait_s: float):
    """The next line the process prints on its stdout pipe within `wait_s` seconds, as the JSON
    object it holds; None where none came (its end, the time up) or it is no JSON object."""
    import json
    import select

    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, wait_s))
    raw = proc.stdout.readline() if ready else b""
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    return line if isinstance(line, dict) else None
