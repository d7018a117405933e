#!/usr/bin/env python3
"""What an artifact (directory or .mar) needs, beside what this machine has; exit status 1 when
no variant can run here, 0 when one can.

  python -m compiled_serving.inspect_artifact ARTIFACT_DIR_OR_MAR [--gpu-id N] [--device-type cpu|gpu] [--trial-load]

Nothing in the artifact is executed unless --trial-load is given; that loads it and runs one
forward in a child process (as the handler's crash-safe load does) and reports a native crash.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--gpu-id", type=int, help="GPU the worker would be assigned (default: 0 if CUDA is visible)")
    p.add_argument("--device-type", choices=("cpu", "gpu"))
    p.add_argument("--trial-load", action="store_true")
    return p


def describe(label, spec) -> None:
    """Print what a variant needs and holds."""
    print(f"[{label}] backend        needs {spec.backend}; torch {spec.torch_version}")
    print(f"[{label}] device         needs {spec.device}"
          + (f" compute capability {spec.compute_capability} ({', '.join(spec.cuda_archs)})"
             if spec.compute_capability else ""))
    if spec.cpu_isa:
        print(f"[{label}] cpu isa        needs {spec.cpu_isa}")
    print(f"[{label}] platform       needs {spec.platform}/{spec.machine}")
    print(f"[{label}] inputs         {'; '.join(s.describe() for s in spec.inputs)}; "
          f"batch {spec.batch_min}..{spec.batch_max}"
          + "".join(f"; {k} {lo}..{hi}" for k, (lo, hi) in spec.dims.items()))
    print(f"[{label}] outputs        {'; '.join(s.describe() for s in spec.outputs)}")
    from handlers.artifact.decoder import of as decoder_of

    decoder = decoder_of(spec)
    how = ("continuous batching" if decoder and decoder.slotted else
           "one sequence at a time per worker, or one per copy of its cache in the engine's lanes on a GPU")
    print(f"[{label}] serves as      " + (f"a generative {decoder.describe()} ({how}, streamed tokens)" if decoder
                                         else "a stateless model (one answer per request, batched)"))
    unchecked = [s.name for s in spec.inputs if s.values and s.values.get("checked") is False]
    if unchecked:
        print(f"[{label}] values         UNCHECKED: {', '.join(unchecked)} reach an indexing operation "
              "with no derivable bound; add one with --input-range or handler.value_ranges")


def verdict(label, spec, gpu_id, args) -> bool:
    """Print whether the variant runs here (and, with --trial-load, loads); True if it does."""
    from handlers.artifact.probe import crash_safe_probe
    from handlers.artifact.variants import assess
    from handlers.config import HandlerConfig
    from handlers.errors import LoadError

    placement, problems, warnings = assess(spec, gpu_id, args.device_type)
    if not problems and args.trial_load:
        try:
            secs = crash_safe_probe(spec, placement, HandlerConfig())
            print(f"[{label}] trial load     OK on {placement} ({secs:.1f}s)")
        except LoadError as e:
            problems.append(str(e))
    for w in warnings:
        print(f"[{label}] WARNING        {w}")
    for prob in problems:
        print(f"[{label}] CANNOT RUN     {prob}")
    if not problems:
        print(f"[{label}] OK             runs here on {placement}")
    return not problems


def main(argv=None):
    args = build_parser().parse_args(argv)

    import torch

    from handlers.artifact.machine import this_machine
    from handlers.artifact.metadata import find_variants
    from handlers.artifact.variants import open_variant
    from handlers.errors import LoadError

    tmp = None
    root = args.path
    if not os.path.exists(root):
        print(f"{args.path}: no such file or directory")
        return 2
    if os.path.isfile(root) and zipfile.is_zipfile(root):
        tmp = tempfile.TemporaryDirectory()
        with zipfile.ZipFile(root) as z:
            z.extractall(tmp.name)
        root = tmp.name
    variants = find_variants(root)
    if not variants:
        print(f"{args.path}: no artifact.json found (not built by cs-compile / cs-archive; a .pt2 "
              "file of your own: cs-import it into an artifact directory first)")
        return 2
    gpu_id = args.gpu_id if args.gpu_id is not None else (0 if torch.cuda.is_available() else None)
    runnable = 0
    print(f"machine: {this_machine().describe()}")
    for d in variants:
        label = os.path.relpath(d, root)
        try:
            spec = open_variant(d)
        except LoadError as e:
            print(f"[{label}] cannot be read: {e}")
            continue
        describe(label, spec)
        runnable += verdict(label, spec, gpu_id, args)
    if tmp:
        tmp.cleanup()
    return 0 if runnable else 1


if __name__ == "__main__":
    sys.exit(main())
