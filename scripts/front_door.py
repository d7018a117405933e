"""The pod's front door: the kserve SDK's ModelServer in front of TorchServe on loopback, so
standard Open Inference Protocol clients reach us (run in .venv-kserve, scripts/setup_kserve_env.sh):

  python -m scripts.front_door --ts-config RUNTIME_DIR/config.properties --model-store DIR
      [--http_port 8080] [--grpc_port 8081]   (the kserve SDK's own options)

REST v1 and v2 (infer, GET /v2/models/NAME metadata from the archive's artifact.json, model
ready, /v2/health/live|ready) and gRPC `inference.GRPCInferenceService` are the SDK's; each
request is forwarded to TorchServe's inference API over one pooled async HTTP client, so
concurrent requests still meet in one TorchServe batch. A 4xx from the handler is raised as the
SDK's InvalidInput (REST 400, gRPC INVALID_ARGUMENT) with the handler's message.

tritonclient.http sends a JSON-only v2 request with no Content-Type, and the SDK (0.21) reads a
body without one as the binary extension and refuses it ("the 'inference-header-content-length'
header is missing"): JsonWithoutContentType names such a body application/json first.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
import zipfile

import httpx
import kserve
from kserve.errors import InferenceError, InvalidInput, ModelNotReady
from kserve.protocol.infer_type import InferRequest, InferResponse

from scripts.cluster_probe import local, read_properties

POOL = 256  # connections to TorchServe: at least the clients that may wait in one batch


def v2_datatype(dtype: str) -> str:
    """artifact.json's torch dtype name -> the OIP datatype ('float32' -> 'FP32')."""
    if dtype == "bfloat16":
        return "BF16"
    return "FP" + dtype[len("float"):] if dtype.startswith("float") else dtype.upper()


def archive_io(mar: str) -> dict:
    """inputs/outputs of the archive's (first) artifact.json, as OIP metadata lists."""
    with zipfile.ZipFile(mar) as z:
        name = next(n for n in z.namelist() if n == "artifact.json" or n.endswith("/artifact.json"))
        art = json.loads(z.read(name))
    return {k: [{"name": t["name"], "datatype": v2_datatype(t["dtype"]), "shape": [-1 if d is None else d for d in t["shape"]]}
                for t in art[k]] for k in ("inputs", "outputs")}


class Forward(kserve.Model):
    def __init__(self, name: str, inference: str, io: dict, client: httpx.AsyncClient):
        super().__init__(name)
        self.inference, self.io, self.client = inference, io, client
        self.load_error = None

    def get_input_types(self):
        if self.load_error:
            raise ModelNotReady(self.name, self.load_error)
        return self.io["inputs"]

    def get_output_types(self):
        if self.load_error:
            raise ModelNotReady(self.name, self.load_error)
        return self.io["outputs"]

    async def predict(self, payload, headers=None, response_headers=None):
        if isinstance(payload, InferRequest):
            # v2 JSON from the decoded tensors: gRPC raw_input_contents and REST binary data
            # alike arrive here as numpy arrays (costs a tolist per request; binary forwarding
            # to the handler's v2 binary path is the faster option left to do)
            body = {"inputs": [
                {"name": i.name, "shape": list(i.shape), "datatype": i.datatype,
                 "data": i.as_numpy().flatten().tolist()} for i in payload.inputs]}
            if payload.request_outputs:
                body["outputs"] = [{"name": o.name} for o in payload.request_outputs]
            if payload.id:
                body["id"] = payload.id
            r = await self.client.post(f"{self.inference}/v2/models/{self.name}/infer", json=body)
            resp = InferResponse.from_rest(self.checked(r))
            resp.id = resp.id or payload.id or str(uuid.uuid4())
            # a gRPC client that sent raw_input_contents reads raw_output_contents (tritonclient)
            resp._use_binary_outputs = bool(payload.from_grpc and getattr(payload, "_use_raw_outputs", False))
            return resp
        r = await self.client.post(f"{self.inference}/v1/models/{self.name}:predict", json=payload)
        return self.checked(r)

    @staticmethod
    def checked(r: httpx.Response) -> dict:
        try:
            body = r.json()
        except ValueError:
            body = {"message": r.text}
        if r.status_code < 400:
            return body
        message = body.get("message", r.text) if isinstance(body, dict) else r.text
        if r.status_code < 500:
            raise InvalidInput(message)
        raise InferenceError(message, status=str(r.status_code))


class JsonWithoutContentType:
    """ASGI middleware: a POST without Content-Type and without the binary extension's
    Inference-Header-Content-Length header is JSON (the v2 protocol's only other body)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            names = {k.lower() for k, _ in scope["headers"]}
            if b"content-type" not in names and b"inference-header-content-length" not in names:
                scope = dict(scope, headers=[*scope["headers"], (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def handler_state(mgmt: str, name: str):
    """(ready, load_error) from TorchServe's workers and the handler's describe_handle JSON."""
    try:
        entry = httpx.get(f"{mgmt}/models/{name}?customized=true", timeout=5).json()[0]
        raw = entry.get("customizedMetadata") or {}
        state = json.loads(raw) if isinstance(raw, str) else raw
    except (httpx.HTTPError, ValueError, IndexError, KeyError):
        return False, None
    worker = any(w.get("status") == "READY" for w in entry.get("workers", []))
    return worker and bool(state.get("ready")), state.get("load_error")


def settle(pending: list, mgmt: str) -> None:
    """Asks TorchServe once about each pending model; those now ready or failed leave `pending`
    (a failure is logged with its reason)."""
    for m in list(pending):
        m.ready, m.load_error = handler_state(mgmt, m.name)
        if m.ready or m.load_error:
            pending.remove(m)
            if m.load_error:
                print(f"front_door: model {m.name} cannot load: {m.load_error}", file=sys.stderr, flush=True)


def watch_not_ready(models: list, mgmt: str, period_s: float = 2.0) -> None:
    """In a daemon thread: models still loading when the wait ended become ready (or failed,
    with the reason) on their routes as soon as TorchServe says so."""
    def poll():
        pending = [m for m in models if not m.ready and not m.load_error]
        while pending:
            time.sleep(period_s)
            settle(pending, mgmt)

    threading.Thread(target=poll, name="front-door-readiness", daemon=True).start()


def wait_for_models(models: list, mgmt: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    pending = list(models)
    while pending and time.time() < deadline:
        settle(pending, mgmt)
        time.sleep(0.5)


def main():
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--ts-config", required=True)
    p.add_argument("--model-store", required=True)
    p.add_argument("--wait-s", type=float, default=600.0)
    args, rest = p.parse_known_args()
    cfg = read_properties(args.ts_config)
    addr = {k: local(cfg[k]) for k in ("inference_address", "management_address")}
    client = httpx.AsyncClient(timeout=httpx.Timeout(float(cfg.get("default_response_timeout", 120))),
                               limits=httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL))
    snapshot = json.loads(cfg["model_snapshot"])["models"]
    models = []
    for name, versions in snapshot.items():
        mar = os.path.join(args.model_store, next(iter(versions.values()))["marName"])
        models.append(Forward(name, addr["inference_address"], archive_io(mar), client))
    wait_for_models(models, addr["management_address"], args.wait_s)
    sys.argv = [sys.argv[0], *rest]
    from kserve.model_server import app  # the SDK's one FastAPI app, which ModelServer serves

    app.add_middleware(JsonWithoutContentType)
    server = kserve.ModelServer()
    for m in models:
        if not m.ready:  # registered, not ready: its ready route and metadata say why
            server.register_model(m)
    # Only ready models go to start(): with none ready the SDK would refuse to start at all
    # (NoModelReady), and a pod whose one model cannot load could not say why on its routes.
    watch_not_ready(models, addr["management_address"])
    server.start([m for m in models if m.ready])


if __name__ == "__main__":
    main()
