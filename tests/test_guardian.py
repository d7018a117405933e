"""The guardian's frames, in process (handlers/torchserve/guardian.py; tests/test_slot_restart.py
kills real workers): it reads the predict frames the frontend wrote to a dead worker as
TorchServe's own reader does, and answers each with the worker's refusal frames."""
import socket
import struct

import pytest

from handlers.torchserve import guardian, guardian_main


def _request(rid: bytes) -> bytes:
    """One request of a predict frame as TorchServe 0.12's frontend encodes it (one header, one
    parameter)."""
    def field(b):
        return struct.pack("!i", len(b)) + b
    end = struct.pack("!i", -1)
    return (field(rid) + field(b"name") + field(b"value") + end
            + field(b"body") + field(b"application/json") + field(b'{"input_ids": [1]}') + end)


def _frame(*rids) -> bytes:
    return b"I" + b"".join(_request(r) for r in rids) + struct.pack("!i", -1)


def test_the_guardian_reads_whole_predict_frames_as_torchserve_does():
    from ts.protocol.otf_message_handler import retrieve_msg

    one, two = _frame(b"a1", b"b2"), _frame(b"c3")
    a, b = socket.socketpair()
    with a, b:
        a.sendall(one)
        assert [r["requestId"].decode() for r in retrieve_msg(b)[1]] == ["a1", "b2"]
    assert guardian_main.predict_requests(one + two) == (["a1", "b2", "c3"], len(one + two))
    assert guardian_main.predict_requests(one + two[:9]) == (["a1", "b2"], len(one)), "a part waits for the rest"
    with pytest.raises(ValueError):  # the dead worker had read part of a frame: not answered
        guardian_main.predict_requests(one[3:])


def test_the_guardians_refusal_is_the_workers_own_for_any_request_id():
    template = guardian.refusal(guardian.PLACEHOLDER).split(guardian._rid_field(guardian.PLACEHOLDER))
    for rid in ("0f2c7a9e-1b2d-4c3e-8f00-123456789abc", "x"):
        assert guardian_main.refusal(template, rid) == guardian.refusal(rid)
    guardian._template[:] = template  # as guardian.start sets it in the worker
    try:
        assert guardian._refused("x") == guardian.refusal("x")
    finally:
        guardian._template.clear()


def test_unread_requests_get_the_refusal_and_a_part_is_kept():
    template = guardian.refusal(guardian.PLACEHOLDER).split(guardian._rid_field(guardian.PLACEHOLDER))
    frontend, held = socket.socketpair()
    with frontend, held:
        frontend.sendall(_frame(b"r1") + _frame(b"r2")[:5])
        rest = guardian_main.answer_unread(held, template, b"")
        assert rest == _frame(b"r2")[:5]
        frontend.settimeout(2)
        assert frontend.recv(1 << 16) == guardian.refusal("r1")


def test_a_worker_whose_guardian_is_gone_serves_on(monkeypatch):
    """The guardian killed (the OOM killer may pick it): the worker's next record meets a closed
    pipe, which must not fail the batch being answered; the worker goes on without a guardian."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the guardian's end, gone
    monkeypatch.setattr(guardian, "_pipe", write_end)
    guardian.streaming("a", "data: {}\n\n", "text/event-stream")  # EPIPE (Python ignores SIGPIPE): caught
    assert guardian._pipe is None and not guardian.active()
    guardian.ended(("a", "b"))  # and nothing more is told
    guardian.streaming("c", "data: {}\n\n", "text/event-stream")


def test_a_batch_of_which_the_guardian_holds_nothing_costs_no_write(monkeypatch):
    """A stateless batch's end tells the guardian nothing (ended filters what it holds); a held
    request's end tells it that request alone."""
    import json
    import os

    read_end, write_end = os.pipe()
    monkeypatch.setattr(guardian, "_pipe", write_end)
    monkeypatch.setattr(guardian, "_holding", set())
    guardian.ended(("x", "y"))
    guardian.streaming("y", "data: {}\n\n", "text/event-stream")
    guardian.ended(("x", "y"))
    os.set_blocking(read_end, False)
    records = [json.loads(line) for line in os.read(read_end, 1 << 16).decode().splitlines()]
    assert [r[0] for r in records] == ["S", "E"] and records[1] == ["E", "y"] and not guardian._holding
    os.close(read_end)
    os.close(write_end)


def test_a_dead_batched_worker_is_let_go_once_the_frontend_writes_its_batch_or_after_the_wait():
    """The guardian's duplicate of a dead sync worker's connection is closed as soon as the
    frontend writes the batch it was gathering (then the frontend answers that batch 507), else
    after the wait; a worker of one request per batch is let go at once."""
    import threading
    import time

    for wait_s, write_after, lo, hi in ((5.0, 0.05, 0.04, 1.0), (0.3, None, 0.3, 1.0), (0.0, None, 0.0, 0.1)):
        front, dup = socket.socketpair()
        if write_after is not None:
            threading.Timer(write_after, lambda s=front: s.sendall(_frame(b"r1"))).start()
        t0 = time.monotonic()
        assert guardian_main.let_go_after_batch(dup, wait_s) == 0
        took = time.monotonic() - t0
        assert lo <= took < hi and dup.fileno() == -1, (wait_s, took)
        front.close()


def test_batched_reads_the_context_and_the_wait_the_archives_delay(monkeypatch):
    from types import SimpleNamespace

    from handlers.config import parse_config

    assert guardian.batched(SimpleNamespace(system_properties={"batch_size": 8}))
    assert not guardian.batched(SimpleNamespace(system_properties={"batch_size": 1}))
    monkeypatch.setattr(guardian, "_batch_delay_ms", guardian._batch_delay_ms)
    assert guardian.batch_wait_s() == pytest.approx(0.1 + guardian.BATCH_MARGIN_S)  # TorchServe's default
    guardian.gathers_batches(parse_config({"maxBatchDelay": 50}).max_batch_delay_ms)
    assert guardian.batch_wait_s() == pytest.approx(0.05 + guardian.BATCH_MARGIN_S)


def test_the_guardian_learns_whether_a_batch_was_in_the_workers_hands(monkeypatch):
    """A sync worker's predict is bracketed by BUSY and IDLE records (a death while busy is let go
    at once: the frontend waits for that batch's answer), which read_records reads back."""
    import os
    from types import SimpleNamespace

    class Service:
        def set_cl_socket(self, sock):
            pass

        def predict(self, batch):
            if batch == "boom":
                raise RuntimeError("boom")
            return b"answer"

    service = SimpleNamespace(Service=Service)
    guardian._patch_sync(service)
    read_end, write_end = os.pipe()
    monkeypatch.setattr(guardian, "_pipe", write_end)
    assert Service().predict("batch") == b"answer"
    with pytest.raises(RuntimeError):
        Service().predict("boom")
    os.write(write_end, guardian.BUSY)  # a third batch, in the worker's hands when it died
    monkeypatch.setattr(guardian, "_pipe", None)
    os.close(write_end)
    held, busy = guardian_main.read_records(read_end)
    assert held == {} and busy
    read_end, write_end = os.pipe()
    os.write(write_end, guardian.BUSY + guardian.IDLE)
    os.close(write_end)
    assert guardian_main.read_records(read_end) == ({}, False)
