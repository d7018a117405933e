"""Abandoned generations, the parts without a server (issue 63 item 4): the pod's listener
(pod/aborts.py) turns nginx's syslog line of a generation it finalized unanswered into a mark,
and nothing else into one; marks are swept by age and count; the workers' check
(handlers/generation/abandon.py) finds a mark, and costs one stat per step while none changes.
Through the real pod: tests/test_abandon_pod.py."""
import os
import socket
import time

import pytest

from handlers.generation import abandon
from handlers.torchserve import headers
from pod import aborts

KEY = "0ceaa7c8ea1ffe78fa8f6b7fcae8df5f"
LINE = b'<190>Nov 28 11:48:45 abort: ' + KEY.encode()  # as nginx 1.22 sent it (pod/aborts.py)


def test_only_nginxs_line_of_a_key_is_a_mark():
    assert aborts.key_of_line(LINE) == KEY
    assert aborts.key_of_line(LINE + b"\n") == KEY
    for bad in (b"<190>Nov 28 11:48:45 other: " + KEY.encode(), LINE[:-1], LINE + b"0", LINE.upper(),
                b"<190>Nov 28 11:48:45 abort: ../../etc/passwd", b"<190>Nov 28 11:48:45 abort: ", b"", b"\xff" * 40,
                b"<190>Nov 28 11:48:45 abort: " + KEY.encode() + b" 499"):
        assert aborts.key_of_line(bad) is None, bad
    assert abandon.key_of(KEY) == KEY and abandon.key_of("evil") is None and abandon.key_of(None) is None


def test_the_listener_marks_what_nginx_sends_over_its_socket_and_nothing_else(tmp_path):
    listener = aborts.Listener(str(tmp_path / "abort.sock"), str(tmp_path / "marks"), keep_s=60)
    assert oct(os.stat(tmp_path / "marks").st_mode & 0o777) == "0o700"
    assert oct(os.stat(tmp_path / "abort.sock").st_mode & 0o777) == "0o600"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"<190>Nov 28 11:48:45 abort: ../escape", str(tmp_path / "abort.sock"))
        s.sendto(LINE, str(tmp_path / "abort.sock"))
    listener.sock.settimeout(5)
    assert not listener.handle(listener.sock.recv(4096))
    assert listener.handle(listener.sock.recv(4096))
    assert os.listdir(tmp_path / "marks") == [KEY] and not (tmp_path / "escape").exists()


def test_marks_are_swept_by_age_and_never_exceed_their_bound(tmp_path, monkeypatch):
    now = [0.0]
    listener = aborts.Listener(str(tmp_path / "s"), str(tmp_path / "m"), keep_s=10, clock=lambda: now[0])
    listener.handle(LINE)
    now[0] = 9.0
    listener.sweep()
    assert os.listdir(tmp_path / "m") == [KEY]
    now[0] = 10.5
    listener.sweep()
    assert os.listdir(tmp_path / "m") == []
    monkeypatch.setattr(aborts, "MAX_MARKS", 3)
    for i in range(5):
        listener.handle(b"<190>Nov 28 11:48:45 abort: " + f"{i:032x}".encode())
    assert sorted(os.listdir(tmp_path / "m")) == [f"{i:032x}" for i in (2, 3, 4)]
    # a listener started again begins with none (its predecessor's requests are gone or marked again)
    aborts.Listener(str(tmp_path / "s"), str(tmp_path / "m"), keep_s=10)
    assert os.listdir(tmp_path / "m") == []


def test_a_worker_finds_a_mark_and_pays_one_stat_per_step_while_none_changes(tmp_path, monkeypatch):
    marks = abandon.Marks(str(tmp_path))
    keys = [f"{i:032x}" for i in range(64)]
    assert marks.gone(keys + [None]) == set()
    abandon.mark(str(tmp_path), keys[7])
    assert marks.gone(keys) == {keys[7]} and marks.is_gone(keys[7]) and not marks.is_gone(keys[8])
    assert not abandon.mark(str(tmp_path), "../x")
    old = time.time_ns() - 10 * abandon.Marks.SETTLE_NS  # the directory settled long ago
    os.utime(tmp_path, ns=(old, old))
    marks.gone(keys)
    calls = []
    real_stat = os.stat  # os.path.exists is a stat too
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: calls.append(p) or real_stat(p, *a, **k))
    assert marks.gone(k for k in keys if k != keys[7]) == set()
    assert len(calls) == 1, calls  # the directory's stat alone
    calls.clear()
    assert marks.gone(keys[:8] + ["f" * 32]) == {keys[7]}
    assert len(calls) == 3, calls  # the directory, the marked key and the new one
    abandon.mark(str(tmp_path), keys[3])  # a new mark changes the directory
    assert marks.gone(keys) == {keys[3], keys[7]}
    assert abandon.Marks(None).gone(keys) == set() and not abandon.Marks(None).is_gone(keys[7])


@pytest.mark.parametrize("sent, seen", [("0ceaa7c8ea1ffe78fa8f6b7fcae8df5f", "0ceaa7c8ea1ffe78fa8f6b7fcae8df5f"),
                                        (None, None)])
def test_the_request_key_header_reaches_the_handler(sent, seen):
    class Ctx:
        def get_all_request_header(self, idx):
            return {"Host": "x", **({"x-pod-request-id": sent} if sent else {})}
    assert headers.read(Ctx(), 0).request_key == seen
