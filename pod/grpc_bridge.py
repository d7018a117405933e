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
INTERNAL, with the handler's message; TorchServe's own errors (no X-Handler-Error) with what their
status means in the pod's words (TORCHSERVE_SAYS), never its body's Java text. ServerLive/Ready, ModelReady and the two metadata calls
answer from pod.status's state file. ModelStreamInfer serves a decoder's generation token by
token (pod/stream_infer.py). The repository RPCs (load, unload, index) are not served:
gRPC answers UNIMPLEMENTED, and nothing on this port can change the server.

Several bridge processes may share the port (SO_REUSEPORT, grpc's default on Linux): pod.start
starts GRPC_BRIDGE_PROCESSES of them.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import secrets
import signal
import struct
from urllib.parse import quote, unquote

import grpc

from handlers import protowire
from handlers.errors import RequestError
from handlers.generation import abandon
from pod import config as pod_config
from pod.config import LARGE_BODY_BYTES
from pod import stream_infer
from pod.state import PLATFORM, READY, SERVER_NAME, StateFile, find_model, server_problem, unservable

def _malloc_trim():
    """glibc's malloc_trim (None elsewhere): gives the free memory of every malloc arena back."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()
SERVICE = "inference.GRPCInferenceService"
MEDIA = "application/x-kserve-v2-protobuf"
STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 415: grpc.StatusCode.INVALID_ARGUMENT,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE, 507: grpc.StatusCode.UNAVAILABLE,
          502: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class Upstream:
    """Keep-alive HTTP/1.1 connections to TorchServe through nginx's gate (its unix socket, which
    bounds the large bodies TorchServe holds at once: kserve/nginx.conf), on this process's event loop: a request
    takes an idle connection or opens one, and gives it back after reading the answer (TorchServe's
    inference answers carry a Content-Length)."""

    def __init__(self, socket_path: str, timeout_s: float):
        self.socket_path, self.timeout_s = socket_path, timeout_s
        self.idle = []

    async def post(self, path: str, body: bytes) -> tuple:
        """(status, body bytes, header fields). A kept-alive connection TorchServe closed meanwhile
        fails before any answer; the request then goes once more on a new connection. ModelInfer
        is a tensor route: X-Generate-Route `infer` (a decoder refuses it naming ModelStreamInfer)."""
        head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {MEDIA}\r\nX-Generate-Route: infer\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
        for attempt in (0, 1):
            reused = bool(self.idle)
            reader, writer = self.idle.pop() if reused else await asyncio.open_unix_connection(self.socket_path)
            try:
                writer.writelines((head, body))  # one send where the transport can
                async with asyncio.timeout(self.timeout_s):  # no task per call, unlike wait_for
                    status, data, close, fields = await read_answer(reader)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                writer.close()
                if attempt or not reused:
                    raise ConnectionError("TorchServe closed the connection before answering") from None
                continue
            except BaseException:
                writer.close()
                raise
            if close:
                writer.close()
            else:
                self.idle.append((reader, writer))
            return status, data, fields


async def read_answer(reader) -> tuple:
    """(status, body, close?, header fields) of one HTTP/1.1 answer with a Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" not in fields:
        raise ConnectionError(f"TorchServe answered {status} without a Content-Length")
    data = await reader.readexactly(int(fields["content-length"]))
    return status, data, fields.get("connection", "").lower() == "close", fields


# What TorchServe's frontend means by a status it answers itself (no X-Handler-Error: not the
# handler's), in the pod's words: its own body is Java's (an exception's text, "use scale workers
# API", unreachable from the pod) and goes to no client
TORCHSERVE_SAYS = {
    400: (grpc.StatusCode.INVALID_ARGUMENT, "TorchServe refused the request as malformed"),
    404: (grpc.StatusCode.NOT_FOUND, "the model is not registered with TorchServe (its archive could not be "
                                     "loaded); ModelReady gives the reason"),
    413: (grpc.StatusCode.RESOURCE_EXHAUSTED, "the request is larger than TorchServe's max_request_size"),
    503: (grpc.StatusCode.UNAVAILABLE, "no worker of this model can take the request now (starting, restarting, "
                                       "or busy with a full queue); retry"),
}
WORKER_FAILED = (grpc.StatusCode.UNAVAILABLE, "the worker serving this request died or failed (TorchServe "
                                              "restarts a worker that died); retry")


def answer_error(status: int, body: bytes, fields: dict) -> tuple:
    """(gRPC status, message) of a failed answer: the gate's refusal or the handler's own words
    (X-Grpc-Message, X-Handler-Error: its JSON), else what TorchServe's status means."""
    code = STATUS.get(status, grpc.StatusCode.INTERNAL)
    if fields.get("x-grpc-message"):
        return code, unquote(fields["x-grpc-message"])
    if fields.get("x-handler-error"):
        try:
            text = json.loads(fields["x-handler-error"]).get("message")
        except (ValueError, AttributeError):
            text = None
        return code, text if isinstance(text, str) else fields["x-handler-error"]
    return TORCHSERVE_SAYS.get(status, WORKER_FAILED)


READY_REASON = "ready-reason"  # trailing metadata of a not-ready answer


def not_ready_because(context, why):
    """`why` (None: ready) as the call's trailing metadata: ServerReadyResponse and
    ModelReadyResponse hold one bool and no other field, so the reason the REST ready route gives
    in its body travels beside it (ASCII, as gRPC metadata values must be). Returns `why`."""
    if why:
        context.set_trailing_metadata(((READY_REASON, why.encode("ascii", "backslashreplace").decode()[:4000]),))
    return why


async def names(request: bytes, context) -> tuple:
    """(model name, version) of a request: its fields 1 and 2 (ModelInferRequest,
    ModelReadyRequest and ModelMetadataRequest alike); a malformed message is the client's."""
    try:
        return protowire.first_string(request, 1), protowire.first_string(request, 2)
    except protowire.ProtoError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a well-formed protobuf message: {e}")


class Bridge:
    def __init__(self, cfg):
        self.cfg, self.state = cfg, StateFile(cfg.state_file)
        self.upstream = Upstream(cfg.gate_socket, timeout_s=cfg.response_timeout_s + 10)
        self.large_in_flight = 0  # ModelInfer requests of LARGE_BODY_BYTES or more being answered

    async def model_infer(self, request: bytes, context):
        """_model_infer; after large requests, once none is left, the memory they held goes back to
        the system (_release: three rounds of sixteen 8.7 MB calls at once had left the bridge at
        580 MiB, 530 more than before them)."""
        large = len(request) >= LARGE_BODY_BYTES
        self.large_in_flight += large
        try:
            return await self._model_infer(request, context)
        finally:
            self.large_in_flight -= large
            if large and not self.large_in_flight:
                # later, once gRPC has let go of the request's buffers too
                asyncio.get_running_loop().call_later(0.5, self._release)

    def _release(self) -> None:
        """Failed calls' requests stay in reference cycles (the abort's exception, its traceback,
        the frames holding the request) until the collector runs: collected here, and the free
        memory of every malloc arena given back to the system."""
        if self.large_in_flight:
            return
        gc.collect()
        if MALLOC_TRIM is not None:
            MALLOC_TRIM(0)

    async def _model_infer(self, request: bytes, context):
        name, version = await names(request, context)
        if not name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ModelInferRequest.model_name is empty; name the model")
        path = f"/predictions/{quote(name, safe='')}" + (f"/{quote(version, safe='')}" if version else "")
        try:
            status, body, fields = await self.upstream.post(path, request)
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"TorchServe did not answer ({type(e).__name__}: {e}); retry")
        if status == 200:
            return body
        code, message = answer_error(status, body, fields)
        await context.abort(code, message)

    async def model_stream_infer(self, requests, context):
        """ModelStreamInfer for a decoder (pod/stream_infer.py): each request on the stream one
        generation, its tokens streamed back as they come; a failed request answers its
        error_message and the stream goes on."""
        async for request in requests:
            try:
                name, version, rid, body = stream_infer.generation_body(request)
            except (RequestError, protowire.ProtoError, UnicodeDecodeError, ValueError, struct.error) as e:
                yield stream_infer.error(f"the request is malformed: {e}")
                continue
            async for reply in self._generate(name, version, rid, body):
                yield reply

    async def _generate(self, name: str, version: str, rid: str, body: dict):
        """One generation's replies. Its worker knows it by a key of this bridge's making; if it
        ends before its last reply (the client cancelled the call, or went), the key is marked for
        the worker to stop it (handlers/generation/abandon.py), as nginx's are (pod/aborts.py)."""
        path, key, ended = stream_infer.path_of(name, version), secrets.token_hex(16), False
        try:
            # through nginx's gate, as every body the pod passes to TorchServe: its bound on the
            # large bodies TorchServe's direct memory holds at once covers the stream's messages
            # (a refusal: 503, X-Grpc-Message, answered as this request's error_message); its
            # /generate/ location passes each line on as it comes and sends TorchServe's key
            async for status, line, fields in stream_infer.lines(self.cfg.gate_socket, path, json.dumps(body).encode(),
                                                                  self.cfg.response_timeout_s + 5, key):
                reply, ended = self._reply(name, version, rid, status, line, fields)
                yield reply
                if ended:
                    return
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            yield stream_infer.error(f"TorchServe did not answer ({type(e).__name__}: {e}); retry")
        finally:
            if not ended:
                self._abandon(key)

    @staticmethod
    def _reply(name: str, version: str, rid: str, status: int, line: bytes, fields: dict) -> tuple:
        """(the stream response for one line of TorchServe's answer, whether it is the last)."""
        if status != 200:
            return stream_infer.error(f"{status}: {answer_error(status, line, fields)[1]}"), True
        obj = json.loads(line)
        if "error" in obj:
            return stream_infer.error(obj["error"]), True
        if "finish_reason" in obj:  # the last line: counts, no new token
            params = {k: obj[k] for k in ("finish_reason", "prompt_tokens", "completion_tokens")}
            return stream_infer.response(name, version, rid, "", [], {**params, "triton_final_response": True}), True
        return stream_infer.response(name, version, rid, obj.get("text", ""), obj.get("token_ids", [])), False

    def _abandon(self, key: str) -> None:
        try:
            abandon.mark(self.cfg.abort_dir, key)
        except OSError as e:  # the generation runs to its end, as it did before the marks
            print(f"pod.grpc_bridge: could not mark an abandoned generation: {e}", flush=True)

    async def model(self, request: bytes, context) -> dict:
        """The state of the model a ModelReady/ModelMetadata request names (fields 1, 2)."""
        name, version = await names(request, context)
        m, missing = find_model(self.state.read(), name, version)
        if m is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, missing)
        return dict(m, name=name)

    async def server_live(self, request, context) -> bytes:
        snap = self.state.read()
        return protowire.encode_bool(1, bool(snap and snap.get("torchserve_live")))

    async def server_ready(self, request, context) -> bytes:
        why = server_problem(self.state.read())
        return protowire.encode_bool(1, not_ready_because(context, why) is None)

    async def model_ready(self, request, context) -> bytes:
        m = await self.model(request, context)
        why = None if m["state"] == READY else f"{m['name']}: {m['state']}: {m['reason']}"
        return protowire.encode_bool(1, not_ready_because(context, why) is None)

    async def server_metadata(self, request, context) -> bytes:
        w = protowire.Writer()
        w.string(1, SERVER_NAME)
        w.string(2, "1")
        w.string(3, "binary_tensor_data")
        return w.bytes()

    async def model_metadata(self, request, context) -> bytes:
        m = await self.model(request, context)
        why = unservable(m["name"], m)
        if why:
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        w = protowire.Writer()
        w.string(1, m["name"])
        w.string(2, m["version"])
        w.string(3, PLATFORM)
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
        handlers = {k: grpc.unary_unary_rpc_method_handler(v) for k, v in calls.items()}
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(self.model_stream_infer)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


async def serve(cfg) -> None:
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", cfg.max_request_bytes),
        ("grpc.max_send_message_length", cfg.max_response_bytes),
        ("grpc.so_reuseport", 1)])
    server.add_generic_rpc_handlers((Bridge(cfg).handler(),))
    if not server.add_insecure_port(f"127.0.0.1:{cfg.bridge_port}"):  # behind nginx, loopback only
        raise SystemExit(f"pod.grpc_bridge: error: cannot listen on port {cfg.bridge_port}")
    await server.start()
    stop = asyncio.Event()
    # SIGTERM: stop taking calls, finish the ones in flight (up to 20 s), exit
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(grace=20)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the config.properties TorchServe runs with")
    asyncio.run(serve(pod_config.load(p.parse_args(argv).config)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
