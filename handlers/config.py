"""Handler configuration: each option declared once (`OPTIONS`: key, type, default, allowed
values, one line of doc), and from those declarations the typed `HandlerConfig`, the parser and
its fix-it messages, and the options table of docs/configuration.md (`python -m handlers.config`
prints it; tests/test_config.py keeps the page equal to it).

TorchServe hands the whole YAML to the worker as `context.model_yaml_config`; our options live
under its `handler:` key, next to TorchServe's own keys, of which the handler reads `deviceType`,
`deviceIds`, `maxBatchDelay` and `maxWorkers`/`minWorkers` (declared here too, `torchserve=True`). Every unknown
key or wrong value fails the load with a message naming the key, what it takes and where to set
it, so a typo never silently falls back to a default. Nothing else in the package reads
model-config keys or supplies defaults of its own.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional

from handlers.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Option:
    name: str  # the HandlerConfig attribute; under `handler:` in model-config.yaml
    kind: type  # bool, int, float, str, tuple (of positive integers), dict
    default: Any
    doc: str  # one line
    choices: tuple = ()  # (value, meaning) pairs: the only values allowed
    low: Optional[float] = None  # the lowest value allowed (inclusive)
    positive: bool = False  # above zero
    key: str = ""  # TorchServe's own top-level key(s), comma-separated, for torchserve options
    parse: Any = None  # a dict option's value check: (name, value) -> the typed value, or ConfigError

    @property
    def torchserve(self) -> bool:
        return bool(self.key)

    def where(self) -> str:
        return self.key.split(",")[0] if self.key else f"handler.{self.name}"

    def fix(self) -> str:
        if self.torchserve:
            return f"set {self.where()} at the top level of the archive's model-config.yaml, or leave it out"
        return f"cs-archive --handler-option {self.name}=VALUE, or leave it out for {self.describe_default()}"

    def describe_default(self) -> str:
        """The default as the options table shows it."""
        d = self.default
        if d is None:
            return "unset"
        if d in ((), {}, ""):
            return "empty"
        return str(d).lower() if isinstance(d, bool) else f"{d:g}" if isinstance(d, float) else str(d)

    def expected(self) -> str:
        """What a value must be, in words."""
        if self.choices:
            words = [f"{v} ({m})" if m else str(v) for v, m in self.choices]
            return ", ".join(words[:-1]) + " or " + words[-1]
        if self.kind is tuple:
            return "a list of integers of at least 0" if self.low == 0 else "a list of positive integers"
        base = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                dict: "a mapping"}[self.kind]
        if self.positive:
            return f"{base} above 0"
        return f"{base} of at least {self.low:g}" if self.low is not None else base


def _ranges(name, value) -> dict:
    """{input: [lo, hi]} with integer bounds, lo <= hi, as {input: (lo, hi)}."""
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, (list, tuple)) and len(v) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) for b in v) and v[0] <= v[1]
        for k, v in value.items())
    if not ok:
        raise ConfigError(f"model-config.yaml handler.{name} = {value!r} is invalid: expected a mapping "
                          "of input names (or NAME[COL] for one column) to [lowest, highest] integers, e.g. "
                          "{input_ids: [0, 30521]}")
    return {k: (v[0], v[1]) for k, v in value.items()}


def _pad_values(name, value) -> dict:
    ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, (int, float))
                                         and not isinstance(v, bool) for k, v in value.items())
    if not ok:
        raise ConfigError(f"model-config.yaml handler.{name} = {value!r} is invalid: expected a mapping of "
                          "input names to the value padding holds, e.g. {input_ids: 0, attention_mask: 0}")
    return dict(value)


OPTIONS = (
    # TorchServe's own keys (top level of model-config.yaml), read by the handler
    Option("device_type", str, None, "gpu: refuse to load without a GPU; cpu: run on the CPU; unset: "
           "follow TorchServe's gpu_id", choices=(("cpu", ""), ("gpu", "")), key="deviceType"),
    Option("workers", int, None, "the model's worker count (a CPU worker's thread budget counts it); unset: "
           "assumed alone", low=1, key="maxWorkers,minWorkers"),
    Option("device_ids", tuple, (), "the GPUs TorchServe spreads the workers over; empty: every visible "
           "one", low=0, key="deviceIds"),
    # 100: TorchServe 0.12's default where the archive names none (ModelConfig.maxBatchDelay)
    Option("max_batch_delay_ms", float, 100.0, "how long TorchServe waits for a batch to fill; a batched "
           "worker's guardian holds a dead worker's connection this long, plus 50 ms, for the batch being "
           "gathered (handlers/torchserve/guardian.py); read from the archive's model-config only (set "
           "it there when the registration sets another)", low=0, key="maxBatchDelay"),
    # 0 = decided at load (handlers/torchserve/threads.py): an equal share of the usable cores on a
    # CPU worker (a GPU's engine: 1); the crash-safe probe child follows it.
    Option("cpu_threads", int, 0, "torch intra-op threads of a worker running the model on the CPU, or of "
           "a GPU's engine; 0: decided at load (a share of the cores on a CPU worker, 1 in a GPU's engine)",
           low=0),
    Option("stream_priority", int, 0, "priority of the engine's CUDA stream (lower is higher)"),
    # Measured on H100 it gained nothing (docs/results), hence off.
    Option("staging_piece_mb", float, 0.0, "above 0: inputs go to the GPU in pieces of this many MiB, each "
           "upload overlapping the host copy of the next; 0: one piece", low=0),
    # TorchServe's base_handler, on import, switches every fp32 matmul to TF32 on Ampere and
    # newer ("Enabled tensor cores"): ~1e-4 relative error that nobody asked for. Our entry does
    # not import it, and the load sets this precision whatever else in the worker did.
    Option("float32_matmul_precision", str, "highest", "the fp32 matmul precision the worker sets",
           choices=(("highest", "IEEE fp32, torch's default"), ("high", "TF32"), ("medium", "bf16"))),
    Option("cuda_graphs", str, "auto", "CUDA graphs per batch bucket (handlers/run/graphs.py), each kept "
           "only if it replays bit-identical to the plain call",
           choices=(("auto", "capture and keep graphs only if they match the plain call"),
                    ("on", "a capture failure fails the load"), ("off", ""))),
    Option("cuda_graph_batch_sizes", tuple, (), "the batch buckets given graphs; empty: powers of two "
           "and the range's ends up to cuda_graph_max_batch"),
    Option("cuda_graph_max_batch", int, 64, "the largest batch bucket given a graph", low=1),
    Option("cuda_graph_memory_mb", float, 2048.0, "a cap on the graphs' memory pool, MiB", positive=True),
    # With CUDA's default schedule the runtime busy-polls a core while a process waits for the GPU;
    # measurements behind auto: docs/configuration.md, cuda_sync.
    Option("cuda_sync", str, "auto", "how the engine waits for its GPU work",
           choices=(("auto", "spin: the engine is alone on its GPU"),
                    ("spin", "the waiting thread busy-polls a core"),
                    ("block", "it sleeps until the GPU is done"),
                    ("hybrid", "it polls for up to handler.cuda_spin_us, then sleeps"))),
    Option("cuda_spin_us", float, 200.0, "with cuda_sync hybrid: how long the engine polls before it "
           "sleeps, in microseconds", low=0),
    # Every emission is a stdout line TorchServe's frontend parses; three per batch took about
    # 0.3 ms of worker CPU per batch (py-spy on the CI CPU; on one H200, 2.58 worker cores against
    # 2.28 at the same rate, `git show 8cb3939:docs/results/e2e_resnet50_fp16_scaling_h200x2.md`).
    Option("stage_metrics_s", float, 1.0, "seconds between emissions of the stage timings (means); 0 "
           "emits after every batch", low=0),
    # One emission took 18-27 us of the worker's CPU (handlers/generation/metrics.py): none per token.
    Option("generation_metrics_s", float, 1.0, "a decoder's generation metrics (tokens, time to first token, "
           "inter-token time, sequences, slots) are emitted at most this often, in seconds; 0: none", low=0),
    # A batch of eight 300 kB requests: 0.4609 against 0.7103 ms of worker CPU on the 2x H200 host
    # (git show 0bd3d87:docs/results/frames_h200x2.md).
    Option("buffered_reader", bool, True, "read the frontend's messages with "
           "handlers/torchserve/frontend_frames.py instead of TorchServe's field-by-field reader"),
    Option("warmup", bool, True, "warm up at load: batch sizes, length buckets, then requests through "
           "the request path"),
    Option("warmup_batch_sizes", tuple, (), "the warm-up's batch sizes; empty: a few across the "
           "artifact's batch range"),
    Option("split_oversized", bool, True, "rows beyond the artifact's max batch: split into several "
           "calls (true) or refuse with 413"),
    Option("max_rows_per_request", int, 1024, "one request may not carry more rows (413)", low=1),
    # config.properties lets TorchServe accept 128 MiB (max_request_size).
    Option("max_body_mb", float, 128.0, "a request body may not be larger, MiB (413)", positive=True),
    # JSON costs a Python object per number: ~0.3 s of worker time per MiB end to end (a 124 MiB
    # body took 36 s), and the batch behind it waits; binary bodies cost a copy.
    Option("max_json_mb", float, 8.0, "a JSON body may not be larger, MiB (413, before parsing)",
           positive=True),
    # handlers/engine (issue 64): the GPU leaves the workers. auto takes it on a GPU: with 12 CPU
    # workers it served the BERT classifier 2.04x, ResNet-50 1.30x and the MLP 1.19x the per-worker
    # path at 128 clients, one client within +0.25 ms, in a third of the GPU memory
    # (docs/results/engine_*_h200_s70, engine_memory_big_mlp_fp16_h200_s74), and a slot-form
    # decoder's continuous batch 1.01-1.04x its per-worker batch's tokens/s at 1-64 streams with a
    # lower time to first token (docs/results/lm_engine_qwen15b_bf16_h200). On the CPU it was not
    # measured against the per-worker path.
    # The per-worker GPU path (`off`) was retired (issue 64 item 6): see RETIRED_VALUES.
    # As cs-archive sized the engine (compiled_serving/worker_sizing.py): checked by the engine before
    # it loads (handlers/engine/room.py, with the other engines loading on that GPU counted) instead
    # of failing out of memory part-way, and read
    # by compiled_serving/kserve.py for the pod's GPU memory. The name is older than the engine.
    Option("worker_gpu_mb", float, 0.0, "GPU memory the model's engine needs on its GPU, MiB (cs-archive "
           "writes it); an engine with less free refuses to load; 0: no check", low=0),
    Option("engine", str, "auto", "where a stateless model's batches or a decoder's sequences run",
           choices=(("auto", "on for a worker given a GPU and an archive a GPU runs (built for CUDA, or a program "
                             "exported on the CPU; stateless or a decoder of either form); otherwise in each "
                             "worker, on the CPU"),
                    ("on", "in one engine process per GPU (per model version) fed by every worker of "
                           "that GPU, which then holds no CUDA context; a slot-form decoder's continuous batch "
                           "too, and a one-sequence decoder's as the engine's lanes (cache_copies); on a CPU "
                           "worker one engine process for the CPU"))),
    # eager: late (the hypothesis that larger steps win where a replay's fixed cost dominates,
    # handlers/engine/core.py) served the MLP and BERT at or below eager at every point on an H200
    # (git show 8374ab8:docs/results/engine_mlp_fp16_h200_s76.json, docs/results/engine_bert_fp16_h200_s76.json)
    Option("engine_launch", str, "eager", "with the engine on a GPU: when a step is launched behind the one "
           "the device runs",
           choices=(("eager", "as soon as a request is queued"),
                    ("late", "once the queued rows fill a step, or the running step is about to end (its "
                             "graphs' replay times say when), so the requests arriving meanwhile join it"))),
    # A request through the engine crosses two sleeps the per-worker path does not (the engine's
    # loop in epoll, the worker in poll), each waking a core. The MLP on an H200 at one client, p50:
    # 3.38 ms with neither spinning, 3.08 with the worker's wait alone, 2.67 with both (per worker
    # 2.65); at 64 clients 25777, 26265 and 28352 req/s; at 128 equal
    # (docs/results/engine_mlp_fp16_h200_s77.json). The spin costs a core per engine only while
    # requests keep coming; an engine on the CPU never spins (its cores run the model).
    Option("engine_spin_us", float, 5000.0, "with the engine on a GPU: how long its loop keeps polling the "
           "workers' sockets after its last work before it sleeps, in microseconds (a core busy meanwhile)", low=0),
    Option("engine_wait_spin_us", float, 300.0, "with the engine on a GPU: how long a worker waiting for its "
           "answer polls the socket before it sleeps, in microseconds", low=0),
    Option("engine_timeout_s", float, 60.0, "with the engine: how long a request waits for it; past it the "
           "request is answered 504, and an engine that then leaves a State unanswered as long again (at "
           "least 5 s) is hung: the worker kills it and starts its successor", positive=True),
    Option("crash_safe_load", bool, True, "try the load and one call in a child process first (catches "
           "native crashes)"),
    Option("crash_safe_timeout_s", float, 600.0, "the trial load's time limit, seconds", positive=True),
    Option("strict_versions", bool, False, "any torch version difference fails the load (not only "
           "major.minor for native artifacts)"),
    Option("trt_multi_device_safe_mode", bool, False, "Torch-TensorRT's multi-device safe mode"),
    Option("variant", str, "", "force one variant directory of a multi-variant archive; empty: chosen "
           "for the machine"),
    # LoadError.recurs; TorchServe lists a worker that answers the failure READY (README).
    Option("answer_load_failure", bool, True, "a load failure that recurs: answer every request 503 "
           "with the reason (true) or raise, so TorchServe restarts the worker with back-off"),
    # An id past an embedding table would abort an AOTI worker on the CPU or poison the CUDA
    # context on a GPU (handlers/values.py).
    Option("check_values", bool, True, "check each request's integer inputs against the valid ranges "
           "in artifact.json (400)"),
    Option("value_ranges", dict, {}, "add or narrow value bounds: {input: [lo, hi]}, or {input[col]: "
           "[lo, hi]} for one column; wider than the model's own fails the load", parse=_ranges),
    Option("refuse_nonfinite", bool, False, "refuse NaN and infinity in floating-point inputs (400)"),
    # handlers/batch.py PadPlan; the worker checks at load that padding leaves answers unchanged
    # (handlers/run/padding.py) and refuses to load where it does not.
    Option("pad", dict, {}, "padding along named dynamic dimensions, declared for a model that masks "
           "it: {input: pad value} for every input with such a dimension; empty: never pad",
           parse=_pad_values),
    # Generation (a decoder: handlers/artifact/decoder.py, handlers/generating.py)
    Option("max_new_tokens", int, 256, "a decoder's tokens per request when the request names no "
           "max_tokens (fewer where the KV cache ends)", low=1),
    Option("eos_token_ids", tuple, (), "a decoder's end-of-sequence token ids; empty: the archive's "
           "tokenizer's end-of-sequence tokens (handlers/generation/text.py)", low=0),
    # A stop string costs worker time on every token (handlers/generation/text.StopText); 500,000
    # of them (6 MB) took ~0.35 s per token (issue 63).
    Option("max_stop_sequences", int, 16, "a decoder request's parameters.stop may hold at most this many "
           "strings (400)", low=0),
    Option("max_stop_chars", int, 256, "each stop string may be at most this many characters (400)", low=1),
    Option("max_stop_token_ids", int, 256, "a decoder request's parameters.stop_token_ids may hold at most "
           "this many ids (400)", low=0),
    Option("queue_size", int, 256, "a continuous batch's sequences (a slot-form decoder, or the engine's lanes) "
           "that wait while every slot is busy "
           "(handlers/generation/engine.py); one more is refused at once with 503 and Retry-After", low=0),
    Option("cache_copies", int, 8, "a one-sequence decoder served by the engine: copies of its KV cache, each "
           "generating one sequence beside the others with the weights shared (handlers/run/lanes.py); fewer "
           "where the GPU's free memory holds fewer", low=1),
    # TorchServe 0.12 never tells a worker that a client went (docs/generation.md, abandoned
    # requests), so a sequence whose client left before it started would still take a slot.
    Option("queue_timeout_s", float, 30.0, "a continuous batch's sequence that waited longer for a slot is "
           "answered 503 with Retry-After and never started; 0: no limit", low=0),
    Option("pad_buckets", tuple, (), "the length buckets requests are padded up to; empty: powers of "
           "two in the dimension's range and its maximum"),
)
_HANDLER = {o.name: o for o in OPTIONS if not o.torchserve}

# Options of the per-worker GPU path, retired with it (issue 64 item 6: one engine per GPU holds
# the one copy of the weights). Archives made before may carry them: they are read, ignored, and
# named (retired_in).
RETIRED = {
    "shared_weights": "the weights holder is gone: one engine per GPU holds the one copy of the weights; a CPU "
                      "worker loads its own",
}
# Values that meant a retired path: the load fails, saying what to set instead.
RETIRED_VALUES = {
    ("engine", "off"): "handler.engine off (the model in each GPU worker, each with its own CUDA context) was "
                       "retired (issue 64): a GPU worker is served by its GPU's engine, and a CPU worker runs the "
                       "model itself under the default, auto. Fix: remove handler.engine from model-config.yaml "
                       "(cs-archive: leave out --handler-option engine=off), or set deviceType: cpu to serve on "
                       "the CPU",
}


def retired_in(model_yaml: Optional[dict]) -> list:
    """The retired options this model-config.yaml still sets, each with why it no longer does anything."""
    raw = (model_yaml or {}).get("handler") or {}
    return [f"handler.{k} is ignored: {RETIRED[k]}" for k in sorted(RETIRED) if isinstance(raw, dict) and k in raw]


def _field(o: Option):
    if isinstance(o.default, dict):
        return dataclasses.field(default_factory=dict)
    return dataclasses.field(default=o.default)


# The typed settings of one worker, one attribute per declared option, each its default unless
# model-config.yaml says otherwise (frozen: dataclasses.replace makes a changed copy).
HandlerConfig = dataclasses.make_dataclass(
    "HandlerConfig", [(o.name, Optional[o.kind] if o.default is None else o.kind, _field(o)) for o in OPTIONS],
    frozen=True, namespace={"__module__": __name__})


def _coerce(o: Option, value):
    """The option's typed value, or ConfigError naming what it takes."""
    kind, v = o.kind, value
    if kind is bool and isinstance(v, str) and v.lower() in ("true", "false"):
        v = v.lower() == "true"
    elif kind is int and isinstance(v, str) and v.lstrip("-").isdigit():
        v = int(v)
    elif kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    elif kind is str and isinstance(v, bool) and "on" in dict(o.choices):
        v = "on" if v else "off"  # YAML 1.1 reads a bare on/off as a boolean
    elif kind is dict and o.parse is not None:
        return o.parse(o.name, v)
    typed = isinstance(v, kind) and not (kind is not bool and isinstance(v, bool))
    if kind is tuple and isinstance(v, list):
        v, typed = tuple(v), True
    if kind is tuple:  # low bounds each element (deviceIds may name GPU 0), else they are positive
        least = 1 if o.low is None else o.low
        typed = typed and all(isinstance(x, int) and not isinstance(x, bool) and x >= least for x in v)
    ok = typed and (not o.choices or v in dict(o.choices)) and (kind is tuple or o.low is None or v >= o.low) \
        and (not o.positive or v > 0)
    if not ok:
        raise ConfigError(f"model-config.yaml {o.where()} = {value!r} is invalid: expected {o.expected()} "
                          f"({o.doc}). Fix: {o.fix()}")
    return v


def parse_config(model_yaml: Optional[dict]) -> "HandlerConfig":
    """The worker's settings from model-config.yaml (None: every default); raises ConfigError
    naming the key, what it takes and where to set it."""
    model_yaml = model_yaml or {}
    raw = model_yaml.get("handler") or {}
    if not isinstance(raw, dict):
        raise ConfigError("model-config.yaml `handler:` must be a mapping of options, e.g. "
                          "handler: {max_json_mb: 8}")
    raw = {k: v for k, v in raw.items() if k not in RETIRED}
    for (k, value), why in RETIRED_VALUES.items():
        given = raw.get(k)  # YAML 1.1 reads a bare off as False
        if given == value or (value == "off" and given is False):
            raise ConfigError(why)
    unknown = sorted(set(raw) - set(_HANDLER))
    if unknown:
        raise ConfigError(f"unknown handler option(s) {', '.join(unknown)} in model-config.yaml; "
                          f"valid options: {', '.join(sorted(_HANDLER))}")
    values = {k: _coerce(_HANDLER[k], v) for k, v in raw.items()}
    for o in OPTIONS:
        if o.torchserve:
            given = [model_yaml[k] for k in o.key.split(",") if model_yaml.get(k) is not None]
            if given:
                values[o.name] = _coerce(o, given[0])
    return HandlerConfig(**values)


def options_table() -> str:
    """The Markdown table of every option, as docs/configuration.md shows it."""
    rows = ["| option | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for o in OPTIONS:
        name = f"`{o.key.replace(',', '` (else `')}`{')' if ',' in o.key else ''} (TorchServe's)" if o.key \
            else f"`{o.name}`"
        default = o.describe_default()
        allowed = ", ".join(f"`{v}`" for v, _ in o.choices) if o.choices else o.expected()
        kind = {tuple: "list", dict: "mapping"}.get(o.kind, o.kind.__name__)
        rows.append(f"| {name} | {kind} | {default} | {allowed} | {o.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(options_table() + "\n")
