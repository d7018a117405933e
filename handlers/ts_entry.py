"""TorchServe entry point: a thin BaseHandler subclass wiring admission -> run -> encode.

The archive copies this file to the model directory's top level (TorchServe imports the
handler by file name) next to the `handlers` package, hence the absolute imports.

Per-stage timings (handlers/stage_timings.py): TorchServe gauges HandlerDecodeTime, HandlerRunTime,
HandlerEncodeTime (ms, means over at most handler.stage_metrics_s; README), and torch.profiler
labels handler.decode / handler.run / handler.encode while a profiler records.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import torch
from ts.torch_handler.base_handler import BaseHandler

from handlers import faults, frontend_frames, oip, safetensors_io, scratch, threads
from handlers.admission import Limits, admit
from handlers.batch import warmup_sizes
from handlers.config import HandlerConfig, parse_config
from handlers.envelope import refuse_envelope
from handlers.errors import LoadError, ModelLoadFailed, RequestError, ServingError
from handlers.kinds import kind_of
from handlers.load import load_artifact
from handlers.probe import probe_once
from handlers.run import runner_for
from handlers.stage_timings import StageTimes, label
from handlers.variants import choose_variant
from handlers.wire.v2_binary import HEADER as V2_HEADER_LENGTH

logger = logging.getLogger(__name__)

# The request bytes of one warm-up batch through handle() at most (see _warm_up_request_path).
WARMUP_BATCH_BYTES = 64 << 20


def _headers(context, idx: int, *names: str) -> list:
    """Values of `names` for request idx (None where absent). Content-Type may arrive per body
    part (REST) or as a request header, in any case."""
    try:
        headers = context.get_all_request_header(idx) or {}
    except (AttributeError, IndexError, TypeError):
        return [None] * len(names)
    parts = [headers[p] for p in ("body", "data") if isinstance(headers.get(p), dict)]
    lowered = {k.lower(): v for k, v in headers.items() if isinstance(k, str) and isinstance(v, str)}
    out = []
    for name in names:
        key = name.lower()
        out.append(next((p[key] for p in parts if p.get(key)), None) or lowered.get(key))
    return out


class CompiledModelHandler(BaseHandler):
    def __init__(self):
        super().__init__()
        self.initialized = False
        self.load_error = None  # a LoadError: this worker answers every request with it
        self.broken = None  # a sticky device fault: the worker is exiting (handlers/faults.py)
        self.limits = None  # set by a load that got as far as reading the artifact's contract
        self._grpc, self._failed = {}, []  # per batch: gRPC request idx -> id; errors answered
        self.stages = StageTimes(self._metric, HandlerConfig.stage_metrics_s)

    def initialize(self, context):
        # JSON bodies as bytes, so admission can refuse a large one before parsing; TorchServe
        # 0.12's worker reads this variable per request (ts/protocol/otf_message_handler.py).
        os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
        scratch.enter()
        self.context = context
        self.model_name = context.manifest.get("model", {}).get("modelName", "model")
        self.model_version = str(context.manifest.get("model", {}).get("modelVersion") or "")
        # A server setting, not the archive: it fails the load (and shows in TorchServe's status)
        refuse_envelope()  # first: a TorchServe request envelope would break every batch
        try:
            self._load(context)
        except LoadError as e:
            # It would fail the same way on every restart (an incompatible, corrupt or
            # misconfigured artifact): raising makes TorchServe restart the worker with back-off
            # while requests wait unanswered (measured: none answered in 420 s). Come up instead
            # and answer each request 503 with the reason; TorchServe lists the worker READY, the
            # handler's description says ready: false (README, "A model that cannot load").
            config = getattr(self, "config", None)
            if not e.recurs or (config is not None and not config.answer_load_failure):
                raise
            logger.error("load failed (%s); every request will be answered 503 with the reason: %s",
                         type(e).__name__, e)
            self.load_error = ModelLoadFailed(f"model {self.model_name!r} failed to load: {e.message}")
            self._metric("ModelLoadFailed", 1.0)
        self.initialized = True  # last: loaded, or answering with the load error

    def describe_handle(self):
        """`GET /models/NAME?customized=true` (management API) shows this as customizedMetadata."""
        return json.dumps({"ready": self.load_error is None and self.broken is None,
                           "load_error": self.load_error.message if self.load_error else None,
                           "device_fault": self.broken})

    def _load(self, context):
        t0 = time.perf_counter()
        props = context.system_properties
        self.config = parse_config(getattr(context, "model_yaml_config", None))
        self.stages = StageTimes(self._metric, self.config.stage_metrics_s)
        # Undo what importing TorchServe's base_handler did (TF32 for all fp32 matmuls), so an
        # fp32 artifact answers like the model it was compiled from; see HandlerConfig.
        torch.set_float32_matmul_precision(self.config.float32_matmul_precision)
        spec, placement, notes = choose_variant(props["model_dir"], props.get("gpu_id"), self.config)
        for note in notes:
            logger.warning("%s", note)
        model_yaml = getattr(context, "model_yaml_config", None) or {}
        workers = threads.workers_from_yaml(model_yaml)
        budget = threads.apply(threads.decide(placement.kind, self.config.cpu_threads, workers,
                                              threads.usable_cores()))
        sync_why = ""
        if placement.kind == "cuda":
            gpus = len(model_yaml.get("deviceIds") or ()) or torch.cuda.device_count()
            sync, sync_why = threads.cuda_wait(self.config.cuda_sync, workers, gpus)
            self.config = dataclasses.replace(self.config, cuda_sync=sync)
        _, probe_note = (probe_once(spec, placement, self.config, budget)
                               if self.config.crash_safe_load else (0.0, "no trial load"))
        self.spec = spec
        self.limits = Limits.of(self.config, spec)
        self.model = load_artifact(spec, placement, self.config)
        self.device = placement.torch_device
        self.runner = runner_for(self.model, spec, self.device, self.config)
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        if self.config.warmup:
            self._warm_up()
        graphs_note = self.runner.prepare(self.config, kind_of(spec))
        if self.config.warmup:
            self._warm_up_request_path(context)
            self.stages.reset()  # the gauges' first means are the clients' batches
        warm_s = time.perf_counter() - t1
        reader = frontend_frames.install(self.config.buffered_reader)
        cc = (".".join(map(str, torch.cuda.get_device_capability(self.device)))
              if placement.kind == "cuda" else None)
        logger.info(
            "loaded %s artifact %s (%s) on %s [%s]; compute capability %s; load %.2fs "
            "(%s), warm-up %.2fs; inputs %s; batch range [%d, %d]; "
            "fp32 matmul precision %s; CPU threads: %s; %s%s; %s; %s",
            spec.backend, spec.artifact, self.model.loader, placement, placement.note, cc or "n/a",
            load_s, probe_note, warm_s, ", ".join(s.describe() for s in spec.inputs),
            spec.batch_min, spec.batch_max, torch.get_float32_matmul_precision(), budget.describe(),
            graphs_note, self.runner.describe_sync() + (f" ({sync_why})" if sync_why else ""),
            self.limits.values.describe() + (f"; padding {self.runner.pad.describe()}" if self.runner.pad else ""),
            reader)
        self._metric("ArtifactLoadTime", load_s * 1000.0)
        self._metric("ArtifactWarmupTime", warm_s * 1000.0)

    def _metric(self, name, ms):
        try:
            self.context.metrics.add_time(name, ms, None, "ms")
        except Exception as e:  # metrics must never fail a load or a request
            logger.debug("metric %s not recorded: %s", name, e)

    def _zeros(self, rows: int) -> dict:
        return self.spec.example(rows)

    def _warm_up(self) -> None:
        """The model across a few batch sizes: kernels, allocator, staging buffers."""
        for size in warmup_sizes(self.spec.batch_min, self.spec.batch_max, self.config.warmup_batch_sizes):
            with torch.inference_mode():
                self.runner.run([self._zeros(size)])
        # every length bucket (padding), or the longest request: the allocator sees its blocks now
        pad = self.runner.pad
        lengths = ([{d: b for d in pad.buckets} for b in sorted({b for v in pad.buckets.values() for b in v})]
                   if pad else [{k: hi for k, (_lo, hi) in self.spec.dims.items()}] if self.spec.dims else [])
        for sizes in lengths:
            sizes = {d: min(n, self.spec.dims[d][1]) for d, n in sizes.items()}
            with torch.inference_mode():
                self.runner.run([self.spec.example(self.spec.batch_min, sizes=sizes)])

    def _warm_up_request_path(self, context) -> None:
        """Requests through handle(), set up as TorchServe's Service.predict sets up a batch
        (request ids, per-request headers, metrics ids), so the first client request pays no
        first-execution cost: metric objects, profiler labels, header parsing, admission, runner
        and encoders (measured without this: 1.2-1.3x a steady request).

        One JSON request (where one could pass max_json_mb), then binary batches at every CUDA
        graph bucket (each bucket's upload and replay through the request path; without graphs,
        the warm-up sizes) up to WARMUP_BATCH_BYTES, largest first, ending with the smallest,
        repeated: the fast path is the last one in the CPU caches (the JSON request's 150k-float
        list evicts them) and the interpreter has specialized it (measured on the CI CPU, first
        call over steady at batch 1, median of 12 loads, two runs: 1.21-1.24x with one binary
        call, 1.07-1.09x with eight). Stage timings are emitted as request "warmup"; the
        context's batch state is restored afterwards."""
        rows = self.spec.batch_min
        zeros = self._zeros(rows)
        binary = safetensors_io.dumps(zeros)
        cases = []
        # JSON spells each element in at least as many bytes as the binary body holds it: where
        # the binary body is over max_json_mb, every JSON request is refused (413) before parsing
        if len(binary) <= self.config.max_json_mb * 2**20:
            cases.append((1, {"inputs": {k: v.tolist() for k, v in zeros.items()}}, "application/json"))
        sizes = set(self.runner.bucket_sizes() or warmup_sizes(
            self.spec.batch_min, self.spec.batch_max, self.config.warmup_batch_sizes))
        for size in sorted(sizes | {rows}, reverse=True):
            n = max(1, size // rows)
            # Every answer of a batch is encoded into a buffer of its own: a batch of large
            # frames (a 4K fp32 frame is 99.5 MB) would hold GBs at load, so those stay small.
            if n == 1 or n * len(binary) <= WARMUP_BATCH_BYTES:
                cases.append((n, binary, safetensors_io.CONTENT_TYPE))
        # The interpreter specializes code only after it has run a few times (CPython 3.11
        # quickens a code object after 8 calls; 3.12 specializes an instruction on its second
        # run): the smallest binary batch, the latency-bound case, runs 8 times in all.
        cases += cases[-1:] * 7
        metrics = getattr(context, "metrics", None)
        saved = (context.request_ids, context.request_processor, getattr(metrics, "request_ids", None))
        try:
            for n, body, content_type in cases:
                self._warm_up_batch(context, n, body, content_type)
        finally:
            context.request_ids, context.request_processor = saved[0], saved[1]
            if metrics is not None:
                metrics.request_ids = saved[2]

    def _warm_up_batch(self, context, n: int, body, content_type: str) -> None:
        """`n` copies of one request through handle(); a failed answer fails the load."""
        from ts.context import RequestProcessor

        context.request_ids = {i: "warmup" for i in range(n)}
        context.request_processor = [RequestProcessor({"body": {"content-type": content_type}}) for _ in range(n)]
        if getattr(context, "metrics", None) is not None:
            context.metrics.request_ids = context.request_ids
        out = self.handle([{"body": body} for _ in range(n)], context)
        for i in range(n):
            status = context.get_response_status(i)[0]
            if status not in (None, 200):
                err = LoadError(f"the warm-up request ({content_type}, batch of {n}) failed: {out[i]}")
                # a 5xx (device memory while several workers start, say) may pass on a
                # restart: let TorchServe restart the worker instead of answering 503 forever
                err.recurs = status < 500
                raise err

    def _fail(self, context, idx, err: ServingError):
        self._failed.append(err)
        context.set_response_status(err.status, err.error_type, idx)
        context.set_response_content_type(idx, "application/json")
        if idx in self._grpc:
            return oip.error_reply(err, self._grpc[idx], self.model_name, self.model_version)
        return json.dumps(err.to_dict())

    def _infer(self, batch: list) -> list:
        """Runs the batch; if it fails, runs each request alone so one bad request fails alone.
        Device faults: handlers/faults.py."""
        try:
            with torch.inference_mode():
                return self.runner.run(batch)
        except Exception as e:
            if faults.is_sticky(e):
                self.broken = f"{type(e).__name__}: {e}"
                faults.exit_soon(self.broken)
                return [ServingError(f"model execution failed with a device fault; this worker is "
                                     f"restarting: {self.broken}")] * len(batch)
            if faults.is_oom(e):
                faults.release_cache()
            if len(batch) == 1:
                client = faults.client_fault(e, self.spec)
                if client is not None:
                    logger.warning("request refused by the model itself: %s", client.message)
                    return [client]
                if faults.is_oom(e):
                    logger.warning("out of device memory on one request: %s", e)
                    return [faults.OutOfDeviceMemory(f"out of device memory for this request ({e}); "
                                                     "retry later or send fewer rows")]
                logger.exception("inference failed")
                return [ServingError(f"model execution failed: {type(e).__name__}: {e}")]
            logger.warning("batch of %d failed (%s); retrying requests one by one", len(batch), e)
        results = []
        for one in batch:
            if self.broken:  # a device fault on an earlier one: the context is unusable
                results.append(faults.WorkerRestarting(f"this worker hit a device fault and is "
                                                       f"restarting: {self.broken}"))
                continue
            out = self._infer([one])[0]
            # The runner's outputs live in reused buffers until its next call: keep a copy.
            results.append(out if isinstance(out, ServingError) else {k: v.clone() for k, v in out.items()})
        return results

    def _admit_all(self, data, context, results) -> list:
        """[(idx, Admitted)] for the valid requests; the others get their error in results."""
        valid = []
        for idx, request in enumerate(data):
            try:
                content_type, accept, v2_length = _headers(context, idx, "Content-Type", "Accept",
                                                           V2_HEADER_LENGTH)
                valid.append((idx, admit(request, self.spec, self.limits, content_type, accept, v2_length)))
            except RequestError as e:
                results[idx] = self._fail(context, idx, e)
            except Exception as e:  # our bug, or memory: this request's own 500, never the batch's
                logger.exception("admission of request %d failed unexpectedly", idx)
                results[idx] = self._fail(context, idx, ServingError(
                    f"internal error while reading the request: {type(e).__name__}: {str(e)[:300]}"))
        if len(valid) < len(data):
            logger.info("batch of %d: %d of %d request(s) rejected before inference", len(data),
                        len(data) - len(valid), len(data))
        return valid

    def _encode_all(self, valid, outputs, context, results) -> None:
        for (idx, req), out in zip(valid, outputs):
            if isinstance(out, ServingError):
                results[idx] = self._fail(context, idx, out)
                continue
            try:
                if idx in self._grpc:
                    body, content_type = oip.reply(out, req.request_id, self.model_name,
                                                   self.model_version), "application/json"
                else:
                    body, content_type = req.encode(out, self.model_name)
            except Exception as e:  # one response that cannot be written fails alone
                logger.exception("encoding the response of request %d failed", idx)
                results[idx] = self._fail(context, idx, ServingError(
                    f"internal error while writing the response: {type(e).__name__}: {str(e)[:300]}"))
                continue
            if idx not in self._grpc:
                for key, value in req.respond_as.response_headers.items():
                    context.set_response_header(idx, key, value)
            context.set_response_content_type(idx, content_type)
            results[idx] = body

    def handle(self, data, context):
        """Raises only through _finish (a batch of OIP gRPC calls that all failed: the exception
        is their answer). Anything else that goes wrong becomes the answer of the request it
        belongs to, or of every request when it belongs to none, never an exception that would
        fail the whole TorchServe batch with 503."""
        self.context = context
        if self._is_describe():
            return [self.describe_handle()]
        self._failed = []
        try:
            json_cap = self.limits.max_json_bytes if self.limits else int(HandlerConfig.max_json_mb * (1 << 20))
            self._grpc = {i: oip.request_id(r) for i, r in enumerate(data)
                          if oip.is_grpc(context, i, r, json_cap)}
        except Exception:  # a malformed gRPC request: answered below as REST, with its error
            logger.exception("could not tell gRPC requests apart")
            self._grpc = {}
        refusal = self.load_error or (self.broken and faults.WorkerRestarting(
            f"this worker hit a device fault and is restarting: {self.broken}"))
        if refusal:
            return self._finish([self._fail(context, idx, refusal) for idx in range(len(data))])
        try:
            results = self._handle(data, context)
        except Exception as e:
            logger.exception("batch failed outside any one request")
            err, self._failed = ServingError(f"internal error: {type(e).__name__}: {str(e)[:300]}"), []
            results = [self._fail(context, idx, err) for idx in range(len(data))]
        return self._finish(results)

    def _handle(self, data, context) -> list:
        results = [None] * len(data)
        t0 = time.perf_counter()
        with label("decode"):
            valid = self._admit_all(data, context, results)
        t1 = time.perf_counter()
        if not valid:
            self.stages.record(decode=(t1 - t0) * 1000.0)
            return results
        with label("run"):
            outputs = self._infer([req.tensors for _, req in valid])
        t2 = time.perf_counter()
        with label("encode"):
            self._encode_all(valid, outputs, context, results)
        self.stages.record(decode=(t1 - t0) * 1000.0, run=(t2 - t1) * 1000.0,
                           encode=(time.perf_counter() - t2) * 1000.0)
        return results

    def _finish(self, results: list) -> list:
        """A batch of gRPC requests that all failed raises, so each call gets a real status."""
        if self._grpc and len(self._grpc) == len(self._failed) == len(results):
            raise oip.batch_failure(self._failed)
        return results
