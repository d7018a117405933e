"""One load point measured by C load generators instead of Python clients: wrk for HTTP/1.1, h2load
(nghttp2) for gRPC over HTTP/2 without TLS.

Why: the Python gRPC client costs 0.5-0.75 ms of CPU per call (docs/results/pod_*_h100_s24.json: the
load generator took 4-6 of 16 cores at 64 clients), so a pod route measured with it competes with its
own load generator for the host's cores; these spend microseconds per request. Each client is one
connection with one request in flight, as the Python clients of bench/bench_load.py are, sending
one body over and over.

Why two tools: h2load reads an HTTP/1.1 status only from a non-empty reason phrase (its parser's
status callback), and TorchServe answers `HTTP/1.1 200 ` with none (nginx passes that line on), so
every answer counts as failed there; wrk reads the status code itself. wrk speaks no HTTP/2, so gRPC
(h2c, prior knowledge: h2load's default for http:// URIs) goes through h2load, whose `:status` is
HTTP/2's.

Neither sees an answer's content, and a gRPC call answers HTTP 200 with its outcome in the
`grpc-status` trailer, which h2load does not report: the caller checks the same body's answer by a
real client before and after the point (bench/bench_pod.py does, against the eager model).

Tools: the command in $LOADGEN followed by the tool's name (e.g. `.gpukit/loadgen/run`, which sets
the library path for the Debian binaries it carries), else `wrk` / `h2load` on PATH.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from bench import cpu_usage


def tool(name: str) -> list:
    """The command that runs `name` (wrk or h2load); SystemExit saying how to get it otherwise."""
    if os.environ.get("LOADGEN"):
        return [os.environ["LOADGEN"], name]
    exe = shutil.which(name)
    if not exe:
        raise SystemExit(f"{name} not found: install Debian's {'wrk' if name == 'wrk' else 'nghttp2-client'} "
                         f"package, or set LOADGEN to a command that runs it as `$LOADGEN {name} ARGS`")
    return [exe]


def split_cores(n: int):
    """The native load generator's own cores: the last `n` of this process's; this process keeps
    the rest, and the servers it starts inherit them. None where none are set apart (n 0, or
    not fewer than the cores there are)."""
    cores = sorted(os.sched_getaffinity(0))
    if not n or n >= len(cores):
        return None
    os.sched_setaffinity(0, cores[:-n])
    return cores[-n:]


def threads(clients: int, cores=None) -> int:
    """One thread per core given to the load generator, else a quarter of this process's cores; at most 4."""
    return max(1, min(clients, 4, len(cores) if cores else len(os.sched_getaffinity(0)) // 4 or 1))


def wrk_command(url: str, path: str, script: str, headers: dict, clients: int, seconds: float, cores=None) -> list:
    cmd = tool("wrk") + ["-t", str(threads(clients, cores)), "-c", str(clients), "-d", f"{max(1, round(seconds))}s",
                         "--latency", "--timeout", "30s", "-s", script]
    for k, v in headers.items():
        cmd += ["-H", f"{k}: {v}"]
    return cmd + [f"{url}{path}"]


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def parse_wrk(out: str, seconds: float) -> dict:
    """wrk's report: total requests, non-2xx/3xx answers, socket errors, latency percentiles (ms)."""
    total = int(re.search(r"(\d+) requests in", out)[1])
    bad = int(m[1]) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0
    sock = sum(map(int, m.groups())) if (m := re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)) else 0
    pct = {int(p): float(v) * UNITS[u] for p, v, u in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)}
    ok = total - bad
    return {"requests": total + sock, "ok": ok, "errors": bad + sock,
            "error_samples": [f"{bad} non-2xx answers"] * bool(bad) + [f"{sock} socket errors"] * bool(sock),
            "req_s": round(ok / seconds, 1), "p50_ms": round(pct[50], 2), "p99_ms": round(pct[99], 2)}


def h2load_command(url: str, path: str, body_file: str, headers: dict, clients: int, seconds: float,
                   warmup: float, log_file: str, cores=None) -> list:
    cmd = tool("h2load") + ["-c", str(clients), "-m", "1", "-t", str(threads(clients, cores)), "-D", f"{seconds:g}",
                            f"--warm-up-time={warmup:g}", "-d", body_file, "--log-file", log_file]
    for k, v in headers.items():
        cmd += ["-H", f"{k.lower()}: {v}"]
    return cmd + [f"http://{urlparse(url).netloc}{path}"]


def parse_h2load_log(log_file: str, seconds: float) -> dict:
    """h2load's --log-file: a line per measured request, tab-separated start (µs since the epoch),
    HTTP status, elapsed µs."""
    import numpy as np

    rows = [(int(p[1]), int(p[2]) / 1e3) for p in (ln.split("\t") for ln in
                                                    Path(log_file).read_text().splitlines()) if len(p) >= 3]
    ok = [ms for s, ms in rows if s == 200]
    lat = np.array(ok) if ok else np.array([float("nan")])
    bad = sorted({s for s, _ in rows if s != 200})
    return {"requests": len(rows), "ok": len(ok), "errors": len(rows) - len(ok),
            "error_samples": [f"HTTP {s}" for s in bad[:3]], "req_s": round(len(ok) / seconds, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 2), "p99_ms": round(float(np.percentile(lat, 99)), 2)}


def _pinned(cores):
    """preexec_fn running the tool on `cores` only (None: where this process may run)."""
    return (lambda: os.sched_setaffinity(0, cores)) if cores else None


def _measured(cmd: list, warmup: float, seconds: float, cores=None) -> tuple:
    """Run `cmd`, the host's cores counted over its measured window (after `warmup`); (output, cores)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_pinned(cores))
    time.sleep(warmup + 0.2)
    before = cpu_usage.snapshot()
    time.sleep(max(0.1, seconds - 0.4))
    cores = cpu_usage.usage(before, cpu_usage.snapshot())
    out, _ = proc.communicate(timeout=seconds + warmup + 120)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-2000:]}")
    return out, cores


def wrk_script(tmp: str, bodies: list) -> str:
    """A wrk Lua script POSTing `bodies` in turn, each connection from its own place in the list
    (Lua strings are byte strings: each body goes out as read); one body is wrk's own static body."""
    for i, b in enumerate(bodies):
        Path(f"{tmp}/body{i}").write_bytes(b)
    script = f"{tmp}/post.lua"
    if len(bodies) == 1:
        Path(script).write_text(f'local f = io.open("{tmp}/body0", "rb")\nwrk.method = "POST"\n'
                                'wrk.body = f:read("*a")\nf:close()\n')
        return script
    Path(script).write_text(
        f'local n = {len(bodies)}\nlocal bodies = {{}}\n'
        f'for i = 1, n do local f = io.open("{tmp}/body" .. (i - 1), "rb"); bodies[i] = f:read("*a"); f:close() end\n'
        'local i = 0\nwrk.method = "POST"\n'
        'function init(args) i = math.random(n) end\n'
        'function request() i = i % n + 1; return wrk.format(nil, nil, nil, bodies[i]) end\n')
    return script


def run_bodies(url: str, path: str, bodies: list, headers: dict, clients: int, seconds: float, warmup: float,
               cores=None) -> dict:
    """bench_load.summarize's figures for HTTP/1.1 POSTs of `bodies` in turn by `clients` wrk
    connections (one request in flight each), on `cores` only when given."""
    with tempfile.TemporaryDirectory(prefix="native_load_") as tmp:
        script = wrk_script(tmp, bodies)
        subprocess.run(wrk_command(url, path, script, headers, clients, warmup, cores), capture_output=True,
                       check=True, timeout=warmup + 60, preexec_fn=_pinned(cores))  # wrk has no warm-up option
        out, busy = _measured(wrk_command(url, path, script, headers, clients, seconds, cores), 0.0, seconds, cores)
    return {**parse_wrk(out, seconds), "mismatches": None, "seconds": seconds, "cpu_cores": busy,
            "load_generator": "wrk", "load_generator_cores": sorted(cores) if cores else None}


def run_point(url: str, path: str, body: bytes, headers: dict, clients: int, seconds: float, warmup: float,
              grpc: bool = False, cores=None) -> dict:
    """bench_load.summarize's figures for one body sent by `clients` connections: gRPC (url grpc://HOST:PORT,
    path the method; body the serialized request message) by h2load, else HTTP/1.1 POSTs by wrk; on
    `cores` only when given (the server kept off them by the caller, as clients on other hosts would be)."""
    if not grpc:
        return run_bodies(url, path, [body], headers, clients, seconds, warmup, cores)
    with tempfile.TemporaryDirectory(prefix="native_load_") as tmp:
        body_file, log_file = f"{tmp}/body", f"{tmp}/log"
        # gRPC's length-prefixed message: compression flag 0, 4-byte big-endian length
        Path(body_file).write_bytes(b"\0" + len(body).to_bytes(4, "big") + body)
        cmd = h2load_command(url, path, body_file, {"content-type": "application/grpc", "te": "trailers",
                                                    **headers}, clients, seconds, warmup, log_file, cores)
        _, busy = _measured(cmd, warmup, seconds, cores)
        res = parse_h2load_log(log_file, seconds)
    return {**res, "mismatches": None, "seconds": seconds, "cpu_cores": busy, "load_generator": "h2load",
            "load_generator_cores": sorted(cores) if cores else None}
