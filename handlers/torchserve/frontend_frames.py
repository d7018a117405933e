"""The worker's reader of the frontend's messages: TorchServe's frame format, read from a buffer.

TorchServe 0.12's Python worker reads every message from the frontend one field at a time
(ts/protocol/otf_message_handler.py: each `_retrieve_int` and `_retrieve_buffer` is its own
recv(2)): a request with eight HTTP headers costs about 40 system calls, and each body is
received into a bytes object and then copied into a bytearray. That reading is on every
batch's critical path: the frontend sends a worker its next batch only after the answer to
the last one. Measured with `python -m bench.bench_frames` (batches of 8 requests of 301,160
bytes with 8 headers each): TorchServe's reader 0.7103 ms of CPU per batch on the 2x H200 host,
this one 0.4609 ms (git show 0bd3d87:docs/results/frames_h200x2.md); on the CI CPU 0.93-1.45 against 0.40-0.51.

This reader takes the same frames from a buffer that one recv_into fills with whatever has
arrived, receives each large value straight into its own bytearray, and returns exactly what
TorchServe's `retrieve_msg` returns (the same dicts, lists and types; tests/test_frames.py
compares the two over a socket, frame by frame). One difference: it does not log TorchServe's
"Backend received inference at" line, which the shipped log4j2.xml drops anyway.

Frames (TorchServe 0.12; ints are 4-byte big-endian, "bytes" is an int length then the bytes;
a length of -1 ends a list):
  load       b"L", bytes model name, bytes model path, int batch size, bytes handler, int GPU
             id (-1: none), bytes envelope, 1-byte bool limitMaxImagePixels
  inference  b"I", then requests until -1: bytes request id; headers until -1: bytes name,
             bytes value; parameters until -1: bytes name, bytes content type, bytes value

`install` puts `retrieve_msg` in place of TorchServe's in the worker's main loop: TorchServe
starts the worker as the script ts/model_service_worker.py, whose loop (`handle_connection`)
looks up `retrieve_msg` among the script's module globals (`__main__`) for every message. It
does so only for TorchServe versions whose frame format this reader was tested against.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import sys

from handlers import timeline
from handlers.torchserve import restart

_INT = struct.Struct("!i")
_BOOL = struct.Struct("!?")
# Values at least this long are received straight into their own bytearray; shorter ones
# (ids, headers, names) are sliced out of the buffer, which is larger than this.
_DIRECT = 1 << 16
_BUFFER = 1 << 18
TESTED_VERSIONS = ("0.12.",)  # TorchServe releases whose frame format is the one above


class FrameReader:
    """Fields of the frontend's frames, in order, from one connection."""

    def __init__(self, conn):
        self.conn = conn
        self.buf = bytearray(_BUFFER)
        self.view = memoryview(self.buf)
        self.pos = self.end = 0  # unread bytes are buf[pos:end]

    def _recv_into(self, view, limit=0) -> int:
        got = self.conn.recv_into(view, limit)
        if not got:  # as TorchServe's worker does when the frontend goes away
            logging.info("Frontend disconnected.")
            sys.exit(0)
        return got

    def _fill(self, need: int) -> None:
        """At least `need` (< _BUFFER) unread bytes in the buffer."""
        if self.pos + need > _BUFFER:
            left = self.end - self.pos
            self.buf[:left] = self.view[self.pos:self.end]
            self.pos, self.end = 0, left
        while self.end - self.pos < need:
            self.end += self._recv_into(self.view[self.end:])

    def int(self) -> int:
        if self.end - self.pos < 4:
            self._fill(4)
        (value,) = _INT.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def bool(self) -> bool:
        if self.end == self.pos:
            self._fill(1)
        (value,) = _BOOL.unpack_from(self.buf, self.pos)
        self.pos += 1
        return value

    def bytes(self, n: int) -> bytearray:
        """The next `n` bytes as a bytearray of their own (empty for n <= 0, as TorchServe's)."""
        if n <= 0:
            return bytearray()
        if n < _DIRECT:
            if self.end - self.pos < n:
                self._fill(n)
            out = self.buf[self.pos:self.pos + n]
            self.pos += n
            return out
        out = bytearray(n)
        view = memoryview(out)
        got = min(n, self.end - self.pos)
        view[:got] = self.view[self.pos:self.pos + got]
        self.pos += got
        while got < n:
            got += self._recv_into(view[got:], n - got)
        return out

    def sized(self) -> bytearray:
        return self.bytes(self.int())


def _value(reader: FrameReader, content_type: str, decode: bool):
    """A parameter's value, decoded as TorchServe's worker decodes it (JSON, text) if `decode`."""
    value = reader.sized()
    if decode and content_type == "application/json":
        try:
            return json.loads(value.decode("utf-8"))
        except Exception:
            logging.warning("Failed json decoding of input data. Forwarding encoded payload", exc_info=True)
    elif decode and content_type.startswith("text"):
        try:
            return value.decode("utf-8")
        except Exception:
            logging.warning("Failed utf-8 decoding of input data. Forwarding encoded payload", exc_info=True)
    return value


def _request(reader: FrameReader, length: int, decode: bool) -> dict:
    request = {"requestId": reader.bytes(length)}
    headers = []
    while (n := reader.int()) != -1:
        headers.append({"name": reader.bytes(n), "value": reader.sized()})
    request["headers"] = headers
    parameters = []
    while (n := reader.int()) != -1:
        name = reader.bytes(n).decode("utf-8")
        content_type = reader.sized().decode("utf-8")
        parameters.append({"name": name, "contentType": content_type,
                           "value": _value(reader, content_type, decode)})
    request["parameters"] = parameters
    return request


def _load_message(reader: FrameReader) -> dict:
    msg = {"modelName": reader.sized(), "modelPath": reader.sized(), "batchSize": reader.int(),
           "handler": reader.sized()}
    gpu = reader.int()
    if gpu >= 0:
        msg["gpu"] = gpu
    msg["envelope"] = reader.sized()
    msg["limitMaxImagePixels"] = reader.bool()
    return msg


_reader = None  # the FrameReader of the connection read last (a worker has one)


def retrieve_msg(conn):
    """(command, message) as TorchServe's `retrieve_msg` returns them."""
    global _reader
    if _reader is None or _reader.conn is not conn:
        _reader = FrameReader(conn)
    reader = _reader
    if timeline.ON:
        timeline.mark("wait")
    if reader.pos == reader.end:
        # the loop sent its last answers and is back for the next message: the clean moment to
        # exit after a sticky device fault
        restart.exit_if_idle(conn)
    cmd = reader.bytes(1)
    if timeline.ON:
        timeline.mark("arrived")
    if cmd == b"I":
        decode = os.environ.get("TS_DECODE_INPUT_REQUEST") in (None, "true")
        msg = []
        while (n := reader.int()) != -1:
            msg.append(_request(reader, n, decode))
        if timeline.ON:
            timeline.mark("read", len(msg))
        return cmd, msg
    if cmd == b"L":
        return cmd, _load_message(reader)
    raise ValueError("Invalid command: {}".format(cmd))


def install(enabled: bool) -> str:
    """Puts `retrieve_msg` into this TorchServe worker's loop; returns what was done, for the load line."""
    if not enabled:
        return "TorchServe's frame reader (handler.buffered_reader: false)"
    main = sys.modules.get("__main__")
    if os.path.basename(getattr(main, "__file__", "") or "") != "model_service_worker.py":
        return "TorchServe's frame reader (not in a TorchServe worker process)"
    if async_worker():
        # TorchServe's async worker (model-config asyncCommunication) reads requests in
        # ts/async_service.py with that module's own retrieve_msg, never the loop's: replacing
        # the loop's would change nothing, and that reader was not tested against this one.
        return "TorchServe's frame reader (TorchServe's async worker reads with its own loop)"
    if getattr(main, "retrieve_msg", None) is retrieve_msg:
        return "buffered frame reader"
    try:
        from ts.protocol import otf_message_handler
        from ts.version import __version__
    except ImportError as e:
        return f"TorchServe's frame reader ({e})"
    if not __version__.startswith(TESTED_VERSIONS):
        return (f"TorchServe's frame reader (TorchServe {__version__}: the buffered reader was tested "
                f"against {', '.join(v + 'x' for v in TESTED_VERSIONS)})")
    if getattr(main, "retrieve_msg", None) is not otf_message_handler.retrieve_msg:
        return "TorchServe's frame reader (the worker's retrieve_msg is not TorchServe's own)"
    main.retrieve_msg = retrieve_msg
    from handlers import process

    process.record("TorchServe's worker loop", "__main__.retrieve_msg is handlers.torchserve.frontend_frames.retrieve_msg")
    return "buffered frame reader"


def async_worker() -> bool:
    """Whether this process is TorchServe's async worker (model-config asyncCommunication: its
    frontend starts ts/model_service_worker.py with --async, and the worker awaits `handle`)."""
    return "--async" in sys.argv
