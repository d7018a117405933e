#!/usr/bin/env python3
"""Build a self-contained .mar with torch-model-archiver: the handler package, the artifact(s)
with their artifact.json, and a model-config.yaml. A stock TorchServe with torch serves it;
nothing is pip-installed per model.

  python -m compiled_serving.archive --artifact DIR --name NAME [--out STORE]  (default: ROOT/model_store)
      [--artifact DIR2 ...]            # several variants (one per compute capability / CPU ISA)
  python -m compiled_serving.archive --artifact PROGRAM.pt2 --name NAME          # torch.export.save output
  python -m compiled_serving.archive --artifact PACKAGE.pt2 --program PROGRAM.pt2 --name NAME  # AOTInductor
      [--input-range INPUT[COL]=LO:HI ...]  # a file is imported first (compiled_serving/import_artifact.py)
      [--pad auto|none]                # auto: declare the padding the import found safe
      [--workers N] [--batch-size N] [--max-batch-delay MS] [--device-type cpu|gpu]
      [--gpu-memory-gib G] [--worker-overhead-mib M] [--gpu-memory-headroom F]  # the engine's GPU memory
      [--handler-option KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Optional
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from handlers.artifact.metadata import METADATA_FILE, read_spec, row_bytes, sha256_file
from handlers.config import RETIRED, parse_config
from handlers.errors import LoadError
from compiled_serving import worker_sizing
from compiled_serving.weight_bytes import weight_bytes


def slot_decoder(specs):
    """The slot-form decoder the variants hold (handlers/artifact/decoder.py), or None."""
    from handlers.artifact.decoder import of as decoder_of

    decoders = [decoder_of(s) for s in specs]
    return decoders[0] if decoders and all(d is not None and d.slotted for d in decoders) else None


def batched_decoder(specs, handler_opts: dict, device_type: Optional[str] = None):
    """The decoder whose sequences one continuous batch runs (handlers/continuous.py), or None:
    a slot-form decoder, or a one-sequence decoder whose every worker the engine serves as its
    lanes (handlers/run/lanes.py): with handler.engine on, any; with auto, where every variant
    is one a GPU worker runs (gpu_variants: built for CUDA and deviceType not cpu, or exported on
    the CPU with deviceType gpu). A worker the engine does not serve runs the decoder itself, one
    sequence at a time, which TorchServe's async worker would answer whole."""
    from handlers.artifact.decoder import of as decoder_of
    from handlers.config import parse_config

    slotted = slot_decoder(specs)
    if slotted is not None:
        return slotted
    decoders = [decoder_of(s) for s in specs]
    if not decoders or any(d is None for d in decoders):
        return None
    setting = parse_config({"handler": handler_opts}).engine
    if setting == "on" or (setting == "auto" and len(gpu_variants(specs, device_type)) == len(specs)):
        return decoders[0]
    return None


def gpu_variants(specs, device_type: Optional[str]) -> list:
    """The variants a GPU worker runs and this archive sizes for a GPU: built for CUDA (unless
    deviceType is cpu); with deviceType gpu also programs exported on the CPU, which the worker's
    GPU runs (handlers/engine_worker.py gpu_runnable; without it such an archive may as well be
    served on a CPU host, and is sized for one)."""
    from handlers.engine_worker import gpu_runnable

    if device_type == "cpu":
        return []
    return [s for s in specs if s.device == "cuda" or (device_type == "gpu" and gpu_runnable(s))]


def default_workers(cpus: int):
    """(workers, why) for speed on the CPU, on a machine with `cpus` cores: a CPU worker's operators
    already run on several threads each, so more workers than cores/4 only make them contend for the
    same cores. (Where a GPU runs the model, its engine does, and the workers follow the cores:
    compiled_serving/worker_sizing.py.)"""
    n = max(1, cpus // 4)
    return n, f"a CPU artifact on {cpus} cores: one worker per 4 cores, at least 1"


def gpu_sizing(args, cuda_specs, handler_opts: dict) -> worker_sizing.Sizing:
    """The engine's memory arithmetic for the largest of the variants a GPU runs (the engine loads one)."""
    if args.worker_overhead_mib is not None and args.worker_overhead_mib < 0:
        fail(f"--worker-overhead-mib {args.worker_overhead_mib}: expected the MiB the engine holds beside its weights")
    if not 0 <= args.gpu_memory_headroom < 1:
        fail(f"--gpu-memory-headroom {args.gpu_memory_headroom}: expected a fraction from 0 up to 1, e.g. 0.1")
    weights = max((weight_bytes(s) for s in cuda_specs), key=lambda w: w.bytes)
    graphs_off = handler_opts.get("cuda_graphs") in ("off", False)
    if args.worker_overhead_mib is not None:
        overhead, how = args.worker_overhead_mib, "--worker-overhead-mib"
    elif graphs_off:
        overhead, how = worker_sizing.OVERHEAD_NO_GRAPHS_MIB, "measured without CUDA graphs, H100 BERT-style encoder"
    else:
        overhead, how = worker_sizing.OVERHEAD_MIB, "measured with CUDA graphs, H100 BERT-style encoder"
    try:
        gpu = worker_sizing.target_gpu(args.gpu_memory_gib)
    except worker_sizing.SizingError as e:
        fail(str(e))
    return worker_sizing.Sizing(weights.mib, weights.how, overhead, how, gpu, args.gpu_memory_headroom,
                                cores=os.cpu_count() or 1)


def serves_by_engine(handler_opts: dict, specs: list, on_gpu: bool) -> bool:
    """Whether workers of these variants are served by the engine: the worker's own decision
    (handlers/engine_worker.py serves) for a worker given a GPU or not, with the settings as it reads them."""
    from handlers.config import parse_config
    from handlers.engine_worker import serves

    return serves(parse_config({"handler": handler_opts}).engine, specs, on_gpu=on_gpu)


@dataclass(frozen=True)
class Decision:
    """One decision of the archive: its value and what is said about it, in order: (to stderr?,
    text) lines that main prints. The decisions read the arguments and the artifacts, never
    change them, and raise ArchiveError; main alone prints and picks the exit status."""
    value: Any
    said: tuple = ()


def said(text: str) -> tuple:
    return (False, f"cs-archive: {text}")


def warned(text: str) -> tuple:
    return (True, f"cs-archive: warning: {text}")


@dataclass(frozen=True)
class WorkerPlan:
    workers: int
    worker_gpu_mb: Optional[float] = None  # the engine's need (handler.worker_gpu_mb), None: not sized
    gpu_sizing: Optional[dict] = None  # model-config's gpuSizing record


def decide_workers(args, specs, handler_opts) -> Decision:
    """The worker count (given, else for speed) with why. Where a GPU runs the variants, its engine
    does: the workers follow the host's cores once the engine fits the GPU, and the engine's need
    (checked by the engine before it loads) and the GPU memory it was sized for are kept; an engine
    that does not fit is refused, or warned about beside a hand-chosen count."""
    cuda = gpu_variants(specs, args.device_type)
    if cuda:
        sizing = gpu_sizing(args, cuda, handler_opts)
        if args.workers is None:
            try:
                return Decision(WorkerPlan(sizing.workers, sizing.need_mib, sizing.record()), (said(sizing.line()),))
            except worker_sizing.SizingError as e:
                fail(str(e))
        misfit = sizing.misfit(args.workers)
        return Decision(WorkerPlan(args.workers, sizing.need_mib, sizing.record()), (warned(misfit),) if misfit else ())
    lines = []
    if args.gpu_memory_gib is not None or args.worker_overhead_mib is not None:
        lines.append((True, "cs-archive: note: --gpu-memory-gib and --worker-overhead-mib size a GPU's engine; "
                            "these artifacts run on the CPU, so they are not used"))
    if args.workers is not None:
        return Decision(WorkerPlan(args.workers), tuple(lines))
    speed, why = cpu_speed(specs, handler_opts, args.device_type)
    return Decision(WorkerPlan(speed), tuple(lines) + (said(f"--workers {speed} ({why}; pass --workers N to choose)"),))


def cpu_speed(specs, handler_opts: dict, device_type) -> tuple:
    """(workers, why) on the CPU: default_workers, one for a decoder whose sequences one batch runs."""
    slotted, batched = slot_decoder(specs), batched_decoder(specs, handler_opts, device_type)
    if batched is not None and not batched.slotted:  # the engine's lanes (handlers/run/lanes.py), engine: on
        return 1, ("a one-sequence decoder served by the engine: its lanes (handler.cache_copies, copies of the "
                   "cache on one copy of the weights) run the sequences of every worker, which tokenize and "
                   "stream (more workers: more of that CPU work)")
    if slotted is not None and serves_by_engine(handler_opts, specs, on_gpu=False):  # engine: on holds the batch
        return 1, (f"a slot-form decoder served by the engine: its one batch runs all {slotted.slots} sequence "
                   "slots for every worker, which tokenize and stream (more workers: more of that CPU work)")
    if slotted is not None:  # one batch runs every sequence: a second worker is a second copy
        return 1, (f"a slot-form decoder: one worker runs all {slotted.slots} sequence slots on one cache; "
                   "another worker would hold another copy of the weights and the cache")
    return default_workers(os.cpu_count() or 1)


class ArchiveError(Exception):
    """What stops the archive: main prints `cs-archive: error: MESSAGE` and exits with status 1."""


def fail(msg):
    raise ArchiveError(msg)


def _yaml_value(text: str):
    return yaml.safe_load(text)


def copy_variant(src: str, dest: str):
    try:
        spec = read_spec(src)
    except LoadError as e:
        fail(str(e))
    if sha256_file(spec.artifact_path) != spec.sha256:
        fail(f"{spec.artifact_path} does not match the SHA-256 in {METADATA_FILE}; recompile it")
    from handlers.artifact import cache
    from handlers.artifact.kinds import kind_of
    from handlers.artifact.state import require_checked

    try:
        require_checked(spec, kind_of(spec))  # the worker would refuse it: say so now
        cache.read(spec)  # a malformed cache record likewise
    except LoadError as e:
        fail(str(e))
    os.makedirs(dest, exist_ok=True)
    shutil.copy2(os.path.join(src, METADATA_FILE), dest)
    shutil.copy2(spec.artifact_path, dest)
    cubins = spec.extra.get("cubin_dir")
    if cubins:
        shutil.copytree(os.path.join(src, cubins), os.path.join(dest, cubins))
    return spec


LARGE_RESPONSE_ROW = 4 << 20


def response_row_bytes(spec) -> int:
    """Bytes one row of the outputs takes in a response (0 where a dimension is named: its size
    is the request's)."""
    return row_bytes(spec.outputs, {})


# batchSize with no --batch-size: 16 for a CUDA model whose request rows are small, 8 otherwise.
# Measured through TorchServe 0.12 on an H100 (docs/results/heavy_{mlp,bert,r50}_fp16_h100.md,
# 6 workers, 1 ms delay): 16 against 8 served more at 1, 64 and 128 clients for the MLP (1 KiB
# rows; +5% at 64, +52% at 128) and the BERT classifier (<= 4 KiB; +10%, +43%); ResNet-50
# (294 KiB rows), whose frontend time goes to reading the bodies, served 10% less at 64 clients,
# so large rows keep 8. CPU workers were not measured at 16 and keep 8.
BATCH_DEFAULT, BATCH_SMALL_ROWS, SMALL_REQUEST_ROW = 8, 16, 64 << 10


def default_batch(specs) -> tuple:
    """(batchSize with no --batch-size, why)."""
    rows = [row_bytes(s.inputs, s.dims) for s in specs]
    if all(s.device == "cuda" for s in specs) and all(0 < r <= SMALL_REQUEST_ROW for r in rows):
        return BATCH_SMALL_ROWS, (f"a CUDA model with request rows of at most {max(rows) / 1024:.1f} KiB: "
                                  "measured faster than 8 (compiled_serving/archive.py BATCH_SMALL_ROWS)")
    return BATCH_DEFAULT, "measured for ResNet-50 class models and CPU workers"


def decide_batch_size(given, specs, handler_opts: dict, device_type: Optional[str] = None) -> Decision:
    """TorchServe's batchSize: as given, else default_batch's (16 or 8), at most what every
    variant accepts per call, and 1 where a row of the outputs is several MiB; with the warnings
    a batch size calls for."""
    lines = []
    if batched_decoder(specs, handler_opts, device_type) is not None:  # the engine forms the batches (handlers/continuous.py)
        if given not in (None, 1):
            fail(f"--batch-size {given}: this decoder takes each request as it arrives and batches its "
                 "sequences itself (continuous batching); leave --batch-size out")
        return Decision(1, (said("batchSize 1 with asyncCommunication: the frontend hands every request to the "
                                 "worker as it arrives and the worker's engine batches the sequences "
                                 "(continuous batching, handlers/continuous.py)"),))
    if given is not None:
        n = given
    elif any(response_row_bytes(s) > LARGE_RESPONSE_ROW for s in specs):
        n = 1
    else:
        base, why = default_batch(specs)
        n = max(1, min([base] + [s.batch_max for s in specs]))
        lines.append(said(f"batchSize {n} ({why}; pass --batch-size N to choose)"))
    for spec in specs:
        if n > spec.batch_max and handler_opts.get("split_oversized", True) is not False:
            lines.append(warned(f"batchSize {n} exceeds what {spec.artifact} accepts per call "
                                f"({spec.batch_min}..{spec.batch_max}); batches will be split into several calls"))
        elif n > spec.batch_max:
            lines.append(warned(f"batchSize {n} exceeds the artifact's max batch {spec.batch_max} and "
                                "split_oversized is off: oversized requests are refused"))
        big = response_row_bytes(spec)
        if n > 1 and big > LARGE_RESPONSE_ROW:
            lines.append(warned(
                f"each row of {spec.artifact}'s outputs is {big / 2**20:.1f} MiB. TorchServe 0.12's frontend re-reads "
                "a batched worker response from its start on every network read until the last request's bytes "
                "arrive, which is quadratic in the response size (seen in soak runs whose logs were not kept: a batch "
                "of 2 x 50 MB took 22 s to relay after 0.2 s of inference). Use --batch-size 1 for this model"))
    return Decision(n, tuple(lines))


def check_delay(delay_ms: int, batch_size: int) -> None:
    """A batch of more than one with maxBatchDelay 0 waits 100 ms for every batch: TorchServe 0.12
    takes 0 as unset and uses its default (measured: every batch of a worker 101-104 ms apart at
    batchSize 8, maxBatchDelay 0, through real TorchServe on the CPU machine, echo handler alike)."""
    if batch_size > 1 and delay_ms <= 0:
        raise ArchiveError(f"--max-batch-delay {delay_ms} with batchSize {batch_size}: TorchServe 0.12 takes a "
                           "delay of 0 as unset and waits its default, 100 ms, for every batch to fill. Use "
                           "--max-batch-delay 1 (the least it honours), or --batch-size 1 for no batching")


def imported(path: str, i: int, args, handler_opts: dict, tmp: str) -> str:
    """A directory as it is; a .pt2 file imported into a directory of its own first."""
    if os.path.isdir(path):
        return path
    if not os.path.exists(path):
        fail(f"--artifact {path}: no such file or directory")
    from compiled_serving.import_artifact import ImportError_, import_artifact

    try:
        return import_artifact(path, os.path.join(tmp, f"imported_{i}"), args.program, args.input_range,
                               find_pad=args.pad == "auto" and "pad" not in handler_opts)
    except ImportError_ as e:
        fail(e.reason)


# What serving without padding costs, measured (docs/performance.md "The final revision"):
# requests of different lengths cannot share a call unless padded.
NO_PAD_COST = ("requests of different lengths run as groups of equal length, every distinct length its own "
               "call: a text encoder with lengths 16..128 at 64 clients served 2387.0 req/s without padding against "
               "14427.5 with it on one H100 (docs/performance.md)")


def decide_pad(pad_flag: str, handler_opts: dict, specs) -> Decision:
    """The pad values to declare (None: none) with why: an explicit pad= option as given, --pad
    none nothing, else what the import found safe for every variant (artifact.json extra.padding,
    compiled_serving/find_padding.py)."""
    from handlers.artifact.decoder import of as decoder_of

    if not any(s.dims for s in specs) or any(decoder_of(s) for s in specs):  # a decoder is never padded
        return Decision(None)
    if "pad" in handler_opts:
        return Decision(None, (said("pad= as given with --handler-option (the worker checks at load that it "
                                    "leaves answers unchanged)"),))
    if pad_flag == "none":
        return Decision(None, (said(f"no padding (--pad none): {NO_PAD_COST}"),))
    found = [s.extra.get("padding") for s in specs]
    if any(f is None for f in found):
        return Decision(None, (said(
            "no padding: padding was not tried (a directory not imported from a .pt2 with its program; python -m "
            f"compiled_serving.import_artifact tries it); {NO_PAD_COST}. If the model masks padding, declare it: "
            "--handler-option \"pad={input_ids: 0, attention_mask: 0}\""),))
    pads = [f.get("pad") for f in found]
    if all(p and p == pads[0] for p in pads):
        from compiled_serving.find_padding import show

        pad = {s.name: pads[0][s.name] for s in specs[0].inputs if s.name in pads[0]}  # inputs' order
        return Decision(pad, (said(f"pad={show(pad)}: {found[0]['why']} (compiled_serving/find_padding.py; the "
                                   "worker checks it again at load; --pad none turns it off)"),))
    why = next((f["why"] for f in found if not f.get("pad")), "the variants disagree")
    unsafe = why.startswith("padding changes")  # find_padding's words for answers that changed
    return Decision(None, (said(f"{'no padding is safe' if unsafe else 'no padding'}: {why}. So {NO_PAD_COST}"),))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", action="append", required=True,
                   help="directory written by cs-compile (repeat for variants), or a .pt2 file "
                        "from torch.export.save or aoti_compile_and_package")
    p.add_argument("--program", help="with an AOTInductor package: the torch.export program it was "
                                     "compiled from (the package does not record its input shapes)")
    p.add_argument("--input-range", action="append", default=[], metavar="INPUT[COL]=LO:HI",
                   help="with a .pt2 file: valid values of an integer input (INPUT[COL]: of one column)")
    p.add_argument("--name", required=True)
    p.add_argument("--out", default=os.path.join(ROOT, "model_store"),
                   help="the model store to write NAME.mar into (default: this checkout's model_store/)")
    p.add_argument("--version", default="1.0")
    # Defaults measured end to end through TorchServe (docs/performance.md "Serving settings" and
    # "One engine per GPU", docs/results/e2e_*, engine_*): 3 workers per 4 cores feeding the
    # engine, batches of up to 8, 1 ms batch delay.
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes for the model (default: for an artifact a GPU runs 3 per 4 cores of this "
                        "machine, feeding one engine process per GPU (handler.engine auto), once the engine fits "
                        "the GPU's memory (printed with the arithmetic); for a CPU artifact one per 4 cores of "
                        "this machine, at least 1, and one for a decoder)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="memory of the GPU that will serve a CUDA artifact (default: GPU 0 of this machine; "
                        f"without one {worker_sizing.DEFAULT_GPU_GIB:g}, the L4/A10G class, printed as assumed)")
    p.add_argument("--worker-overhead-mib", type=float, default=None,
                   help="GPU memory the engine holds beside its weights: CUDA context, graph pools, activations "
                        f"at the largest batch (default {worker_sizing.OVERHEAD_MIB}, measured on an H100 with "
                        f"CUDA graphs; {worker_sizing.OVERHEAD_NO_GRAPHS_MIB} with cuda_graphs=off)")
    p.add_argument("--gpu-memory-headroom", type=float, default=worker_sizing.DEFAULT_HEADROOM,
                   help=f"fraction of the GPU's memory left out of the sizing (default {worker_sizing.DEFAULT_HEADROOM:g})")
    p.add_argument("--batch-size", type=int, default=None,
                   help="TorchServe batchSize (default: 16 for a CUDA model whose request rows are at most "
                        "64 KiB, else 8; at most the artifact's max batch; 1 for outputs of several MiB per row)")
    p.add_argument("--max-batch-delay", type=int, default=1, help="milliseconds (default 1)")
    p.add_argument("--response-timeout", type=int, default=120, help="seconds")
    p.add_argument("--device-type", choices=("cpu", "gpu"))
    p.add_argument("--device-ids", help="comma-separated GPU ids for this model's workers")
    p.add_argument("--handler-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--tokenizer", help="a decoder's tokenizer.json (the `tokenizers` library's file, as a "
                                       "transformers model ships it): text in and out, end-of-sequence ids")
    p.add_argument("--tokenizer-config", help="the decoder's tokenizer_config.json (transformers' file): its "
                                              "chat_template (or chat_template.jinja beside it) serves OpenAI's "
                                              "v1/chat/completions (default: the one beside --tokenizer, if any)")
    p.add_argument("--pad", choices=("auto", "none"), default="auto",
                   help="auto (default): for inputs with a dynamic length, declare pad= where the import found "
                        "padding leaves the program's answers unchanged (printed with the reason); none: never "
                        "pad. An explicit --handler-option pad=... is used as given")
    return p


def handler_options(items: list) -> dict:
    """--handler-option KEY=VALUE items, each value read as YAML."""
    opts = {}
    for item in items:
        if "=" not in item:
            fail(f"--handler-option {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        if k in RETIRED:  # a worker would ignore it: say so now, and write nothing
            fail(f"--handler-option {k}: retired, {RETIRED[k]}; leave it out")
        opts[k] = _yaml_value(v)
    return opts


def model_config(args, handler_opts: dict, workers: Optional[WorkerPlan] = None, batch_size: int = 1,
                 pad: Optional[dict] = None, continuous: bool = False) -> dict:
    """model-config.yaml, the one place that writes it, validated as the worker validates it."""
    if not args.name.replace("_", "").replace("-", "").isalnum():
        fail(f"--name {args.name!r}: use letters, digits, '-' and '_'")
    n = workers.workers if workers else args.workers
    cfg = {"minWorkers": n, "maxWorkers": n, "batchSize": batch_size,
           "maxBatchDelay": args.max_batch_delay, "responseTimeout": args.response_timeout}
    if continuous:  # TorchServe 0.12 then sends requests without waiting for answers (handlers/continuous.py)
        cfg["asyncCommunication"] = True
    if args.device_type:
        cfg["deviceType"] = args.device_type
    if args.device_ids:
        cfg["deviceIds"] = [int(x) for x in args.device_ids.split(",")]
    handler = dict(handler_opts)
    if workers and workers.worker_gpu_mb is not None:
        handler.setdefault("worker_gpu_mb", workers.worker_gpu_mb)
    if pad:
        handler["pad"] = pad
    if handler:
        cfg["handler"] = handler
    if workers and workers.gpu_sizing:
        cfg["gpuSizing"] = workers.gpu_sizing
    try:
        parse_config(cfg)  # the same validation the worker runs: fail here, not at load
    except LoadError as e:
        fail(str(e))
    return cfg


def stage_variants(dirs: list, stage: str) -> list:
    """Copy each artifact directory into the staging directory (several: one variant directory
    each); their specs."""
    if len(dirs) == 1:
        return [copy_variant(dirs[0], stage)]
    specs = []
    for i, src in enumerate(dirs):
        spec = read_spec(src)
        tag = spec.device + (f"_cc{spec.compute_capability.replace('.', '')}" if spec.compute_capability
                             else f"_{(spec.cpu_isa or 'generic').split()[0].lower()}")
        specs.append(copy_variant(src, os.path.join(stage, "variants", f"{i:02d}_{spec.backend}_{tag}")))
    return specs


def stage_tokenizer(args, specs, stage) -> None:
    """--tokenizer into the archive's top level (handlers/generation/text.py reads it there),
    checked to load and to fit the decoder's vocabulary."""
    from handlers.artifact.decoder import of as decoder_of
    from handlers.generation.text import TOKENIZER_FILE

    decoders = [decoder_of(s) for s in specs]
    if all(decoders):  # say what it was recognised as: a decoder is served as generated tokens, not tensors
        print(f"cs-archive: recognised as a {decoders[0].describe()}; served as generated tokens (streamed)")
    beside = [os.path.join(a, TOKENIZER_FILE) for a in args.artifact if os.path.isdir(a)]
    if not args.tokenizer and beside and os.path.isfile(beside[0]):  # cs-export-lm's directory carries its own
        args.tokenizer = beside[0]
        print(f"tokenizer: {beside[0]} (the artifact directory's own; --tokenizer names another)")
    if not args.tokenizer:
        if getattr(args, "tokenizer_config", None):
            fail("--tokenizer-config needs --tokenizer (the chat template's text is tokenized by it)")
        return
    if not all(decoders):
        fail("--tokenizer is for a decoder (a language model with its KV cache in the program); "
             f"{specs[0].artifact} is served in batches and takes tensors")
    try:
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(args.tokenizer).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001  (the library's own error, named)
        fail(f"--tokenizer {args.tokenizer}: not a tokenizers file ({type(e).__name__}: {e}); pass the "
             "tokenizer.json a transformers model ships (tokenizer.save_pretrained writes it)")
    vocab = min(d.vocab for d in decoders)
    if size > vocab:
        fail(f"--tokenizer {args.tokenizer} has {size} tokens but the decoder's logits cover {vocab}: "
             "is it the model's own tokenizer?")
    shutil.copy2(args.tokenizer, os.path.join(stage, TOKENIZER_FILE))
    stage_chat_template(args, stage)


def stage_chat_template(args, stage) -> None:
    """--tokenizer-config (or tokenizer_config.json beside --tokenizer) into the archive's top
    level with its chat template, checked to compile as the worker compiles it
    (handlers/generation/chat.py); said either way."""
    from handlers.errors import LoadError
    from handlers.generation import chat

    path = args.tokenizer_config or os.path.join(os.path.dirname(os.path.abspath(args.tokenizer)), chat.CONFIG_FILE)
    if not os.path.isfile(path):
        if args.tokenizer_config:
            fail(f"--tokenizer-config {path}: no such file")
        print(f"chat template: none (no {chat.CONFIG_FILE} beside --tokenizer; pass --tokenizer-config): "
              "v1/chat/completions answers 400, v1/completions serves")
        return
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        source = chat.template_source(config, os.path.join(os.path.dirname(path), chat.JINJA_FILE))
        if source is not None:
            chat.ChatTemplate(source, config)
    except (OSError, ValueError, AttributeError, LoadError) as e:
        fail(f"--tokenizer-config {path}: {getattr(e, 'message', e)}; pass the tokenizer_config.json a transformers "
             "model ships (tokenizer.save_pretrained writes it)")
    config["chat_template"] = source  # the .jinja file's text where the config had none
    with open(os.path.join(stage, chat.CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False)
    print(f"chat template: {'from ' + path if source else 'none in ' + path} (OpenAI's v1/chat/completions "
          f"{'serves' if source else 'answers 400'})")


def declare_eos(specs, handler_opts: dict) -> None:
    """The end-of-sequence ids cs-export-lm recorded from the checkpoint's generation config
    (artifact.json `extra.generation`) as handler.eos_token_ids, unless given; said either way."""
    recorded = (specs[0].extra.get("generation") or {}).get("eos_token_ids")
    if recorded is None:
        return
    if "eos_token_ids" in handler_opts:
        print(f"end-of-sequence ids: {list(handler_opts['eos_token_ids'])} as given (the artifact records {recorded})")
        return
    handler_opts["eos_token_ids"] = list(recorded)
    where = specs[0].extra["generation"].get("from", "the checkpoint")
    print(f"end-of-sequence ids: {recorded} (the checkpoint's {where}, recorded by cs-export-lm)")


def run_archiver(args, cfg, stage, tmp) -> None:
    """torch-model-archiver over the staging directory, with model-config.yaml from `cfg`."""
    config_path = os.path.join(tmp, "model-config.yaml")
    with open(config_path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    cmd = ["torch-model-archiver", "--model-name", args.name, "--version", args.version,
           "--handler", os.path.join(stage, "handlers", "ts_entry.py"),
           "--extra-files", stage, "--config-file", config_path,
           "--export-path", args.out, "--force", "--archive-format", "zip-store"]
    exe = shutil.which("torch-model-archiver") or os.path.join(os.path.dirname(sys.executable),
                                                                "torch-model-archiver")
    cmd[0] = exe
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"torch-model-archiver failed: {r.stderr.strip() or r.stdout.strip()}")


def build(args) -> tuple:
    """The archive: (its path, the variants' specs, its model config, the workers' and batch
    size's decisions), what was decided printed in order."""
    opts = handler_options(args.handler_option)
    model_config(args, opts)  # the options checked before anything is imported
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        stage = os.path.join(tmp, "stage")
        shutil.copytree(os.path.join(ROOT, "handlers"), os.path.join(stage, "handlers"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        dirs = [imported(a, i, args, opts, tmp) for i, a in enumerate(args.artifact)]
        specs = stage_variants(dirs, stage)
        stage_tokenizer(args, specs, stage)
        declare_eos(specs, opts)
        workers = decide_workers(args, specs, opts)
        pad = decide_pad(args.pad, opts, specs)
        batch = decide_batch_size(args.batch_size, specs, opts, args.device_type)
        check_delay(args.max_batch_delay, batch.value)
        for d in (workers, pad, batch):
            show(d)
        cfg = model_config(args, opts, workers.value, batch.value, pad.value,
                           batched_decoder(specs, opts, args.device_type) is not None)
        run_archiver(args, cfg, stage, tmp)
    return os.path.join(args.out, f"{args.name}.mar"), specs, cfg


def show(decision: Decision) -> None:
    for to_stderr, text in decision.said:
        print(text, file=sys.stderr if to_stderr else sys.stdout)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        mar, specs, cfg = build(args)
    except (ArchiveError, LoadError) as e:
        print(f"cs-archive: error: {e}", file=sys.stderr)
        return 1
    from handlers.artifact.decoder import of as decoder_of

    decoder = decoder_of(specs[0])
    kind = (f"recognised as a {decoder.describe()}, served with streamed tokens"
            + (" by continuous batching" if cfg.get("asyncCommunication") else "") if decoder else "a stateless model")
    print(f"wrote {mar} ({len(specs)} variant(s); {kind}; batchSize {cfg['batchSize']}, workers {cfg['minWorkers']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
