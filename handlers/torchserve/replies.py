"""TorchServe's reply I/O for one batch: the pipeline's answers (handlers/pipeline.py: one
wire.base.Encoded or wire.base.Failed per request) set on TorchServe 0.12's context, the bodies
returned in request order.

Facts this relies on (ts/context.py, ts/service.py): the worker sends request idx's status,
headers and Content-Type as set with `context.set_response_status(code, phrase, idx)`,
`set_response_header(idx, key, value)` and `set_response_content_type(idx, value)`, with the
body at index idx of the list `handle` returns; an exception raised from `handle` fails the whole
batch, with a PredictionException's code as every request's status.
"""
from __future__ import annotations

import threading

from handlers.torchserve import oip
from handlers.wire import oip_grpc
from handlers.wire.base import Failed

# A JSON error answer is also sent in this header: the KServe pod's nginx rewrites the errors
# TorchServe's frontend makes (its 503 says "use scale workers API", unreachable from the pod) and
# must pass the handler's own verbatim (a 413 that says which limit, a 503 with the load failure);
# it tells them apart by this header and answers with its value (kserve/nginx.conf). json.dumps
# writes ASCII with newlines escaped, so the body is a valid header value.
ERROR_HEADER = "X-Handler-Error"
ERROR_HEADER_MAX = 8192  # within nginx's proxy_buffer_size for the answer's headers (64k)

# A transport whose frontend drops per-request statuses -> the exception to raise when every
# request of a batch came over it and failed, so each call still gets a real status.
BATCH_FAILURES = {oip_grpc.TRANSPORT: oip.batch_failure}


def send_chunk(context, idx: int, answer) -> None:
    """One chunk of request idx's streamed answer (an Encoded), sent now: TorchServe 0.12's
    `send_intermediate_predict_response` (ts/handler_utils/utils.py) writes it to the frontend
    marked ts_stream_next, which the frontend passes on as an HTTP/1.1 chunk (/predictions) or a
    gRPC StreamPredictions message; the body `handle` returns for idx ends the stream."""
    from ts.handler_utils.utils import send_intermediate_predict_response

    body, content_type, extra = answer
    for key, value in extra.items():
        context.set_response_header(idx, key, value)
    context.set_response_content_type(idx, content_type)
    send_intermediate_predict_response({idx: body}, {idx: context.request_ids[idx]},
                                       "Intermediate Prediction success", 200, context)


def write(context, answers: list) -> list:
    """Sets each answer's status (errors; TorchServe's default is 200), headers and Content-Type
    on the context and returns the bodies; raises a transport's batch failure (BATCH_FAILURES)."""
    bodies = [None] * len(answers)
    for idx, answer in enumerate(answers):
        if type(answer) is Failed:
            context.set_response_status(answer.error.status, answer.error.error_type, idx)
            answer = answer.encoded
            if answer.media_type == "application/json" and len(answer.body) <= ERROR_HEADER_MAX:
                context.set_response_header(idx, ERROR_HEADER, answer.body)
        body, content_type, extra = answer
        for key, value in extra.items():  # the format's own headers (v2 binary, gRPC through nginx)
            context.set_response_header(idx, key, value)
        context.set_response_content_type(idx, content_type)
        bodies[idx] = body
    first = answers[0] if answers else None
    if type(first) is Failed and first.transport in BATCH_FAILURES and all(
            type(a) is Failed and a.transport == first.transport for a in answers):
        raise BATCH_FAILURES[first.transport]([a.error for a in answers])
    return bodies


STREAM_NEXT = "ts_stream_next"  # TorchServe 0.12's header: true for a chunk, false for a stream's end
# An async worker's frame writers (handlers/continuous.py's chunks, the guardian's patched
# send_responses): each holds it around one frame
FRAME_LOCK = threading.Lock()


class _Chunks:
    """The part of TorchServe's Context that `create_predict_response` reads and writes for each
    answer, for chunks of several requests that arrived in different batches. The answers at
    `whole` are not marked as chunks (create_predict_response marks every answer of a frame)."""

    def __init__(self, whole: set):
        self.status, self.headers, self.stopping_criteria, self.whole = {}, {}, None, whole

    def set_response_status(self, code: int, phrase: str = "", idx: int = 0) -> None:
        self.status[idx] = (code, phrase)

    def get_response_status(self, idx: int):
        return self.status.get(idx, (200, ""))

    def set_response_header(self, idx, key, value) -> None:
        if not (key == STREAM_NEXT and idx in self.whole):
            self.headers.setdefault(idx, {})[key] = value

    def get_response_headers(self, idx) -> dict:
        return self.headers.setdefault(idx, {})

    def set_response_content_type(self, idx, value) -> None:
        self.set_response_header(idx, "content-type", value)

    def get_response_content_type(self, idx):
        return self.get_response_headers(idx).get("content-type")


def send_chunks(sock, lock, items: list) -> None:
    """One frame to the frontend holding a chunk of each of several requests' streamed answers
    (`items`: [(request id, Encoded or Failed)]), each marked ts_stream_next true: TorchServe
    0.12's frontend relays each as the next chunk of its request (RestJob: the first with the
    status and headers), whichever batch the request came in. A Failed goes unmarked, as a whole
    answer: the frontend closes the connection after the status line of any answer of 400 or
    more (NettyUtils.sendHttpResponse), so an error cannot be a stream's first chunk; its last
    frame (ts_stream_next false, handlers/continuous.py) then only lets the frontend forget the
    request, its writes to the closed connection dropped. `lock` keeps the frames of this
    worker's own writers whole; TorchServe's async worker writes its batch replies from another
    thread without it, and the frontend reads every frame whole only because each write of up to
    half the socket's send buffer (about 100 KiB on Linux for a Unix socket) is queued as one
    unit: a chunk here is one token or one answer."""
    from ts.protocol.otf_message_handler import create_predict_response

    ctx = _Chunks({i for i, (_rid, answer) in enumerate(items) if type(answer) is Failed})
    bodies = write(ctx, [answer for _rid, answer in items])
    msg = create_predict_response(dict(enumerate(bodies)), {i: rid for i, (rid, _a) in enumerate(items)},
                                  "Intermediate Prediction success", 200, ctx, True)
    with lock:
        sock.sendall(msg)
