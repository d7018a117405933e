"""handlers/torchserve/frontend_frames.py against TorchServe's own reader, over real sockets.

Every message is written into a Unix socket pair (whole, or in small pieces from a thread, as a
busy frontend's writes arrive) and read once by TorchServe's `retrieve_msg` and once by ours;
the two results must be equal in value and in type, field by field.
"""
import itertools
import os
import random
import socket
import sys
import threading
import types

import pytest
from ts.protocol import otf_message_handler

from handlers.torchserve import frontend_frames
from bench.bench_frames import (
    CLIENT_HEADERS,
    batch_message,
    encode_inference,
    encode_load,
)

BIG = 1 << 20  # past the reader's buffer: received straight into its own bytearray


def _read(reader, data: bytes, pieces=None, messages=1):
    """What `reader` returns for `messages` messages written as `data` (in pieces of the given
    sizes, cycled, from a thread; None: one sendall)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def write():
        if pieces is None:
            a.sendall(data)
            return
        at, sizes = 0, itertools.cycle(pieces)
        while at < len(data):
            n = next(sizes)
            a.sendall(data[at:at + n])
            at += n

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        return [reader(b) for _ in range(messages)]
    finally:
        writer.join(timeout=30)
        a.close()
        b.close()


def _typed(obj):
    """obj with every value paired with its type, so equality also compares types."""
    if isinstance(obj, dict):
        return {k: _typed(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_typed(v) for v in obj]
    return (type(obj).__name__, obj)


def _same(data: bytes, pieces=None, messages=1):
    ours = _read(frontend_frames.retrieve_msg, data, pieces, messages)
    stock = _read(otf_message_handler.retrieve_msg, data, pieces, messages)
    assert _typed(ours) == _typed(stock)
    return ours


MIXED = [
    ("id-0", CLIENT_HEADERS, [("body", "application/x-safetensors", os.urandom(BIG + 3))]),
    ("id-1", [], [("data", "application/octet-stream", b"")]),  # no headers, an empty value
    ("", [("X-Empty", ""), ("X-Negative-Length", -7)], []),  # empty id, no parameters
    ("id-3", [("Content-Type", "multipart/form-data")],
     [("a", "application/octet-stream", os.urandom((1 << 16) - 1)),  # the largest buffered value
      ("b", "application/octet-stream", os.urandom(1 << 16)),  # the smallest direct one
      ("c", "application/json", b'{"x": [1, 2]}'), ("d", "text/plain", "h\u00e9llo".encode()),
      ("e", "application/json", b"{not json"), ("f", "text/plain", b"\xff\xfe")]),
]


@pytest.mark.parametrize("pieces", [None, [1], [7, 4093, 3], [65536, 1, 131071]])
def test_inference_messages_read_alike_however_they_arrive(pieces):
    (cmd, msg), = _same(encode_inference(MIXED), pieces)
    assert cmd == b"I" and len(msg) == len(MIXED)


@pytest.mark.server
@pytest.mark.parametrize("decode", [None, "true", "false"])
def test_json_and_text_values_decoded_as_torchserve_decodes_them(monkeypatch, decode):
    if decode is None:
        monkeypatch.delenv("TS_DECODE_INPUT_REQUEST", raising=False)
    else:
        monkeypatch.setenv("TS_DECODE_INPUT_REQUEST", decode)
    (_, msg), = _same(encode_inference(MIXED[3:]))
    values = {p["name"]: p["value"] for p in msg[0]["parameters"]}
    assert values["c"] == ({"x": [1, 2]} if decode != "false" else bytearray(b'{"x": [1, 2]}'))
    assert values["e"] == bytearray(b"{not json")  # undecodable: handed over as received


def test_back_to_back_messages_keep_what_was_read_ahead():
    first, second = batch_message(3, 5000), encode_inference(MIXED)
    out = _same(first + second + first, pieces=[70001], messages=3)
    assert [len(m) for _, m in out] == [3, len(MIXED), 3]


@pytest.mark.parametrize("gpu", [-1, 0, 3])
def test_load_messages_read_alike(gpu):
    data = encode_load(name="resnet", path="/models/r", batch_size=8, handler="ts_entry.py",
                       gpu=gpu, envelope="", limit=True)
    (cmd, msg), = _same(data + batch_message(2, 100), pieces=[5], messages=1)
    assert cmd == b"L" and msg.get("gpu") == (gpu if gpu >= 0 else None)


def test_random_messages_in_random_pieces():
    rng = random.Random(7)
    for _ in range(20):
        requests = [(os.urandom(rng.randrange(0, 40)).hex(),
                     [(f"H{j}", os.urandom(rng.randrange(0, 300)).hex()) for j in range(rng.randrange(0, 12))],
                     [(f"p{j}", "application/octet-stream", os.urandom(rng.choice([0, 10, 70000, 300000])))
                      for j in range(rng.randrange(0, 3))])
                    for _ in range(rng.randrange(0, 9))]
        _same(encode_inference(requests), [rng.randrange(1, 100000) for _ in range(5)])


@pytest.mark.parametrize("data", [b"X", encode_inference(MIXED)[:1000], b""])
def test_bad_command_and_a_vanished_frontend_end_alike(data):
    """An unknown command raises ValueError in both; a frontend gone mid-message (or before one)
    makes both exit the worker with status 0."""
    outcomes = []
    for reader in (frontend_frames.retrieve_msg, otf_message_handler.retrieve_msg):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        a.sendall(data)
        a.close()
        with pytest.raises((ValueError, SystemExit)) as caught:
            reader(b)
        b.close()
        outcomes.append((caught.type, getattr(caught.value, "code", None)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0] == ((ValueError, None) if data == b"X" else (SystemExit, 0))


def _worker_main(monkeypatch, retrieve=otf_message_handler.retrieve_msg, name="model_service_worker.py"):
    main = types.ModuleType("__main__")
    main.__file__ = f"/site-packages/ts/{name}"
    main.retrieve_msg = retrieve
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


@pytest.mark.server
def test_install_replaces_the_reader_of_a_torchserve_worker_loop(monkeypatch):
    main = _worker_main(monkeypatch)
    assert frontend_frames.install(True) == "buffered frame reader"
    assert main.retrieve_msg is frontend_frames.retrieve_msg
    assert frontend_frames.install(True) == "buffered frame reader"  # idempotent


@pytest.mark.server
@pytest.mark.parametrize("case", ["disabled", "not a worker", "other version", "already replaced", "async worker"])
def test_install_keeps_torchserves_reader_and_says_why(monkeypatch, case):
    someone_elses = lambda conn: None  # noqa: E731
    main = _worker_main(monkeypatch, retrieve=someone_elses if case == "already replaced" else
                        otf_message_handler.retrieve_msg,
                        name="pytest.py" if case == "not a worker" else "model_service_worker.py")
    if case == "other version":
        monkeypatch.setattr("ts.version.__version__", "0.13.0")
    if case == "async worker":  # model_service_worker.py started as TorchServe starts an async one
        monkeypatch.setattr(sys, "argv", ["model_service_worker.py", "--sock-type", "unix", "--async"])
    before = main.retrieve_msg
    note = frontend_frames.install(case != "disabled")
    assert main.retrieve_msg is before
    assert note.startswith("TorchServe's frame reader (")
    assert {"disabled": "buffered_reader: false", "not a worker": "not in a TorchServe worker",
            "other version": "TorchServe 0.13.0", "already replaced": "not TorchServe's own",
            "async worker": "async worker reads with its own loop"}[case] in note


@pytest.mark.server
def test_bench_frames_writes_its_results(tmp_path):
    """bench/bench_frames.py: both readers timed on the same messages (it raises if they
    disagree), results JSON with the common first keys, Markdown and plot beside it."""
    import json

    from bench import bench_frames

    bench_frames.main(["--batch-sizes", "1,3", "--body-bytes", "70000", "--messages", "5", "--rounds", "1",
                       "--out", str(tmp_path / "frames")])
    result = json.loads((tmp_path / "frames.json").read_text())
    assert list(result)[:4] == ["device", "date", "torch", "command"]
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        assert r["torchserve_ms"] > 0 and r["buffered_ms"] > 0
        assert abs(r["ratio"] - r["buffered_ms"] / r["torchserve_ms"]) < 0.01  # from unrounded times
    assert "| 3 |" in (tmp_path / "frames.md").read_text()
    assert (tmp_path / "frames.png").stat().st_size > 1000


@pytest.mark.server
@pytest.mark.parametrize("waiting", [False, True])
def test_after_a_sticky_fault_the_reader_exits_only_between_messages(waiting):
    """handlers/torchserve/restart.exit_soon + retrieve_msg: once a sticky device fault set the exit, the
    worker's loop coming back for its next message exits (70) if none has begun to arrive, and
    reads and returns it if one has (its requests are answered before the next return)."""
    import multiprocessing

    from handlers.torchserve import restart

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    data = batch_message(2, 100)
    if waiting:
        a.sendall(data)

    def child():
        restart._exit_reason = "CUDA error: device-side assert triggered"
        msg = frontend_frames.retrieve_msg(b)
        os._exit(0 if msg[0] == b"I" and len(msg[1]) == 2 else 3)

    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join(timeout=30)
    a.close()
    b.close()
    assert p.exitcode == (0 if waiting else 70)
