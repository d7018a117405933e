"""The worker's scratch directory: where native loaders extract files, removed when the worker
exits and swept on the next start.

aoti_load_package extracts the package (wrapper library, weights) into a fresh
`aotinductor_*` directory under std::filesystem::temp_directory_path(), which reads TMPDIR at
call time; the loader object is never destroyed when a worker process exits, so every worker
start used to leave one behind (a real model's weights on disk per restart). enter() points
TMPDIR of this process (and of its children: the crash-safe probe) at
TMPDIR/compiled-serving/worker-PID and removes it when the worker is gone, however it ends:
measured through real TorchServe, neither a stop nor kill -9 runs the worker's atexit handlers,
so a reaper (/bin/sh, in its own session, ~1 MB) waits for the worker's pid to disappear and
deletes the directory. Directories of workers gone while no reaper ran (a reboot, a killed
reaper) are swept by the next worker start. The root must be a directory of this user that no
one else can write (else a private one is made). Limit: liveness is judged by pid in this
process's pid namespace, so containers sharing one TMPDIR should each set their own.
"""
from __future__ import annotations

import atexit
import logging
import os
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile

from handlers import process

logger = logging.getLogger(__name__)
ROOT_NAME = "compiled-serving"
_entered = None
_root = None  # the private root the worker directories live under (shared by this user's workers)


def sweep(root: str) -> list:
    """Remove worker-PID directories under root whose process is gone; returns their paths."""
    gone = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        pid = name.removeprefix("worker-")
        if name.startswith("worker-") and pid.isdigit() and not process.alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    return gone


def _owned_root(root: str):
    """root, created 0700 if missing, when it is a real directory of this user that no one else
    may write; else None. Extracted libraries are dlopen-ed from below it: a directory another
    user controls could swap them in between."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.lstat(root)
    except OSError:
        return None
    private = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022
    return root if private else None


def _exit_on_sigterm(signum, frame):
    # atexit's handlers run (SIG_DFL would skip them), then the process ends at once: SystemExit
    # would reach interpreter shutdown, which in TorchServe's async worker waits for ever for
    # its threads that are not daemons (frontend_watch.py)
    atexit._run_exitfuncs()
    os._exit(128 + signum)


def _start_reaper(pid: int, path: str) -> None:
    script = (f"while kill -0 {pid} 2>/dev/null; do sleep 1; done; rm -rf {shlex.quote(path)}")
    try:
        subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError as e:  # no /bin/sh: the next start's sweep still removes it
        logger.warning("no reaper for %s (%s); the next worker start removes it", path, e)


def enter() -> str:
    """Idempotent; returns this worker's scratch directory."""
    global _entered
    if _entered:
        return _entered
    base = os.environ.get("TMPDIR") or tempfile.gettempdir()
    root = _owned_root(os.path.join(base, ROOT_NAME))
    if root is None:  # someone else's, a link, or open to others: a private one, nothing swept
        root = tempfile.mkdtemp(prefix=f"{ROOT_NAME}-", dir=base)
        logger.warning("%s is not a private directory of this user; extracting under %s instead",
                       os.path.join(base, ROOT_NAME), root)
    swept = sweep(root)
    if swept:
        logger.info("removed scratch directories of %d earlier worker(s): %s", len(swept), ", ".join(swept))
    mine = os.path.join(root, f"worker-{os.getpid()}")
    os.makedirs(mine, exist_ok=True)
    os.environ["TMPDIR"] = mine
    tempfile.tempdir = None  # Python's tempfile re-reads TMPDIR
    atexit.register(shutil.rmtree, mine, True)
    _start_reaper(os.getpid(), mine)
    process.record("TMPDIR and tempfile.tempdir", f"{mine}, removed at exit (atexit) and by a reaper process "
                   "when this worker is gone")
    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
            process.record("SIGTERM", "runs the atexit handlers, then os._exit")
    except ValueError:  # not the main thread (tests calling initialize from a thread)
        pass
    global _root
    _entered, _root = mine, root
    return mine


def remove_now() -> None:
    """Removes this worker's scratch directory at once (before an os._exit, which skips atexit)."""
    if _entered:
        shutil.rmtree(_entered, ignore_errors=True)


def shared_root():
    """The private root of this user's worker directories (None before enter()): a directory of
    this user that no one else may write, which outlives any one worker."""
    return _root
