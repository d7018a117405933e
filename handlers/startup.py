"""A worker's start: config -> variant -> thread budget and GPU wait -> trial load -> load ->
runner -> warm-up, once, into a `Worker` (handlers/worker.py), and the one load line that says
what was chosen and why."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

import torch

from handlers import process
from handlers.admission import Limits
from handlers.artifact.kinds import kind_of
from handlers.artifact.load import load_artifact
from handlers.artifact.probe import probe_once
from handlers.artifact.room import reserved as gpu_room
from handlers.artifact.state import require_checked
from handlers.artifact.variants import choose_variant
from handlers.batch import warmup_sizes
from handlers.config import parse_config
from handlers.errors import LoadError
from handlers.run import runner_for
from handlers.run.cuda import CudaRunner
from handlers.run.padding import verify_padding
from handlers.torchserve import frontend_frames, idle, restart, scratch, threads
from handlers.torchserve.envelope import refuse_envelope
from handlers.torchserve.stage_timings import StageTimes
from handlers.wire import safetensors_io
from handlers.worker import Worker

logger = logging.getLogger(__name__)

# The request bytes of one warm-up batch through handle() at most (see warm_up_request_path).
WARMUP_BATCH_BYTES = 64 << 20


class StartSteps:
    """Seconds per step of a worker's start, in order: the load line's breakdown and the
    WorkerStartTime metric. The first step, the process's age when the handler's start began,
    is the interpreter, TorchServe's and torch's imports and the frontend's load message."""

    def __init__(self):
        before = process.age_s()
        self.times = {"process and imports": before} if before is not None else {}
        self._t = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self._t
        self._t = now

    def total(self) -> float:
        return sum(self.times.values())

    def describe(self) -> str:
        return (f"{self.total():.2f}s" + (" since the process began" if "process and imports" in self.times else "")
                + " (" + ", ".join(f"{k} {v:.2f}s" for k, v in self.times.items()) + ")")


def enter_process() -> None:
    """What the worker sets in its process before loading: TorchServe's request decoding, the
    scratch directory for native loaders, and the refusal of a request envelope."""
    # JSON bodies as bytes, so admission can refuse a large one before parsing; TorchServe
    # 0.12's worker reads this variable per request (ts/protocol/otf_message_handler.py).
    os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
    process.record("TS_DECODE_INPUT_REQUEST", "false (JSON bodies reach the handler as bytes)")
    scratch.enter()
    # A server setting, not the archive: it fails the load (and shows in TorchServe's status);
    # a TorchServe request envelope would break every batch
    refuse_envelope()


def load_failure(e: Exception) -> LoadError:
    """What a failed start raises to TorchServe: a LoadError as it is, any other exception as a
    LoadError naming it (type, message) that TorchServe restarts. TorchServe 0.12's worker
    (ts/model_service_worker.py load_model) answers a RuntimeError whose text holds "CUDA" (a
    device-side assert, a cuDNN failure) and any MemoryError with "System out of memory" (507)
    and logs "cuda OOM"; a LoadError is neither, so the worker's log carries the real cause and
    its traceback ("Backend worker process died") and the frontend starts a fresh worker."""
    if isinstance(e, LoadError):
        return e
    text = str(e).strip() or "(no message)"
    err = LoadError(f"the worker's start failed with {type(e).__name__}: {text}")
    err.recurs = False  # not known to recur: a restart may pass (a capture, memory while workers start)
    return err


def answers_load_failure(context) -> bool:
    """handler.answer_load_failure of the archive; where the config itself is what failed,
    the default (answer)."""
    try:
        return parse_config(getattr(context, "model_yaml_config", None)).answer_load_failure
    except LoadError:
        return True


def start(context, metric, serving, handle) -> Worker:
    """The loaded, warmed-up worker; raises LoadError with what the artifact needs, what the
    machine has and the fix. `serving(worker)` is called once the model is loaded, before the
    request-path warm-up sends requests through the entry's `handle(data, context)`."""
    steps = StartSteps()
    props, yaml_config = context.system_properties, getattr(context, "model_yaml_config", None) or {}
    config = parse_config(yaml_config)
    # The archive's precision, whatever else in the process set (importing TorchServe's
    # base_handler switches fp32 matmuls to TF32), so an fp32 artifact answers like the model
    # it was compiled from; see HandlerConfig.
    torch.set_float32_matmul_precision(config.float32_matmul_precision)
    process.record("torch fp32 matmul precision", config.float32_matmul_precision)
    spec, placement, notes = choose_variant(props["model_dir"], props.get("gpu_id"), config)
    require_checked(spec, kind_of(spec))  # a program that writes state between calls is never served as stateless
    for note in notes:
        logger.warning("%s", note)
    workers = threads.workers_from_yaml(yaml_config)
    # before the trial load takes GPU memory; reserved until this start is over (siblings count it)
    with gpu_room(config.worker_gpu_mb, placement, workers, ledger_dir=scratch.shared_root()):
        return _load_and_warm(context, metric, serving, handle, steps, config, (spec, placement, workers))


def _load_and_warm(context, metric, serving, handle, steps, config, chosen) -> Worker:
    """start()'s load, checks and warm-up; `chosen`: the variant's spec, its placement and the
    model's worker count."""
    spec, placement, workers = chosen
    yaml_config = getattr(context, "model_yaml_config", None) or {}
    budget = threads.apply(threads.decide(placement.kind, config.cpu_threads, workers, threads.usable_cores()))
    sync_why = ""
    if placement.kind == "cuda":
        gpus = len(yaml_config.get("deviceIds") or ()) or torch.cuda.device_count()
        sync, sync_why = threads.cuda_wait(config.cuda_sync, workers, gpus)
        config = dataclasses.replace(config, cuda_sync=sync)
    steps.done("variant")
    _, probe_note = probe_once(spec, placement, config, budget, scratch.shared_root()) if config.crash_safe_load else (0.0, "no trial load")
    steps.done("trial load")
    model = load_artifact(spec, placement, config)
    worker = Worker(config=config, spec=spec, limits=Limits.of(config, spec), model=model,
                    runner=runner_for(model, spec, placement.torch_device, config),
                    device=placement.torch_device, stages=StageTimes(metric, config.stage_metrics_s))
    # declared padding must leave answers unchanged before any client's request is padded
    pad_note = verify_padding(model, worker.runner, spec, placement.torch_device) if worker.runner.pad else ""
    steps.done("load")
    serving(worker)
    reader = frontend_frames.install(config.buffered_reader)
    graphs_note, deferred = prepare_graphs(worker, kind_of(spec), steps)
    if config.warmup:
        warm_up_request_path(worker, context, handle, smallest_only=deferred)
        worker.stages.reset()  # the gauges' first means are the clients' batches
        steps.done("request-path warm-up")
    _log_loaded(worker, placement, budget, (probe_note, graphs_note, pad_note), sync_why, reader, steps)
    if deferred:
        defer_graphs(worker)
    metric("ArtifactLoadTime", sum(steps.times.get(k, 0.0) for k in ("variant", "trial load", "load")) * 1000.0)
    metric("ArtifactWarmupTime", sum(steps.times.get(k, 0.0) for k in ("warm-up", "CUDA graphs",
                                                                       "request-path warm-up")) * 1000.0)
    metric("WorkerStartTime", steps.total() * 1000.0)
    return worker


def _log_loaded(worker, placement, budget, notes, sync_why, reader, steps) -> None:
    """The load line; `notes`: the trial load's, the CUDA graphs' and the padding check's."""
    spec, runner = worker.spec, worker.runner
    probe_note, graphs_note, pad_note = notes
    cc = (".".join(map(str, torch.cuda.get_device_capability(worker.device)))
          if placement.kind == "cuda" else None)
    logger.info(
        "loaded %s artifact %s (%s) on %s [%s]; compute capability %s; started in %s; %s; "
        "inputs %s; batch range [%d, %d]; "
        "fp32 matmul precision %s; CPU threads: %s; %s%s; %s; %s",
        spec.backend, spec.artifact, worker.model.loader, placement, placement.note, cc or "n/a",
        steps.describe(), probe_note, ", ".join(s.describe() for s in spec.inputs),
        spec.batch_min, spec.batch_max, torch.get_float32_matmul_precision(), budget.describe(),
        graphs_note, runner.describe_sync() + (f" ({sync_why})" if sync_why else ""),
        worker.limits.values.describe() + (f"; padding {runner.pad.describe()}, {pad_note}" if runner.pad else ""),
        reader)
    logger.info("process-wide changes: %s", process.describe())


def between_batches_hook() -> bool:
    """Whether this worker's loop reads its messages with frontend_frames.retrieve_msg, which
    runs the work deferred between batches (torchserve/restart.py, idle.py) each time the loop
    is back for its next message: TorchServe's own reader, its async worker and a handler
    driven in-process (tests, bench.bench) never get there."""
    main = sys.modules.get("__main__")
    return getattr(main, "retrieve_msg", None) is frontend_frames.retrieve_msg


def prepare_graphs(worker: Worker, kind, steps: StartSteps) -> tuple:
    """Warm-up and CUDA graphs before the worker is ready: (the load line's graphs note, whether
    the capture was deferred). With `cuda_graphs: auto`, a model whose graphs can be captured
    and a CUDA worker whose loop runs work between batches, the graphs are captured after ready (defer_graphs) and the warm-up runs
    the smallest batch only (each graph's capture first runs its own shape on the worker's
    stream, as the warm-up would); otherwise as before: the warm-up's batch sizes, then every
    capture."""
    config = worker.config
    defer = isinstance(worker.runner, CudaRunner) and worker.runner.defers(config, kind) and between_batches_hook()
    if config.warmup:
        warm_up(worker, smallest_only=defer)
        steps.done("warm-up")
    note = worker.runner.prepare(config, kind, defer=True) if defer else worker.runner.prepare(config, kind)
    steps.done("CUDA graphs")
    return note, defer and worker.runner.deferred is not None


def defer_graphs(worker: Worker) -> None:
    """The deferred captures, one shape per step between batches (idle.py: only while no next
    message has begun to arrive; a message that arrives during a step waits for that one
    capture). Calls run plainly until their shape's graph is captured and verified. Logs when
    done: how long since ready, how many calls ran plainly meanwhile, what was kept and what
    fell back. A sticky CUDA error during a capture exits the worker (restart.exit_soon), as
    one in a batch does: TorchServe starts a fresh one."""
    runner, t0 = worker.runner, time.perf_counter()
    runner.plain_calls = 0  # the clients' calls only: the request-path warm-up ran before ready

    def step() -> bool:
        try:
            note = runner.capture_next()
        except Exception as e:  # noqa: BLE001  (sticky: capture_next raises nothing else; the context is unusable)
            logger.critical("CUDA graph capture after ready hit a device fault: %s: %s", type(e).__name__, e)
            restart.exit_soon(f"CUDA graph capture after ready: {type(e).__name__}: {e}")
            return False
        if note is None:
            return True
        logger.info("CUDA graphs after ready: done in %.2fs, %d call(s) ran without a graph meanwhile; %s",
                    time.perf_counter() - t0, runner.plain_calls, note)
        return False

    idle.defer(step)


def warm_up(worker: Worker, smallest_only: bool = False) -> None:
    """The model across a few batch sizes (`smallest_only`: the smallest accepted batch):
    kernels, allocator, staging buffers; then every length bucket at that batch. Its inputs are
    valid requests (ArtifactSpec.example: ids inside their ranges, per column; masks all ones),
    never all zeros: a fully masked row or an id outside its table is what kernels fail on."""
    spec, runner = worker.spec, worker.runner
    sizes = warmup_sizes(spec.batch_min, spec.batch_max, worker.config.warmup_batch_sizes)
    for size in sizes[:1] if smallest_only else sizes:
        with torch.inference_mode():
            runner.run([spec.example(size)])
    # every length bucket (padding), or the longest request: the allocator sees its blocks now
    pad = runner.pad
    lengths = ([{d: b for d in pad.buckets} for b in sorted({b for v in pad.buckets.values() for b in v})]
               if pad else [{k: hi for k, (_lo, hi) in spec.dims.items()}] if spec.dims else [])
    for sizes in lengths:
        sizes = {d: min(n, spec.dims[d][1]) for d, n in sizes.items()}
        with torch.inference_mode():
            runner.run([spec.example(spec.batch_min, sizes=sizes)])


def warm_up_request_path(worker: Worker, context, handle, smallest_only: bool = False) -> None:
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
    context's batch state is restored afterwards. `smallest_only` (CUDA graphs captured after
    ready): the JSON request and the smallest binary batch only."""
    spec, config = worker.spec, worker.config
    rows = spec.batch_min
    example = spec.example(rows)  # a valid request (ids in range, masks of ones)
    binary = safetensors_io.dumps(example)
    cases = []
    # JSON spells each element in at least as many bytes as the binary body holds it: where
    # the binary body is over max_json_mb, every JSON request is refused (413) before parsing
    if len(binary) <= config.max_json_mb * 2**20:
        cases.append((1, {"inputs": {k: v.tolist() for k, v in example.items()}}, "application/json"))
    sizes = set() if smallest_only else set(worker.runner.bucket_sizes() or warmup_sizes(
        spec.batch_min, spec.batch_max, config.warmup_batch_sizes))
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
            _warm_up_batch(context, handle, n, body, content_type)
    finally:
        context.request_ids, context.request_processor = saved[0], saved[1]
        if metrics is not None:
            metrics.request_ids = saved[2]


def _warm_up_batch(context, handle, n: int, body, content_type: str) -> None:
    """`n` copies of one request through handle(); a failed answer fails the load."""
    from ts.context import RequestProcessor

    context.request_ids = {i: "warmup" for i in range(n)}
    context.request_processor = [RequestProcessor({"body": {"content-type": content_type}}) for _ in range(n)]
    if getattr(context, "metrics", None) is not None:
        context.metrics.request_ids = context.request_ids
    out = handle([{"body": body} for _ in range(n)], context)
    for i in range(n):
        status = context.get_response_status(i)[0]
        if status not in (None, 200):
            err = LoadError(f"the warm-up request ({content_type}, batch of {n}) failed: {out[i]}")
            # a 5xx (device memory while several workers start, say) may pass on a
            # restart: let TorchServe restart the worker instead of answering 503 forever
            err.recurs = status < 500
            raise err
