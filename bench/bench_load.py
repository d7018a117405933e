"""Closed-loop HTTP load generator for bench/bench_e2e.py: `clients` keep-alive connections
spread over several processes (one thread per connection), each sending its next request as
soon as the last answer arrived. Loopback only; bounded by time and by a request count.

Each connection sends prebuilt HTTP/1.1 requests and reads Content-Length answers itself
(`Connection`). With `http.client` (and 8 processes) the load generator took 7.9 cores for
13.5k req/s of 300 kB, 0.59 ms of CPU per request with the answer check, and its busiest
process was 99% busy, so under its interpreter lock: at that rate it, not TorchServe, was the
limit being measured (e2e_resnet50_fp16_scaling_httpclient_h200x2.md, core accounting; in git history:
`git show c29cc58^:docs/results/e2e_resnet50_fp16_scaling_httpclient_h200x2.md`).

Answers are counted only when they complete inside the measured window, after a warm-up;
every 200 answer is parsed (`safetensors` by default; the KServe v2 binary extension or a gRPC
ModelInferResponse for bench/bench_pod.py's routes: ANSWERS) and compared with the reference
output of the input it answered (|d| <= tol + tol * max|ref|). A `grpc://HOST:PORT` url sends
each body as one unary gRPC call of the method `path` instead (bench/bench_pod.py).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
from urllib.parse import urlparse

from bench import cpu_usage, worker_spy

HEADERS = {"Content-Type": "application/x-safetensors"}


V2_NUMPY = {"FP16": "float16", "FP32": "float32", "FP64": "float64", "INT8": "int8", "INT16": "int16",
            "INT32": "int32", "INT64": "int64", "UINT8": "uint8", "BOOL": "bool"}


def _safetensors(body: bytes) -> dict:
    from safetensors.numpy import load

    return load(body)


def _v2_binary(body: bytes) -> dict:
    """A KServe v2 reply: its JSON header, then each binary output's bytes in order."""
    import json

    import numpy as np

    header, pos = json.JSONDecoder().raw_decode(body.decode("latin-1"))
    out = {}
    for o in header["outputs"]:
        dt = np.dtype(V2_NUMPY[o["datatype"]])
        if "data" in o:
            out[o["name"]] = np.asarray(o["data"], dt).reshape(o["shape"])
            continue
        n = o["parameters"]["binary_data_size"]
        out[o["name"]] = np.frombuffer(body, dt, count=n // dt.itemsize, offset=pos).reshape(o["shape"])
        pos += n
    return out


def _protobuf(body: bytes) -> dict:
    """A gRPC ModelInferResponse: outputs (field 5: name 1, datatype 2, shape 3) and
    raw_output_contents (field 6) in the same order."""
    import numpy as np

    from handlers import protowire

    metas, raws = [], []
    for field, _, value in protowire.fields(body):
        if field == 5:
            meta = {}
            for f, _, v in protowire.fields(value):
                if f in (1, 2):
                    meta[f] = bytes(v).decode()
                elif f == 3:
                    meta[3] = protowire.varints(v, np.int64).tolist()
            metas.append(meta)
        elif field == 6:
            raws.append(bytes(value))
    return {m[1]: np.frombuffer(r, V2_NUMPY[m[2]]).reshape(m.get(3, [])) for m, r in zip(metas, raws)}


ANSWERS = {"safetensors": _safetensors, "v2_binary": _v2_binary, "protobuf": _protobuf}


def _mismatch(body: bytes, ref: dict, tol: float, answer: str = "safetensors") -> bool:
    import numpy as np

    try:
        got = ANSWERS[answer](body)
    except Exception:
        return True
    for name, want in ref.items():
        have = got.get(name)
        if have is None or have.shape != want.shape:
            return True
        bound = tol + tol * float(np.max(np.abs(want))) if want.size else 0.0
        # written as "not <=" so that a NaN in the answer (where the reference has none) is a mismatch
        if want.size and not float(np.max(np.abs(have.astype(np.float32) - want))) <= bound:
            return True
    return False


def build_request(host: str, port: int, path: str, headers: dict, body: bytes) -> bytes:
    """One POST as the bytes on the wire (HTTP/1.1, keep-alive, Content-Length)."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Connection:
    """A keep-alive HTTP/1.1 client connection for prebuilt requests. Answers must carry a
    Content-Length (TorchServe's non-streaming answers do); a chunked or malformed answer
    raises ValueError. The connection reopens itself after an error or `Connection: close`.
    sendall and recv release the interpreter lock while the kernel copies."""

    def __init__(self, host: str, port: int, timeout: float = 120.0):
        self.addr, self.timeout, self.sock, self.buf = (host, port), timeout, None, bytearray()

    def exchange(self, request: bytes) -> tuple:
        """Send one request, return (status, body)."""
        if self.sock is None:
            self.sock = socket.create_connection(self.addr, timeout=self.timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.buf = bytearray()
        try:
            self.sock.sendall(request)
            end = self._fill_until(b"\r\n\r\n")
            status, length, close = _parse_head(bytes(self.buf[:end]))
            del self.buf[:end + 4]
            while len(self.buf) < length:
                self._recv()
            body = bytes(self.buf[:length])
            del self.buf[:length]
        except BaseException:
            self.close()
            raise
        if close:
            self.close()
        return status, body

    def _recv(self):
        chunk = self.sock.recv(1 << 18)
        if not chunk:
            raise ConnectionError("server closed the connection mid-answer")
        self.buf += chunk

    def _fill_until(self, sep: bytes) -> int:
        start = 0
        while (end := self.buf.find(sep, start)) < 0:
            start = max(0, len(self.buf) - len(sep) + 1)
            self._recv()
        return end

    def close(self):
        if self.sock is not None:
            self.sock.close()
        self.sock, self.buf = None, bytearray()


def _parse_head(head: bytes) -> tuple:
    """(status, content length, close?) of an answer's status line and headers."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    # HTTP/1.0 closes after the answer unless it says keep-alive; HTTP/1.1 keeps it unless "close"
    length, close = None, parts[0] == b"HTTP/1.0"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            if not value.isdigit():
                raise ValueError(f"answer's Content-Length {value[:40]!r} is not a byte count")
            length = int(value)
        elif name == b"transfer-encoding" and value != b"identity":
            raise ValueError(f"answer uses Transfer-Encoding {value!r}; this client reads Content-Length only")
        elif name == b"connection":
            tokens = {t.strip() for t in value.split(b",")}
            close = b"close" in tokens or (close and b"keep-alive" not in tokens)
    if length is None:
        raise ValueError("answer has no Content-Length")
    return int(parts[1]), length, close


class GrpcConnection:
    """One gRPC channel (its own HTTP/2 connection) calling one unary method with bytes."""

    def __init__(self, target: str, method: str):
        import grpc

        self.grpc = grpc
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", -1),
                                                              ("grpc.max_send_message_length", -1)])
        self.call = self.channel.unary_unary(method)

    def exchange(self, request: bytes) -> tuple:
        """(200, reply) or (the gRPC status code's number, its details)."""
        try:
            return 200, self.call(request, timeout=120)
        except self.grpc.RpcError as e:
            return e.code().value[0], (e.details() or "").encode()

    def close(self):
        self.channel.close()


def _client(host, port, requests, check, first, t0, t_warm, t_end, budget, out, method=None):
    conn = Connection(host, port) if method is None else GrpcConnection(f"{host}:{port}", method)
    i = first
    while time.time() < t_end and budget[0] > 0:
        k = i % len(requests)
        i += 1
        start = time.time()
        try:
            status, data = conn.exchange(requests[k])
        except Exception as e:  # any failure is an error row (status 0), never a silently dead client
            status, data = 0, repr(e).encode()
        done = time.time()
        if start < t_warm or done > t_end:
            continue
        budget[0] -= 1
        bad = status == 200 and check is not None and _mismatch(data, check[0][k], *check[1:])
        out.append((done - start, status, bad, data[:300] if status != 200 else b""))
    conn.close()


def _process(url, path, token, bodies, check, n_threads, offset, t0, t_warm, t_end, budget, queue, headers=None):
    u = urlparse(url)
    grpc_method = path if u.scheme == "grpc" else None
    # one headers dict for every body, or one per body
    per_body = headers if isinstance(headers, list) else [HEADERS if headers is None else headers] * len(bodies)
    per_body = [dict(h, Authorization=f"Bearer {token}") for h in per_body]
    while time.time() < t0:
        time.sleep(0.005)
    results, left = [], [budget]
    # shared, read-only: whole HTTP requests, or the bodies themselves for gRPC
    requests = bodies if grpc_method else [build_request(u.hostname, u.port, path, h, b)
                                           for h, b in zip(per_body, bodies)]
    threads = [threading.Thread(target=_client, args=(u.hostname, u.port, requests, check,
                                                      offset + j, t0, t_warm, t_end, left, results, grpc_method))
               for j in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(results)


def run_point(url, path, token, bodies, check, clients, seconds, warmup, max_requests, processes=0,
              spy_rate=0, spy_exe="", spy_root=None, headers=None) -> dict:
    """One measurement. check: (refs per body, tol[, answer format of ANSWERS]) or None.
    headers: the requests' headers (default HEADERS: safetensors), or a list of one per body. spy_rate: also sample TorchServe's
    workers (those descending from process `spy_root`, the server's launcher) with py-spy
    (`spy_exe`) at this rate during the measured window, but for its last second
    (bench/worker_spy.py). Returns the point's figures."""
    # half the cores this process may run on at most: each process is one interpreter lock, and
    # the server needs the rest
    procs = processes or max(1, min(clients, len(os.sched_getaffinity(0)) // 2))
    procs = min(procs, clients)
    ctx = mp.get_context("spawn")  # the parent may hold a CUDA context: never fork it
    queue = ctx.Queue()
    t0 = time.time() + 3.0  # spawned interpreters import numpy and safetensors first
    t_warm, t_end = t0 + warmup, t0 + warmup + seconds
    split = [clients // procs + (1 if j < clients % procs else 0) for j in range(procs)]
    workers = [ctx.Process(target=_process, args=(url, path, token, bodies, check, split[j], sum(split[:j]),
                                                   t0, t_warm, t_end, max_requests // procs + 1, queue, headers))
               for j in range(procs)]
    for w in workers:
        w.start()
    # where the host's cores went during the measured window (the clients' own clock)
    time.sleep(max(0.0, t_warm - time.time()))
    before = cpu_usage.snapshot()
    spies = worker_spy.Spies(int(seconds) - 1, spy_rate, spy_exe, spy_root) if spy_rate else None
    try:
        time.sleep(max(0.0, t_end - time.time()))
        cores = cpu_usage.usage(before, cpu_usage.snapshot())
        rows = []
        for _ in workers:
            rows += queue.get(timeout=seconds + warmup + 300)
        for w in workers:
            w.join()
    except BaseException:
        if spies is not None:
            spies.stop()
        raise
    out = {**summarize(rows, seconds, check is not None), "cpu_cores": cores}
    if spies is not None:
        out["spy"] = spies.finish(out["req_s"])
        if cores and out["req_s"]:  # the same workers' CPU per request from /proc, beside it
            out["spy"]["workers_cpu_us_per_request"] = round(cores["workers"] / out["req_s"] * 1e6, 1)
    return out


def first_request(url, path, token, body, check, steady=20, idle_seconds=2.0, idle_repeats=5) -> dict:
    """What one client sees of a model that has just become ready: its very first request (on a
    new connection), then `steady` back-to-back requests on that connection, then requests each
    after `idle_seconds` of silence. check: (reference outputs, tol). Every answer must be a 200
    that matches, or this raises: a first-request figure of a failed answer means nothing."""
    import statistics

    u = urlparse(url)
    headers = dict(HEADERS, Authorization=f"Bearer {token}")
    conn = Connection(u.hostname, u.port)
    request = build_request(u.hostname, u.port, path, headers, body)

    def one() -> float:
        start = time.perf_counter()
        status, data = conn.exchange(request)
        ms = (time.perf_counter() - start) * 1e3
        if status != 200 or _mismatch(data, check[0], check[1]):
            raise RuntimeError(f"{path}: answer {status} {data[:200]!r} is not the reference output")
        return ms

    try:
        first = one()
        steady_ms = [one() for _ in range(steady)]
        idle = []
        for _ in range(idle_repeats):
            time.sleep(idle_seconds)
            idle.append(one())
    finally:
        conn.close()
    med = statistics.median(steady_ms)
    out = {"first_ms": round(first, 3), "steady_median_ms": round(med, 3),
           "first_over_steady": round(first / med, 3)}
    if idle:
        out.update(after_idle_median_ms=round(statistics.median(idle), 3), idle_seconds=idle_seconds,
                   after_idle_over_steady=round(statistics.median(idle) / med, 3))
    return out


def summarize(rows, seconds, checked) -> dict:
    import numpy as np

    ok = [r for r in rows if r[1] == 200]
    lat = np.array([r[0] for r in ok]) * 1e3 if ok else np.array([float("nan")])
    errors = [r for r in rows if r[1] != 200]
    return {
        "requests": len(rows), "ok": len(ok), "errors": len(errors),
        "error_samples": sorted({f"{r[1]}: {r[3].decode(errors='replace')[:160]}" for r in errors})[:3],
        "mismatches": sum(1 for r in ok if r[2]) if checked else None,
        "req_s": round(len(ok) / seconds, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2),
        "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "seconds": seconds,
    }
