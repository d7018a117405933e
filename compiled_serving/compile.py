#!/usr/bin/env python3
"""Compile a model into a servable artifact plus its artifact.json.

  python -m compiled_serving.compile --model FILE.py:FACTORY --input NAME:SHAPE:DTYPE [--input ...]
      [--dynamic-batch MIN:MAX] [--dim NAME=MIN:MAX ...] [--input-range INPUT[COL]=LO:HI ...]
      --backend {aoti,export,tensorrt} --device {cpu,cuda} --out DIR

FACTORY returns an nn.Module in eval mode; SHAPE like 8x3x32x32 (dimension 0 is the batch,
and the example batch must lie inside MIN:MAX). A dimension may be a name declared with --dim,
e.g. `--input input_ids:8xS:int64 --input attention_mask:8xS:int64 --dim S=8:512`: requests may
then carry any length in that range (inputs sharing a name must agree). Input names must be the
forward()'s parameter names, in order. Integer inputs that index a table get their valid values
from the graph (compiled_serving/contract.py), per column where columns index different tables;
--input-range adds or narrows a bound (a wider one is refused). The artifact is
checked against eager before metadata is written.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from handlers.artifact.kinds import KINDS
from handlers.artifact.kinds.aoti_package import package_metadata
from handlers.artifact.metadata import (
    DTYPES,
    ArtifactSpec,
    TensorSpec,
    sha256_file,
    write_spec,
)
from compiled_serving import contract

# Kinds that compile.py produces from an exported program (the bare .so is extracted: --bare-so).
COMPILABLE = tuple(name for name, kind in KINDS.items() if kind.compile_needs is not None)

ARTIFACT = "model.pt2"


class CompileError(SystemExit):
    def __init__(self, msg):
        super().__init__(f"cs-compile: error: {msg}")


def pick_compiler(explicit=None) -> str:
    """AOTInductor builds a C++ wrapper. On the GPU image, g++ 13 (which that image exports as
    CXX=/opt/gcc/bin/g++) produces wrappers that segfault in aoti_load_package (std::regex in
    parse_device_str; libstdc++ not linked); g++-12 works. So g++-12 is preferred wherever it
    exists, even over an inherited CXX; --cxx chooses another on purpose."""
    if explicit:
        os.environ["CXX"] = explicit
    elif shutil.which("g++-12"):
        os.environ["CXX"] = "g++-12"
    cxx = os.environ.get("CXX", "g++")
    # inductor reads CXX once, when torch._inductor.config is imported (its `cpp.cxx` default), and an
    # export may have imported it already: set there too, or the choice above is silently ignored
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None and "CXX" in os.environ:
        inductor.cpp.cxx = (None, cxx)
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        return f"{cxx}: {version.splitlines()[0]}" if version else cxx
    except (OSError, subprocess.SubprocessError):
        return cxx


def parse_input(text: str, named=()) -> TensorSpec:
    parts = text.split(":")
    if len(parts) != 3:
        raise CompileError(f"--input {text!r}: expected NAME:SHAPE:DTYPE, e.g. image:8x3x32x32:float32")
    name, shape, dtype = parts
    dims = []
    for i, d in enumerate(shape.split("x")):
        if d.isdigit():
            dims.append(int(d))
        elif i > 0 and d in named:
            dims.append(d)
        else:
            raise CompileError(f"--input {text!r}: SHAPE must be integers joined by 'x' (8x3x32x32), or "
                               f"names declared with --dim after the batch (8xS with --dim S=1:512); got {d!r}")
    dims = tuple(dims)
    if not dims or any(isinstance(d, int) and d <= 0 for d in dims):
        raise CompileError(f"--input {text!r}: every dimension must be positive")
    if dtype not in DTYPES:
        raise CompileError(f"--input {text!r}: dtype must be one of {', '.join(DTYPES)}")
    return TensorSpec(name, dtype, dims)


def parse_dims(items) -> dict:
    """--dim NAME=MIN:MAX values as {name: (min, max)}."""
    expected = "NAME=MIN:MAX with an identifier NAME and 1 <= MIN <= MAX, e.g. S=8:512"
    out = contract.parse_named_ranges(items, "--dim", expected, CompileError)
    for name, (lo, _hi) in out.items():
        if not (name.isidentifier() and lo >= 1):
            raise CompileError(f"--dim {name}={lo}:{_hi}: expected {expected}")
    return out


def example_size(lo: int, hi: int) -> int:
    """The example length a named dimension is exported with: inside its range, not 1 (export
    specializes a dimension whose example is 0 or 1)."""
    return min(hi, max(lo, 16, 2))


def load_factory(ref: str):
    if ":" not in ref:
        raise CompileError(f"--model {ref!r}: expected FILE.py:FACTORY")
    path, factory = ref.rsplit(":", 1)
    if not os.path.isfile(path):
        raise CompileError(f"--model: file {path!r} not found")
    spec = importlib.util.spec_from_file_location("user_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, factory):
        raise CompileError(f"--model: {path} has no {factory!r}")
    return getattr(mod, factory)


def example_inputs(specs, device):
    import torch

    g = torch.Generator().manual_seed(1234)
    out = []
    for s in specs:
        dt = getattr(torch, s.dtype)
        shape = tuple(s.shape)
        if dt == torch.bool:
            t = torch.rand(shape, generator=g) > 0.3
        elif dt.is_floating_point:
            t = torch.randn(shape, generator=g).to(dt)
        else:
            t = torch.randint(0, 8, shape, generator=g).to(dt)
        out.append(t.to(device))
    return out


def output_structure(out):
    import torch

    if isinstance(out, torch.Tensor):
        return "tensor", [("output", out)]
    if isinstance(out, dict):
        return "dict", list(out.items())
    if isinstance(out, (tuple, list)):
        return "tuple", [(f"output_{i}", t) for i, t in enumerate(out)]
    raise CompileError(f"model returned {type(out).__name__}; expected a tensor, tuple or dict of tensors")


def check_needs(kind) -> None:
    """What the kind's compile step needs (ArtifactKind.compile_needs) is present, or a clear
    error; the C++ compiler ("cxx") is picked by pick_compiler."""
    if "torch_tensorrt" in kind.compile_needs:
        try:
            import torch_tensorrt  # noqa: F401
        except ImportError:
            raise CompileError(f"--backend {kind.name} needs torch_tensorrt (pip install torch-tensorrt "
                               "matching your torch) and NVIDIA TensorRT on a CUDA machine; not available "
                               "here") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="FILE.py:FACTORY returning an nn.Module in eval mode")
    p.add_argument("--input", action="append", required=True, dest="raw_inputs",
                   help="NAME:SHAPE:DTYPE, once per forward() argument, in order")
    p.add_argument("--dynamic-batch", help="MIN:MAX range of dimension 0; omit for a fixed batch")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=MIN:MAX",
                   help="a named dynamic dimension used in --input shapes (e.g. S=8:512)")
    p.add_argument("--input-range", action="append", default=[], metavar="INPUT[COL]=LO:HI",
                   help="valid values of an integer input, or of one position along its column dimension "
                        "(INPUT[COL]); adds a bound or narrows the graph's, never widens it (refused)")
    p.add_argument("--backend", required=True, choices=COMPILABLE,
                   help="artifact kind (handlers/artifact/kinds/): " + ", ".join(COMPILABLE))
    p.add_argument("--device", required=True, choices=("cpu", "cuda"))
    p.add_argument("--device-index", type=int, default=0, help="CUDA device to compile on")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="fp16 casts the model and floating inputs to half before compiling")
    p.add_argument("--hardware-compatible", action="store_true",
                   help="tensorrt: build Ampere-and-later hardware-compatible engines")
    p.add_argument("--bare-so", action="store_true",
                   help="aoti: also extract the bare wrapper .so (+ cubin dir) as an aoti_so variant")
    p.add_argument("--cxx", help="aoti: C++ compiler for the wrapper (default: g++-12 if present, else $CXX)")
    p.add_argument("--out", required=True, help="output directory (created)")
    return p


def dynamic_batch(text, inputs):
    """(MIN, MAX) of --dynamic-batch, or None for a fixed batch (absent, or MIN == MAX)."""
    if not text:
        return None
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise CompileError(f"--dynamic-batch {text!r}: expected MIN:MAX, e.g. 1:32") from None
    if not 1 <= lo <= hi:
        raise CompileError(f"--dynamic-batch {text!r}: need 1 <= MIN <= MAX")
    for s in inputs:
        if not lo <= s.shape[0] <= hi:
            raise CompileError(f"--input {s.name}: example batch {s.shape[0]} lies outside --dynamic-batch {lo}:{hi}")
    return None if lo == hi else (lo, hi)


def parse_args(argv=None):
    """The arguments, checked: `dims`, `inputs` (TensorSpecs) and `dyn` (the batch range) added."""
    args = build_parser().parse_args(argv)
    # absolute: the trial load runs in a child process started in the package's directory
    args.out = os.path.abspath(args.out)
    args.dims = parse_dims(args.dim)
    args.inputs = [parse_input(t, args.dims) for t in args.raw_inputs]
    unused = set(args.dims) - {d for s in args.inputs for d in s.shape[1:]}
    if unused:
        raise CompileError(f"--dim {', '.join(sorted(unused))} is not used in any --input shape")
    args.dyn = dynamic_batch(args.dynamic_batch, args.inputs)
    batches = {s.shape[0] for s in args.inputs}
    if len(batches) != 1:
        raise CompileError("all --input shapes must share dimension 0 (the batch)")
    return args


def model_and_inputs(args):
    """(module, example inputs) on the target device, in the target precision; sets
    args.device_str and, for fp16, the inputs' dtypes."""
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise CompileError("--device cuda but CUDA is not available; use --device cpu or a GPU machine")
        torch.cuda.set_device(args.device_index)  # CUDA state binds to the current device
        args.device_str = f"cuda:{args.device_index}"
    else:
        args.device_str = "cpu"
    device = torch.device(args.device_str)
    module = load_factory(args.model)()
    if not isinstance(module, torch.nn.Module):
        raise CompileError("FACTORY must return a torch.nn.Module")
    module = module.eval().to(device)
    check_input_names(module, [s.name for s in args.inputs])
    sizes = {n: example_size(lo, hi) for n, (lo, hi) in args.dims.items()}
    inputs = example_inputs([TensorSpec(s.name, s.dtype, s.concrete(s.shape[0], sizes)) for s in args.inputs],
                            device)
    if args.precision == "fp16":
        module = module.half()
        inputs = [t.half() if t.is_floating_point() else t for t in inputs]
        args.inputs = [TensorSpec(s.name, "float16" if s.dtype.startswith("float") else s.dtype, s.shape)
                       for s in args.inputs]
    return module, inputs


def check_input_names(module, names: list) -> None:
    """--input names are forward()'s parameters, in order, every one without a default included."""
    sig = inspect.signature(module.forward).parameters.values()
    params = [p.name for p in sig if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in sig if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if params[:len(names)] != names:
        raise CompileError(f"--input names {names} must match forward()'s parameters {params}, in order")
    if len(names) < len(required):
        missing = required[len(names):]
        raise CompileError(f"forward() also needs {missing}: add --input NAME:SHAPE:DTYPE for each, in order")


def export_program(module, inputs, args):
    """(exported program, eager outputs' structure, named eager outputs, export start time)."""
    import torch

    dynamic_shapes = None
    if args.dyn or args.dims:
        named = {n: torch.export.Dim(n, min=lo, max=hi) for n, (lo, hi) in args.dims.items()}
        batch = torch.export.Dim("batch", min=args.dyn[0], max=args.dyn[1]) if args.dyn else None
        dynamic_shapes = {s.name: {a: named[d] for a, d in enumerate(s.shape) if isinstance(d, str)}
                          | ({0: batch} if batch else {}) for s in args.inputs}
    with torch.no_grad():
        eager = module(*inputs)
        structure, named = output_structure(eager)
        t0 = time.perf_counter()
        ep = torch.export.export(module, tuple(inputs), dynamic_shapes=dynamic_shapes)
    return ep, structure, named, t0


def read_contract(ep, named, args):
    """(the contract read from the graph, the value ranges after --input-range)."""
    hints = {f"{s.name}.{a}": d for s in args.inputs for a, d in enumerate(s.shape) if isinstance(d, str)}
    try:
        found = contract.read(ep, [n for n, _ in named], hints)
        values = contract.tighten(found.values, contract.parse_ranges(args.input_range), found.inputs)
    except contract.ContractError as e:
        raise CompileError(str(e)) from None
    return found, values


def device_facts(args, path):
    """(compute capability, CUDA archs, CPU ISA) of the new artifact."""
    import torch

    cc = archs = isa = None
    if args.device == "cuda":
        major, minor = torch.cuda.get_device_capability(torch.device(args.device_str))
        cc, archs = f"{major}.{minor}", [f"sm_{major}{minor}"]
    if args.backend == "aoti":
        meta = package_metadata(path)
        isa = meta.get("AOTI_CPU_ISA") or None
        if args.device == "cuda" and meta.get("AOTI_COMPUTE_CAPABILITY"):
            c = meta["AOTI_COMPUTE_CAPABILITY"]
            cc, archs = f"{c[:-1]}.{c[-1]}", [f"sm_{c}"]
    return cc, archs, isa


def artifact_spec(args, path, found, values, structure, compiler, extra) -> ArtifactSpec:
    import torch

    cc, archs, isa = device_facts(args, path)
    lo, hi = found.batch
    return ArtifactSpec(
        backend=args.backend, artifact=ARTIFACT, sha256=sha256_file(path), device=args.device,
        inputs=tuple(TensorSpec(n, dt, tuple(shape), values.get(n)) for n, dt, shape in found.inputs),
        outputs=tuple(TensorSpec(n, dt, tuple(shape)) for n, dt, shape in found.outputs), dims=found.dims,
        output_structure=structure, batch_min=lo, batch_max=hi, torch_version=torch.__version__,
        compute_capability=cc, cuda_archs=tuple(archs or ()), cpu_isa=isa, platform=sys.platform,
        machine=platform.machine(), compiler=compiler, extra=extra, variant_dir=args.out)


def check_against_eager(spec, inputs, named, args, compiler) -> float:
    """Load the new artifact (first in a child process, so a wrapper that crashes at load is
    reported here rather than killing this process) and compare it with eager; the worst
    difference."""
    import torch

    from handlers.artifact.device import Placement
    from handlers.artifact.load import load_artifact
    from handlers.artifact.probe import crash_safe_probe
    from handlers.config import HandlerConfig
    from handlers.errors import LoadError

    placement = Placement(args.device, args.device_index if args.device == "cuda" else None)
    try:
        crash_safe_probe(spec, placement, HandlerConfig())
    except LoadError as e:
        raise CompileError(f"the new artifact fails to load ({e}); compiler: {compiler or 'n/a'}") from None
    loaded = load_artifact(spec, placement)
    with torch.no_grad():
        got = loaded(*inputs)
    # |artifact - eager| <= atol + rtol * max|eager|, per output: fp16 logits can be large.
    atol, rtol = (1e-2, 1e-2) if args.precision == "fp16" else (1e-4, 1e-4)
    worst = 0.0
    for n, ref in named:
        if not ref.numel():
            continue
        diff = (got[n].float() - ref.float()).abs().max().item()
        bound = atol + rtol * ref.float().abs().max().item()
        worst = max(worst, diff)
        if diff > bound:
            raise CompileError(f"compiled output {n!r} differs from eager by {diff:.3g} (> {bound:.3g}); "
                               "not publishing it")
    return worst


def main(argv=None):
    args = parse_args(argv)
    kind = KINDS[args.backend]
    check_needs(kind)
    if args.dims and args.backend == "tensorrt":
        raise CompileError("--dim: named dynamic dimensions are not supported with --backend tensorrt "
                           "(its engines take per-input shape ranges this script does not build yet); "
                           "use --backend aoti or export")
    compiler = pick_compiler(args.cxx) if "cxx" in kind.compile_needs else ""
    module, inputs = model_and_inputs(args)
    os.makedirs(args.out, exist_ok=True)
    ep, structure, named, t0 = export_program(module, inputs, args)
    found, values = read_contract(ep, named, args)
    path = os.path.join(args.out, ARTIFACT)
    extra = {**kind.compile(ep, inputs, path, args), "state": found.state}
    compile_s = time.perf_counter() - t0
    spec = artifact_spec(args, path, found, values, structure, compiler, extra)
    spec_path = write_spec(spec, args.out)
    # Check the artifact against eager before anyone serves it; one that fails keeps no
    # artifact.json, so neither cs-inspect nor cs-archive takes it for a checked one.
    try:
        worst = check_against_eager(spec, inputs, named, args, compiler)
    except BaseException:
        os.remove(spec_path)
        raise
    if args.bare_so:
        from compiled_serving.bare_so import extract_bare_so

        extract_bare_so(spec, os.path.join(args.out, "bare_so"))
    lo, hi = found.batch
    print(f"wrote {path} ({args.backend}, {args.device}, batch {lo}..{hi}) in {compile_s:.1f}s; "
          f"max |artifact - eager| = {worst:.2e}; inputs {'; '.join(s.describe() for s in spec.inputs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
