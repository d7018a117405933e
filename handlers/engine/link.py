"""A worker's way to its engine: the engine of its (archive, GPU, TorchServe frontend) found, or
started when none answers, under a file lock, so the workers of one GPU that start at once agree
on one engine (the first starts it, the others wait on the lock and connect to it).

The engine runs in a session of its own (a worker's death or restart does not end it), with the
environment of the worker that started it: CUDA_VISIBLE_DEVICES naming that worker's one GPU
(handlers/artifact/confine.py), so the engine sees it as cuda:0. It imports the archive's copy
of `handlers` (the model directory first on PYTHONPATH, as TorchServe runs the worker). It ends
with its frontend, or when no worker was connected for IDLE_EXIT_S (handlers/engine/serve.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

from handlers import process
from handlers.engine import room
from handlers.engine.client import EngineClient
from handlers.errors import EngineUnavailable, LoadError, ProtocolError

logger = logging.getLogger(__name__)
ENGINE_START_S = 600.0  # an engine's load, warm-up and CUDA graph captures at most
# a sibling worker starting the engine holds the lock while it waits for the ready line: the
# engine's start, after a wait for GPU room (room.MAX_WAIT_S) at most
LOCK_WAIT_S = ENGINE_START_S + room.MAX_WAIT_S + 30
IDLE_EXIT_S = 15.0  # longer than TorchServe's restart of a killed worker (about a second) plus its start
ENGINE_DIR_PREFIX = "cs-engine-"


def paths(root: str, model_dir: str, yaml_config, gpu: Optional[str]) -> dict:
    """The engine's socket, lock and log. The frontend (the worker's parent) is part of the name,
    so another TorchServe on the same files gets its own engine, tied to its own lifetime; so are
    the model's directory (one per registered archive and version), its settings and the GPU as
    the host names it (`gpu`: the worker's CUDA_VISIBLE_DEVICES entry; None: the CPU)."""
    settings = json.dumps(yaml_config, sort_keys=True, default=str)
    key = f"{os.path.realpath(model_dir)}|{settings}|{gpu}|{process.frontend_pid()}"
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    d = os.path.join(root, "engines")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return {ext: os.path.join(d, f"{tag}.{ext}") for ext in ("sock", "lock", "log")}


def connect(root: str, model_dir: str, yaml_config, gpu: Optional[str], gpu_id: Optional[int],
            name: str, model: str = "") -> EngineClient:
    """A client of the engine for this archive and GPU (`gpu`: the GPU as the host names it, for
    the engine's name; `gpu_id`: as the engine places on it, None for the CPU), starting the
    engine where none answers; LoadError with the engine's own reason (and its log's path) where
    it cannot load. `model`: the model's name, the engine's (engine-MODEL) in its log and samples."""
    p = paths(root, model_dir, yaml_config, gpu)
    fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not process.lock_within(fd, LOCK_WAIT_S):
            raise LoadError(f"waited {LOCK_WAIT_S:.0f}s for the engine's lock {p['lock']}, which a sibling "
                            f"worker keeps while it starts the engine; the engine's log: {p['log']}")
        with contextlib.suppress(OSError, EngineUnavailable, ProtocolError):
            return EngineClient(p["sock"], name)
        start(p, root, model_dir, yaml_config, gpu_id, model)
        return EngineClient(p["sock"], name)
    finally:
        os.close(fd)


def start(p: dict, root: str, model_dir: str, yaml_config, gpu_id: Optional[int], model: str = "") -> int:
    """Starts the engine and waits for its ready line; returns its pid."""
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # A TMPDIR of its own, beside the private scratch root: the worker's own is removed when
    # that worker dies, and the engine outlives it (an AOTInductor package unpacks there).
    tmp = tempfile.mkdtemp(prefix=ENGINE_DIR_PREFIX, dir=os.path.dirname(root))
    env = dict(os.environ, TMPDIR=tmp)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "handlers.engine.serve", p["sock"], "--model-dir", model_dir,
           "--config-json", json.dumps(yaml_config, default=str), "--verdict-root", root,
           "--frontend", str(process.frontend_pid()), "--idle-exit-s", str(IDLE_EXIT_S),
           "--name", f"engine-{model or os.path.basename(os.path.normpath(model_dir))}"]
    if gpu_id is not None:
        cmd += ["--gpu-id", str(gpu_id)]  # 0 where the worker is confined to its GPU
    with open(p["log"], "ab") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=pkg_parent, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=log, start_new_session=True, close_fds=True)
    line = _ready_line(proc, p["log"])
    if "error" in line:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LoadError(f"the engine could not load the model: {line['error']} (its log: {p['log']})")
    return int(line["pid"])


def _ready_line(proc, log: str) -> dict:
    """The engine's ready (or error) line, within ENGINE_START_S of its start, or of its room on the
    GPU where it says first that it waits for other engines' loads there (handlers/engine/room.py:
    it refuses by itself after room.MAX_WAIT_S); LoadError where none comes (the engine killed)."""
    t0 = time.monotonic()
    deadline, waited = t0 + ENGINE_START_S, ""
    while True:
        line = process.json_line(proc, deadline - time.monotonic())
        if line is not None and "waiting_for_room" in line:
            waited = f"; it waited for GPU room first ({line['waiting_for_room']})"
            logger.info("the engine waits for other engines' loads on its GPU: %s", line["waiting_for_room"])
            deadline = time.monotonic() + room.MAX_WAIT_S + ENGINE_START_S
        elif line is not None and "room_after_s" in line:
            deadline = time.monotonic() + ENGINE_START_S  # its own load starts now
        else:
            break
    proc.stdout.close()
    if line is None:
        proc.kill()
        try:  # its status says which: killed here where it still ran
            status = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        raise LoadError(f"the engine gave no ready line: it ended after {time.monotonic() - t0:.1f}s with exit status "
                        f"{status} (-9: still loading at the {ENGINE_START_S:.0f}s limit, and killed){waited}; its "
                        f"log, with the cause: {log}")
    return line
