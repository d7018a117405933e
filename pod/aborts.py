"""The pod's listener of abandoned generations: nginx's log line of each generation request it
finalized without answering it whole (its client closed the connection before or during the
answer) becomes a mark the workers read (handlers/generation/abandon.py). Runs as a thread of
pod.status.

Facts of nginx (1.22, the image's Debian nginx) this relies on, each seen on this machine:
- on a proxied request with proxy_buffering off, a client that closes its connection is noticed
  at once (epoll reports the close; error log: "client prematurely closed connection, so upstream
  connection is closed too") and the request is finalized: status 499 before the answer's status
  line went out, the answer's own status (200) after it, `$request_completion` empty in both, "OK"
  only for an answer sent whole;
- `access_log syslog:server=unix:PATH` sends each line as one datagram
  `<PRI>Mon DD HH:MM:SS TAG: LINE` (`nohostname`), without blocking; none is sent while no
  socket is bound there (nginx logs its failed connect and serves on);
- `$request_id` is 16 random bytes in hex, made by nginx per request; kserve/nginx.conf sends it
  to TorchServe in abandon.HEADER on the generate routes, replacing any client's value, and logs
  it alone (format `abandoned`), so no line carries a client's bytes.

Only a datagram of that shape whose key is 32 lowercase hex digits marks anything, and the
socket is in the pod's RUNTIME_DIR, reachable by the pod's processes only: nothing from the data
plane names a request to stop. A mark is kept for as long as its request may live in TorchServe
(the longest response timeout, and a margin), at most MAX_MARKS at once (the oldest go first).
"""
from __future__ import annotations

import collections
import os
import socket
import threading
import time
from typing import Optional

from handlers.generation.abandon import KEY, mark

TAG = b"abort: "  # kserve/nginx.conf's syslog tag, and the separator syslog writes after it
MAX_MARKS = 20_000  # an attack's marks, bounded (empty files: an inode each)
MARGIN_S = 30.0  # beyond the longest response timeout a request may live in the queue and worker


def key_of_line(datagram: bytes) -> Optional[str]:
    """The request key of one syslog datagram from nginx, or None for anything else."""
    _, tag, rest = datagram.partition(TAG)
    if not tag:
        return None
    key = rest.strip().decode("ascii", "replace")
    return key if KEY.fullmatch(key) else None


class Listener:
    """Binds `socket_path` (a datagram socket), marks each key in `directory`, sweeps old marks."""

    def __init__(self, socket_path: str, directory: str, keep_s: float, clock=time.monotonic):
        self.socket_path, self.directory, self.keep_s, self.clock = socket_path, directory, keep_s, clock
        self.marks: collections.deque = collections.deque()  # (clock() when marked, key), oldest first
        self.marked = 0
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for old in os.listdir(directory):  # an earlier listener's: their requests are gone or marked again
            self._remove(old)
        try:
            os.unlink(socket_path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_path)
        os.chmod(socket_path, 0o600)  # nginx's workers run as the pod's user (root on a developer's machine)

    def handle(self, datagram: bytes) -> bool:
        key = key_of_line(datagram)
        if key is None:
            return False
        self.sweep()
        mark(self.directory, key)
        self.marks.append((self.clock(), key))
        self.marked += 1
        return True

    def sweep(self) -> None:
        """Removes the marks older than keep_s, and the oldest beyond MAX_MARKS - 1."""
        now = self.clock()
        while self.marks and (now - self.marks[0][0] > self.keep_s or len(self.marks) >= MAX_MARKS):
            self._remove(self.marks.popleft()[1])

    def _remove(self, key: str) -> None:
        try:
            os.unlink(os.path.join(self.directory, key))
        except FileNotFoundError:
            pass

    def serve_forever(self) -> None:
        self.sock.settimeout(self.keep_s / 4)  # a quiet pod's marks are swept too
        while True:
            try:
                self.handle(self.sock.recv(4096))
            except socket.timeout:
                self.sweep()
            except OSError as e:  # a failed mark (disk full): the request runs on, as without the pod
                print(f"pod.status: abort listener: {type(e).__name__}: {e}", flush=True)


def start(cfg) -> Listener:
    """The listener of pod `cfg` (pod/config.py), serving on a daemon thread."""
    listener = Listener(cfg.abort_socket, cfg.abort_dir, cfg.response_timeout_s + MARGIN_S)
    threading.Thread(target=listener.serve_forever, name="pod-aborts", daemon=True).start()
    return listener
