"""The guardian process of an async worker (handlers/torchserve/guardian.py says why and what it
does). Standard library only: it starts in a fraction of a second and holds no model memory.

    python -m handlers.torchserve.guardian_main SOCK_FD PIPE_FD FRONTEND_PID MODEL_JSON
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import socket
import ssl
import struct
import sys
import termios
import time
import urllib.parse
import urllib.request

# The frontend closes its end of a worker's connection before it kills the worker on purpose
# (WorkerThread.shutdown: backendChannel close; then WorkLoadManager.modelChanged kills the
# process): a pipe that closes with the connection still open after this long is a death.
SETTLE_S = 0.3
SENT_WAIT_S = 2.0  # the longest wait for the frontend to read the death frames
DEFAULT_MANAGEMENT = "http://127.0.0.1:8081"  # TorchServe's default management_address


def log(msg: str) -> None:
    # the worker's stdout, which the frontend's WorkerLifeCycle copies into model_log.log until
    # it stops reading (WorkerLifeCycle's Scanner stops with the worker it was started for)
    try:
        print(f"[guardian {os.getpid()}] {msg}", flush=True)
    except OSError:
        pass


def read_records(pipe_fd: int) -> dict:
    """The death frames of the requests streaming when the pipe closed: {rid: frame}."""
    held, rest = {}, b""
    with os.fdopen(pipe_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                op, *args = json.loads(line)
                if op == "S":
                    held[args[0]] = base64.b64decode(args[1])
                else:
                    for rid in args:
                        held.pop(rid, None)
    return held


def frontend_holds(sock: socket.socket) -> bool:
    """Whether the frontend still holds its end of the connection (peeked without blocking)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def wait_read(sock: socket.socket, limit_s: float = SENT_WAIT_S) -> None:
    """Until the frontend has read everything sent on `sock` (TIOCOUTQ: bytes not yet read by
    the peer of a Unix socket), then a little more for its event loop to act on it."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        left = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        if left == 0:
            break
        time.sleep(0.01)
    time.sleep(0.1)


def management(frontend_pid: int) -> tuple:
    """(management base URL, headers) of the frontend: its config file (`-f`, as ts/model_server.py
    starts it) names management_address; its key_file.json (written where it was started, when
    token authorization is on) holds the management key."""
    proc = f"/proc/{frontend_pid}"
    base, headers = DEFAULT_MANAGEMENT, {}
    try:
        argv = open(f"{proc}/cmdline", "rb").read().decode().split("\0")
        config = os.path.join(f"{proc}/cwd", argv[argv.index("-f") + 1])
        for line in open(config, encoding="utf-8"):
            key, _, value = line.strip().partition("=")
            if key.strip() == "management_address":
                base = value.strip().replace("\\:", ":")
    except (OSError, ValueError, IndexError):
        pass
    try:
        keys = json.load(open(f"{proc}/cwd/key_file.json", encoding="utf-8"))
        headers["Authorization"] = f"Bearer {keys['management']['key']}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return base.rstrip("/"), headers


def call(method: str, url: str, headers: dict):
    req = urllib.request.Request(url, method=method, headers=headers)
    ctx = ssl._create_unverified_context() if url.startswith("https") else None  # the frontend's own address
    with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
        return json.loads(r.read() or b"null")


def replace_workers(frontend_pid: int, model: dict) -> None:
    """The model's workers scaled to 0 and back: TorchServe makes new AsyncWorkerThreads."""
    base, headers = management(frontend_pid)
    path = f"{base}/models/{urllib.parse.quote(model['name'])}"
    if model.get("version"):
        path += f"/{urllib.parse.quote(str(model['version']))}"
    (desc,) = call("GET", path, headers)[:1]
    low, high = desc["minWorkers"], desc["maxWorkers"]
    try:
        call("PUT", f"{path}?min_worker=0&max_worker=0&synchronous=true", headers)
    finally:
        # back up even when the scale-down answered an error: WorkLoadManager.modelChanged removes
        # the model's threads from its table before it stops them (WorkerThread.shutdown, which
        # can throw), and a model left with none answers 503 for ever
        for attempt in range(3):
            try:
                call("PUT", f"{path}?min_worker={low}&max_worker={high}", headers)
                break
            except Exception as e:  # noqa: BLE001
                log(f"scaling model {model['name']} back to {low}..{high} failed ({type(e).__name__}: {e})")
                if attempt == 2:
                    raise
                time.sleep(1.0)
    log(f"model {model['name']}: workers scaled to 0 and back to {low}..{high}")


def main(argv: list) -> int:
    sock_fd, pipe_fd, frontend_pid, model = int(argv[1]), int(argv[2]), int(argv[3]), json.loads(argv[4])
    sock = socket.socket(fileno=sock_fd)
    held = read_records(pipe_fd)
    time.sleep(SETTLE_S)
    if not frontend_holds(sock):
        return 0  # a stop on purpose, or the frontend is gone
    log(f"the worker of model {model['name']} died; ending {len(held)} stream(s) and replacing its worker")
    try:
        sock.sendall(b"".join(held.values()))
        wait_read(sock)
        replace_workers(frontend_pid, model)
    except Exception as e:  # noqa: BLE001  (the frontend then restarts the worker its own way)
        log(f"could not replace the worker: {type(e).__name__}: {e}")
        return 1
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
