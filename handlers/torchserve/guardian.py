"""The return of an async worker (model-config asyncCommunication: a slot decoder's continuous
batching, handlers/continuous.py) that dies: SIGKILL, the OOM killer, a sticky fault's exit; the
end of the streams of a sync worker that dies (a one-sequence decoder: ends_streams, below); and
the answer to the batch a sync worker's frontend was gathering when it died (batched, below).

TorchServe 0.12 never brings such a worker back. Its frontend restarts a dead worker by running
the same WorkerThread object again (WorkerThread.retry: `manager.submitTask(this)`), and
AsyncWorkerThread keeps `loadingFinished` true from the first load for the object's life:
- AsyncWorkerThread.run waits for the load's answer only `if (loadingFinished == false)`, so the
  restarted thread asks AsyncBatchAggregator.getRequest for the next job at once, while the load
  job is still in the aggregator's `jobs` (only the load's answer clears it, sendResponse:
  "Predictions is empty. This is from initial load"). Any request already queued (every one
  that arrived while the worker was down) joins it there, and getRequest throws
  `IllegalStateException: Received more than 1 control command`; the thread's `finally` clears
  `jobs` (cleanJobs: that request is lost, its client waits for the response timeout), kills the
  new worker and retries with a longer back-off (WorkerThread.BACK_OFF, up to 1597 s);
- AsyncWorkerHandler.channelRead0 sets WORKER_MODEL_LOADED only `if (!loadingFinished)`, so even
  a restart that meets no request never makes the worker READY again (DescribeModelResponse:
  "UNLOADING"; ApiUtils.getModelDescription wants WORKER_MODEL_LOADED);
- the requests the dead worker held stay in AsyncBatchAggregator.jobs_in_backend unanswered:
  the thread's `finally` errors only `req`, which the loop has already set to null.
Only a new AsyncWorkerThread loads properly, and the management API's scale call makes one
(WorkLoadManager.modelChanged: min_worker 0 removes the model's threads, then min_worker N adds
fresh ones).

So the async worker starts a guardian, a small process (no torch) that holds a duplicate of the
worker's connection to the frontend and reads, on a pipe, the frames that would end each request
the worker holds (`received`: read from the frontend, answered 503 'retry'; `streaming`: before
its first token chunk; `answering`/`answered`: around the write of an answer sent as a chunk of
its own) and which requests have had their last frame (`ended`). When the pipe closes and the frontend has not closed the connection itself (it
does so first when it stops a worker: WorkerThread.shutdown), the worker died; the guardian:
1. ends each request the worker held with its frames (the last marked ts_stream_next false:
   AsyncBatchAggregator forgets the request; its client gets an error event, a 503, or the end of
   an answer already sent; death_frames says why they suit a first chunk written or not), and
   answers 503 each request the old thread wrote to the connection since the death (it reads
   them as ts/protocol/otf_message_handler.py does), once, and again right before step 2;
2. scales the model to 0 workers and back while it still holds the connection, so the old thread
   never sees a disconnect and never retries: WorkerThread.shutdown interrupts it and calls
   AsyncBatchAggregator.sendError(null, ...), which puts every request it still holds (sent to
   the dead worker, never started) back at the head of the model's queue (handleErrorJob:
   model.addFirst) for the new worker. Requests that arrive while no worker exists get
   TorchServe's 503 at once; those already queued wait for the new worker.
   Not always, TorchServe's own races (tests/test_slot_restart.py, xfail): shutdown closes the
   channel (on its event loop, asynchronously) before it takes `currentThread`; when the
   channel's closeFuture listener (AsyncWorkerThread.connect) takes and interrupts the thread
   first, shutdown skips sendError(null) and the requests the old thread had written to the
   dead worker are never re-queued nor answered (their clients wait for the response timeout);
   and a request the old thread takes while shutdown clears backendChannel fails at
   `backendChannel.get(0)`, answered 507 "Worker died." (status 413 for exit 137). Step 1
   therefore leaves the scale-down nothing to re-queue but what the old thread writes in the
   milliseconds between the guardian's last read and the shutdown, and a request the dead
   worker was reading when it died (the guardian cannot read the rest of that frame, and
   leaves what follows to the scale-down).
"""
from __future__ import annotations

import base64
import builtins
import json
import logging
import os
import struct
import subprocess
import sys

from handlers import process
from handlers.errors import ServingError

logger = logging.getLogger(__name__)
TESTED_VERSIONS = ("0.12.",)  # TorchServe releases whose AsyncWorkerThread behaves as above
_pipe = None  # the write end of the guardian's pipe, in the worker; None: no guardian


def install() -> str:
    """In TorchServe's async worker, starts the guardian when the async service starts (after the
    load's answer, ts/model_service_worker.py handle_connection_async) and learns each last frame
    sent; returns what was done."""
    from handlers.torchserve import frontend_frames

    main = sys.modules.get("__main__")
    if os.path.basename(getattr(main, "__file__", "") or "") != "model_service_worker.py":
        return "not a TorchServe worker process"
    try:
        from ts import service
        from ts.version import __version__
    except ImportError as e:
        return f"no guardian ({e})"
    if not __version__.startswith(TESTED_VERSIONS):
        return f"no guardian (TorchServe {__version__}; written against {', '.join(TESTED_VERSIONS)}x)"
    if not frontend_frames.async_worker():
        _patch_sync(service)
        return ("a guardian ends this worker's streams and answers the batch being gathered if it dies "
                "(started with the connection where it streams or takes batches: ends_streams, batched)")
    from ts import async_service

    _patch(async_service)
    process.record("guardian", "started with the async service; brings the worker back if it dies")
    return "a guardian brings this async worker back if it dies"


_streams = False  # a sync worker whose answers stream (ends_streams): its guardian starts with its connection
# (as a batched one's does: batched)


def ends_streams() -> None:
    """This sync worker streams answers (a one-sequence decoder, handlers/generating.py; or a decoder
    the engine serves, streamed by handlers/continuous.py's handle_sync where the archive has no
    asyncCommunication): its guardian starts once TorchServe hands the service its connection
    (after the load's answer). TorchServe restarts a sync worker itself, but ends a stream its
    dead worker had begun with a whole new HTTP response (RestJob.sendError), which Netty refuses
    on a chunked answer already under way: the client's connection closes mid-answer, with no
    error event. The guardian writes the stream's error event and last frame first
    (death_frames), then lets go. It must be told each batch's requests `ended` before TorchServe
    writes their last frames (handlers/torchserve/exchange.py, continuous.handle_sync): a frame
    for a request the sync frontend no longer holds raises IllegalStateException in
    BatchAggregator.sendResponse, and its WorkerThread then ends the stream under way with that
    same RestJob.sendError."""
    global _streams
    _streams = True


def _patch_sync(service) -> None:
    """ts/service.py's Service.set_cl_socket (ts/model_service_worker.py handle_connection calls it
    right after the load's answer) starts the guardian where the worker streams or takes batches
    of more than one request (batched); Service.predict tells it when a batch is in the worker's
    hands (a death then: the frontend waits for that batch's answer, and is let go at once)."""
    original, original_predict = service.Service.set_cl_socket, service.Service.predict

    def predict(self, batch):
        if _pipe is None:
            return original_predict(self, batch)
        _write(BUSY)
        try:
            return original_predict(self, batch)
        finally:
            _write(IDLE)

    service.Service.predict = predict

    def set_cl_socket(self, cl_socket):
        original(self, cl_socket)
        if (_streams or batched(self.context)) and _pipe is None:
            start(cl_socket, self.context, "sync")
            process.record("guardian", "started with the connection; if this worker dies it ends its streams "
                                       "and lets the frontend answer the batch it was gathering")

    service.Service.set_cl_socket = set_cl_socket


def batched(context) -> bool:
    """Whether TorchServe gathers batches of more than one request for this worker. Its sync
    WorkerThread waits up to maxBatchDelay for a batch to fill after it took the first request
    (BatchAggregator.getRequest); a worker that dies meanwhile interrupts that wait, and
    WorkerThread.run's `finally` then answers only the batch before (its `req`), while the requests
    taken stay in the aggregator unanswered until another request arrives: every client of an idle
    model waited for its own timeout (tests/test_faults.py kill_9, 2026-11-30: 4 of 4 in flight).
    The guardian holds the connection until that batch is written (guardian_main.let_go_after_batch),
    so the WorkerThread answers it 507 "Worker died." as it answers any batch sent to a dead worker;
    a worker that died with a batch in its hands (predict: BUSY) is let go at once. Left open: a
    batch whose first request arrives later than BATCH_MARGIN_S after an idle worker's death is
    still being gathered when the guardian lets go; its requests wait for the next request."""
    props = getattr(context, "system_properties", None) or {}
    try:
        return int(props.get("batch_size") or 1) > 1
    except (TypeError, ValueError):
        return False


def gathers_batches(max_batch_delay_ms: float) -> None:
    """The archive's maxBatchDelay (handlers/config.py max_batch_delay_ms), told at load: how long
    after a death the frontend may still write the batch it was gathering, beside a margin for the
    frontend's own turn (batch_wait_s)."""
    global _batch_delay_ms
    _batch_delay_ms = float(max_batch_delay_ms)


def batch_wait_s() -> float:
    return _batch_delay_ms / 1000.0 + BATCH_MARGIN_S


_batch_delay_ms = 100.0  # TorchServe 0.12's default; the load tells the archive's (gathers_batches)
# beside maxBatchDelay: the frontend's WorkerThread writing what it gathered (a worker idle when it
# dies is restarted this much later)
BATCH_MARGIN_S = 0.05


class _Frame(bytearray):
    """A frame of ts/async_service.py's predict, with the ids of the requests it answers."""

    rids: tuple = ()


def _patch(async_service) -> None:
    """ts/async_service.py's AsyncService: `run` starts the guardian first; `send_responses`
    (the writer of every batch's last frames, one per `handle` call) tells it which requests
    got their last frame. predict builds each frame with the module's create_predict_response."""
    original_cpr, original_run = async_service.create_predict_response, async_service.AsyncService.run

    def create_predict_response(ret, req_id_map, *args, **kwargs):
        frame = _Frame(original_cpr(ret, req_id_map, *args, **kwargs))
        frame.rids = tuple(req_id_map.values())
        return frame

    def run(self):
        start(self.service.cl_socket, self.service.context, "async")
        return original_run(self)

    original_retrieve = async_service.retrieve_msg

    def retrieve_msg(conn):  # receive_requests' reader of each frame the frontend writes
        cmd, msg = original_retrieve(conn)
        if cmd == b"I":
            for request in msg:
                received(request["requestId"].decode("utf-8"))
        return cmd, msg

    def send_responses(self):
        import asyncio

        from handlers.torchserve.replies import FRAME_LOCK as LOCK

        while True:
            frame = asyncio.run_coroutine_threadsafe(self.out_queue.get(), self.loop).result()
            # told before the write: a death between the two leaves the request in the frontend's
            # jobs_in_backend, which the scale-down re-queues (a frame for a request the frontend
            # has forgotten would be AsyncBatchAggregator.sendResponse's IllegalStateException,
            # and AsyncWorkerHandler.exceptionCaught closes the connection)
            ended(getattr(frame, "rids", ()))
            with LOCK:  # whole frames, beside the engine's chunks (replies.send_chunks)
                self.service.cl_socket.sendall(frame)

    original_call = async_service.AsyncService.call_predict

    async def call_predict(self, batch):
        # fetch_batches never reads the future of this coroutine: a raise in predict outside its
        # own try (copy.deepcopy(self.context), the batch's parsing, its reply's framing) would
        # leave the batch's requests in the frontend's jobs_in_backend, unanswered for good
        try:
            await original_call(self, batch)
        except Exception as e:  # noqa: BLE001
            rids = [r["requestId"].decode("utf-8") for r in batch]
            logger.exception("TorchServe's predict raised outside its error handling: %s answered 500", rids)
            await self.out_queue.put(unanswered(rids, e))

    async_service.AsyncService.call_predict = call_predict
    async_service.create_predict_response = create_predict_response
    async_service.print = quiet_print  # a module global shadows the builtin in that module alone
    async_service.retrieve_msg = retrieve_msg
    async_service.AsyncService.run = run
    async_service.AsyncService.send_responses = send_responses


ENTRY_POINT_LINE = "self._entry_point="


def quiet_print(*args, **kwargs) -> None:
    """`print` for ts/async_service.py alone: its predict prints `self._entry_point=<bound method
    ...>` on every call (a debug line left in TorchServe 0.12.0; the worker's stdout goes to
    model_log.log: a line a second from pod.status's describe poll alone). That line is dropped,
    any other printed as the builtin prints it."""
    if args and isinstance(args[0], str) and args[0].startswith(ENTRY_POINT_LINE):
        return
    builtins.print(*args, **kwargs)


def start(sock, context, mode: str) -> None:
    """Starts the guardian with a duplicate of `sock` (the frontend connection); `mode`: "async"
    (it brings the worker back) or "sync" (it only ends the streams; TorchServe restarts the worker)."""
    global _pipe
    manifest = getattr(context, "manifest", None) or {}
    model = {"name": context.model_name, "version": (manifest.get("model") or {}).get("modelVersion"),
             "batch_wait_s": batch_wait_s() if batched(context) else 0.0}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    read_end, write_end = os.pipe()
    _template[:] = refusal(PLACEHOLDER).split(_rid_field(PLACEHOLDER))
    template = [base64.b64encode(part).decode() for part in _template]
    args = [sys.executable, "-m", "handlers.torchserve.guardian_main", str(sock.fileno()), str(read_end),
            str(process.frontend_pid()), json.dumps(model), json.dumps(template), mode]
    subprocess.Popen(args, pass_fds=(sock.fileno(), read_end), env=env, stdin=subprocess.DEVNULL)
    os.close(read_end)
    _pipe = write_end


BUSY, IDLE = b'["B"]\n', b'["I"]\n'  # a batch entered and left the worker's predict (guardian_main.read_records)


def _tell(record: list) -> None:
    _write((json.dumps(record) + "\n").encode())


def _write(line: bytes) -> None:
    global _pipe
    if _pipe is None:
        return
    try:
        os.write(_pipe, line)  # one write under PIPE_BUF: whole
    except OSError as e:  # the guardian is gone (killed): the worker serves on without one
        logger.warning("the guardian is gone (%s): this worker's streams are no longer ended if it dies", e)
        os.close(_pipe)
        _pipe = None


class WorkerDied(ServingError):
    """What ends a stream whose worker died: the client may retry (a new worker is coming)."""

    status = 503
    error_type = "ServiceUnavailable"


DIED = WorkerDied("the worker serving this request died (killed, or out of memory); a new one is starting: retry")


def streaming(rid: str, event: str, media_type: str) -> None:
    """Request `rid` is about to send its first token chunk: if the worker dies, the guardian ends
    its stream with `event` (an error event). The death is told before the chunk is written, so
    the guardian cannot know whether the chunk reached the frontend: its frames suit both
    (death_frames)."""
    _hold(rid, death_frames(rid, event, media_type))


def received(rid: str) -> None:
    """The worker has read request `rid`: if it dies before the request begins to answer, the
    guardian answers DIED (a whole 503). Without it the request would wait in the frontend's
    AsyncBatchAggregator.jobs_in_backend for the scale-down to re-queue it, which TorchServe 0.12
    does not always do (module docstring)."""
    _hold(rid, _refused(rid))


def answering(rid: str, answer) -> None:
    """Request `rid` is about to send its whole answer as a chunk of its own (an Encoded or a
    Failed, handlers/continuous.py Client.last): if the worker dies before it is written, the
    guardian answers DIED instead (a whole 503, as a Failed goes)."""
    _hold(rid, _refused(rid))


PLACEHOLDER = "guardian-request-id-placeholder"  # the guardian's template (guardian_main.refusal)
_template = []  # refusal(PLACEHOLDER) split at its request id: a refusal in a microsecond, not 65


def _refused(rid: str) -> bytes:
    return _rid_field(rid).join(_template) if _template else refusal(rid)


def refusal(rid: str) -> bytes:
    """The frames that answer request `rid` DIED whether or not it began to answer (death_frames)."""
    from handlers import wire
    from handlers.wire.base import Failed

    died = wire.ERRORS.error(DIED, None, "")
    return death_frames(rid, Failed(DIED, died, None), died.media_type)


def unanswered(rids: list, e: Exception) -> _Frame:
    """The frames that answer requests `rids`, whose batch TorchServe's predict dropped with `e`,
    a whole 500 each (death_frames), as one frame of send_responses (its `rids` told ended)."""
    from handlers import wire
    from handlers.wire.base import Failed

    err = ServingError(f"the worker could not start this request (TorchServe's predict raised "
                       f"{type(e).__name__}: {e}); retry")
    encoded = wire.ERRORS.error(err, None, "")
    frame = _Frame(b"".join(death_frames(rid, Failed(err, encoded, None), encoded.media_type) for rid in rids))
    frame.rids = tuple(rids)
    return frame


def _rid_field(rid: str) -> bytes:
    """How a frame carries a request id (create_predict_response): its length, then its bytes."""
    return struct.pack("!i", len(rid.encode())) + rid.encode()


def answered(rid: str, media_type: str) -> None:
    """Request `rid`'s own chunk has been written: if the worker dies now, the guardian only
    ends it (its last frame). A death between the write and this record (adjacent calls) leaves
    the 503 to follow an answer already sent: a garbled answer, not a hang."""
    _hold(rid, end_frame(rid, media_type))


_holding = set()  # the requests whose frames the guardian holds (told "S", not yet "E")


def _hold(rid: str, frames: bytes) -> None:
    if _pipe is not None:
        _holding.add(rid)
        _tell(["S", rid, base64.b64encode(frames).decode()])


def active() -> bool:
    """Whether this worker's guardian runs (the records above reach it)."""
    return _pipe is not None


def ended(rids) -> None:
    """Requests `rids` got their last frame: the guardian lets go of what it holds for them (a
    batch of which it holds nothing, a stateless one, costs no write)."""
    held = [rid for rid in rids if rid in _holding]
    if held:
        _holding.difference_update(held)
        if _pipe is not None:
            _tell(["E", *held])


def death_frames(rid: str, first, media_type: str) -> bytes:
    """The frames that end request `rid` whether or not its first chunk reached the frontend:
    `first` (a str: a chunk marked ts_stream_next true, status 200; a Failed: a whole answer with
    its status, unmarked), then an empty last frame (ts_stream_next false: AsyncBatchAggregator.
    sendResponse forgets the request only on that false). TorchServe 0.12's RestJob.
    responseInference counts a request's chunks (numStreams): a chunk that is the first sends the
    status line and headers, a later one only its body, so the error event follows the tokens
    already sent or opens the answer; a last frame that follows no chunk (numStreams 0 -> -1)
    writes content with no status line, which Netty's HttpResponseEncoder refuses (it accepts
    HttpContent only after an HttpResponse): the client would wait for its timeout. An unmarked
    whole answer of 400 or more closes the connection (NettyUtils.sendHttpResponse), and the last
    frame's writes after it are dropped."""
    from handlers.wire.base import Encoded

    chunk = Encoded(first, media_type, {}) if isinstance(first, str) else first
    return _frame(rid, chunk, True) + end_frame(rid, media_type)


def end_frame(rid: str, media_type: str) -> bytes:
    """The frame that only ends request `rid` (empty, ts_stream_next false)."""
    from handlers.wire.base import Encoded

    return _frame(rid, Encoded("", media_type, {}), False)


def _frame(rid: str, answer, chunk: bool) -> bytes:
    from ts.protocol.otf_message_handler import create_predict_response

    from handlers.torchserve import replies
    from handlers.wire.base import Failed

    whole = type(answer) is Failed
    ctx = replies._Chunks({0} if whole else set())
    (body,) = replies.write(ctx, [answer])
    if not chunk:
        ctx.set_response_header(0, replies.STREAM_NEXT, "false")
    return bytes(create_predict_response({0: body}, {0: rid}, "the worker died", 200, ctx, chunk and not whole))
