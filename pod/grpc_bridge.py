"""The pod's gRPC port: KServe's Open Inference Protocol service (`inference.GRPCInferenceService`,
what tritonclient.grpc and the kserve SDK call), bridged to TorchServe's inference API without
decoding a tensor:

  python -m pod.grpc_bridge --config RUNTIME_DIR/config.properties

ModelInfer's serialized request is POSTed unchanged to TorchServe's `/predictions/NAME[/VERSION]`
as `application/x-kserve-v2-protobuf`; the handler decodes it (handlers/wire/kserve_v2_grpc.py,
raw and typed contents) and answers a serialized ModelInferResponse, which goes back unchanged.
The bridge reads only the request's model name and version (protobuf fields 1 and 2).
A handler error's HTTP status becomes the gRPC status: 400/415 INVALID_ARGUMENT, 404 NOT_FOUND,
413 RESOURCE_EXHAUSTED, 503/507 and an unreachable TorchServe UNAVAILABLE (retryable), others
INTERNAL, with the handler's message. ServerLive/Ready, ModelReady and the two metadata calls
answer from pod.status's state file. The repository RPCs (load, unload, index) are not served:
gRPC answers UNIMPLEMENTED, and nothing on this port can change the server.

Several bridge processes may share the port (SO_REUSEPORT, grpc's default on Linux): pod.start
starts GRPC_BRIDGE_PROCESSES of them.
"""
from __future__ import annotations

import argparse
import http.client
import json
import signal
import threading
from concurrent import futures
from urllib.parse import quote

import grpc

from handlers import protowire
from pod import config as pod_config
from pod.state import FAILED, READY, StateFile, server_problem

SERVICE = "inference.GRPCInferenceService"
MEDIA = "application/x-kserve-v2-protobuf"
THREADS = 128  # each call holds a thread while TorchServe batches it
STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 415: grpc.StatusCode.INVALID_ARGUMENT,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE, 507: grpc.StatusCode.UNAVAILABLE,
          502: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
RETRYABLE = (http.client.RemoteDisconnected, http.client.CannotSendRequest, ConnectionResetError,
             BrokenPipeError)


class Upstream:
    """One keep-alive HTTP/1.1 connection to TorchServe per bridge thread."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.local = threading.local()

    def post(self, path: str, body: bytes) -> tuple:
        """(status, body bytes). A kept-alive connection TorchServe closed meanwhile is
        reopened once (the request had not been read: RemoteDisconnected before any reply)."""
        for attempt in (0, 1):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                conn.request("POST", path, body=body, headers={"Content-Type": MEDIA})
                r = conn.getresponse()
                data = r.read()
                if r.will_close:
                    self.drop()
                return r.status, data
            except RETRYABLE:
                self.drop()
                if attempt:
                    raise

    def drop(self) -> None:
        conn, self.local.conn = getattr(self.local, "conn", None), None
        if conn is not None:
            conn.close()


def error_message(status: int, body: bytes) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        text = obj.get("message") or obj.get("error")
        if isinstance(text, str):
            return text
    return body.decode("utf-8", "replace")[:2000] or f"TorchServe answered {status}"


def names(request: bytes, context) -> tuple:
    """(model name, version) of a request: its fields 1 and 2 (ModelInferRequest,
    ModelReadyRequest and ModelMetadataRequest alike); a malformed message is the client's."""
    try:
        return protowire.first_string(request, 1), protowire.first_string(request, 2)
    except protowire.ProtoError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a well-formed protobuf message: {e}")


class Bridge:
    def __init__(self, cfg):
        self.cfg, self.state = cfg, StateFile(cfg.state_file)
        self.upstream = Upstream(*cfg.inference, timeout_s=cfg.response_timeout_s + 5)

    def model_infer(self, request: bytes, context):
        name, version = names(request, context)
        if not name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ModelInferRequest.model_name is empty; name the model")
        path = f"/predictions/{quote(name, safe='')}" + (f"/{quote(version, safe='')}" if version else "")
        try:
            status, body = self.upstream.post(path, request)
        except (OSError, http.client.HTTPException) as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"TorchServe did not answer ({type(e).__name__}); retry")
        if status == 200:
            return body
        context.abort(STATUS.get(status, grpc.StatusCode.INTERNAL), error_message(status, body))

    def model(self, request: bytes, context) -> dict:
        """The state of the model a ModelReady/ModelMetadata request names (fields 1, 2)."""
        name, version = names(request, context)
        models = (self.state.read() or {}).get("models", {})
        m = models.get(name or "")
        if m is None or (version and version != m["version"]):
            context.abort(grpc.StatusCode.NOT_FOUND, f"model {name!r}{f' version {version!r}' if version else ''} "
                                                     f"is not served here; this pod serves {', '.join(models) or 'nothing yet'}")
        return dict(m, name=name)

    def server_live(self, request, context) -> bytes:
        snap = self.state.read()
        return protowire.encode_bool(1, bool(snap and snap.get("torchserve_live")))

    def server_ready(self, request, context) -> bytes:
        return protowire.encode_bool(1, server_problem(self.state.read()) is None)

    def model_ready(self, request, context) -> bytes:
        return protowire.encode_bool(1, self.model(request, context)["state"] == READY)

    def server_metadata(self, request, context) -> bytes:
        w = protowire.Writer()
        w.string(1, "compiled-torchserve")
        w.string(2, "1")
        w.string(3, "binary_tensor_data")
        return w.bytes()

    def model_metadata(self, request, context) -> bytes:
        m = self.model(request, context)
        if m["state"] == FAILED:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"model {m['name']!r} cannot be served: {m['reason']}")
        w = protowire.Writer()
        w.string(1, m["name"])
        w.string(2, m["version"])
        w.string(3, "pytorch_torchserve")
        for field, tensors in ((4, m["inputs"]), (5, m["outputs"])):
            for t in tensors:
                tw = protowire.Writer()
                tw.string(1, t["name"])
                tw.string(2, t["datatype"])
                tw.packed_varints(3, t["shape"])
                w.message(field, tw.bytes())
        return w.bytes()

    def handler(self):
        """Byte-level method handlers (no (de)serializers: requests and replies stay bytes)."""
        calls = {"ModelInfer": self.model_infer, "ServerLive": self.server_live, "ServerReady": self.server_ready,
                 "ModelReady": self.model_ready, "ServerMetadata": self.server_metadata,
                 "ModelMetadata": self.model_metadata}
        return grpc.method_handlers_generic_handler(
            SERVICE, {k: grpc.unary_unary_rpc_method_handler(v) for k, v in calls.items()})


def serve(cfg) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=THREADS), options=[
        ("grpc.max_receive_message_length", cfg.max_request_bytes),
        ("grpc.max_send_message_length", cfg.max_response_bytes),
        ("grpc.so_reuseport", 1)])
    server.add_generic_rpc_handlers((Bridge(cfg).handler(),))
    if not server.add_insecure_port(f"0.0.0.0:{cfg.grpc_port}"):
        raise SystemExit(f"pod.grpc_bridge: error: cannot listen on port {cfg.grpc_port}")
    server.start()
    return server


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the config.properties TorchServe runs with")
    server = serve(pod_config.load(p.parse_args(argv).config))
    done = threading.Event()
    # SIGTERM: stop taking calls, finish the ones in flight (up to 20 s), exit
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    server.stop(grace=20).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
