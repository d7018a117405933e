"""The guardian process of an async worker (handlers/torchserve/guardian.py says why and what it
does). Standard library only: it starts in a fraction of a second and holds no model memory.

    python -m handlers.torchserve.guardian_main SOCK_FD PIPE_FD FRONTEND_PID MODEL_JSON TEMPLATE_JSON MODE

MODE "async": the death frames, then the worker replaced (scaled to 0 and back); "sync" (a
worker TorchServe restarts itself: a one-sequence decoder's, or one given batches): the death
frames of the streams under way, then the connection let go; where none was under way, once the
frontend has written the batch it was gathering, or at once for a worker of one request per
batch (the frontend sees the death only once every holder of the worker's end of the connection
has closed it).
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import select
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


def read_records(pipe_fd: int) -> tuple:
    """({rid: death frame} of the requests streaming when the pipe closed, whether a batch was in
    the worker's predict then)."""
    held, rest, busy = {}, b"", False
    with os.fdopen(pipe_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                op, *args = json.loads(line)
                if op == "S":
                    held[args[0]] = base64.b64decode(args[1])
                elif op in ("B", "I"):
                    busy = op == "B"
                else:
                    for rid in args:
                        held.pop(rid, None)
    return held, busy


def frontend_holds(sock: socket.socket) -> bool:
    """Whether the frontend still holds its end of the connection (peeked without blocking)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def wait_read(sock: socket.socket, limit_s: float = SENT_WAIT_S, then_s: float = 0.1) -> None:
    """Until the frontend has read everything sent on `sock` (TIOCOUTQ: bytes not yet read by
    the peer of a Unix socket), then `then_s` more for its event loop to act on it."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        left = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        if left == 0:
            break
        time.sleep(0.01)
    time.sleep(then_s)


def predict_requests(buf: bytes) -> tuple:
    """(the request ids of the whole predict frames at the start of `buf`, the bytes they take),
    as ts/protocol/otf_message_handler.py's retrieve_msg reads them: b"I", then per request its
    id, headers (name, value) and parameters (name, content type, value), each list ended by -1,
    the batch ended by -1; every length a big-endian int. Raises ValueError where `buf` holds
    something else (the dead worker had read part of a frame: the rest is not one)."""
    ids, done, pos = [], 0, 0

    def num() -> int:
        nonlocal pos
        if pos + 4 > len(buf):
            raise IndexError
        pos += 4
        return struct.unpack_from("!i", buf, pos - 4)[0]

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0:
            raise ValueError(f"length {n}")
        if pos + n > len(buf):
            raise IndexError
        pos += n
        return buf[pos - n:pos]

    try:
        while pos < len(buf):
            if buf[pos:pos + 1] != b"I":
                raise ValueError(f"command {buf[pos:pos + 1]!r}")
            pos += 1
            frame = []
            while (n := num()) != -1:
                if not 0 < n <= 256:  # the frontend's request ids are UUIDs
                    raise ValueError(f"request id of {n} bytes")
                frame.append(take(n).decode("utf-8"))
                while (n := num()) != -1:  # headers
                    take(n), take(num())
                while (n := num()) != -1:  # parameters
                    take(n), take(num()), take(num())
            ids, done = ids + frame, pos
    except IndexError:  # a frame not whole yet: the next read brings the rest
        pass
    except UnicodeDecodeError as e:
        raise ValueError(str(e)) from None
    return ids, done


def answer_unread(sock: socket.socket, template: list, rest: bytes) -> bytes:
    """Answers each request the frontend wrote since the worker died (its old AsyncWorkerThread
    goes on taking requests and writing them to this connection, which holds them in
    AsyncBatchAggregator.jobs_in_backend) with the worker's refusal frames (a whole 503, then
    ts_stream_next false: the frontend forgets it); returns the bytes of a frame not whole yet."""
    while True:
        try:
            chunk = sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        if not chunk:
            break
        rest += chunk
    ids, done = predict_requests(rest)
    if ids:
        sock.sendall(b"".join(refusal(template, rid) for rid in ids))
        log(f"answered {len(ids)} request(s) sent to the dead worker: 503, retry")
    return rest[done:]


def refusal(template: list, rid: str) -> bytes:
    """The worker's refusal frames (guardian.refusal) for request `rid`."""
    field = struct.pack("!i", len(rid.encode())) + rid.encode()
    return field.join(template)


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


def replace_workers(frontend_pid: int, model: dict, last=lambda: None) -> None:
    """The model's workers scaled to 0 and back: TorchServe makes new AsyncWorkerThreads;
    `last` runs right before the scale-down (as close to it as the management API allows)."""
    base, headers = management(frontend_pid)
    path = f"{base}/models/{urllib.parse.quote(model['name'])}"
    if model.get("version"):
        path += f"/{urllib.parse.quote(str(model['version']))}"
    (desc,) = call("GET", path, headers)[:1]
    low, high = desc["minWorkers"], desc["maxWorkers"]
    last()
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


def end_streams(sock: socket.socket, held: dict) -> int:
    """A sync worker died with streams under way: their error events and last frames written
    (the frontend's WorkerThread passes them on and ends each answer), read, then the connection
    closed: the frontend sees the death and restarts the worker (WorkerThread.retry). A request the
    WorkerThread took from the queue in between (it takes the next once an answer has ended) gets
    TorchServe's own answer for a request sent to a worker that died (507 "Worker died.", which
    the pod answers 503 retry); the others wait in the queue for the new worker."""
    log(f"the worker died; ending {len(held)} stream(s) with an error event")
    try:
        sock.sendall(b"".join(held.values()))
        # closed once the frontend has read them: a close it sees first interrupts its WorkerThread
        # (the channel's closeFuture listener) before it takes the last frame from its replies
        wait_read(sock)
    except OSError as e:
        log(f"could not end the streams: {type(e).__name__}: {e}")
        return 1
    finally:
        sock.close()
    return 0


def let_go_after_batch(sock: socket.socket, wait_s: float) -> int:
    """A sync worker died with no stream under way: the connection is let go once the frontend
    writes to it (the batch its WorkerThread was gathering, or a stop's close), or after `wait_s`
    (guardian.batch_wait_s; 0: at once). Let go while the WorkerThread waits for its batch to fill,
    the death would interrupt that wait and leave the requests it took unanswered
    (guardian.batched); let go after the write, the WorkerThread answers that batch 507."""
    try:
        if wait_s > 0:
            poller = select.poll()  # not select(): a descriptor may be past FD_SETSIZE
            poller.register(sock, select.POLLIN | select.POLLHUP)
            written = bool(poller.poll(wait_s * 1000.0))
            log("the worker died idle; " + ("a batch was written to it: the frontend answers it 507" if written
                                             else f"no batch came within {wait_s:.2f} s") + " and restarts the worker")
    finally:
        sock.close()
    return 0


def main(argv: list) -> int:
    sock_fd, pipe_fd, frontend_pid, model = int(argv[1]), int(argv[2]), int(argv[3]), json.loads(argv[4])
    template = [base64.b64decode(part) for part in json.loads(argv[5])]
    sync = argv[6:7] == ["sync"]
    sock = socket.socket(fileno=sock_fd)
    held, busy = read_records(pipe_fd)
    if sync and not held:  # nothing of ours to end: the frontend's own handling of the death
        # busy: the frontend waits for the answer to the batch it sent, and answers it 507 at the close
        return let_go_after_batch(sock, 0.0 if busy else float(model.get("batch_wait_s") or 0.0))
    time.sleep(SETTLE_S)
    if not frontend_holds(sock):
        return 0  # a stop on purpose, or the frontend is gone
    if sync:
        return end_streams(sock, held)
    log(f"the worker of model {model['name']} died; ending {len(held)} stream(s) and replacing its worker")
    try:
        sock.sendall(b"".join(held.values()))
        rest = [b""]

        def answer(then_s: float) -> None:
            if rest[0] is None:
                return
            try:
                rest[0] = answer_unread(sock, template, rest[0])
            except ValueError as e:  # left to the scale-down's re-queue (guardian.py says when it fails)
                log(f"what the frontend wrote since the death is no whole frame ({e}); not answered")
                rest[0] = None
            wait_read(sock, then_s=then_s)

        answer(0.1)  # and the frames above read and acted on
        # last right before the scale-down: a request written after it is the scale-down's
        # to re-queue (guardian.py: not always)
        replace_workers(frontend_pid, model, last=lambda: answer(0.02))
    except Exception as e:  # noqa: BLE001  (the frontend then restarts the worker its own way)
        log(f"could not replace the worker: {type(e).__name__}: {e}")
        return 1
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
