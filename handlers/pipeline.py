"""One TorchServe batch through the worker: admit -> run -> encode, exactly one answer per request.

The pipeline knows no server: it is handed each request's body and headers and returns one
answer per request, an encoded reply (wire.base.Encoded) or an error (wire.base.Failed); the
TorchServe adapter sets them on the context (handlers/torchserve/replies.py). The batch's own
state is a local `Batch`, never the handler's: nothing of one batch survives into the next.
Anything that goes wrong becomes the answer of the request it belongs to, or of every request
when it belongs to none.

Per-stage timings (handlers/torchserve/stage_timings.py): TorchServe gauges HandlerDecodeTime, HandlerRunTime,
HandlerEncodeTime and HandlerTime (ms, means over at most handler.stage_metrics_s), and torch.profiler labels
handler.decode / handler.run / handler.encode while a profiler records.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from handlers import faults, timeline
from handlers.wire.request import Request, arrival, read_arrived
from handlers.admission import admit
from handlers.config import HandlerConfig
from handlers.errors import RequestError, ServingError
from handlers.generation.formats import GENERATE_ROUTES
from handlers.loaded import Loaded
from handlers.torchserve.stage_timings import label

logger = logging.getLogger(__name__)
NOT_A_DECODER = ("this model is not a language model: it takes tensors, on /v2/models/NAME/infer or "
                 "/predictions/NAME; the generate routes serve decoders (docs/generation.md)")


class Batch:
    """One TorchServe batch's answers: request idx -> wire.base.Encoded or wire.base.Failed."""

    __slots__ = ("answers", "model_name", "version")

    def __init__(self, n: int, model_name: str, version: str):
        self.answers: list = [None] * n
        self.model_name, self.version = model_name, version

    def fail(self, idx: int, req: Request, err: ServingError) -> None:
        self.answers[idx] = req.error(err, self.model_name, self.version)

    def answer(self, idx: int, req: Request, out: dict) -> None:
        self.answers[idx] = req.encode(out, self.model_name, self.version)

    def fail_all(self, data: list, headers: list, err: ServingError, loaded: Optional[Loaded]) -> list:
        """Every request answered with `err`, each in its transport's shape (its body unread)."""
        cap = loaded.limits.max_json_bytes if loaded else int(HandlerConfig.max_json_mb * (1 << 20))
        for idx, (request, h) in enumerate(zip(data, headers)):
            self.fail(idx, arrival(request, h, cap), err)
        return self.answers


def serve(worker, data: list, headers: list) -> list:
    """The answers to one TorchServe batch (`worker`: handlers/worker.Worker; `headers`: each
    request's handlers.torchserve.headers.RequestHeaders); with the worker's `profile` (a
    factory from stage_timings.batch_profiler), the batch runs under torch.profiler."""
    if worker.profile is not None:
        return _profiled(worker.profile, worker, data, headers)
    return _serve(worker, data, headers)


def _profiled(profile, *args) -> list:
    """The batch under torch.profiler; a trace that cannot be written (a full disk) is logged,
    never the batch's failure."""
    prof = profile()
    prof.__enter__()
    try:
        return _serve(*args)
    finally:
        try:
            prof.__exit__(None, None, None)
        except Exception as e:
            logger.warning("the profiler's trace was not written: %s", e)


def _serve(worker, data: list, headers: list) -> list:
    batch = Batch(len(data), worker.name, worker.version)
    refusal = worker.health.refusal()
    if refusal is not None:
        return batch.fail_all(data, headers, refusal, worker.loaded)
    try:
        _run(worker, data, headers, batch)
    except Exception as e:
        logger.exception("batch failed outside any one request")
        err = ServingError(f"internal error: {type(e).__name__}: {str(e)[:300]}")
        return batch.fail_all(data, headers, err, worker.loaded)
    return batch.answers


def _run(worker, data: list, headers: list, batch: Batch) -> None:
    loaded = worker.loaded
    t0 = time.perf_counter()
    with label("decode"):
        valid = admit_all(loaded, data, headers, batch)
    t1 = time.perf_counter()
    if timeline.ON:
        timeline.mark("decoded")
    if not valid:
        loaded.stages.record(decode=(t1 - t0) * 1000.0, total=(t1 - t0) * 1000.0)
        return
    with label("run"):
        outputs = infer(worker, [req.tensors for _, req in valid])
    t2 = time.perf_counter()
    if timeline.ON:
        timeline.mark("ran")
    with label("encode"):
        encode_all(valid, outputs, batch)
    t3 = time.perf_counter()
    if timeline.ON:
        timeline.mark("encoded")
    loaded.stages.record(decode=(t1 - t0) * 1000.0, run=(t2 - t1) * 1000.0, encode=(t3 - t2) * 1000.0,
                         total=(t3 - t0) * 1000.0)


def admit_all(loaded: Loaded, data: list, headers: list, batch: Batch) -> list:
    """[(idx, admitted wire.request.Request)] for the valid requests; the others get their error in the batch."""
    valid = []
    spec, limits = loaded.spec, loaded.limits
    for idx, request in enumerate(data):
        req = arrival(request, headers[idx], limits.max_json_bytes)
        if headers[idx].generate_route in GENERATE_ROUTES:  # the pod's generate routes serve decoders only: body unread
            batch.fail(idx, req, RequestError(NOT_A_DECODER))
            continue
        read_arrived(req, request, headers[idx], limits)  # never raises: admit raises what it met
        try:
            valid.append((idx, admit(req, spec, limits)))
        except RequestError as e:
            batch.fail(idx, req, e)
        except Exception as e:  # our bug, or memory: this request's own 500, never the batch's
            logger.exception("admission of request %d failed unexpectedly", idx)
            batch.fail(idx, req, ServingError(f"internal error while reading the request: "
                                              f"{type(e).__name__}: {str(e)[:300]}"))
    if len(valid) < len(data):
        logger.info("batch of %d: %d of %d request(s) rejected before inference", len(data),
                    len(data) - len(valid), len(data))
    return valid


def encode_all(valid: list, outputs: list, batch: Batch) -> None:
    for (idx, req), out in zip(valid, outputs):
        if isinstance(out, ServingError):
            batch.fail(idx, req, out)
            continue
        try:
            batch.answer(idx, req, out)
        except ServingError as e:  # the format refused to answer (a request naming another model)
            batch.fail(idx, req, e)
        except Exception as e:  # one response that cannot be written fails alone
            logger.exception("encoding the response of request %d failed", idx)
            batch.fail(idx, req, ServingError(f"internal error while writing the response: "
                                              f"{type(e).__name__}: {str(e)[:300]}"))


def infer(worker, batch: list) -> list:
    """Runs the batch; if it fails, runs each request alone so one bad request fails alone.
    Device faults: handlers/faults.py."""
    try:
        with torch.inference_mode():
            return worker.loaded.runner.run(batch)
    except Exception as e:
        if faults.is_sticky(e):
            reason = f"{type(e).__name__}: {e}"
            worker.broken(reason)
            return [ServingError(f"model execution failed with a device fault; this worker is "
                                 f"restarting: {reason}")] * len(batch)
        if faults.is_oom(e):
            faults.release_cache()
        if len(batch) == 1:
            return [_one_failed(worker.loaded, e)]
        logger.warning("batch of %d failed (%s); retrying requests one by one", len(batch), e)
    results = []
    for one in batch:
        refusal = worker.health.refusal()
        if refusal is not None:  # a device fault on an earlier one: the context is unusable
            results.append(refusal)
            continue
        out = infer(worker, [one])[0]
        # The runner's outputs live in reused buffers until its next call: keep a copy.
        results.append(out if isinstance(out, ServingError) else {k: v.clone() for k, v in out.items()})
    return results


def _one_failed(loaded: Loaded, e: Exception) -> ServingError:
    """The answer of a single request the model failed on: the client's fault where the model
    itself said so (handlers/faults.client_fault), out of memory, or a 500 naming the error."""
    client = faults.client_fault(e, loaded.spec)
    if client is not None:
        logger.warning("request refused by the model itself: %s", client.message)
        return client
    if faults.is_oom(e):
        logger.warning("out of device memory on one request: %s", e)
        return faults.OutOfDeviceMemory.for_request(e)
    logger.exception("inference failed")
    return ServingError(f"model execution failed: {type(e).__name__}: {e}")
