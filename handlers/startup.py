"""A worker's start where it runs the model itself, on the CPU (a worker given a GPU is served
by its GPU's engine: handlers/engine_worker.py), as steps that return values: plan (settings ->
variant, checked stateless) -> load (thread budget -> trial load -> load -> runner -> padding
check), and the one load line that says what was chosen and why. handlers/worker.py runs them,
then the warm-up (handlers/warmup.py)."""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from handlers import process
from handlers.admission import Limits
from handlers.artifact import confine
from handlers.artifact.decoder import of as decoder_of
from handlers.artifact.device import Placement
from handlers.artifact.kinds import kind_of
from handlers.artifact.load import load_artifact
from handlers.artifact.metadata import ArtifactSpec
from handlers.artifact.probe import probe_once
from handlers.artifact.state import require_checked
from handlers.artifact.variants import choose_variant
from handlers.config import HandlerConfig, parse_config, retired_in
from handlers.errors import LoadError
from handlers.continuous import Continuous
from handlers.generating import Generation
from handlers.generation.text import Text
from handlers.loaded import Loaded
from handlers.run import runner_for
from handlers.run.decoder import DecoderRunner
from handlers.run.slots import SlotRunner
from handlers.run.padding import verify_padding
from handlers.torchserve import frontend_watch, guardian, scratch, threads
from handlers.torchserve.envelope import refuse_envelope
from handlers.torchserve.stage_timings import StageTimes

logger = logging.getLogger(__name__)


class StartSteps:
    """Seconds per step of a worker's start, in order: the load line's breakdown and the
    WorkerStartTime metric. The first step, the process's age when the handler's start began,
    is the interpreter, TorchServe's and torch's imports and the frontend's load message."""

    def __init__(self):
        before = process.age_s()
        self.times = {"process and imports": before} if before is not None else {}
        self.notes: dict = {}  # what a step chose, for the load line: step -> note
        self._t = time.perf_counter()

    def note(self, step: str, text: str) -> None:
        self.notes[step] = text

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self._t
        self._t = now

    def total(self) -> float:
        return sum(self.times.values())

    def sum(self, *names: str) -> float:
        return sum(self.times.get(k, 0.0) for k in names)

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
    frontend_watch.start()  # an async worker exits once its frontend is gone
    guardian.install()  # and comes back if it dies (TorchServe 0.12 alone never brings it back)
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


@dataclasses.dataclass
class StartPlan:
    """What a worker's start decided before loading anything: its settings, the variant it
    serves and where."""
    config: HandlerConfig
    spec: ArtifactSpec
    placement: Placement
    model_dir: str  # the archive's files (a decoder's tokenizer.json)


def settings(context) -> tuple:
    """(the archive's model-config.yaml as TorchServe hands it over, the handler's settings parsed
    from it): the one place a worker reads it."""
    raw = getattr(context, "model_yaml_config", None)
    return raw, parse_config(raw)


def warn_retired(context) -> None:
    """A warning for each retired option the archive's model-config.yaml still sets (handlers/config.py RETIRED)."""
    for note in retired_in(getattr(context, "model_yaml_config", None)):
        logger.warning("%s", note)


def plan(context) -> StartPlan:
    """The settings parsed once, the variant chosen for this worker's device and checked to be
    stateless; raises LoadError naming what is wrong and the fix."""
    _, config = settings(context)
    # The archive's precision, whatever else in the process set (importing TorchServe's
    # base_handler switches fp32 matmuls to TF32), so an fp32 artifact answers like the model
    # it was compiled from; see HandlerConfig.
    torch.set_float32_matmul_precision(config.float32_matmul_precision)
    process.record("torch fp32 matmul precision", config.float32_matmul_precision)
    props = context.system_properties
    gpu_id, _ = confine_worker(props.get("gpu_id"))
    spec, placement, notes = choose_variant(props["model_dir"], gpu_id, config, scratch.shared_root())
    if placement.kind != "cpu":
        # a worker runs models on the CPU only (the per-worker GPU path was retired, issue 64):
        # engine_worker.wanted found no GPU here (NVML) where CUDA places one; the CPU, said why
        logger.warning("%s/%s could go to %s, but this worker found no GPU before CUDA started (NVML, "
                       "/dev/nvidiactl), so it runs the model itself on the CPU. Fix: handler.engine: on in "
                       "model-config.yaml sends it to the GPU's engine", spec.backend, spec.device, placement.where)
        spec, placement, notes = choose_variant(props["model_dir"], None, config, scratch.shared_root())
    require_checked(spec, kind_of(spec))  # a program that writes state between calls is never served as stateless
    for note in notes:
        logger.warning("%s", note)
    slow_imports = process.uncompiled_imports(torch)
    if slow_imports:
        logger.warning("slow worker starts: %s", slow_imports)
    return StartPlan(config, spec, placement, props["model_dir"])


def confine_worker(gpu_id) -> tuple:
    """(the gpu_id to place by, what confine.confine did): a worker given a GPU sees that GPU alone
    from before CUDA starts (handlers/artifact/confine.py), so it and every process it starts
    place by index 0; recorded for the load line, and a warning where it could not be done."""
    confined = confine.confine(gpu_id)
    if confined.entry is not None:
        process.record(confine.VAR, f"{confined.entry} (TorchServe gpu_id {gpu_id}: this worker and the processes "
                                    "it starts see that GPU alone, as cuda:0)")
        return 0, confined
    if gpu_id is not None and confined.host_gpus != 0:
        logger.warning("this worker is not confined to its GPU (%s): a thread or library that uses CUDA without "
                       "naming a device may use another GPU", confined.why_not)
    return gpu_id, confined


def load(plan: StartPlan, emit, steps: StartSteps) -> Loaded:
    """The thread budget, the trial load, the load and its runner, and the check that declared
    padding leaves answers unchanged (before any client's request is padded)."""
    config, spec, placement = plan.config, plan.spec, plan.placement
    budget = threads.apply(threads.decide(placement.kind, config.cpu_threads, config.workers, threads.usable_cores()))
    steps.note("threads", budget.describe())
    steps.done("variant")
    _, probe_note = (probe_once(spec, placement, config, budget, scratch.shared_root())
                     if config.crash_safe_load else (0.0, "no trial load"))
    steps.note("trial load", probe_note)
    steps.done("trial load")
    model = load_artifact(spec, placement, config)
    limits, decoder = Limits.of(config, spec), decoder_of(spec)
    if decoder is not None and decoder.slotted:  # many sequences on one cache (handlers/continuous.py)
        runner = SlotRunner(model, decoder, placement.torch_device, config)
        generation = Continuous(runner, Text.in_dir(plan.model_dir), config, limits.max_json_bytes)
    elif decoder is not None:  # a decoder: generation on its one KV cache (handlers/generating.py)
        runner = DecoderRunner(model, decoder, placement.torch_device, config)
        generation = Generation(runner, Text.in_dir(plan.model_dir), config, limits.max_json_bytes)
    else:
        runner, generation = runner_for(model, spec, placement.torch_device, config), None
    loaded = Loaded(config=config, spec=spec, limits=limits, model=model, runner=runner, device=placement.torch_device,
                    stages=StageTimes(emit, config.stage_metrics_s), generation=generation)
    if generation is None and runner.pad:
        steps.note("padding", verify_padding(model, loaded.runner, spec, placement.torch_device))
    steps.done("load")
    return loaded


def emit_times(emit, steps: StartSteps) -> None:
    """The start's metrics: the artifact's load, its warm-up and the whole start (ms)."""
    emit("ArtifactLoadTime", steps.sum("variant", "trial load", "load") * 1000.0)
    emit("ArtifactWarmupTime", steps.sum("warm-up", "CUDA graphs", "request-path warm-up") * 1000.0)
    emit("WorkerStartTime", steps.total() * 1000.0)


def log_decoder(loaded: Loaded, placement: Placement, steps: StartSteps, reader: str) -> None:
    """A decoder's load line: what serves it and how, and how long each step took."""
    spec = loaded.spec
    logger.info("loaded %s decoder %s (%s) on %s [%s]; started in %s; %s; %s; CPU threads: %s; %s",
                spec.backend, spec.artifact, loaded.model.loader, placement.where, placement.note, steps.describe(),
                steps.notes.get("trial load", ""), loaded.generation.describe(),
                steps.notes.get("threads", ""), reader)
    logger.info("process-wide changes: %s", process.describe())


def log_loaded(loaded: Loaded, placement: Placement, steps: StartSteps, reader: str) -> None:
    """The load line: what was chosen and why, and how long each step took."""
    spec, runner, notes = loaded.spec, loaded.runner, steps.notes
    logger.info(
        "loaded %s artifact %s (%s) on %s [%s]; started in %s; %s; inputs %s; batch range [%d, %d]; "
        "fp32 matmul precision %s; CPU threads: %s; %s; %s; %s",
        spec.backend, spec.artifact, loaded.model.loader, placement.where, placement.note,
        steps.describe(), notes.get("trial load", ""), ", ".join(s.describe() for s in spec.inputs),
        spec.batch_min, spec.batch_max, torch.get_float32_matmul_precision(), notes.get("threads", ""),
        notes.get("graphs", ""),
        loaded.limits.values.describe() + (f"; padding {runner.pad.describe()}, {notes.get('padding', '')}"
                                           if runner.pad else ""),
        reader)
    logger.info("process-wide changes: %s", process.describe())
