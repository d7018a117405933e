"""Handler configuration, parsed once at load from model-config.yaml into a typed object.

TorchServe hands the whole YAML to the worker as `context.model_yaml_config`; our options
live under its `handler:` key, next to TorchServe's own `deviceType`/`deviceIds`. Every
unknown key or wrong type fails the load with a message naming the key and what it takes,
so a typo never silently falls back to a default.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, get_type_hints

from handlers.errors import ConfigError


@dataclass(frozen=True)
class HandlerConfig:
    # TorchServe's own keys (top level of model-config.yaml)
    device_type: Optional[str] = None  # "cpu" / "gpu" / None (follow what TorchServe assigns)
    workers: Optional[int] = None  # maxWorkers, else minWorkers: the model's worker count; None: not stated
    device_ids: tuple = ()  # deviceIds: the GPUs TorchServe spreads the workers over; empty: every visible one
    # Ours (under `handler:`)
    # CPU threads for this worker's torch (intra-op); 0 = decided at load (handlers/torchserve/threads.py):
    # 1 on a CUDA worker, an equal share of the usable cores on a CPU worker.
    cpu_threads: int = 0
    stream_priority: int = 0  # CUDA stream priority; lower is higher priority (-1 high on most GPUs)
    # >0: inputs go to the GPU in pieces of this many MiB, each upload overlapping the host copy
    # of the next piece. Measured on H100 it gained nothing (docs/results), hence off.
    staging_piece_mb: float = 0.0
    # TorchServe's base_handler, on import, switches every fp32 matmul to TF32 on Ampere and
    # newer ("Enabled tensor cores"): ~1e-4 relative error that nobody asked for. Our entry does
    # not import it, and the load sets this precision whatever else in the worker did: torch's
    # default unless the archive asks for "high" (TF32) or "medium" (bf16).
    float32_matmul_precision: str = "highest"
    # CUDA graphs per batch bucket (run/graphs.py): auto | on | off, which batch sizes (empty:
    # powers of two up to cuda_graph_max_batch), and a cap on the memory the graphs hold.
    cuda_graphs: str = "auto"
    cuda_graph_batch_sizes: tuple = ()
    cuda_graph_max_batch: int = 64
    cuda_graph_memory_mb: float = 2048.0
    # How a worker waits for its GPU work (run/cuda.py): spin (a core busy-polls, CUDA's own
    # choice), block (the thread sleeps until the GPU is done; its core is free meanwhile),
    # hybrid (polls for up to cuda_spin_us, then sleeps) or auto (spin when alone on its GPU,
    # else what threads.cuda_wait says, with the measurements behind it).
    cuda_sync: str = "auto"
    cuda_spin_us: float = 200.0
    # Stage timings (handlers/torchserve/stage_timings.py) are gauges: each is emitted as the mean over the batches
    # since its last emission, at most once per this many seconds (0: after every batch). Every
    # emission is a stdout line TorchServe's frontend parses; three per batch took about 0.3 ms of
    # worker CPU per batch (py-spy on the CI CPU; on one H200, 2.58 worker cores against 2.28 at
    # the same rate, docs/results/e2e_resnet50_fp16_scaling_h200x2.md).
    stage_metrics_s: float = 1.0
    # Read the frontend's messages with handlers/torchserve/frontend_frames.py (a buffered reader of
    # TorchServe's frame format) instead of TorchServe's field-by-field reader. A batch of eight
    # 300 kB requests: 0.4609 against 0.7103 ms of worker CPU on the 2x H200 host
    # (docs/results/frames_h200x2.md); end to end on two GPUs, 14224.25 req/s against 13373.1
    # and 14703.65 against 14596.75 in two runs, the workers using 0.5 cores less each time
    # (docs/results/e2e_resnet50_fp16_scaling_h200x2_s9.md, e2e_resnet50_fp16_reader_h200x2.md).
    buffered_reader: bool = True
    warmup: bool = True
    warmup_batch_sizes: tuple = ()  # empty: a few buckets across the artifact's batch range
    split_oversized: bool = True  # requests beyond the artifact's max batch: split (True) or refuse
    max_rows_per_request: int = 1024  # a single request may not carry more rows than this (413)
    # A request body handed over as bytes may not be larger (413); config.properties lets
    # TorchServe accept 128 MiB (max_request_size).
    max_body_mb: float = 128.0
    # A JSON body may not be larger (413, checked before parsing). JSON costs a Python object
    # per number: ~0.3 s of worker time per MiB end to end (measured: a 124 MiB body took 36 s), and
    # the batch behind it waits; binary bodies cost a copy.
    max_json_mb: float = 8.0
    # GPU memory one worker needs, MiB: its copy of the weights plus context, graph pools and
    # activations, as cs-archive sized the worker count (compiled_serving/worker_sizing.py). A CUDA
    # worker with less free on its GPU refuses to load with the numbers (handlers/artifact/room.py)
    # instead of failing out of memory on every restart. 0: no check.
    worker_gpu_mb: float = 0.0
    crash_safe_load: bool = True  # try loading in a child process first (catches native crashes)
    crash_safe_timeout_s: float = 600.0
    strict_versions: bool = False  # torch major.minor mismatch: fail (True) or warn (False)
    trt_multi_device_safe_mode: bool = False
    variant: str = ""  # force one variant directory name (multi-variant archives)
    # A load failure that recurs (LoadError.recurs): true = the worker comes up and answers every
    # request 503 ModelLoadFailed with the reason (TorchServe then lists it READY; README);
    # false = raise, so TorchServe restarts the worker with back-off and requests wait.
    answer_load_failure: bool = True
    # Value contracts (handlers/values.py): check each request's integer inputs against the valid
    # ranges in artifact.json (an id past an embedding table would abort an AOTI worker on the CPU
    # or poison the CUDA context on a GPU); value_ranges adds or narrows bounds, {input: [lo, hi]}
    # or {input[col]: [lo, hi]} for one position along its column dimension (a range wider than
    # the model's own bound fails the load naming it); refuse_nonfinite refuses NaN and infinity
    # in floating-point inputs.
    check_values: bool = True
    value_ranges: dict = field(default_factory=dict)
    refuse_nonfinite: bool = False
    # Padding along named dynamic dimensions (handlers/batch.py PadPlan), declared by whoever
    # archives a model that masks padding: {input: pad value} for every input with such a
    # dimension. Requests are padded up to a length bucket (pad_buckets; empty: the powers of two
    # in the dimension's range and its maximum) so texts of different lengths share one call
    # (several buckets share the largest one's call where the runner knows that is cheaper:
    # CUDA graphs timed at capture); outputs with the dimension are cut back to each request's
    # own length. The worker checks at load that padding leaves answers unchanged
    # (handlers/run/padding.py) and refuses to load where it does not. Empty: never pad.
    pad: dict = field(default_factory=dict)
    pad_buckets: tuple = ()


_TOP_LEVEL = ("device_type", "workers", "device_ids")
_HANDLER_KEYS = {f.name: f for f in fields(HandlerConfig) if f.name not in _TOP_LEVEL}
# Each option's type, from the dataclass annotations (one place): int, float, str, bool, tuple.
_TYPES = {k: t for k, t in get_type_hints(HandlerConfig).items() if k not in _TOP_LEVEL}


def _coerce(key, value, kind):
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lstrip("-").isdigit():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    elif kind is dict:
        return _pad_values(key, value) if key == "pad" else _ranges(key, value)
    elif kind is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and v > 0 for v in value):
            return tuple(value)
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                tuple: "a list of positive integers"}[kind]
    raise ConfigError(f"model-config.yaml handler.{key} = {value!r} is invalid: expected {expected}")


def _ranges(key, value) -> dict:
    """{input: [lo, hi]} with integer bounds, lo <= hi, as {input: (lo, hi)}."""
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, (list, tuple)) and len(v) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) for b in v) and v[0] <= v[1]
        for k, v in value.items())
    if not ok:
        raise ConfigError(f"model-config.yaml handler.{key} = {value!r} is invalid: expected a mapping "
                          "of input names (or NAME[COL] for one column) to [lowest, highest] integers, e.g. "
                          "{input_ids: [0, 30521]}")
    return {k: (v[0], v[1]) for k, v in value.items()}


def _pad_values(key, value) -> dict:
    ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, (int, float))
                                         and not isinstance(v, bool) for k, v in value.items())
    if not ok:
        raise ConfigError(f"model-config.yaml handler.{key} = {value!r} is invalid: expected a mapping of "
                          "input names to the value padding holds, e.g. {input_ids: 0, attention_mask: 0}")
    return dict(value)


def parse_config(model_yaml: Optional[dict]) -> HandlerConfig:
    model_yaml = model_yaml or {}
    device_type = model_yaml.get("deviceType")
    if device_type is not None and device_type not in ("cpu", "gpu"):
        raise ConfigError(f"model-config.yaml deviceType = {device_type!r} is not supported by this "
                          "handler: use 'cpu' or 'gpu', or leave it out to follow TorchServe's assignment")
    raw = model_yaml.get("handler") or {}
    if not isinstance(raw, dict):
        raise ConfigError("model-config.yaml `handler:` must be a mapping of options")
    unknown = sorted(set(raw) - set(_HANDLER_KEYS))
    if unknown:
        raise ConfigError(f"unknown handler option(s) {', '.join(unknown)} in model-config.yaml; "
                          f"valid options: {', '.join(sorted(_HANDLER_KEYS))}")
    if isinstance(raw.get("cuda_graphs"), bool):  # YAML 1.1 reads a bare on/off as a boolean
        raw = {**raw, "cuda_graphs": "on" if raw["cuda_graphs"] else "off"}
    values = {k: _coerce(k, v, _TYPES[k]) for k, v in raw.items()}
    _validate(values)
    workers = next((v for v in (model_yaml.get("maxWorkers"), model_yaml.get("minWorkers"))
                    if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
    return HandlerConfig(device_type=device_type, workers=workers,
                         device_ids=tuple(model_yaml.get("deviceIds") or ()), **values)


def _validate(values: dict) -> None:
    """Range and choice checks of already typed option values; each names the fix."""
    if values.get("cpu_threads", 0) < 0:
        raise ConfigError("model-config.yaml handler.cpu_threads must be 0 (decide at load) or a "
                          "positive number of threads")
    if values.get("max_rows_per_request", 1) < 1:
        raise ConfigError("model-config.yaml handler.max_rows_per_request must be at least 1")
    if values.get("float32_matmul_precision", "highest") not in ("highest", "high", "medium"):
        raise ConfigError(f"model-config.yaml handler.float32_matmul_precision = "
                          f"{values['float32_matmul_precision']!r} is invalid: expected highest (IEEE "
                          "fp32, torch's default), high (TF32) or medium (bf16)")
    if values.get("worker_gpu_mb", 0.0) < 0:
        raise ConfigError("model-config.yaml handler.worker_gpu_mb must be 0 (no check) or the MiB of GPU "
                          "memory one worker needs (cs-archive writes it)")
    for key in ("max_body_mb", "max_json_mb"):
        if values.get(key, 1.0) <= 0:
            raise ConfigError(f"model-config.yaml handler.{key} must be a positive size in MiB")
    if values.get("stage_metrics_s", 1.0) < 0:
        raise ConfigError("model-config.yaml handler.stage_metrics_s must be 0 (emit the stage timings "
                          "after every batch) or a positive number of seconds between emissions")
    if values.get("staging_piece_mb", 0.0) < 0:
        raise ConfigError("model-config.yaml handler.staging_piece_mb must be 0 (no pieces) or a "
                          "positive size in MiB")
    if values.get("cuda_graphs", "auto") not in ("auto", "on", "off"):
        raise ConfigError(f"model-config.yaml handler.cuda_graphs = {values['cuda_graphs']!r} is invalid: "
                          "expected auto (capture and keep graphs only if they match the plain call), "
                          "on (a capture failure fails the load) or off")
    if values.get("cuda_sync", "auto") not in ("auto", "spin", "block", "hybrid"):
        raise ConfigError(f"model-config.yaml handler.cuda_sync = {values['cuda_sync']!r} is invalid: "
                          "expected auto (spin when a worker is alone on its GPU, else hybrid), spin "
                          "(the waiting worker busy-polls a core), block (it sleeps until the GPU is "
                          "done) or hybrid (it polls for up to handler.cuda_spin_us, then sleeps)")
    if values.get("cuda_spin_us", 0.0) < 0:
        raise ConfigError("model-config.yaml handler.cuda_spin_us must be 0 or a positive number of "
                          "microseconds")
    if values.get("cuda_graph_max_batch", 1) < 1 or values.get("cuda_graph_memory_mb", 1.0) <= 0:
        raise ConfigError("model-config.yaml handler.cuda_graph_max_batch must be at least 1 and "
                          "handler.cuda_graph_memory_mb positive")
