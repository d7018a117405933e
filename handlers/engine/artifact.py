"""The engine's model: an archive's artifact loaded on the engine's device, behind the runner the
worker would build for it (handlers/run), warmed up and its CUDA graphs captured before the
engine answers its first Hello.

The engine chooses the variant itself (handlers/artifact/variants.py, with this process's
machine facts), and tells each worker which one in its Ready: a worker never asks CUDA anything,
so it holds no CUDA context (asking a device's capability starts CUDA in the asking process).
A process started by a worker confined to its GPU inherits that confinement
(handlers/artifact/confine.py): it sees the GPU as cuda:0.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Optional

import torch

from handlers.artifact.confine import VAR, visible_ids
from handlers.artifact.decoder import of as decoder_of
from handlers.artifact.kinds import kind_of
from handlers.artifact.load import load_artifact
from handlers.artifact.state import require_checked
from handlers.artifact.variants import choose_variant
from handlers.config import parse_config
from handlers.engine import room
from handlers.run import runner_for
from handlers.run.padding import verify_padding
from handlers.run.warm import warm

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineModel:
    """What the engine loaded: the runner every worker's requests go through, the variant's
    directory (sent to the workers in Ready) and the load's account for the log."""

    runner: object
    spec: object
    variant_dir: str
    where: str
    describe: str
    config: object = None
    budget: Optional[tuple] = None  # a decoder's (Budget, its note): the engine generates


def load(model_dir: str, yaml_config: dict, gpu_id, verdict_root=None, notice=None) -> EngineModel:
    """The archive in `model_dir` loaded for this process's device (`gpu_id`: 0 for the one GPU
    a confined engine sees, None for the CPU), warmed up, graphs captured; LoadError naming the
    cause and its fix otherwise (the workers fail their load with it). `notice`: told when the
    load waits for other engines' loads on its GPU (handlers/engine/room.py reserved)."""
    t0 = time.perf_counter()
    config = parse_config(yaml_config)
    torch.set_float32_matmul_precision(config.float32_matmul_precision)
    spec, placement, notes = choose_variant(model_dir, gpu_id, config, verdict_root)
    placement = _host_named(placement)
    for note in notes:
        logger.warning("%s", note)
    kind = kind_of(spec)
    require_checked(spec, kind)
    decoder = decoder_of(spec)
    _threads(placement.kind, config.cpu_threads)
    # the GPU's room for the engine, reserved until its graphs are captured (handlers/engine/room.py)
    ledger = os.path.join(verdict_root, "engines") if verdict_root else None
    with room.reserved(config.worker_gpu_mb, placement, ledger, notice=notice) as waited:
        t0 += waited  # the load line's load time is the load's own (the room's log line says the wait)
        if decoder is not None and not decoder.slotted:
            return _lanes(spec, decoder, placement, config, t0)
        return _stateless_or_slots(spec, kind, decoder, placement, config, t0)


def _stateless_or_slots(spec, kind, decoder, placement, config, t0: float) -> EngineModel:
    """The artifact loaded: a slot-form decoder's runner for generation, else the runner every
    worker's requests go through, warmed up, its graphs captured."""
    model = load_artifact(spec, placement, config)
    if decoder is not None:
        return _slots(model, spec, decoder, placement, config, t0)
    runner = runner_for(model, spec, placement.torch_device, config)
    padding = verify_padding(model, runner, spec, placement.torch_device) if runner.pad else "no padding"
    t1 = time.perf_counter()
    if config.warmup:
        warm(spec, runner, config.warmup_batch_sizes)
    graphs = runner.prepare(config, kind)
    # the workers pad their batches by this runner's replay times (Ready.costs, handlers/engine/runner.py);
    # the runner's plan stays, so jobs of neighbouring buckets are padded to one where its cost model
    # says one call is cheaper (batch.PadPlan.targets), and each job's rows are cut back to its bucket
    plan = runner.pad
    t2 = time.perf_counter()
    parts = [f"{spec.backend} artifact {spec.artifact} ({model.loader}) on {placement.where} [{placement.note}]",
             f"load {t1 - t0:.2f}s, warm-up and graphs {t2 - t1:.2f}s", graphs, runner.describe_sync(),
             f"padding: {padding}" + (f" (to {plan.describe()}: each batch by its worker, jobs shared by the engine)"
                                      if plan else ""),
             f"CPU threads {torch.get_num_threads()}", f"steps launched {config.engine_launch} (handler.engine_launch)"]
    describe = "; ".join(p for p in parts if p)  # a CPU runner describes no sync
    return EngineModel(runner, spec, spec.variant_dir, placement.where, describe, config)


def _slots(model, spec, decoder, placement, config, t0: float) -> EngineModel:
    """A slot-form decoder's runner, for the engine's generation (handlers/engine/generation.py)."""
    from handlers.run.slots import SlotRunner

    runner = SlotRunner(model, decoder, placement.torch_device, config)
    return _generating(runner, spec, placement, config, t0, f"slot-form decoder {spec.artifact} ({model.loader})")


def _lanes(spec, decoder, placement, config, t0: float) -> EngineModel:
    """A one-sequence decoder as handler.cache_copies lanes (handlers/run/lanes.py), for the
    engine's generation as a slot-form decoder's slots."""
    from handlers.run.lanes import LaneRunner, load_lanes

    lanes, note = load_lanes(spec, decoder, placement, config)
    return _generating(LaneRunner(lanes, config), spec, placement, config, t0,
                       f"one-sequence decoder {spec.artifact} ({lanes[0].model.loader})", note)


def _generating(runner, spec, placement, config, t0: float, what: str, note: str = "") -> EngineModel:
    """A decoder's runner (slots or lanes) warmed up, its graphs captured and its prompt budget
    per turn timed (handlers/generation/engine.py), for the engine's generation; the load line
    names `what` was loaded and `note`."""
    from handlers.generation.engine import measure_budget, warm as warm_slots

    t1 = time.perf_counter()
    if config.warmup:
        warm_slots(runner)
    graphs = runner.capture(config.cuda_graphs)
    budget = measure_budget(runner)
    describe = (f"{spec.backend} {what} on {placement.where} [{placement.note}]; " + (f"{note}; " if note else "")
                + f"load {t1 - t0:.2f}s, warm-up, graphs and budget {time.perf_counter() - t1:.2f}s; {graphs}; "
                f"CPU threads {torch.get_num_threads()}")
    return EngineModel(runner, spec, spec.variant_dir, placement.where, describe, config, budget)


def _host_named(placement):
    """`placement` naming its GPU as the host does where this engine sees one GPU alone: it inherits
    its worker's confinement (CUDA_VISIBLE_DEVICES, handlers/artifact/confine.py), so its cuda:0 is
    that entry, which every worker's load line and the log then show ("cuda:0 (host GPU 1)")."""
    ids = visible_ids(os.environ.get(VAR))
    if placement.kind != "cuda" or ids is None or len(ids) != 1:
        return placement
    return dataclasses.replace(placement, gpu=ids[0])


def _threads(kind: str, configured: int) -> None:
    """torch's intra-op threads: on a GPU one (the engine's loop feeds the device; its socket
    readers need the other cores), on the CPU every core this process may use, or
    handler.cpu_threads where set: the engine is the only process running the model."""
    if configured:
        n = configured
    elif kind == "cuda":
        n = 1
    else:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(n)
