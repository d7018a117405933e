"""The load generator's own HTTP/1.1 connection (bench/bench_load.Connection), differentially
against the standard library's http.client on a real keep-alive HTTP server (http.server):
the same status and the same body for every request, across body sizes, error statuses,
`Connection: close` and a chunked answer it must refuse."""
from __future__ import annotations

import hashlib
import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.bench_load import Connection, _parse_head, build_request

HEADERS = {"Content-Type": "application/x-safetensors", "Authorization": "Bearer k"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless told otherwise

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        digest = hashlib.sha256(body).hexdigest().encode()
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(digest), digest))
            return
        status = 503 if self.path == "/busy" else 200
        answer = (b'{"code": 503, "message": "busy"}' if status == 503
                  else digest + b":" + self.headers["Authorization"].encode() + b":" + str(len(body)).encode())
        self.send_response(status)
        self.send_header("Content-Length", str(len(answer)))
        if self.path == "/close":
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(answer)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address
    srv.shutdown()


def _stdlib(addr, path, body):
    conn = http.client.HTTPConnection(*addr, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=HEADERS)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_same_answers_as_http_client_on_one_keep_alive_connection(server):
    host, port = server
    conn = Connection(host, port, timeout=30)
    bodies = [b"", b"x", bytes(range(256)) * 1176, bytes(2_000_003)]  # 0 B .. 2 MB (300 kB: one image)
    first = None
    try:
        for path in ("/predict", "/busy", "/predict"):
            for body in bodies:
                got = conn.exchange(build_request(host, port, path, HEADERS, body))
                assert got == _stdlib(server, path, body), (path, len(body))
                # one socket throughout: every answer, 503s included, was read exactly to its end
                first = first or conn.sock
                assert conn.sock is first and first is not None
    finally:
        conn.close()


def test_connection_close_and_chunked_answers(server):
    host, port = server
    conn = Connection(host, port, timeout=30)
    try:
        assert conn.exchange(build_request(host, port, "/close", HEADERS, b"a")) == _stdlib(server, "/close", b"a")
        assert conn.sock is None  # the server said close: the next request opens a new socket
        with pytest.raises(ValueError, match="Transfer-Encoding"):
            conn.exchange(build_request(host, port, "/chunked", HEADERS, b"b"))
        assert conn.sock is None  # an error never leaves a half-read answer on the socket
        assert conn.exchange(build_request(host, port, "/predict", HEADERS, b"c")) == _stdlib(server, "/predict", b"c")
    finally:
        conn.close()


def test_malformed_answer_heads_are_refused():
    assert _parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: keep-alive") == (200, 12, False)
    assert _parse_head(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close") == (503, 0, True)
    with pytest.raises(ValueError, match="status line"):
        _parse_head(b"SSH-2.0-OpenSSH\r\nContent-Length: 1")
    with pytest.raises(ValueError, match="no Content-Length"):
        _parse_head(b"HTTP/1.1 200 OK\r\nConnection: keep-alive")
    with pytest.raises(ValueError, match="not a byte count"):
        _parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: -3")
    # close: a token among several; HTTP/1.0 closes unless it says keep-alive
    assert _parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: upgrade, close")[2] is True
    assert _parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1")[2] is True
    assert _parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\nConnection: Keep-Alive")[2] is False


def test_an_answer_with_nan_is_a_mismatch():
    """|got - want| <= bound is False for NaN: a NaN answer to a finite reference is wrong."""
    import numpy as np
    from safetensors.numpy import save

    from bench.bench_load import _mismatch

    want = {"out": np.array([1.0, 2.0], dtype=np.float32)}
    assert not _mismatch(save({"out": np.array([1.0, 2.0], dtype=np.float16)}), want, 1e-3)
    assert _mismatch(save({"out": np.array([1.0, np.nan], dtype=np.float16)}), want, 1e-3)
    assert _mismatch(save({"out": np.array([1.0, 2.5], dtype=np.float16)}), want, 1e-3)
    assert _mismatch(b"not safetensors", want, 1e-3)
