"""One TorchServe batch through the worker: admit -> run -> encode, exactly one reply per request.

The batch's own state (which requests came over OIP gRPC, which failed) is a local `Batch`, never
the handler's: nothing of one batch survives into the next. Anything that goes wrong becomes the
answer of the request it belongs to, or of every request when it belongs to none; the only
exception raised is a batch of OIP gRPC calls that all failed (TorchServe's gRPC frontend turns
a raised PredictionException into each call's status).

Per-stage timings (handlers/torchserve/stage_timings.py): TorchServe gauges HandlerDecodeTime, HandlerRunTime,
HandlerEncodeTime and HandlerTime (ms, means over at most handler.stage_metrics_s), and torch.profiler labels
handler.decode / handler.run / handler.encode while a profiler records.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from handlers import faults, wire
from handlers.admission import admit
from handlers.config import HandlerConfig
from handlers.errors import RequestError, ServingError
from handlers.torchserve import headers, oip, restart  # noqa: F401  (oip registers its transport format)
from handlers.torchserve.stage_timings import batch_profiler, label  # noqa: F401  (the entry's profiler)
from handlers.worker import Health, Worker

logger = logging.getLogger(__name__)
DEFAULT_FORMAT = wire.WireFormat()  # the error answer of a request no transport format owns


class Batch:
    """One TorchServe batch's replies: request idx -> body, statuses set on the context."""

    def __init__(self, data: list, context, worker: Optional[Worker], model_name: str, version: str = ""):
        self.context, self.model_name, self.version = context, model_name, version
        self.results: list = [None] * len(data)
        self.failed: list = []
        self.headers = [headers.read(context, i) for i in range(len(data))]  # once per request
        # per request: the format bound to the transport it arrived over (TorchServe's OIP gRPC
        # service, handlers/torchserve/oip.py), else None (its headers and body choose), and
        # its id for an error answered before its decode
        self.transports: list = [None] * len(data)
        self.ids: list = [None] * len(data)
        cap = worker.limits.max_json_bytes if worker else int(HandlerConfig.max_json_mb * (1 << 20))
        for i, (r, h) in enumerate(zip(data, self.headers)):
            try:
                fmt = wire.transport_format(r, h, cap)
                if fmt is not None:
                    self.transports[i], self.ids[i] = fmt, fmt.request_id(r)
            except Exception:  # a malformed transport request: answered as REST, with its error
                logger.exception("could not tell request %d's transport", i)
                self.transports[i] = self.ids[i] = None

    def fail(self, idx: int, err: ServingError) -> None:
        self.failed.append(err)
        fmt = self.transports[idx] or DEFAULT_FORMAT
        body, content_type, extra = fmt.error(err, self.ids[idx], self.model_name, self.version)
        self.context.set_response_status(err.status, err.error_type, idx)
        for key, value in extra.items():  # a transport's own error headers (gRPC through nginx)
            self.context.set_response_header(idx, key, value)
        self.context.set_response_content_type(idx, content_type)
        self.results[idx] = body

    def answer(self, idx: int, req, out: dict) -> None:
        body, content_type, extra = req.encode(out, self.model_name, self.version)
        for key, value in extra.items():
            self.context.set_response_header(idx, key, value)
        self.context.set_response_content_type(idx, content_type)
        self.results[idx] = body

    def finish(self) -> list:
        """A batch whose requests all came over one transport and all failed raises what that
        transport's format says (OIP gRPC: so each call gets a real status)."""
        fmt = self.transports[0] if self.transports else None
        if (fmt is not None and len(self.failed) == len(self.results)
                and all(f is fmt for f in self.transports)):
            exc = fmt.batch_failure(self.failed)
            if exc is not None:
                raise exc
        return self.results


def serve(worker: Optional[Worker], health: Health, data: list, context, model_name: str,
          model_version: str = "", profile=None) -> list:
    """The replies to one TorchServe batch (handlers/ts_entry.py's handle); with `profile` (a
    factory from batch_profiler), the batch runs under torch.profiler."""
    if profile is not None:
        return _profiled(profile, worker, health, data, context, model_name, model_version)
    batch = Batch(data, context, worker, model_name, model_version)
    refusal = health.refusal()
    if refusal is not None:
        for idx in range(len(data)):
            batch.fail(idx, refusal)
        return batch.finish()
    try:
        _run(worker, health, data, batch)
    except Exception as e:
        logger.exception("batch failed outside any one request")
        err, batch.failed = ServingError(f"internal error: {type(e).__name__}: {str(e)[:300]}"), []
        for idx in range(len(data)):
            batch.fail(idx, err)
    return batch.finish()


def _profiled(profile, *args) -> list:
    """The batch under torch.profiler; a trace that cannot be written (a full disk) is logged,
    never the batch's failure."""
    prof = profile()
    prof.__enter__()
    try:
        return serve(*args)
    finally:
        try:
            prof.__exit__(None, None, None)
        except Exception as e:
            logger.warning("the profiler's trace was not written: %s", e)


def _run(worker: Worker, health: Health, data: list, batch: Batch) -> None:
    t0 = time.perf_counter()
    with label("decode"):
        valid = admit_all(worker, data, batch)
    t1 = time.perf_counter()
    if not valid:
        worker.stages.record(decode=(t1 - t0) * 1000.0, total=(t1 - t0) * 1000.0)
        return
    with label("run"):
        outputs = infer(worker, health, [req.tensors for _, req in valid])
    t2 = time.perf_counter()
    with label("encode"):
        encode_all(valid, outputs, batch)
    t3 = time.perf_counter()
    worker.stages.record(decode=(t1 - t0) * 1000.0, run=(t2 - t1) * 1000.0, encode=(t3 - t2) * 1000.0,
                         total=(t3 - t0) * 1000.0)


def admit_all(worker: Worker, data: list, batch: Batch) -> list:
    """[(idx, Admitted)] for the valid requests; the others get their error in the batch."""
    valid = []
    for idx, request in enumerate(data):
        try:
            h = batch.headers[idx]
            valid.append((idx, admit(request, worker.spec, worker.limits, h.content_type, h.accept,
                                     h.v2_header_length, batch.transports[idx])))
        except RequestError as e:
            batch.fail(idx, e)
        except Exception as e:  # our bug, or memory: this request's own 500, never the batch's
            logger.exception("admission of request %d failed unexpectedly", idx)
            batch.fail(idx, ServingError(f"internal error while reading the request: "
                                         f"{type(e).__name__}: {str(e)[:300]}"))
    if len(valid) < len(data):
        logger.info("batch of %d: %d of %d request(s) rejected before inference", len(data),
                    len(data) - len(valid), len(data))
    return valid


def encode_all(valid: list, outputs: list, batch: Batch) -> None:
    for (idx, req), out in zip(valid, outputs):
        if isinstance(out, ServingError):
            batch.fail(idx, out)
            continue
        try:
            batch.answer(idx, req, out)
        except ServingError as e:  # the format refused to answer (a request naming another model)
            batch.fail(idx, e)
        except Exception as e:  # one response that cannot be written fails alone
            logger.exception("encoding the response of request %d failed", idx)
            batch.fail(idx, ServingError(f"internal error while writing the response: "
                                         f"{type(e).__name__}: {str(e)[:300]}"))


def infer(worker: Worker, health: Health, batch: list) -> list:
    """Runs the batch; if it fails, runs each request alone so one bad request fails alone.
    Device faults: handlers/faults.py."""
    try:
        with torch.inference_mode():
            return worker.runner.run(batch)
    except Exception as e:
        if faults.is_sticky(e):
            health.broken(f"{type(e).__name__}: {e}")
            restart.exit_soon(health.reason)
            return [ServingError(f"model execution failed with a device fault; this worker is "
                                 f"restarting: {health.reason}")] * len(batch)
        if faults.is_oom(e):
            faults.release_cache()
        if len(batch) == 1:
            return [_one_failed(worker, e)]
        logger.warning("batch of %d failed (%s); retrying requests one by one", len(batch), e)
    results = []
    for one in batch:
        refusal = health.refusal()
        if refusal is not None:  # a device fault on an earlier one: the context is unusable
            results.append(refusal)
            continue
        out = infer(worker, health, [one])[0]
        # The runner's outputs live in reused buffers until its next call: keep a copy.
        results.append(out if isinstance(out, ServingError) else {k: v.clone() for k, v in out.items()})
    return results


def _one_failed(worker: Worker, e: Exception) -> ServingError:
    """The answer of a single request the model failed on: the client's fault where the model
    itself said so (handlers/faults.client_fault), out of memory, or a 500 naming the error."""
    client = faults.client_fault(e, worker.spec)
    if client is not None:
        logger.warning("request refused by the model itself: %s", client.message)
        return client
    if faults.is_oom(e):
        logger.warning("out of device memory on one request: %s", e)
        return faults.OutOfDeviceMemory(f"out of device memory for this request ({e}); retry later or send fewer rows")
    logger.exception("inference failed")
    return ServingError(f"model execution failed: {type(e).__name__}: {e}")
