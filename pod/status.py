"""The pod's health, ready and metadata answers, off the inference path (nginx sends these GET
routes here; pod.grpc_bridge and the probes read the state file this process writes):

  python -m pod.status --config RUNTIME_DIR/config.properties

Open Inference Protocol REST routes (KServe v2) and KServe v1's model status:
  GET /v2/health/live             200 {"live": true} while TorchServe answers /ping, the
                                  gRPC bridge answers ServerLive, and no model that served has
                                  gone WORKER_LOST_S without serving again; else 503 with the reason
  GET /v2/health/ready            200 {"ready": true} when every model of the pod serves; else
                                  503 {"ready": false, "reason"} naming each model and why
  GET /v2                         server metadata
  GET /v2/models/NAME[/versions/V]          model metadata (inputs, outputs from the archive)
  GET /v2/models/NAME[/versions/V]/ready    200 ready / 503 with the reason / 404 unknown
  GET /v1/models, /v1/models/NAME KServe v1 list and model status
  GET /openai/v1/models[/NAME]    OpenAI's model list: the pod's decoders
  POST /openai/v1/completions, /openai/v1/chat/completions
                                  the model named in the body looked up: X-Accel-Redirect to
                                  its TorchServe route, or OpenAI's error (pod/openai_route.py)
Listens on loopback for nginx; nothing here changes the server.

The kubelet's probes have their own listener, PROBE_PORT (8083) on every address, serving
GET /v2/health/live and /v2/health/ready only: a flood of connections on the public ports (9,000
half-sent headers exhaust nginx's worker_connections, shared by all its ports) must not fail the
liveness probe and have the kubelet restart a pod that serves. A connection here that has not sent
its request within PROBE_HEADER_TIMEOUT_S is closed.

A thread of this process is the listener of abandoned generations (pod/aborts.py).
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from handlers import protowire
from pod import aborts
from pod import config as pod_config
from pod import openai_route
from pod.state import PLATFORM, READY, SERVER_NAME, Poller, find_model, lost_models, server_problem, unservable

PERIOD_S = 1.0
BRIDGE_STALE_S = 30.0  # liveness fails when the gRPC bridge has not answered for this long
PROBE_HEADER_TIMEOUT_S = 5.0  # the probe listener closes a connection silent this long
PROBE_ROUTES = ("/v2/health/live", "/v2/health/ready")
MODEL_ROUTE = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready)?$")
V1_ROUTE = re.compile(r"^/v1/models/([^/:]+)$")


class Status:
    """The latest state, refreshed by a daemon thread; answers each route as (code, body)."""

    def __init__(self, cfg):
        self.cfg, self.poller = cfg, Poller(cfg)
        # time.monotonic() of the bridge's last answer (None: never): a step of the wall clock
        # (NTP, a node's resync) must not make a live bridge look stale, which fails the liveness probe
        self.snapshot, self.bridge_seen = None, None
        self.decoders = openai_route.decoders(cfg.models)  # {name: version}: OpenAI's routes

    def refresh(self) -> None:
        self.snapshot = self.poller.poll()
        if bridge_live(self.cfg.bridge_port):
            self.bridge_seen = time.monotonic()

    def _bridge_stale(self) -> bool:
        return self.bridge_seen is None or time.monotonic() - self.bridge_seen > BRIDGE_STALE_S

    def live(self) -> tuple:
        problems = []
        if not (self.snapshot and self.snapshot["torchserve_live"]):
            problems.append("TorchServe is not answering /ping")
        if self._bridge_stale():
            problems.append(f"the gRPC bridge has not answered ServerLive for {BRIDGE_STALE_S:.0f} s")
        problems += lost_models(self.snapshot, self.cfg.worker_lost_s)
        return (200, {"live": True}) if not problems else (503, {"live": False, "reason": "; ".join(problems)})

    def ready(self) -> tuple:
        problem = server_problem(self.snapshot)
        if problem is None and self._bridge_stale():
            problem = "the gRPC bridge is not answering"
        return (200, {"ready": True}) if problem is None else (503, {"ready": False, "reason": problem})

    def model(self, name: str, version, what: str) -> tuple:
        m, missing = find_model(self.snapshot, name, version)
        if m is None:
            return 404, {"error": missing}
        if what == "ready":
            body = {"name": name, "ready": m["state"] == READY}
            return (200, body) if body["ready"] else (503, dict(body, reason=m["reason"]))
        why = unservable(name, m)
        if why:
            return 503, {"error": why}
        return 200, {"name": name, "versions": [m["version"]], "platform": PLATFORM,
                     "inputs": m["inputs"], "outputs": m["outputs"]}

    def route(self, path: str) -> tuple:
        path = path.split("?", 1)[0].rstrip("/")
        if path == "/v2/health/live":
            return self.live()
        if path == "/v2/health/ready":
            return self.ready()
        if path == "/v2":
            return 200, {"name": SERVER_NAME, "version": "1", "extensions": ["binary_tensor_data"]}
        if path == "/v1/models":
            return 200, {"models": [m.name for m in self.cfg.models]}
        listed = openai_route.get(path, self.decoders)
        if listed is not None:
            return listed
        m = MODEL_ROUTE.match(path)
        if m:
            return self.model(m.group(1), m.group(2), "ready" if m.group(3) else "metadata")
        m = V1_ROUTE.match(path)
        if m:
            return self.model(m.group(1), None, "ready")
        return 404, {"error": f"no route {path!r}"}


def bridge_live(port: int) -> bool:
    """One ServerLive call to the bridge on its loopback port (not through nginx, whose
    connections a client's flood may hold: liveness would fail on a pod that serves): an empty
    request; the reply is live when its field 1 (bool live) is set."""
    import grpc

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary("/inference.GRPCInferenceService/ServerLive")
            return call(b"", timeout=2.0) == protowire.encode_bool(1, True)
    except grpc.RpcError:
        return False


def handler_class(status: Status, probes_only: bool = False):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: nginx holds a pool of connections here
        timeout = PROBE_HEADER_TIMEOUT_S if probes_only else None

        def do_GET(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            if probes_only and path not in PROBE_ROUTES:
                code, body = 404, {"error": f"this port serves the kubelet's probes only: GET {' or '.join(PROBE_ROUTES)}"}
            else:
                code, body = status.route(self.path)
            self._answer(code, {}, body)

        def do_POST(self):  # OpenAI's routes, nginx's lookup of the model in the body
            if probes_only:  # the body left unread: the connection closes after the answer
                self.close_connection = True
                self._answer(404, {}, {"error": f"this port serves the kubelet's probes only: GET {' or '.join(PROBE_ROUTES)}"})
                return
            size = int(self.headers.get("Content-Length") or 0)  # nginx buffered the body: it sends the length
            body = self.rfile.read(size) if size > 0 else b""
            self._answer(*openai_route.post(self.path.split("?", 1)[0], body, status.decoders))

        def _answer(self, code: int, headers: dict, body) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # the probes call every few seconds: no line per call
            pass

    return Handler


def poll_forever(status: Status) -> None:
    while True:
        try:
            status.refresh()
        except Exception as e:  # a poll must never end the loop; the next one tries again
            print(f"pod.status: poll failed: {type(e).__name__}: {e}", flush=True)
        time.sleep(PERIOD_S)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the config.properties TorchServe runs with")
    cfg = pod_config.load(p.parse_args(argv).config)
    status = Status(cfg)
    for name, err in status.poller.io_error.items():
        print(f"pod.status: model {name} cannot be served: {err}", flush=True)
    threading.Thread(target=poll_forever, args=(status,), name="pod-status-poll", daemon=True).start()
    aborts.start(cfg)  # nginx's abandoned generations become the workers' marks (pod/aborts.py)
    probes = probe_server(cfg.probe_port, handler_class(status, probes_only=True))
    threading.Thread(target=probes.serve_forever, name="pod-status-probes", daemon=True).start()
    server = ThreadingHTTPServer(("127.0.0.1", cfg.status_port), handler_class(status))
    server.daemon_threads = True
    server.serve_forever()
    return 0


def probe_server(port: int, handler) -> ThreadingHTTPServer:
    """The probes' listener on every address: IPv6 and IPv4 on one socket where the host has IPv6
    (the kubelet dials the pod's IP, which is IPv6 on an IPv6-only cluster), IPv4 otherwise."""
    from pod.nginx import ipv6_available

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ipv6_available() else socket.AF_INET

        def server_bind(self):
            if self.address_family == socket.AF_INET6:
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

    return Server(("::" if Server.address_family == socket.AF_INET6 else "0.0.0.0", port), handler)


if __name__ == "__main__":
    raise SystemExit(main())
