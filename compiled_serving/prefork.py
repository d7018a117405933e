"""TorchServe's workers forked from one warm process, so a worker that dies answers again in about
TorchServe's back-off (issue 64: a killed worker answering again within 1.5 s; its start was
2.9-3.5 s of interpreter and imports, `import torch` the most of it, before our handler ran).

How TorchServe 0.12 starts a worker (frontend/.../wlm/WorkerLifeCycle.startWorkerPython): it runs
the interpreter of the `torchserve` command (ts/model_server.py passes `--python sys.executable`,
which overrides config.properties' `python`) with `.../ts/model_service_worker.py --sock-type unix
--sock-name PATH --metrics-config FILE [--async]`, the model's environment and the model directory
as its working directory; it reads the process's stdout and stderr (the worker's log lines, its
`[PID]` and "Torch worker started.") and stops it with SIGKILL (`destroyForcibly`). It starts a
dead worker again after its back-off: 1 s the first time (WorkerThread.BACK_OFF[1]).

So the hook is at the interpreter's start: scripts/setup_env.sh writes `cs_prefork.pth` into the
environment's site-packages, whose one line calls `hook` here in a process running
model_service_worker.py, and nothing else in any other (site runs a .pth line that starts with
`import` at every start; sys.argv is set by then).

- Where a warm process (the zygote: torch and TorchServe's worker modules imported, nothing else
  done) answers for this exact environment, working directory and frontend, the starting worker
  (the launcher) sends it its arguments and its stdin, stdout and stderr (SCM_RIGHTS); the zygote
  forks a child that takes them as its own and runs the worker script as `python SCRIPT` would;
  the launcher waits for that child and ends with its status. A launcher killed (TorchServe's
  SIGKILL) ends its child: the child watches the launcher's pid. TorchServe reads the child's
  `[PID]`, so a `kill -9` of "the worker" is of the child, whose end ends its launcher.
- Where none answers (the first start of every worker), the hook starts one in the background for
  the next start (one per key, under a lock the zygote then holds for its life) and returns: the
  worker starts as it always did, never slower, and any failure of the zygote leaves that start.
- The zygote ends within a second of its frontend (the launcher's parent, checked each second), so
  `torchserve --stop` leaves none. Its socket is in Linux's abstract namespace (`cs-prefork-UID-KEY`:
  no file to leave behind, no path-length limit from the temporary directory), and each side checks
  the other is this user (SO_PEERCRED); its lock and log are in a directory of this user's alone
  (0700, `cs-prefork-UID` in the temporary directory).

What a forked worker shares with a fresh one: the environment (the key is its hash, so every
variable read at import time has the value the worker would have read), the interpreter and
sys.path (the zygote honours the same PYTHONPATH; the child puts the script's directory first, as
`python SCRIPT` does), the modules imported in the zygote: torch, TorchServe's worker modules and
the few others every handler's start imports (PREIMPORTS), nothing of `handlers`, so the archive's
own copy, first on the model's PYTHONPATH, is imported by the child as by a fresh worker. The
zygote compiles the archive's sources without running them (compile_sources), and the child's
import system takes that code for a source whose path and bytes are those compiled (use_compiled):
the same code, not compiled again at every restart. The zygote never initialises CUDA (a CUDA
context does not survive a fork; the child makes its own) and runs no torch operation (no thread
pool is started to fork). Its forked workers' command line is the zygote's (`prefork.py --zygote
KEY ...`).

This module is the build package's (installed) and uses the standard library alone: the hook runs
with the model's PYTHONPATH, where an archive's `handlers` comes first, and the zygote is started
by this file's path, so neither depends on what an archive carries. `CS_PREFORK=off` in
TorchServe's environment leaves every start as it was.
"""
from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time

WORKER_SCRIPT = "model_service_worker.py"  # TorchServe's worker: any other process is left alone
# cs_prefork.pth's one line (`python -m compiled_serving.prefork --pth` prints it; scripts/setup_env.sh
# writes it): this module is imported only by a process running TorchServe's worker
PTH_LINE = ("import sys; (sys.argv[:1] or [''])[0].endswith('/model_service_worker.py') "
            "and __import__('compiled_serving.prefork').prefork.hook()")
CONNECT_TIMEOUT_S = 2.0
# a zygote answers a request with its child's pid after one fork (milliseconds); one that has not
# within this is hung: the launcher kills it (no child can come later) and starts the worker itself
FORK_TIMEOUT_S = 10.0
FRONTEND_ENV = "CS_FRONTEND_PID"  # handlers/process.py reads it (the name is written in both)
# What a handler's start imports besides torch and TorchServe's worker modules, imported once in
# the zygote (a forked engine-served worker's start imported them in 3-10 ms on the CI's 2 cores:
# msgspec with decimal for handlers/engine/protocol.py, secrets with hmac for handlers/weights,
# shlex for handlers/torchserve/scratch.py, TorchServe's envelope base class): installed packages
# and the standard library only, nothing of `handlers` (the child imports the archive's copy).
# None starts a thread, touches CUDA or keeps a value read from the environment at import.
PREIMPORTS = ("msgspec", "decimal", "secrets", "shlex", "ts.torch_handler.request_envelope.base")
# what compile_sources compiles at most: an archive's own code is 115 files, 0.77 MB (handlers/ and
# ts_entry.py: 0.18 s and 3 MiB of the zygote's memory on the CI's 2 cores)
SOURCES_MAX_FILES = 1000
SOURCES_MAX_BYTES = 8 << 20


def key_of(env: dict, cwd: str, frontend: int) -> str:
    """One zygote per environment, working directory, interpreter and frontend process."""
    text = json.dumps([sorted(env.items()), cwd, sys.executable, frontend])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def address(key: str) -> str:
    """The zygote's socket: a name in the abstract namespace (the leading NUL)."""
    return f"\0cs-prefork-{os.getuid()}-{key}"


def home() -> str:
    """This user's directory for the zygotes' locks and logs (0700, refused otherwise)."""
    import tempfile  # here alone: a launcher a zygote answers never calls this (tempfile's imports: 3-4 ms)

    d = os.path.join(tempfile.gettempdir(), f"cs-prefork-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(d) or os.path.islink(d):
        raise PermissionError(f"{d} must be a directory of this user's alone (0700)")
    return d


def hook() -> None:
    """At the start of an interpreter running TorchServe's worker (cs_prefork.pth): the worker
    forked from the zygote of its key, this process following it and ending with its status (it
    never returns then); else the zygote started for the next worker, and the start goes on."""
    if getattr(sys, "_cs_prefork_hooked", False):  # site may read one .pth twice (lib64 -> lib)
        return
    sys._cs_prefork_hooked = True  # type: ignore[attr-defined]
    argv = list(sys.argv)
    if not argv or os.path.basename(argv[0]) != WORKER_SCRIPT or os.environ.get("CS_PREFORK") == "off":
        return
    frontend, key = os.getppid(), None
    try:
        key = key_of(dict(os.environ), os.getcwd(), frontend)
        sock, child = handoff(address(key), argv)
    except OSError:  # none answers: one is started for the next worker; this one starts as it would
        try:
            if key is not None:
                start_zygote(home(), key, frontend)
        except OSError:
            pass
        return
    status = follow(sock, child)
    sys.stdout.flush()
    os._exit(status)


def handoff(path: str, argv: list) -> tuple:
    """The request sent to the zygote at `path` with this process's stdin, stdout and stderr: the
    connection, on which the zygote then answers the child's status when it ends, and its pid."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(CONNECT_TIMEOUT_S)
    zygote = None
    try:
        s.connect(path)
        pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid():  # an abstract name anyone could bind: no descriptor of ours to another user
            raise PermissionError(f"the socket {path[1:]} is another user's")
        zygote = pid
        msg = json.dumps({"argv": argv, "cwd": os.getcwd(), "launcher": os.getpid()}).encode()
        socket.send_fds(s, [struct.pack("!I", len(msg)) + msg], [0, 1, 2])
        s.settimeout(FORK_TIMEOUT_S)
        reply = read_line(s)
        if "pid" not in reply:
            raise OSError(f"the zygote refused: {reply.get('error')}")
    except (OSError, ValueError):
        s.close()
        if zygote:  # it has this process's descriptors: it must not start a worker after this one starts
            _pass_on(zygote, signal.SIGKILL)
        raise
    s.settimeout(None)
    return s, int(reply["pid"])


def read_line(s: socket.socket) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            raise OSError("the zygote closed the connection")
        buf += chunk
    return json.loads(buf)


def follow(sock: socket.socket, pid: int) -> int:
    """Waits for the child to end (SIGTERM, SIGINT and SIGHUP passed on to it): its exit status as
    a process's (128 + signal where a signal ended it), 1 where the zygote went first."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: _pass_on(pid, signum))
    try:
        status = read_line(sock).get("status", 1)
    except (OSError, ValueError):
        status = 1
    return status if status >= 0 else 128 - status


def _pass_on(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def start_zygote(d: str, key: str, frontend: int) -> None:
    """The zygote of `key`, started detached (double fork: no zombie left in this process, which
    becomes the worker), unless one holds the key's lock (running, or starting)."""
    import fcntl

    lock = os.open(os.path.join(d, key + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        return
    log = os.open(os.path.join(d, key + ".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    pid = os.fork()
    if pid == 0:  # the intermediate: a session of its own, then the zygote, then gone
        try:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.set_inheritable(lock, True)
                os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "--zygote", key,
                                          "--frontend", str(frontend), "--lock-fd", str(lock)])
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    os.close(lock)  # the zygote holds the lock (the same open file) for its life
    os.close(log)


class Zygote:
    """The warm process: forks a worker per request. `serve` returns only in a forked child, with
    the request that child runs; in the zygote it loops until its frontend is gone."""

    def __init__(self, key: str, frontend: int):
        self.key, self.frontend = key, frontend
        self.children: dict = {}  # pid -> the launcher's connection, told the status when it ends
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # a child's end wakes the loop at once (its launcher is told its status): SIGCHLD writes
        # a byte to this pipe (signal.set_wakeup_fd), which the loop's select watches
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def open(self) -> None:
        """The socket bound to its key's name: launchers find it from now on, when this process
        only waits for them (its imports done). The name is gone with the process."""
        self.listener.bind(address(self.key))
        self.listener.listen(64)

    def serve(self):
        while True:
            ready, _, _ = select.select([self.listener, self.wake_r], [], [], 1.0)
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self.reap()
            if not alive(self.frontend):
                sys.exit(0)
            if self.listener in ready:
                job = self.accept()
                if job is not None:  # the forked child: leave the loop and become the worker
                    return job

    def accept(self):
        """One launcher's request: in the zygote None (the child forked, its pid answered, or the
        request refused); in the forked child (request, its three descriptors)."""
        conn, _ = self.listener.accept()
        fds: list = []
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():
                raise PermissionError("another user")
            conn.settimeout(CONNECT_TIMEOUT_S)
            head, fds, _, _ = socket.recv_fds(conn, 4, 3)
            body = b""
            while len(body) < struct.unpack("!I", head)[0]:
                chunk = conn.recv(65536)
                if not chunk:
                    raise ValueError("the launcher closed its request half-sent")
                body += chunk
            req = json.loads(body)
            if len(fds) != 3:
                raise ValueError(f"{len(fds)} descriptors, not stdin, stdout and stderr")
        except (OSError, ValueError, struct.error) as e:
            for fd in fds:
                os.close(fd)
            _send(conn, {"error": str(e)})
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: nothing of the zygote's loop stays open or armed
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.listener.close()
            for other in self.children.values():
                other.close()
            conn.close()
            return req, fds
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        self.children[pid] = conn
        _send(conn, {"pid": pid})
        return None

    def reap(self) -> None:
        """Each ended child's status to its launcher (negative: the signal that ended it)."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                _send(conn, {"status": code})
                conn.close()


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:
        pass


def alive(pid: int) -> bool:
    """handlers/process.py's `alive`, written again: this module may import nothing of `handlers`
    (an archive's copy comes first on a worker's PYTHONPATH), and `handlers` nothing of this
    build package (an archive does not carry it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:  # a zombie is dead: signal 0 succeeds on it until it is reaped
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] not in (b"Z", b"X")


def preimport() -> list:
    """PREIMPORTS imported; those this environment lacks are left to the worker (its import
    fails there as in a fresh one). Returns the names imported."""
    import importlib

    done = []
    for name in PREIMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        done.append(name)
    return done


def compile_sources(cwd: str) -> dict:
    """{path: (source bytes, code)} of the .py files under each sys.path entry inside `cwd` (the
    model directory: TorchServe's working directory for a worker, first on its PYTHONPATH), each
    compiled as the import system compiles a source file (SourceLoader.source_to_code: `compile`,
    dont_inherit, the interpreter's optimize level) under the path it names it by; none is run.
    A forked worker imports the archive's modules itself, as a fresh one does, but compiles none
    again (use_compiled). Where no bytecode is read (an archive carries none, and where
    PYTHONDONTWRITEBYTECODE=1 none is written: the GPU machine's image and the CI machine),
    every worker compiled the 104 modules of `handlers` its start imports, most of its handler's
    import: measured in forked engine-served restarts on the CI's 2 cores (busy), the handler's
    import took 0.26-0.6 s, 0.05-0.15 s without compiling. A file that fails to compile or warns
    is left out: the worker compiles it, its error or warning its own."""
    import warnings

    out: dict = {}
    files, size = 0, 0
    for path in _sources(cwd):
        if files >= SOURCES_MAX_FILES:
            break
        try:
            with open(path, "rb") as f:
                data = f.read(SOURCES_MAX_BYTES - size + 1)
            if size + len(data) > SOURCES_MAX_BYTES:
                break
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a SyntaxWarning (say) raised here: the worker's to print
                code = compile(data, path, "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError, Warning):
            continue
        out[path] = (data, code)
        files, size = files + 1, size + len(data)
    return out


def _sources(cwd: str):
    """The paths of the .py files an import can reach under each sys.path entry inside `cwd`,
    spelled as importlib's FileFinder spells them (its directory: an absolute entry as written,
    a relative one joined to the working directory; joined with "/" and trailing separators
    stripped), so that the loader asks for exactly these names."""
    root, seen = os.path.realpath(cwd), set()
    for entry in sys.path:
        top = cwd if entry in ("", ".") else entry if os.path.isabs(entry) else _join(cwd, entry)
        real = os.path.realpath(top)
        if _join(top) in seen or not os.path.isdir(top) or (real != root and not real.startswith(root + os.sep)):
            continue
        seen.add(_join(top))
        for d, dirs, names in os.walk(top):
            # a package's name is an identifier; __pycache__ holds no source
            dirs[:] = sorted(n for n in dirs if n.isidentifier() and n != "__pycache__")
            rel = os.path.relpath(d, top)
            for n in sorted(names):
                if n.endswith(".py") and n[:-3].isidentifier():
                    yield _join(top, *([] if rel == "." else rel.split(os.sep)), n)


def _join(*parts: str) -> str:
    """importlib._bootstrap_external._path_join on POSIX (its FileFinder's paths)."""
    return "/".join(p.rstrip("/") for p in parts if p)


def use_compiled(sources: dict) -> None:
    """In the forked child: the import system's compile of a source file (SourceFileLoader's
    source_to_code, which get_code calls where it reads no valid bytecode) answered from
    `sources` where the path and the bytes are those the zygote compiled; any other source is
    compiled as before. The code is what `compile` makes of the same bytes and name."""
    from importlib.machinery import SourceFileLoader

    compile_source = SourceFileLoader.source_to_code

    def source_to_code(self, data, path, *, _optimize=-1):
        hit = sources.get(path)
        if hit is not None and _optimize == -1 and hit[0] == data:
            return hit[1]
        return compile_source(self, data, path, _optimize=_optimize)

    SourceFileLoader.source_to_code = source_to_code


def become_worker(req: dict, fds: list, frontend: int, sources: dict | None = None) -> None:
    """In the forked child: the launcher's stdin, stdout and stderr, its working directory, no
    `handlers` module of the zygote's, a watch on the launcher, the zygote's compiled `sources`
    (compile_sources), then the worker script as `python SCRIPT ARGS` runs it (this function
    returns when it does, to the interpreter's exit)."""
    import runpy
    import threading

    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.chdir(req["cwd"])
    # its parent is this zygote: what the handler takes for its frontend (handlers/process.py
    # frontend_pid: the engine's key, the guardian, the frontend watch)
    os.environ[FRONTEND_ENV] = str(frontend)
    threading.Thread(target=_die_with, args=(req["launcher"],), name="prefork-launcher-watch", daemon=True).start()
    use_compiled(sources or {})
    sys.argv = list(req["argv"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python SCRIPT` puts its directory
    runpy.run_path(sys.argv[0], run_name="__main__")


def _die_with(launcher: int) -> None:
    """The launcher is the process TorchServe holds and kills: its end ends this worker. (The
    same wait as handlers/torchserve/frontend_watch.watch_pid, apart for the reason `alive` says.)"""
    try:
        fd = os.pidfd_open(launcher)
        select.select([fd], [], [])
    except OSError:
        while alive(launcher):
            time.sleep(0.2)
    os._exit(137)


def zygote_main(argv: list) -> None:
    import argparse

    p = argparse.ArgumentParser(description="the warm process TorchServe's workers are forked from (hook)")
    p.add_argument("--zygote", required=True, help="its key (key_of)")
    p.add_argument("--frontend", type=int, required=True, help="the pid it ends with")
    p.add_argument("--lock-fd", type=int, required=True, help="the key's lock, held for this process's life")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    import torch  # noqa: F401  (the worker's imports, once: no CUDA call here)
    import ts.async_service  # noqa: F401
    import ts.model_service_worker  # noqa: F401

    preimport()

    if torch.cuda.is_initialized():  # a CUDA context does not survive a fork: never serve with one
        raise SystemExit("the zygote's imports initialised CUDA; workers start without it")
    sources = compile_sources(os.getcwd())  # its working directory is the launcher's: the model's
    zygote = Zygote(args.zygote, args.frontend)
    zygote.open()

    print(f"zygote {args.zygote} pid {os.getpid()} ready in {time.perf_counter() - t0:.2f}s "
          f"for frontend {args.frontend} ({len(sources)} source files compiled)", flush=True)
    req, fds = zygote.serve()
    os.close(args.lock_fd)  # the child does not hold the zygote's lock
    become_worker(req, fds, args.frontend, sources)


if __name__ == "__main__":
    if sys.argv[1:] == ["--pth"]:
        print(PTH_LINE)
        raise SystemExit(0)
    del sys.path[0]  # run by its path (start_zygote): its own directory, first on sys.path, is no worker's
    zygote_main(sys.argv[1:])
