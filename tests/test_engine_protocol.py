"""handlers/engine/protocol.py and handlers/engine/arena.py: every message round-trips through the framing, bad
frames are typed errors, the arena's allocator, zero-copy views, a full arena (503), cleanup."""
import itertools
import gc
import os
import socket
import threading

import msgspec
import pytest
import torch

from handlers.engine import protocol as p
from handlers.engine.arena import ALIGN, Allocator, Arena
from handlers.errors import ArenaFull, ProtocolError

REF = p.TensorRef("x", "float32", (2, 3), 128, 24)
EVERY = [
    p.Hello("w1", 42, 1 << 20, 1 << 20),
    p.Ready("engine", 43, 64),
    p.Infer(7, (REF, p.TensorRef("ids", "int64", (2, 0), 0, 0))),
    p.Result(7, (REF,)),
    p.Failed(7, 400, "InvalidInput", "bad row", retryable=False),
    p.Failed(8, 503, "ArenaFull", "no room", retryable=True),
    p.Release(7),
    p.Abort(9),
    p.State(3),
    p.State(3, queued=5, clients=2, calls=11, rows=40, held=1),
    p.EngineDead("sticky CUDA error"),
    p.Ready("engine", 43, 1, generation=p.GenerationInfo(32, 320, 512, 256, "slots")),
    p.Generate(11, (1, 2, 3), 16, (0, 2), p.Sampling(0.7, 40, 0.9, 5, 2), "pod-key"),
    p.Generate(12, (4,), 1, ()),
    p.Tokens((p.Emitted(11, (5, 6), (p.Logprob(-0.1, ((5, -0.1), (9, -2.5))), p.Logprob(-0.3)), "length"),
              p.Emitted(12, (7,)))),
]


def test_the_list_covers_every_message_kind():
    assert {type(m) for m in EVERY} == set(p.MESSAGES)


@pytest.mark.parametrize("msg", EVERY, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_a_frame(msg):
    frame = p.Encoder().frame(msg)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert p.Decoder().feed(frame) == [msg]


def test_frames_split_anywhere_and_joined_decode_in_order():
    enc, dec = p.Encoder(), p.Decoder()
    stream = b"".join(enc.frame(m) for m in EVERY)
    got = []
    for i in range(0, len(stream), 5):  # 5-byte pieces cut every header and body
        got += dec.feed(stream[i:i + 5])
    assert got == EVERY
    # pieces that end on a frame's end (read where they are), inside one, or hold several
    ends = list(itertools.accumulate(len(enc.frame(m)) for m in EVERY))
    cuts = sorted({0, len(stream), *ends[::3], *(e - 2 for e in ends[1::3]), *(e + 7 for e in ends[2::4])})
    got = []
    for a, b in zip(cuts, cuts[1:]):
        got += dec.feed(stream[a:b])
    assert got == EVERY


def test_no_tensor_bytes_cross_the_socket():
    big = p.Infer(1, (p.TensorRef("x", "float32", (4096, 1024), 0, 16 << 20),))
    assert len(p.Encoder().frame(big)) < 64


def test_a_bad_frame_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="not a message"):
        p.Decoder().feed(b"\x00\x00\x00\x02\x91\x01")  # a msgpack [1]: no kind tag
    with pytest.raises(ProtocolError, match="over"):
        p.Decoder().feed((p.MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(ProtocolError):  # a known kind with a field of the wrong type
        body = msgspec.msgpack.encode(["release", "x"])
        p.Decoder().feed(len(body).to_bytes(4, "big") + body)


def test_a_connection_carries_messages_and_an_fd_and_sees_the_end():
    a, b = socket.socketpair()
    ca, cb = p.Connection(a), p.Connection(b)
    r, w = os.pipe()
    try:
        ca.send(EVERY[0], fds=(r,))
        msgs, fds = cb.recv(want_fds=1)
        assert msgs == [EVERY[0]] and len(fds) == 1
        os.write(w, b"hi")
        assert os.read(fds[0], 2) == b"hi"  # the same pipe, through another descriptor
        os.close(fds[0])
        threading.Thread(target=lambda: [ca.send(m) for m in EVERY[1:]]).start()
        got = []
        while len(got) < len(EVERY) - 1:
            got += cb.recv()[0]
        assert got == EVERY[1:]
        ca.close()
        assert cb.recv() == ([], [])
    finally:
        os.close(r), os.close(w), cb.close()


# --- the arena ---

def test_first_fit_reuses_freed_blocks_and_merges_neighbours():
    al = Allocator(0, 10 * ALIGN)
    blocks = [al.alloc(ALIGN) for _ in range(10)]
    assert blocks == [i * ALIGN for i in range(10)]
    with pytest.raises(ArenaFull):
        al.alloc(1)
    for at in (blocks[3], blocks[5], blocks[4]):  # 4 last: it joins 3 and 5 into one
        al.free(at)
    assert al.alloc(3 * ALIGN) == blocks[3]
    for at in blocks[:3] + blocks[6:]:
        al.free(at)
    al.free(blocks[3])
    assert al._free == [(0, 10 * ALIGN)] and al.in_use() == 0
    with pytest.raises(KeyError):
        al.free(blocks[0])  # twice


def test_put_view_release_zero_copy_on_the_engine_side():
    with Arena.create(1 << 16, 1 << 16) as worker:
        engine = Arena.attach(os.dup(worker.fd), 1 << 16, 1 << 16)
        x = torch.arange(24, dtype=torch.float32).view(4, 6)[:, ::2]  # not contiguous
        ref = worker.put("x", x)
        assert ref.shape == (4, 3) and ref.nbytes == 48 and ref.offset < (1 << 16)
        seen = engine.view(ref)
        assert torch.equal(seen, x)
        worker.view(ref)[0, 0] = 99.0  # one memory: the engine sees the worker's write
        assert seen[0, 0].item() == 99.0
        out, buf = engine.alloc("y", torch.int64, (2, 2))
        assert out.offset >= 1 << 16  # the engine allocates in its own part
        buf.copy_(torch.tensor([[1, 2], [3, 4]]))
        assert worker.view(out).tolist() == [[1, 2], [3, 4]]
        for dt in (torch.bfloat16, torch.bool, torch.uint8, torch.float16):
            r = worker.put("d", torch.ones(3, dtype=dt))
            assert engine.view(r).dtype == dt and engine.view(r).tolist() == torch.ones(3, dtype=dt).tolist()
        assert engine.view(worker.put("empty", torch.zeros(0, 5))).shape == (0, 5)
        worker.release(ref)
        engine.release(out)
        del seen
        engine.close()


def test_a_full_arena_is_a_retryable_503_not_a_crash():
    with Arena.create(1024, 1024) as a:
        a.put("x", torch.zeros(200))
        with pytest.raises(ArenaFull) as e:
            a.put("y", torch.zeros(200))
        assert e.value.status == 503 and e.value.retryable


def test_a_ref_outside_the_arena_is_refused():
    with Arena.create(1024, 1024) as a:
        with pytest.raises(ValueError, match="outside"):
            a.view(p.TensorRef("x", "float32", (1000,), 0, 4000))


def test_a_ref_whose_shape_is_not_its_bytes_is_refused_and_views_match_a_plain_slice():
    """A view is one as_strided call on the mapping as its dtype, so the shape is checked against
    the bytes the bounds were checked for: a ref claiming more elements than its nbytes hold (a
    bug, or a hostile peer reading past its block) is refused, as is a negative size."""
    with Arena.create(1 << 12, 1 << 12) as a:
        with pytest.raises(ValueError, match="is 4000 bytes, the ref says 40"):
            a.view(p.TensorRef("x", "float32", (10, 100), 0, 40))
        with pytest.raises(ValueError, match="negative"):
            a.view(p.TensorRef("x", "float32", (-1, 4), 0, 16))
        for dt, shape in ((torch.float32, (3, 5)), (torch.int64, (2, 1, 4)), (torch.float16, (7,)), (torch.bool, (2, 3))):
            ref = a.put("t", torch.arange(torch.Size(shape).numel()).view(shape).to(dt))
            plain = a.base[ref.offset:ref.offset + ref.nbytes].view(dt).view(shape)
            seen = a.view(ref)
            assert seen.is_contiguous() and seen.data_ptr() == plain.data_ptr() and torch.equal(seen, plain)


def memfd_mappings():
    return [line for line in open("/proc/self/maps") if "/memfd:cs-arena" in line]


def memfd_fds():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:cs-arena"):
                out.append(fd)
        except OSError:
            pass
    return out


def test_close_leaves_nothing_behind_even_with_views_alive():
    shm_before = set(os.listdir("/dev/shm"))
    assert not memfd_mappings() and not memfd_fds()
    worker = Arena.create(1 << 16, 1 << 16)
    engine = Arena.attach(os.dup(worker.fd), 1 << 16, 1 << 16)
    ref = worker.put("x", torch.ones(8))
    view = engine.view(ref)
    assert memfd_mappings() and memfd_fds()
    engine.close()
    worker.close()
    assert view.sum().item() == 8.0  # a view outliving close() still reads its memory
    del view
    gc.collect()
    assert not memfd_mappings() and not memfd_fds()
    assert set(os.listdir("/dev/shm")) <= shm_before  # the arena never had a name there


def test_an_engine_socket_under_a_deep_directory_binds_and_connects(tmp_path):
    """A socket path longer than sun_path's 107 bytes (a TorchServe under a deep directory: the README
    walk's clone) is bound and reached through its directory's descriptor; the file stays in place."""
    import socket

    from handlers.engine.protocol import UNIX_PATH_MAX, unix_address
    from handlers.engine.serve import listen

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = str(deep / "82e78bc11cf1ab0c.sock")
    assert len(path) > UNIX_PATH_MAX
    server = listen(path)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with unix_address(path) as address:
            client.connect(address)
        conn, _ = server.accept()
        client.sendall(b"hello")
        assert conn.recv(5) == b"hello" and (deep / "82e78bc11cf1ab0c.sock").is_socket()
        conn.close()
    finally:
        client.close()
        server.close()
    with unix_address("/tmp/short.sock") as address:
        assert address == "/tmp/short.sock"
