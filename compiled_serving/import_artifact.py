#!/usr/bin/env python3
"""Bring an artifact compiled in the user's own pipeline into the layout the handler serves: a
directory holding the file and the artifact.json that compiled_serving/compile.py would have written.

  python -m compiled_serving.import_artifact --artifact PROGRAM.pt2 --out DIR
  python -m compiled_serving.import_artifact --artifact PACKAGE.pt2 --program PROGRAM.pt2 --out DIR
      [--input-range INPUT[COL]=LO:HI ...] [--device-index N] [--pad auto|none]

Accepted:
- a program saved with `torch.export.save(ep, "PROGRAM.pt2")`: it holds the whole contract
  (input and output names, dtypes, every dimension, each dynamic dimension's range), read from it
  by compiled_serving/contract.py, and is served as an exported program;
- an AOTInductor package from `torch._inductor.aoti_compile_and_package(ep, package_path=...)`:
  it records the device and compile flags it was built for, not its inputs' shapes or ranges, so
  the program it was compiled from comes with it (--program; save `ep` before compiling).

The same checks as compile: the artifact loads in a child process first (a native crash is
reported, not suffered), then its answers are compared with the program's on example inputs.
Where an input has a dynamic length, padding is tried on the program (compiled_serving/find_padding.py)
and the finding recorded in artifact.json (`extra.padding`: the pad values, or none and why),
which compiled_serving/archive.py declares as `pad=`; `--pad none` skips it.
`python -m compiled_serving.archive --artifact FILE.pt2` runs this on its own.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import zipfile

from handlers.artifact import cache
from handlers.artifact.metadata import ArtifactSpec, TensorSpec, read_spec, sha256_file, write_spec
from compiled_serving import contract

ARTIFACT = "model.pt2"


class ImportError_(SystemExit):
    """An import that cannot go on; `reason` alone (cs-archive prefixes it with its own name)."""

    def __init__(self, msg):
        super().__init__(f"cs-import: error: {msg}")
        self.reason = msg


def is_aoti_package(path: str) -> bool:
    """AOTInductor packages are PT2 archives whose entries include the compiled model under
    data/aotinductor/ (torch._inductor.package)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any("/aotinductor/" in n or n.startswith("data/aotinductor/") for n in z.namelist())
    except zipfile.BadZipFile:
        raise ImportError_(f"{path} is not a PT2 archive (not a zip file); expected a file written by "
                           "torch.export.save or torch._inductor.aoti_compile_and_package") from None


def not_a_program(path: str):
    """What a file that is no torch.export program is, with the way to one, or None: a
    TorchScript archive (torch.jit.save: code/ and constants.pkl) or a torch.save checkpoint (a
    pickled module or state_dict: data.pkl and no models/) is the file a user most often has."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return None
    if any("/aotinductor/" in n for n in names):
        return (f"{path} is an AOTInductor package, not a torch.export program: pass it as --artifact, and "
                "the program it was compiled from as --program")
    if any("/models/" in n for n in names):
        return None
    how = ("export it: ep = torch.export.export(model.eval(), example_inputs); "
           "torch.export.save(ep, 'model.pt2'), or let cs-compile --model FILE.py:FACTORY do it "
           "(docs/serve-your-own-model.md)")
    if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
        return f"{path} is a TorchScript module (torch.jit.save), not a torch.export program: {how}"
    if any(n.endswith("/data.pkl") for n in names):
        return (f"{path} is a torch.save checkpoint (a pickled module or a state_dict), not a torch.export "
                f"program: build the model, load its weights, then {how}")
    return None


def load_program(path: str):
    """The program with its tensors on the CPU, and the device it was exported on
    (handlers/artifact/program_file.py: a program saved from cuda:1 reads where there is none)."""
    import torch

    from handlers.artifact.program_file import load_on_cpu

    other = not_a_program(path)
    if other:
        raise ImportError_(other)
    try:
        return load_on_cpu(path)
    except Exception as e:  # torch raises several types for a file of another kind or version
        raise ImportError_(f"{path} could not be read as a torch.export program ({type(e).__name__}: "
                           f"{str(e)[:300]}); expected a file written by torch.export.save(ep, path) "
                           f"with this torch ({torch.__version__})") from None


def check_device(exported_on, needs_gpu: bool, asked=None):
    """Where the import's checks run (one device for all of them). A CPU program or package: the
    CPU. Otherwise `asked` (--device-index) where given, else the GPU the program was exported on
    where this machine has it, else GPU 0, else (a program, which relocates) the CPU; a CUDA
    package (`needs_gpu`) on a machine without a GPU is refused, naming the fix."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if exported_on.type == "cpu" and not needs_gpu:
        return torch.device("cpu")
    if asked is not None:
        if asked >= gpus:
            raise ImportError_(f"--device-index {asked}: this machine has {gpus} GPU(s)")
        return torch.device("cuda", asked)
    if exported_on.type == "cuda" and exported_on.index is not None and exported_on.index < gpus:
        return exported_on
    if gpus:
        return torch.device("cuda", 0)
    if needs_gpu:
        raise ImportError_("the AOTInductor package was compiled for CUDA and this machine has no GPU: import it on "
                           "a machine with one (the import runs it once to compare it with the program)")
    return torch.device("cpu")


def example_inputs(found: contract.Contract, device, low: bool = False) -> list:
    """One example per input at a batch and lengths inside their ranges; integers inside their
    value ranges (the bounds from the graph), seeded."""
    import torch

    from compiled_serving.compile import example_size

    g = torch.Generator().manual_seed(1234)
    rows = min(found.batch[1], max(found.batch[0], 2))
    sizes = {n: (lo if low else example_size(lo, hi)) for n, (lo, hi) in found.dims.items()}
    out = []
    for name, dtype, shape in found.inputs:
        dims = (rows,) + tuple(sizes[d] if isinstance(d, str) else d for d in shape[1:])
        dt = getattr(torch, dtype)
        if dt == torch.bool:
            t = torch.rand(dims, generator=g) > 0.3
        elif dt.is_floating_point:
            t = torch.randn(dims, generator=g).to(dt)
        else:
            v = found.values.get(name) or {}
            lo, hi = v.get("min", 0), v.get("max", 7)
            t = torch.randint(max(lo, 0), min(hi, max(lo, 0) + 7) + 1, dims, generator=g).to(dt)
        out.append(t.to(device))
    return out


def _compat_facts(kind: str, path: str, device: str) -> dict:
    """compute capability, CUDA archs and CPU ISA as compile.py records them."""
    import torch

    facts = {"compute_capability": None, "cuda_archs": (), "cpu_isa": None}
    if kind == "aoti":
        from handlers.artifact.kinds.aoti_package import package_metadata

        meta = package_metadata(path)
        facts["cpu_isa"] = meta.get("AOTI_CPU_ISA") or None
        c = meta.get("AOTI_COMPUTE_CAPABILITY")
        if device == "cuda" and c:
            facts["compute_capability"], facts["cuda_archs"] = f"{c[:-1]}.{c[-1]}", (f"sm_{c}",)
            return facts
    if device == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        facts["compute_capability"], facts["cuda_archs"] = f"{major}.{minor}", (f"sm_{major}{minor}",)
    return facts


def import_artifact(path: str, out: str, program: str | None = None, input_ranges=(), device_index: int | None = None,
                    find_pad: bool = True) -> str:
    """Writes DIR/model.pt2 and DIR/artifact.json (with the padding finding where `find_pad` and
    an input has a dynamic length); returns DIR."""
    import torch

    if not os.path.isfile(path):
        raise ImportError_(f"{path} is not a file")
    out = os.path.abspath(out)  # the trial load runs in another directory (artifact/probe.py)
    aoti = is_aoti_package(path)
    if aoti and not program:
        raise ImportError_(f"{path} is an AOTInductor package: it records the device and compile flags "
                           "it was built for but not its inputs' names, shapes and ranges. Pass the program "
                           "it was compiled from: --program PROGRAM.pt2 (torch.export.save(ep, "
                           "'PROGRAM.pt2') before torch._inductor.aoti_compile_and_package(ep, ...))")
    ep, saved = load_program(program or path)
    try:
        structure, names = contract.output_layout(ep)
        found = contract.read(ep, names)
        values = contract.tighten(found.values, contract.parse_ranges(input_ranges), found.inputs)
    except contract.ContractError as e:
        raise ImportError_(str(e)) from None
    device = saved.device.type
    kind = "aoti" if aoti else "export"
    if aoti:
        from handlers.artifact.kinds.aoti_package import package_metadata

        device = package_metadata(path).get("AOTI_DEVICE_KEY", device) or device
    on = check_device(saved.device, aoti and device == "cuda", device_index)
    print(f"cs-import: the checks run on {on} (the program was exported on {saved.device}; "
          f"this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s))")
    left = cache.of_program(ep, found.state.get("mutated", ()))  # the cache the program leaves out (artifact/cache.py)
    cache.materialize(ep, left, found.state.get("mutated", ()), on, program or path)  # zeros, for the checks below
    ep = relocate_program(ep, on)
    os.makedirs(out, exist_ok=True)
    dest = os.path.join(out, ARTIFACT)
    shutil.copy2(path, dest)
    lo, hi = found.batch
    spec = ArtifactSpec(
        backend=kind, artifact=ARTIFACT, sha256=sha256_file(dest), device=device,
        inputs=tuple(TensorSpec(n, dt, tuple(s), values.get(n)) for n, dt, s in found.inputs),
        outputs=tuple(TensorSpec(n, dt, tuple(s)) for n, dt, s in found.outputs), dims=found.dims,
        output_structure=structure, batch_min=lo, batch_max=hi, torch_version=torch.__version__,
        platform=sys.platform, machine=platform.machine(), variant_dir=out,
        extra={"imported_from": os.path.basename(path), "state": found.state,
               **({cache.KEY: cache.record(left)} if left else {})}, **_compat_facts(kind, dest, device))
    write_spec(spec, out)
    worst = check(spec, ep, found, on, saved.device)
    print(f"imported {path} as {kind} ({device}, batch {lo}..{hi}) into {out}; max |artifact - program| = "
          f"{worst:.2e}; inputs {'; '.join(s.describe() for s in spec.inputs)}"
          + (f"; dims {', '.join(f'{k} {a}..{b}' for k, (a, b) in found.dims.items())}" if found.dims else ""))
    if find_pad and found.dims and "decoder" not in found.state:
        from compiled_serving import find_padding

        finding = find_padding.search(ep.module(), spec, on)
        write_spec(type(spec)(**{**spec.__dict__, "extra": {**spec.extra, "padding": finding.record()}}), out)
    return out


def relocate_program(ep, device):
    """The program on the checks' device, its graph's device arguments too
    (handlers/artifact/relocate.py); ImportError_ naming what could not move."""
    from handlers.artifact.relocate import relocate
    from handlers.errors import LoadError

    try:
        return relocate(ep, device)
    except LoadError as e:
        raise ImportError_(str(e)) from None


def moved_hint(spec, exported_on, on) -> str:
    """The fix where a package built on one GPU failed to load on another: AOTInductor packages
    loaded on another index of the same kind of GPU on two H200s (docs/results/placement_2gpu_h200x2),
    but a package's kernels are built for its compile device, and where that cannot move, the
    package must be built where it serves."""
    if spec.backend != "aoti" or exported_on is None or exported_on == on:
        return ""
    return (f". The package was compiled on {exported_on} and checked on {on}: check it on its own GPU "
            f"(--device-index {exported_on.index}) on a machine that has it, or compile it again on the GPU "
            "type it will serve on (cs-compile --device cuda)")


def check(spec, ep, found, on, exported_on=None) -> float:
    """Trial load in a child process, then the artifact against the program on example inputs
    (at the dimensions' minimum and at their example sizes), all on the device `on`."""
    import torch

    from handlers.artifact.device import Placement
    from handlers.artifact.load import load_artifact
    from handlers.artifact.probe import crash_safe_probe
    from handlers.config import HandlerConfig
    from handlers.errors import LoadError
    from handlers.run.padding import first_difference

    placement = Placement(on.type, on.index if on.type == "cuda" else None)
    try:
        crash_safe_probe(spec, placement, HandlerConfig())
    except LoadError as e:
        raise ImportError_(f"the artifact fails to load on {on} ({e}){moved_hint(spec, exported_on, on)}") from None
    loaded = load_artifact(spec, placement)
    if "decoder" in found.state:
        return check_decoder(found.state["decoder"], ep, loaded, placement.torch_device)
    module = ep.module()
    worst = 0.0
    for low in (True, False):
        inputs = example_inputs(found, placement.torch_device, low)
        with torch.no_grad():
            want = module(*inputs)
            got = loaded(*inputs)
        want = want if isinstance(want, dict) else dict(zip(spec.output_names, want if isinstance(want, (tuple, list)) else [want]))
        want = {o.name: want[o.name] for o in spec.outputs}
        # the tolerance follows each output's own dtype (first_difference: 10 units in the last place in half precision)
        differs = first_difference(want, got)
        if differs:
            name, diff, bound = differs
            raise ImportError_(f"output {name!r} of the artifact differs from the program: {diff} (> {bound}); "
                               "is --program the program this package was compiled from?")
        worst = max([worst] + [(got[n].float() - r.float()).abs().max().item()
                               for n, r in want.items() if r.is_floating_point() and r.numel()])
    return worst


def check_decoder(record: dict, ep, loaded, device) -> float:
    """A decoder's artifact against its program: a prompt (in one call, or one token per call
    where the program takes one) and one decode step after it, each from its own cache; the slot
    form's prompt goes into its last slot and the step runs beside a row of slot 0."""
    import torch

    from handlers.artifact.decoder import Decoder
    from handlers.run.padding import first_difference

    dec = Decoder.from_record(record)
    module = ep.module()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, dec.vocab, (1, min(6, dec.cache_length - 1)), generator=g).to(device)

    def run(fn, ids, start):
        pos = torch.arange(start, start + ids.shape[1], device=device)
        pos = pos.view(1, -1) if dec.positions_rank == 2 else pos
        args = {dec.tokens: ids, dec.positions: pos}
        if dec.slotted:
            last = torch.tensor([dec.slots - 1], device=device)
            args = {dec.tokens: torch.cat([ids, ids]), dec.positions: torch.cat([pos, pos]),
                    dec.slot_input: torch.cat([last, torch.zeros_like(last)])} if start else {**args, dec.slot_input: last}
        out = fn(**args) if fn is module and dec.keywords else fn(*args.values())
        out = out[dec.logits] if isinstance(out, dict) else out
        return out[0, -1]

    worst = 0.0
    with torch.no_grad():
        for ids, start in ([(prompt, 0)] if dec.chunk_max > 1 else
                           [(prompt[:, i:i + 1], i) for i in range(prompt.shape[1])]) + [(prompt[:, :1], prompt.shape[1])]:
            want, got = run(module, ids, start), run(loaded, ids, start)
            differs = first_difference({"logits": want}, {"logits": got})
            if differs:
                raise ImportError_(f"the decoder's logits differ from the program's at positions {start}..: "
                                   f"{differs[1]} (> {differs[2]}); is --program the program this package was "
                                   "compiled from?")
            worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="a torch.export program or an AOTInductor package (.pt2)")
    p.add_argument("--program", help="the torch.export program an AOTInductor package was compiled from")
    p.add_argument("--input-range", action="append", default=[], metavar="INPUT[COL]=LO:HI",
                   help="valid values of an integer input, or of one position along its column dimension "
                        "(INPUT[COL]); adds a bound or narrows the graph's, never widens it (refused)")
    p.add_argument("--device-index", type=int, default=None,
                   help="the GPU the checks run on (default: the one the program was exported on where this "
                        "machine has it, else GPU 0)")
    p.add_argument("--pad", choices=("auto", "none"), default="auto",
                   help="auto: with a dynamic length, try padding on the program and record what is safe "
                        "(compiled_serving/find_padding.py); none: do not try")
    p.add_argument("--out", required=True, help="output directory (created)")
    args = p.parse_args(argv)
    out = import_artifact(args.artifact, args.out, args.program, args.input_range, args.device_index,
                          args.pad == "auto")
    finding = read_spec(out).extra.get("padding")
    if finding is not None:  # cs-archive prints its own verdict from the same record
        from compiled_serving import find_padding

        pad = finding.get("pad")
        print(f"padding: {'pad=' + find_padding.show(pad) if pad else 'none'} ({finding.get('why')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
