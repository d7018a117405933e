"""A worker served by the engine (handler.engine: auto on a GPU, or on; issue 64): it reads, decodes, admits and
encodes requests on the CPU and hands the tensors to the one engine process of its GPU
(handlers/engine), which runs every worker's requests together. The worker never asks CUDA
anything, so it holds no CUDA context: the engine chooses the variant for the device and names
it in its Ready, whose artifact.json is then this worker's spec (admission, limits, encoding).

A slot-form decoder is served by the engine too (auto on a GPU, as a stateless model; measured on
an H200 against its own per-worker batch: 1.01-1.04x the tokens/s at 1-64 streams, time to first
token 9 ms against 12 alone and 73 against 138 at 64 streams, docs/results/lm_engine_qwen15b_bf16_h200):
the engine runs the one continuous batch (handlers/engine/generation.py), the worker tokenizes,
checks, streams and detokenizes (handlers/continuous.py over handlers/engine/sequences.py). So is a
one-sequence decoder, whose batch is the engine's lanes (handlers/run/lanes.py): copies of its cache on
one copy of the weights, a lane standing for a slot.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional

import torch

from handlers import process
from handlers.admission import Limits
from handlers.batch import PadPlan
from handlers.artifact.decoder import of as decoder_of
from handlers.artifact.kinds import KINDS
from handlers.artifact.metadata import find_variants, read_spec
from handlers.config import HandlerConfig
from handlers.engine import link
from handlers.engine.runner import EngineRunner
from handlers.loaded import Loaded
from handlers.startup import confine_worker, settings
from handlers.torchserve import scratch
from handlers.torchserve.stage_timings import StageTimes

logger = logging.getLogger(__name__)


def wanted(context) -> Optional[HandlerConfig]:
    """The worker's settings where it is served by an engine (serves), else None: the per-worker
    start (handlers/startup.py) reads them again. Asked without any CUDA call: the worker must
    hold no CUDA context."""
    _, config = settings(context)
    specs = [read_spec(d) for d in find_variants(context.system_properties["model_dir"])]
    # a GPU TorchServe assigned: gpu_id set, and device_type not cpu
    on_gpu = context.system_properties.get("gpu_id") is not None and config.device_type != "cpu"
    if on_gpu and not any(s.device == "cuda" for s in specs):
        # only programs exported on the CPU, which the CPU runs too: TorchServe counts GPUs from
        # CUDA_VISIBLE_DEVICES alone where it is set, so its gpu_id does not mean there is one
        on_gpu = host_has_gpu()
    return config if serves(config.engine, specs, on_gpu) else None


def host_has_gpu() -> bool:
    """Whether this process sees an NVIDIA GPU, asked of NVML (torch's count under
    PYTORCH_NVML_BASED_CUDA_CHECK, honouring CUDA_VISIBLE_DEVICES), never of CUDA: a worker that
    starts CUDA can no longer be confined to its GPU (handlers/artifact/confine.py). Where NVML
    cannot tell (-1: no libnvidia-ml, as in a container given the driver's compute capability
    alone, or MIG entries torch does not count), the driver's control device says: it exists
    wherever an NVIDIA driver serves this process."""
    try:
        count = torch.cuda._device_count_nvml()
    except Exception:  # noqa: BLE001  (a private torch function: any failure means unknown)
        count = -1
    return count > 0 or (count < 0 and os.path.exists("/dev/nvidiactl"))


def serves(setting: str, specs: list, on_gpu: bool) -> bool:
    """Whether an archive of these variants is served by the engine (handler.engine `setting`),
    for a worker given a GPU or not: with on, any archive; with auto (the default), on a GPU
    worker, an archive a GPU runs (gpu_runnable: a stateless model, a slot-form decoder, a
    one-sequence decoder as the engine's lanes: handlers/run/lanes.py). A worker it does not serve
    runs the model itself, on the CPU (handlers/startup.py). The worker's decision (wanted) and
    cs-archive's sizing (on_gpu: the GPU variants it sizes)."""
    if setting == "on":
        return True
    return on_gpu and any(gpu_runnable(s) for s in specs)


def gpu_runnable(spec) -> bool:
    """Whether a GPU runs the variant: built for CUDA, or a program exported on the CPU, whose
    kind is relocatable (placed on the worker's GPU, handlers/artifact/device.py). Read from
    artifact.json alone: no CUDA call."""
    if spec.device == "cuda":
        return True
    kind = KINDS.get(spec.backend)
    return kind is not None and kind.relocatable


def load(context, config: HandlerConfig, emit, steps) -> Loaded:
    """Connects to the engine of this worker's GPU (starting it where none answers) and builds
    what the batches read; LoadError with the engine's reason where it cannot load."""
    props = context.system_properties
    gpu_id = None if config.device_type == "cpu" else props.get("gpu_id")
    engine_gpu, confined = confine_worker(gpu_id)  # the engine inherits the confinement
    gpu = confined.entry if confined.entry is not None else None if engine_gpu is None else f"id{engine_gpu}"
    # the worker's own torch work is decoding and encoding: one thread, the cores are the engine's
    torch.set_num_threads(1)
    process.record("torch intra-op threads", "1 (a worker served by the engine runs no model)")
    steps.done("variant")
    model = context.manifest.get("model", {}).get("modelName", "model")
    connect = functools.partial(link.connect, scratch.shared_root(), props["model_dir"], settings(context)[0],
                                gpu, engine_gpu, f"{model}-{os.getpid()}", model)
    client = connect()
    spec = read_spec(client.ready.variant)
    if client.ready.generation is not None:
        return _generating(context, config, emit, steps, client, connect, spec)
    # each request padded to its own bucket here, by the plan the engine's runner has (the same
    # settings); the engine may pad jobs of neighbouring buckets to one (handlers/engine/artifact.py)
    runner = EngineRunner(client, spec, connect, PadPlan.of(spec, config.pad or None, config.pad_buckets),
                          config.engine_timeout_s, config.engine_wait_spin_us / 1e6 if engine_gpu is not None else 0.0)
    steps.note("engine", f"engine pid {client.ready.pid}: {client.ready.describe}")
    steps.done("load")
    return Loaded(config=config, spec=spec, limits=Limits.of(config, spec), model=None, runner=runner,
                  device=torch.device("cpu"), stages=StageTimes(emit, config.stage_metrics_s))


def _generating(context, config: HandlerConfig, emit, steps, client, connect, spec) -> Loaded:
    """A decoder's worker: its requests' sequences run in the engine's batch."""
    from handlers.continuous import Continuous
    from handlers.engine.sequences import RemoteBatch, RemoteSlots
    from handlers.generation.text import Text

    info = client.ready.generation
    limits = Limits.of(config, spec)
    # a one-sequence decoder's lanes stand for slots (handlers/run/lanes.py): the engine says how many
    slots = RemoteSlots(dataclasses.replace(decoder_of(spec), slots=info.slots), info.describe)
    cont = Continuous(slots, Text.in_dir(context.system_properties["model_dir"]), config, limits.max_json_bytes)
    slots.remote = remote = RemoteBatch(connect, cont._deliver)
    remote.attach(client)
    cont.serve_through(remote, f"the batch of engine pid {client.ready.pid} ({info.slots} slots, shared by every "
                               f"worker of this GPU)")
    steps.note("engine", f"engine pid {client.ready.pid}: {client.ready.describe}")
    steps.done("load")
    return Loaded(config=config, spec=spec, limits=limits, model=None, runner=cont.runner,
                  device=torch.device("cpu"), stages=StageTimes(emit, config.stage_metrics_s), generation=cont)


def log_loaded(loaded: Loaded, steps, reader: str) -> None:
    """The load line of a worker served by the engine."""
    spec = loaded.spec
    if loaded.generation is not None:
        logger.info("served by the engine: %s; worker started in %s; %s; %s", steps.notes.get("engine", ""),
                    steps.describe(), loaded.generation.describe(), reader)
        logger.info("process-wide changes: %s", process.describe())
        return
    logger.info("served by the engine: %s; worker started in %s; inputs %s; batch range [%d, %d]; %s; %s",
                steps.notes.get("engine", ""), steps.describe(), ", ".join(s.describe() for s in spec.inputs),
                spec.batch_min, spec.batch_max, loaded.limits.values.describe(), reader)
    logger.info("process-wide changes: %s", process.describe())
