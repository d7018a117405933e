"""The engine's protocol: typed messages between a CPU worker and the GPU engine (issue 64).

Control only crosses the socket. Tensor bytes live in the worker's shared-memory arena
(handlers/engine/arena.py); a message names a tensor by `TensorRef` (name, dtype, shape, offset in the
arena, nbytes), never by its bytes.

The conversation, one Unix stream socket per worker:

    worker -> engine   Hello (the arena's fd rides on this frame, SCM_RIGHTS)
    engine -> worker   Ready (or EngineDead, and the socket closes)
    worker -> engine   Infer(id, inputs)        any number in flight
    engine -> worker   Result(id, outputs) | Failed(id, status, ...)   exactly one per Infer
    worker -> engine   Release(id)              after reading a Result's outputs
    worker -> engine   Abort(id)                the worker gave up; the Infer still gets its
                                                one answer (Failed 499 where it was dropped)
    worker -> engine   State(id)                engine -> worker State(id, counts; a generating
                                                engine's running, waiting, slots in use)
    engine -> worker   EngineDead(reason)       a fault that ends the engine; the socket closes

Generation (a decoder's engine, either form, handlers/engine/generation.py; Ready carries its
`generation` facts): token ids cross, never text (the workers tokenize and detokenize):

    worker -> engine   Generate(id, prompt ids, max_tokens, stop ids, sampling, key)
    engine -> worker   Tokens(items)            one per worker per turn: each sequence's new
                                                token ids (and log probabilities where asked),
                                                `done` the reason where the engine ended it
                       | Failed(id, ...)        the sequence failed (503 Busy: no slot and no
                                                room in the queue; 499: its client went)
    worker -> engine   Abort(id)                the worker ended it (a stop string, its client
                                                gone, a sibling choice failed): its slot is freed
                                                at the engine's next turn, and no answer follows

Who owns which bytes: the worker allocates the inputs in its half of the arena and frees them
when the Infer's one answer arrives (the engine reads them until then); the engine allocates a
Result's outputs in its half and frees them on Release (or Abort, or the worker's disconnect).

Framing: a 4-byte big-endian length, then one msgpack message (msgspec, tagged by `kind`).

Cost of one message on this project's CPU box (2 cores shared with other jobs, so the figures
are noisy; Python 3.11, msgspec 0.22; `python -m engine.protocol` measures again): encode +
decode of an Infer of 3 tensor refs and a Result of 2, µs per message, median of 5 rounds of
20000, two runs:

    codec                                      Infer        Result
    msgspec msgpack, typed Structs (this)    3.6, 4.4      2.8, 3.2
    stdlib json, the same fields as dicts   20.3, 22.3    12.4, 15.1
    stdlib pickle (protocol 5), dicts        6.7, 5.9      3.4, 7.1

msgspec is about 5x faster than json and 1.5-2x faster than pickle, and it builds typed Structs,
checked as it decodes (a bad frame is a ProtocolError, not an AttributeError later), where
json and pickle above give plain dicts unchecked (and pickle would run code from the peer).
Against a request's other costs (its HTTP body's decode, the model call) a few µs per message
is small; what matters more is that no tensor bytes are in it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from typing import Optional, Union

import msgspec

from handlers.errors import ProtocolError

VERSION = 1
HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 20  # control messages only: a frame over 1 MiB is a bug or a hostile peer


class TensorRef(msgspec.Struct, array_like=True, frozen=True):
    """One tensor in a worker's arena: `nbytes` bytes at `offset`, C-contiguous."""

    name: str
    dtype: str  # handlers/dtypes.py's names ("float32", "int64", ...)
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class _Msg(msgspec.Struct, array_like=True, frozen=True, tag_field="kind"):
    pass


class Hello(_Msg, tag="hello"):
    worker: str  # the worker's name, for the engine's log
    pid: int
    worker_bytes: int  # the arena's first part: the worker's inputs
    engine_bytes: int  # the rest: the engine's outputs for this worker
    protocol: int = VERSION


class ReplayCost(msgspec.Struct, array_like=True, frozen=True):
    """One captured graph's replay time (handlers/run/graphs.ReplayTable's entry)."""

    sizes: tuple[tuple[str, int], ...]  # its named-dimension sizes, sorted by name
    rows: int
    ms: float


class GenerationInfo(msgspec.Struct, array_like=True, frozen=True):
    """What a worker needs of the engine's decoder to check and plan a request itself."""

    slots: int  # sequences generated at once (the slot form's slots, or the lanes)
    vocab: int
    cache_length: int  # positions per sequence, prompt and generated tokens together
    queue_size: int  # sequences that may wait for a slot (more: 503 Busy)
    describe: str = ""  # the engine's account of its decoder, budget and graphs


class Ready(_Msg, tag="ready"):
    engine: str
    pid: int
    max_rows: int  # rows the engine runs in one call at most
    protocol: int = VERSION
    variant: str = ""  # the variant directory the engine loaded (its artifact.json is the worker's spec)
    describe: str = ""  # what the engine loaded and how, for the worker's load line
    # its graphs' replay times: the worker pads its batch's length groups to shared buckets where
    # one job is cheaper (batch.PadPlan.targets), as a runner with the graphs pads its own batch
    costs: tuple[ReplayCost, ...] = ()
    generation: Optional[GenerationInfo] = None  # set by an engine that generates (a decoder)


class Infer(_Msg, tag="infer"):
    id: int
    inputs: tuple[TensorRef, ...]
    # Results the worker is done with (their ids), carried here rather than as a Release each:
    # one message and one wake-up of the engine's reader less per request under load
    release: tuple[int, ...] = ()


class Result(_Msg, tag="result"):
    id: int
    outputs: tuple[TensorRef, ...]


class Sampling(msgspec.Struct, array_like=True, frozen=True):
    """A sequence's sampling (handlers/generation/request.Params' fields the engine reads)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    logprobs: Optional[int] = None  # top alternatives per token; None: no log probabilities


class Generate(_Msg, tag="generate"):
    id: int
    prompt: tuple[int, ...]
    max_tokens: int
    stop_ids: tuple[int, ...]  # ids that end the sequence (end-of-sequence and the request's own)
    sampling: Sampling = Sampling()
    key: str = ""  # the pod's name for the request (handlers/generation/abandon.py), "" without one


class Logprob(msgspec.Struct, array_like=True, frozen=True):
    """One token's log probability and its step's most likely alternatives ((id, logprob), ...)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Emitted(msgspec.Struct, array_like=True, frozen=True):
    """A sequence's tokens of one turn."""

    id: int
    tokens: tuple[int, ...]
    logprobs: tuple[Logprob, ...] = ()  # one per token where the request asked
    done: str = ""  # why the engine ended the sequence (eos_token, length); "": it goes on


class Tokens(_Msg, tag="tokens"):
    items: tuple[Emitted, ...]


class Failed(_Msg, tag="failed"):
    id: int
    status: int  # the HTTP status the worker answers with
    error_type: str
    message: str
    retryable: bool = False


class Release(_Msg, tag="release"):
    id: int


class Abort(_Msg, tag="abort"):
    id: int


class State(_Msg, tag="state"):
    id: int
    queued: int = 0  # jobs of every worker waiting for the GPU
    clients: int = 0  # workers connected
    calls: int = 0  # model calls since start
    rows: int = 0  # rows run since start
    held: int = 0  # Results of this worker not released yet
    # a generating engine's batch (handlers/generation/engine.py's gauges); -1: the engine does not generate
    running: int = -1  # sequences decoding
    waiting: int = -1  # sequences waiting for a slot
    slots_in_use: int = -1  # slots held (decoding or filling a prompt)


class EngineDead(_Msg, tag="engine_dead"):
    reason: str


Message = Union[Hello, Ready, Infer, Result, Failed, Release, Abort, State, EngineDead, Generate, Tokens]
MESSAGES = (Hello, Ready, Infer, Result, Failed, Release, Abort, State, EngineDead, Generate, Tokens)


class Encoder:
    """Messages to frames; one per sender (its buffer is reused, not thread-safe)."""

    def __init__(self):
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray(256)

    def frame(self, msg: Message) -> bytes:
        self._enc.encode_into(msg, self._buf, HEADER.size)
        n = len(self._buf) - HEADER.size
        if n > MAX_FRAME:
            raise ProtocolError(f"a {type(msg).__name__} of {n} bytes is over the {MAX_FRAME}-byte frame limit")
        HEADER.pack_into(self._buf, 0, n)
        return bytes(self._buf)


class Decoder:
    """Bytes as they arrive to whole messages; a partial frame waits for the rest."""

    def __init__(self):
        self._dec = msgspec.msgpack.Decoder(Message)
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        """The whole messages `data` completes; a partial frame's bytes wait for the next feed.
        With nothing waiting, `data` is read where it is (most reads end on a frame's end)."""
        if self._buf:
            self._buf += data
            buf = self._buf
        else:
            buf = data
        view = memoryview(buf)
        out, at = [], 0
        try:
            while len(buf) - at >= HEADER.size:
                (n,) = HEADER.unpack_from(buf, at)
                if n > MAX_FRAME:
                    raise ProtocolError(f"a frame of {n} bytes is over the {MAX_FRAME}-byte limit")
                if len(buf) - at - HEADER.size < n:
                    break
                try:
                    out.append(self._dec.decode(view[at + HEADER.size:at + HEADER.size + n]))
                except msgspec.DecodeError as e:
                    raise ProtocolError(f"not a message of protocol {VERSION}: {e}") from None
                at += HEADER.size + n
        finally:
            view.release()  # a bytearray with an export cannot be resized
        if buf is self._buf:
            del self._buf[:at]
        elif at < len(buf):
            self._buf += buf[at:]
        return out


# sun_path holds 108 bytes on Linux, its terminating NUL included (unix(7)): a longer socket path
# fails bind and connect with "AF_UNIX path too long"
UNIX_PATH_MAX = 107


@contextlib.contextmanager
def unix_address(path: str):
    """The address to bind or connect to for the socket file `path`, valid inside the block. A path
    longer than sun_path holds (a TorchServe under a deep directory) is reached through an O_PATH
    descriptor of its directory, /proc/self/fd/N/NAME, which Linux resolves through the descriptor:
    the socket file stays where its directory's permissions guard it."""
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        yield path
        return
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


class Connection:
    """One end of the Unix stream socket: framed sends (thread-safe), framed receives (one
    reader thread). recv returns [] at end of stream: the peer closed or died."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._enc = Encoder()
        self._dec = Decoder()
        self._lock = threading.Lock()

    def send(self, msg: Message, fds: tuple = ()) -> None:
        with self._lock:
            data = self._enc.frame(msg)
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.sendall(data)

    def recv(self, want_fds: int = 0) -> tuple:
        """(messages, fds) of the next read; ([], []) at end of stream. Blocks; the socket's
        timeout, where set, raises socket.timeout."""
        while True:
            if want_fds:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, want_fds)
            else:
                data, fds = self.sock.recv(65536), []
            if not data:
                for fd in fds:
                    _close_fd(fd)
                return [], []
            msgs = self._dec.feed(data)
            if msgs or fds:
                return msgs, fds

    def read_available(self, size: int = 1 << 20) -> tuple:
        """(messages, end of stream) of one read of at most `size` bytes from a socket that is
        ready to read (epoll said so: the read returns at once): the whole frames it completes (a
        partial frame waits for the next read)."""
        try:
            data = self.sock.recv(size)
        except (BlockingIOError, InterruptedError):
            return [], False
        if not data:
            return [], True
        return self._dec.feed(data), False

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _close_fd(fd: int) -> None:
    import os

    os.close(fd)


def _measure(rounds: int = 5, n: int = 20000) -> dict:
    """µs per encode + decode of a typical Infer (3 refs) and Result (2 refs) with each codec:
    msgspec's typed structs against json and pickle of the same fields as plain dicts and lists."""
    import json
    import pickle
    import statistics
    import time

    refs = tuple(TensorRef(f"in{i}", "float32", (8, 128), i * 4096, 4096) for i in range(3))
    msgs = {"Infer": Infer(17, refs), "Result": Result(17, refs[:2])}
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Message)
    codecs = {
        "msgspec msgpack": (lambda m: m, lambda m: dec.decode(enc.encode(m))),
        "stdlib json": (msgspec.to_builtins, lambda d: json.loads(json.dumps(d))),
        "stdlib pickle": (msgspec.to_builtins, lambda d: pickle.loads(pickle.dumps(d, protocol=5))),
    }
    out = {}
    for codec, (prepare, round_trip) in codecs.items():
        for kind, m in msgs.items():
            m, times = prepare(m), []
            for _ in range(rounds):
                t = time.perf_counter()
                for _ in range(n):
                    round_trip(m)
                times.append((time.perf_counter() - t) / n * 1e6)
            out[(codec, kind)] = statistics.median(times)
    return out


if __name__ == "__main__":
    for (codec, kind), us in _measure().items():
        print(f"{codec:18} {kind:7} {us:6.2f} µs")
