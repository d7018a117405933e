"""A worker's side of the weights holder (holder.py): whether this worker shares, the holder found
or started, the weights received, and the watch that stops the worker when the holder is gone.

The holder of an (artifact, device, frontend) answers on a unix socket in this user's private
scratch root (handlers/torchserve/scratch.py: a directory no one else may write), with a random
authkey in a 0600 file beside it. Workers take one file lock per holder around finding or
starting it, and, for kinds whose load allocates their own copy for a moment
(ArtifactKind.load_copies_weights), around that load too, so the GPU never holds more than the
holder's copy and one worker's.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from handlers import process
from handlers.artifact.device import gpu_identity
from handlers.weights.holder import KEY_ENV, PID_FILE

logger = logging.getLogger(__name__)
HOLDER_DIR_PREFIX = "cs-holder-"  # a holder's TMPDIR (its pid file in it: holder.PID_FILE)
HOLDER_START_S = 600.0  # a holder loads the weights once, as a worker would: as long as a trial load may take
RECEIVE_S = 120.0  # mapping the holder's allocations takes well under a second; a holder this slow is stuck
# a sibling keeps the holder's lock while it starts the holder and, for some kinds, while it loads
# on the held weights: longer than both may take means it is stuck, and this worker loads its own
LOCK_WAIT_S = HOLDER_START_S + RECEIVE_S


class ShareError(Exception):
    """The holder could not be found, started or read: the worker loads its own copy."""


def why_not(config, spec, placement, kind, generative: bool):
    """None when this worker reads held weights, else the reason it loads its own copy."""
    if config.shared_weights == "off":
        return "shared_weights is off"
    if placement.kind != "cuda" and config.shared_weights != "on":
        return "a CPU worker (shared_weights: on shares through shared memory)"
    if kind.not_shared:
        return kind.not_shared
    if generative:
        return "a generative model: its cache and weights stay with each worker"
    return None


class HeldWeights:
    """The tensors received from a holder, and the open connection that says it is alive. The
    tensors must outlive every model reading them: the worker keeps this object for its life."""

    def __init__(self, conn, sent: dict, started: bool):
        self.conn, self.started = conn, started
        self.tensors, self.holder_pid, self.check = sent["weights"], sent["pid"], sent["check"]
        # the holder's unpacked library (ArtifactKind.shared_library), kept until it exits
        self.library = sent.get("library")
        self._lost = None  # why the holder is gone, once it is
        self._on_lost = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="weights-holder-watch", daemon=True).start()

    def describe(self) -> str:
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return (f"weights held by pid {self.holder_pid} ({len(self.tensors)} tensors, {nbytes / 2**20:.0f} MiB, "
                + ("started by this worker)" if self.started else "attached)"))

    def close(self) -> None:
        """Lets go of the holder (a load that will not use the held weights after all). Only
        shuts the socket down: that ends the watch's read with EOF and the holder sees this worker
        gone. The watch closes the descriptor itself once its read has returned; closing it here
        could hand its number to the next connection while the watch still reads from it."""
        self.tensors = {}
        with contextlib.suppress(OSError):
            with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as dup:
                dup.shutdown(socket.SHUT_RDWR)

    def on_lost(self, callback) -> None:
        """callback(reason) once the holder is gone (at once if it already is)."""
        with self._lock:
            self._on_lost, lost = callback, self._lost
        if lost and self.tensors:  # after close() nothing reads the holder's memory
            callback(lost)

    def _watch(self) -> None:
        try:
            while True:
                self.conn.recv_bytes()  # the holder sends nothing more: returns only when it is gone
        except (EOFError, OSError):
            pass
        self.conn.close()
        reason = f"the weights holder (pid {self.holder_pid}) is gone; this worker's model read its memory"
        with self._lock:
            self._lost, callback = reason, self._on_lost
        if callback and self.tensors:  # not after close(): nothing reads the holder's memory then
            callback(reason)


def verify(model, check: bytes, device) -> str:
    """The held load's answer to the holder's check request against the artifact's own copy's
    (holder.reference, saved by torch.save); raises ShareError where they differ beyond float
    rounding (1e-3), so a worker never serves a wrong answer from held weights. Returns what was
    found, for the load line."""
    import io

    import torch

    check = torch.load(io.BytesIO(check), weights_only=True)
    try:
        with torch.inference_mode():
            got = model(*(t.to(device) for t in check["inputs"].values()))
    except Exception as e:  # noqa: BLE001  (an exported program's first call on the held tensors: no smoke call)
        raise ShareError(f"the answer check's call on the held weights failed: {type(e).__name__}: {e}") from e
    exact = True
    for name, want in check["outputs"].items():
        have = got[name].cpu()
        if have.shape != want.shape or have.dtype != want.dtype:
            raise ShareError(f"output {name} is {have.dtype} {list(have.shape)} on the held weights, "
                             f"{want.dtype} {list(want.shape)} on the artifact's own copy")
        if not torch.equal(have, want):
            exact = False
            diff = (have.double() - want.double()).abs().max().item()
            if not torch.allclose(have.double(), want.double(), rtol=1e-3, atol=1e-3):
                raise ShareError(f"output {name} on the held weights differs from the artifact's own copy's "
                                 f"by up to {diff:.3g}")
    return "answers equal to the own copy's" if exact else "answers within 1e-3 of the own copy's"


def release_load_scratch(placement) -> None:
    """Frees what the held load's first call and answer check left on the device: torch keeps a
    cuBLAS workspace per (handle, stream) a matmul ran on, and makes a new one at the next call
    that needs it. Measured on an H200 (docs/results/shared_weights_big_mlp_fp16_h200,
    worker_memory): a held worker's allocator held 67 MiB after its load where an own-copy
    worker held 34."""
    import torch

    if placement.kind == "cuda":
        torch.cuda.synchronize(placement.torch_device)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds of torch
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def _paths(root: str, spec, placement) -> dict:
    # the frontend (this worker's parent) is part of the name: another TorchServe on the same
    # files gets its own holder, tied to its own lifetime
    # and so is the artifact's digest: a file changed in place gets a new holder, not the old weights
    # and the GPU by its identity: every confined worker calls its own GPU cuda:0 (confine.py)
    key = f"{os.path.realpath(spec.artifact_path)}|{spec.sha256}|{gpu_identity(placement)}|{process.frontend_pid()}"
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    d = os.path.join(root, "weights")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return {ext: os.path.join(d, f"{tag}.{ext}") for ext in ("sock", "key", "lock", "log")}


# a socket with nobody listening, no socket or key file, a stale key
NOT_THERE = (OSError, EOFError, ValueError, multiprocessing.AuthenticationError)


def _connect(paths: dict):
    from multiprocessing.connection import Client

    with open(paths["key"], "rb") as f:
        key = f.read()
    return Client(paths["sock"], family="AF_UNIX", authkey=key)


def _start_holder(paths: dict, root: str, spec, placement) -> int:
    """Starts the holder in its own session (it outlives the worker that started it) and waits
    for its ready line; returns its pid."""
    key = secrets.token_hex(32).encode()  # hex: it also travels in the environment
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths["key"])
    fd = os.open(paths["key"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # A TMPDIR of its own: the worker's (scratch.py) is removed when that worker dies, with what
    # the holder keeps there (on the CPU, torch's shared-memory manager's socket). Made beside the
    # scratch root, private and uniquely named (mkdtemp), and short: that socket's path may not
    # pass 107 bytes. Once loaded the holder keeps only the library its workers load there
    # (ArtifactKind.shared_library); it removes the directory when it exits, and a later start
    # sweeps the directory of one that could not (killed, or failed to start).
    sweep_holder_dirs(os.path.dirname(root))
    tmp = tempfile.mkdtemp(prefix=HOLDER_DIR_PREFIX, dir=os.path.dirname(root))
    env = dict(os.environ, TMPDIR=tmp, **{KEY_ENV: key.decode()})
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    index = placement.index if placement.index is not None else -1
    cmd = [sys.executable, "-m", "handlers.weights.holder", spec.variant_dir, placement.kind, str(index),
           paths["sock"], str(process.frontend_pid())]
    with open(paths["log"], "ab") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=pkg_parent, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=log, start_new_session=True, close_fds=True)
    with open(os.path.join(tmp, PID_FILE), "w") as f:
        f.write(str(proc.pid))
    line = _ready_line(proc, paths)
    if "error" in line:
        raise ShareError(f"the weights holder failed to load: {line['error']}")
    return int(line["pid"])


def sweep_holder_dirs(parent: str) -> list:
    """Removes this user's holder directories under `parent` whose holder is gone (its pid file
    names a dead process, or it has none, or an empty one, and is older than a holder's start
    may take: its starter died before writing it); returns their names. A holder's unpacked
    library is as large as the model, and on a tmpfs it is memory."""
    gone = []
    for name in os.listdir(parent) if os.path.isdir(parent) else ():
        d = os.path.join(parent, name)
        try:
            if not name.startswith(HOLDER_DIR_PREFIX) or os.lstat(d).st_uid != os.getuid():
                continue
            try:
                with open(os.path.join(d, PID_FILE)) as f:
                    pid = int(f.read().strip() or 0)
            except FileNotFoundError:
                pid = 0
            # no pid: judged by age (signal 0 to pid 0 would ask about this process's own group)
            dead = not process.alive(pid) if pid > 0 else time.time() - os.lstat(d).st_mtime > HOLDER_START_S
        except (OSError, ValueError):
            continue
        if dead:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(name)
    return gone


def _ready_line(proc, paths: dict) -> dict:
    line = process.ready_line(proc, HOLDER_START_S)
    if line is None:
        raise ShareError(f"the weights holder gave no ready line within {HOLDER_START_S:.0f}s "
                         f"(exit status {proc.poll()}); its log: {paths['log']}")
    return line


def _receive(conn) -> dict:
    try:
        if not conn.poll(RECEIVE_S):
            raise ShareError(f"the weights holder sent nothing within {RECEIVE_S:.0f}s")
        return conn.recv()  # rebuilding the tensors maps the holder's allocations (CUDA IPC)
    except ShareError:
        raise
    except Exception as e:  # noqa: BLE001  (an IPC handle this process cannot open, a holder gone mid-send)
        raise ShareError(f"receiving the held weights failed: {type(e).__name__}: {e}") from e


def take_lock(fd: int, path: str, wait_s: float) -> None:
    """The holder's lock within `wait_s`; ShareError naming the lock and the wait where a sibling
    keeps it longer (a worker's readiness never waits on a stuck sibling)."""
    if not process.lock_within(fd, wait_s):
        raise ShareError(f"waited {wait_s:.0f}s for the weights holder's lock {path}, which a sibling "
                         "worker keeps while it starts the holder or loads on it; its log is beside "
                         "the lock (.log)")


@contextlib.contextmanager
def attached(root: str, spec, placement, hold_lock: bool):
    """Yields HeldWeights from the holder of this artifact on this device, starting it when none
    answers. hold_lock: keep the holder's lock until the block ends (a load that allocates its
    own copy for a moment). Raises ShareError when no weights could be received."""
    import torch.multiprocessing  # noqa: F401  (registers the tensor rebuilders the holder's pickles name)

    if root is None:
        raise ShareError("no private scratch root to keep the holder's socket in")
    paths = _paths(root, spec, placement)
    fd = os.open(paths["lock"], os.O_RDWR | os.O_CREAT, 0o600)
    try:
        take_lock(fd, paths["lock"], LOCK_WAIT_S)
        started = False
        try:
            conn = _connect(paths)
        except NOT_THERE:
            holder, started = _start_holder(paths, root, spec, placement), True
            try:
                conn = _connect(paths)
            except NOT_THERE as e:
                raise ShareError(f"the weights holder started (pid {holder}) but refused the connection: {e!r}") from e
        t0 = time.perf_counter()
        held = HeldWeights(conn, _receive(conn), started)
        if not hold_lock:
            os.close(fd)
            fd = None
        logger.info("received %d held tensors in %.2fs", len(held.tensors), time.perf_counter() - t0)
        try:
            yield held
        except BaseException:  # the load on them failed: no connection left for the holder to count
            held.close()
            raise
    finally:
        if fd is not None:
            os.close(fd)
