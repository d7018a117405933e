"""A loaded worker's warm-up before it reports ready: the model across a few batch sizes and
every length bucket, its CUDA graphs (in the engine: handlers/engine), and
requests through the whole TorchServe request path (handlers/torchserve/exchange.py), so the
first client request pays no first-execution cost. handlers/worker.py runs these in order."""
from __future__ import annotations

import torch

from handlers.artifact.kinds import kind_of
from handlers.batch import warmup_sizes
from handlers.run.warm import warm
from handlers.errors import LoadError
from handlers.loaded import Loaded
from handlers.torchserve import exchange
from handlers.wire import safetensors_io

# The request bytes of one warm-up batch through the request path at most (see request_path).
WARMUP_BATCH_BYTES = 64 << 20


def model_and_graphs(loaded: Loaded, steps) -> None:
    """Warm-up at the warm-up's batch sizes, then the runner's preparation (the load line's
    graphs note goes to `steps`)."""
    config, runner, kind = loaded.config, loaded.runner, kind_of(loaded.spec)
    if config.warmup:
        model(loaded)
        steps.done("warm-up")
    steps.note("graphs", runner.prepare(config, kind))
    steps.done("CUDA graphs")


def decoder(loaded: Loaded, steps) -> None:
    """A decoder's warm-up: a generation of a few tokens from a prompt of the longest chunk one
    call takes (kernels and allocator for both shapes), then the decode step's CUDA graph."""
    from handlers.generation import loop
    from handlers.generation.request import GenerateRequest, Params

    runner = loaded.runner
    if loaded.config.warmup:
        n = max(1, min(runner.dec.chunk_max, runner.dec.cache_length - 4))
        req = GenerateRequest(None, [i % runner.dec.vocab for i in range(n)], Params(max_tokens=3, ignore_eos=True))
        for _ in loop.generate(runner, req, loop.Plan(req.ids, 3, frozenset()), None):
            pass
        steps.done("warm-up")
    steps.note("graphs", runner.capture(loaded.config.cuda_graphs))
    steps.done("CUDA graphs")


def slots(loaded: Loaded, steps, broken) -> None:
    """A slot decoder's warm-up (handlers/generation/engine.warm), the steps' CUDA graphs, the
    prompt budget per turn timed on this device (measure_budget), then the engine's thread."""
    from handlers.generation.engine import measure_budget, warm as warm_slots

    runner, cont = loaded.runner, loaded.generation
    if loaded.config.warmup:
        warm_slots(runner)
        steps.done("warm-up")
    steps.note("graphs", runner.capture(loaded.config.cuda_graphs))
    steps.done("CUDA graphs")
    cont.start(*measure_budget(runner), broken)


def model(loaded: Loaded) -> None:
    """The model across a few batch sizes and every length bucket (handlers/run/warm.py)."""
    warm(loaded.spec, loaded.runner, loaded.config.warmup_batch_sizes)


def request_path(worker, context) -> None:
    """Requests through the worker's TorchServe exchange, set up as TorchServe's Service.predict
    sets up a batch (request ids, per-request headers, metrics ids), so the first client request
    pays no first-execution cost: metric objects, profiler labels, header parsing, admission,
    runner and encoders (measured without this: 1.2-1.3x a steady request).

    One JSON request (where one could pass max_json_mb), then binary batches at every CUDA
    graph bucket (each bucket's upload and replay through the request path; without graphs,
    the warm-up sizes) up to WARMUP_BATCH_BYTES, largest first, ending with the smallest,
    repeated: the fast path is the last one in the CPU caches (the JSON request's 150k-float
    list evicts them) and the interpreter has specialized it (measured on the CI CPU, first
    call over steady at batch 1, median of 12 loads, two runs: 1.21-1.24x with one binary
    call, 1.07-1.09x with eight). Stage timings are emitted as request "warmup"; the
    context's batch state is restored afterwards."""
    cases = _cases(worker.loaded)
    metrics = getattr(context, "metrics", None)
    saved = (context.request_ids, context.request_processor, getattr(metrics, "request_ids", None))
    try:
        for n, body, content_type in cases:
            _batch(worker, context, n, body, content_type)
    finally:
        context.request_ids, context.request_processor = saved[0], saved[1]
        if metrics is not None:
            metrics.request_ids = saved[2]
    worker.loaded.stages.reset()  # the gauges' first means are the clients' batches


def _cases(loaded: Loaded) -> list:
    """(copies, body, content type) of each warm-up batch, in order."""
    spec, config = loaded.spec, loaded.config
    rows = spec.batch_min
    example = spec.example(rows)  # a valid request (ids in range, masks of ones)
    binary = safetensors_io.dumps(example)
    cases = []
    # JSON spells each element in at least as many bytes as the binary body holds it: where
    # the binary body is over max_json_mb, every JSON request is refused (413) before parsing
    if len(binary) <= config.max_json_mb * 2**20:
        cases.append((1, {"inputs": {k: v.tolist() for k, v in example.items()}}, "application/json"))
    sizes = set(loaded.runner.bucket_sizes() or warmup_sizes(spec.batch_min, spec.batch_max,
                                                             config.warmup_batch_sizes))
    for size in sorted(sizes | {rows}, reverse=True):
        n = max(1, size // rows)
        # Every answer of a batch is encoded into a buffer of its own: a batch of large
        # frames (a 4K fp32 frame is 99.5 MB) would hold GBs at load, so those stay small.
        if n == 1 or n * len(binary) <= WARMUP_BATCH_BYTES:
            cases.append((n, binary, safetensors_io.CONTENT_TYPE))
    # The interpreter specializes code only after it has run a few times (CPython 3.11
    # quickens a code object after 8 calls; 3.12 specializes an instruction on its second
    # run): the smallest binary batch, the latency-bound case, runs 8 times in all.
    return cases + cases[-1:] * 7


def _batch(worker, context, n: int, body, content_type: str) -> None:
    """`n` copies of one request through the exchange; a failed answer fails the load."""
    from ts.context import RequestProcessor

    context.request_ids = {i: "warmup" for i in range(n)}
    context.request_processor = [RequestProcessor({"body": {"content-type": content_type}}) for _ in range(n)]
    if getattr(context, "metrics", None) is not None:
        context.metrics.request_ids = context.request_ids
    out = exchange.handle(worker, [{"body": body} for _ in range(n)], context)
    for i in range(n):
        status = context.get_response_status(i)[0]
        if status not in (None, 200):
            err = LoadError(f"the warm-up request ({content_type}, batch of {n}) failed: {out[i]}")
            # a 5xx (device memory while several workers start, say) may pass on a
            # restart: let TorchServe restart the worker instead of answering 503 forever
            err.recurs = status < 500
            raise err
