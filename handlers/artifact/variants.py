"""Variant choice: which of the archive's artifacts this worker serves, and where.

Each variant directory holds one artifact.json and its artifact (one per compute capability
or CPU ISA, say). Every variant's artifact.json is placed (device.py) and judged (rules.py);
then, best first (exact fits before ones that only warn, then archive order), a variant's file
is checked against its pinned SHA-256, recognised from its own files (kinds.recognise) and
judged again with what they say, until one fits exactly (the artifact's own facts may turn a
warning into an exact fit or the reverse, so a warning does not stop the search). A load with an
exact fit hashes the variant it serves once; it hashes others only while none fits exactly.
"""
from __future__ import annotations

import os

from handlers.artifact.device import Wanted, placement_for_worker
from handlers.artifact.integrity import verify_integrity
from handlers.artifact.kinds import kind_of, recognise
from handlers.artifact.machine import describe_machine, this_machine
from handlers.artifact.metadata import ArtifactSpec, find_variants, read_spec
from handlers.artifact.rules import check
from handlers.config import HandlerConfig
from handlers.errors import IncompatibleArtifact, LoadError


def open_variant(directory: str, verdict_root=None) -> ArtifactSpec:
    """artifact.json, checked against the artifact's SHA-256 before anything inside the
    artifact is read (a match kept under `verdict_root`: integrity.py), then recognised from
    what the artifact itself says it is."""
    spec = read_spec(directory)
    verify_integrity(spec, kind_of(spec).zipped, verdict_root)
    return recognise(spec)


def assess(spec: ArtifactSpec, gpu_id, device_type, strict_versions=False):
    """Where this worker would run the artifact and what stops it. Returns
    (placement or None, fatal problems, warnings)."""
    kind = kind_of(spec)
    missing = kind.requirements(spec)
    if missing:
        return None, missing, []
    try:
        placement = placement_for_worker(gpu_id, Wanted(device_type, spec.device, spec.backend, kind.relocatable))
    except IncompatibleArtifact as e:
        return None, [str(e)], []
    fatal, warn = check(spec, kind, placement, this_machine(placement), strict_versions)
    return placement, fatal, warn


def _target(spec: ArtifactSpec) -> str:
    return (f"{spec.backend}/{spec.device}"
            + (f" cc {spec.compute_capability}" if spec.compute_capability else "")
            + (f" ISA {spec.cpu_isa}" if spec.cpu_isa and spec.device == "cpu" else ""))


def _refusal(model_dir: str, d: str, spec: ArtifactSpec, fatal: list) -> str:
    return f"[{os.path.relpath(d, model_dir)}: {_target(spec)}] " + "; ".join(fatal)


def _variant_dirs(model_dir: str, config: HandlerConfig) -> list:
    dirs = find_variants(model_dir)
    if config.variant:
        dirs = [d for d in dirs if os.path.basename(d) == config.variant]
        if not dirs:
            raise LoadError(f"handler.variant {config.variant!r} names no variant in the archive")
    if not dirs:
        raise LoadError(f"no artifact.json in {model_dir} or its variants/ directory: build the archive "
                        "with cs-archive")
    return dirs


def choose_variant(model_dir: str, gpu_id, config: HandlerConfig, verdict_root=None):
    """Pick the artifact variant that fits this worker. Returns (spec, placement, warnings).
    `verdict_root`: where matched digests are kept (open_variant)."""
    refused, ranked = {}, []  # refused: variant dir -> why, as last judged
    for d in _variant_dirs(model_dir, config):
        spec = read_spec(d)
        placement, fatal, warn = assess(spec, gpu_id, config.device_type, config.strict_versions)
        if fatal:
            refused[d] = _refusal(model_dir, d, spec, fatal)
        on_cpu = placement is None or placement.kind != "cuda"
        ranked.append((bool(fatal), bool(warn), on_cpu, len(ranked), d))
    # by artifact.json: exact fits, then warnings; on a GPU its placements first (a GPU's engine
    # given a CPU package and a program it can relocate runs the program), then archive order;
    # refused last
    ranked.sort()
    best = None
    for *_, d in ranked:
        spec = open_variant(d, verdict_root)  # hashed and recognised: now its own files speak
        placement, fatal, warn = assess(spec, gpu_id, config.device_type, config.strict_versions)
        if fatal:
            refused[d] = _refusal(model_dir, d, spec, fatal)
            continue
        refused.pop(d, None)
        if best is None or (best[2] and not warn):
            best = (spec, placement, warn)
        if not warn:  # an exact fit: nothing after it in this order can be better
            break
    if best is None:
        raise IncompatibleArtifact("no artifact in this archive can run on this worker. This machine: "
                                   f"{describe_machine(gpu_id)}. " + " ".join(refused.values()))
    return best
