#!/usr/bin/env python3
"""A transformers causal LM (a `save_pretrained` directory, safetensors) into the slot form
(examples/slot_decoder.py's contract: many sequences on one compiled cache, served by continuous
batching) as an artifact directory `cs-archive --artifact OUT_DIR` takes with no options:

  cs-export-lm --model CHECKPOINT_DIR --out OUT_DIR [--dtype auto] [--slots N] [--max-seq L] [--device auto]
      [--gpu-memory-gib G] [--package]
  cs-archive --artifact OUT_DIR --name lm

OUT_DIR holds the program (torch.export, or with --package its AOTInductor package beside
program.pt2) imported as compiled_serving/import_artifact.py does (model.pt2, artifact.json:
the decoder recognised and checked), the tokenizer (tokenizer.json, tokenizer_config.json and
chat_template.jinja where the checkpoint has them) and the end-of-sequence ids of its generation
config (artifact.json `extra.generation.eos_token_ids`, which cs-archive declares).

Built on transformers' own modeling code (compiled_serving/slot_lm.py: a Cache of a row per
slot, the positions and masks as the model's own arguments); before export the slot form's logits
are checked against the model's own forward, prompt and decode step, and a family that does not
fit is refused with what did not.

The KV cache is not written into the artifact (handlers/artifact/cache.py): the program holds a
one-element placeholder of each cache tensor, the package leaves them out of its constants, and
artifact.json records them (`extra.cache`: names, dtype, shapes) for the loader to allocate as zeros
on the serving device. So --slots and --max-seq default to what the export GPU's memory holds
(compiled_serving/lm_sizing.py, with the arithmetic printed; --gpu-memory-gib names another GPU's),
and to 8 slots of 512 positions on the CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from typing import Optional

DTYPES = ("float32", "float16", "bfloat16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class ExportError(SystemExit):
    def __init__(self, msg):
        super().__init__(f"cs-export-lm: error: {msg}")


def load(path: str, dtype: str, device: str = "cpu"):
    """The model in eval mode on `device` (where the program is exported, checked and compiled),
    in the checkpoint's dtype (`auto`) or the one named."""
    import torch
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise ExportError(f"--model {path}: not a directory (a transformers checkpoint saved with save_pretrained)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto" if dtype == "auto" else getattr(torch, dtype))
    except (OSError, ValueError, KeyError) as e:
        raise ExportError(f"--model {path}: transformers cannot load it as a causal LM ({type(e).__name__}: {e})")
    try:
        return model.to(device).eval()
    except (RuntimeError, AssertionError) as e:  # no such device (torch's own error, named)
        raise ExportError(f"--device {device}: {type(e).__name__}: {str(e)[:300]}")


def tokenizer_of(path: str, vocab: int):
    """The checkpoint's `tokenizers` tokenizer, refused where it is missing or does not fit the
    model (transformers then makes one of a token or a few, which turns every text into unknowns)."""
    from tokenizers import Tokenizer

    try:
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path).backend_tokenizer
    except Exception as e:  # noqa: BLE001  (the library's own error, named: no file, a broken file, no backend)
        raise ExportError(f"{path} has no usable tokenizer ({type(e).__name__}: {e}); save it beside the model: "
                          "AutoTokenizer.from_pretrained(SOURCE).save_pretrained(DIR)")
    have = tok.get_vocab_size(with_added_tokens=True)
    if have < 2 or have > vocab:
        raise ExportError(f"{path}'s tokenizer holds {have} token(s), the model's vocabulary {vocab}: the tokenizer "
                          "files are missing or belong to another model; save the model's own tokenizer beside it")
    return tok


def eos_ids(path: str, model) -> list:
    """The end-of-sequence ids of the checkpoint's generation config (else its model config)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    ids = [] if eos is None else [int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos])]
    vocab = model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ExportError(f"the generation config's eos_token_id {bad} lies outside the vocabulary of {vocab}")
    return ids


def check_lengths(model, slots: int, max_seq: int) -> None:
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and max_seq > positions:
        raise ExportError(f"--max-seq {max_seq} is more than the {positions} positions this model has "
                          f"(config.max_position_embeddings): use --max-seq {positions} or less")
    if slots < 2 or max_seq < 2:
        raise ExportError(f"--slots {slots} --max-seq {max_seq}: the slot form needs at least 2 of each")


def self_check(slot_module, model) -> float:
    """The slot form's logits against the model's own forward: a 5-token prompt into the last
    slot, then a step of that sequence beside a row of slot 0; the largest difference."""
    import torch

    from compiled_serving.slot_lm import Unsupported

    device = next(model.parameters()).device
    slots = slot_module.k_cache_0.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=g).to(device)
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        pre = slot_module(ids[:, :5], torch.arange(5, device=device)[None], torch.tensor([slots - 1], device=device))
        step = slot_module(torch.cat([ids[:, 5:], ids[:, :1]]), torch.tensor([[5], [0]], device=device),
                           torch.tensor([slots - 1, 0], device=device))
    got = torch.cat([pre[0].float(), step[0].float()])
    worst = (got - want[0]).abs().max().item()
    scale = want.abs().max().item()
    bound = 1e-3 * max(scale, 1.0) if want.dtype == torch.float32 and pre.dtype == torch.float32 else 5e-2 * max(scale, 1.0)
    if not worst <= bound:
        raise Unsupported(f"the slot form's logits differ from the model's own forward by {worst:.3g} (> {bound:.3g}): "
                          "its layers read the cache, positions or masks otherwise than the Cache API gives them")
    return worst


def build_program(model, args):
    """(the exported slot form, its check against the model's own forward); ExportError naming
    the family and why where it does not fit."""
    from compiled_serving import slot_lm

    family = getattr(model.config, "model_type", type(model).__name__)
    try:
        module = slot_lm.SlotLM(model, args.slots, args.max_seq).eval()
        worst = self_check(module, model)
    except slot_lm.Unsupported as e:
        raise ExportError(f"{family} ({type(model).__name__}) cannot go into the slot form this way: {e}")
    try:
        return slot_lm.export(module, args.slots), worst
    except Exception as e:  # noqa: BLE001  (torch.export's own error, named with the family)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ExportError(f"{family} ({type(model).__name__}): torch.export fails on its modeling code in the slot "
                          f"form ({type(e).__name__}: {first[:400]})")


# The package's constants outside its library, each in data/weights/ (torch/_inductor/config.py), so
# that the cache can be left out of them (handlers/artifact/kinds/aoti_constants.py loads the rest).
PACKAGE_OPTIONS = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False,
                   "aot_inductor.package_constants_on_disk_format": "pickle_weights"}


def split_package() -> Optional[str]:
    """None where this torch can compile a package with its constants outside its library (so the
    cache can be left out: `package`); else why not. Those are torch's private pieces (written
    against torch 2.13); a torch without them packages the cache inside, as before."""
    try:
        from torch._inductor import aot_compile, config  # noqa: F401
        from torch._inductor.package import package_aoti  # noqa: F401
        from torch.export.pt2_archive._package_weights import Weights  # noqa: F401
    except ImportError as e:
        return f"this torch lacks {e.name or e}"
    missing = [k for k in ("package_constants_in_so", "package_constants_on_disk_format")
               if not hasattr(config.aot_inductor, k)]
    return f"this torch's inductor has no aot_inductor.{missing[0]}" if missing else None


def _module_of(ep):
    """ep.module() without its input guards where this torch has them (a guard is no part of what is compiled)."""
    import inspect

    return ep.module(check_guards=False) if "check_guards" in inspect.signature(ep.module).parameters else ep.module()


def package_whole(ep, path: str) -> None:
    """`ep` compiled into the package `path` with every constant inside its library, the cache too (a
    torch that cannot leave it out: split_package)."""
    from torch._inductor import aoti_compile_and_package

    try:
        aoti_compile_and_package(ep, package_path=path)
    except Exception as e:  # noqa: BLE001  (inductor's own error, named)
        raise ExportError(f"aoti_compile_and_package failed ({type(e).__name__}: {str(e)[:400]}); export without "
                          "--package to serve the program itself")


def package(ep, path: str, cache: tuple) -> None:
    """`ep` compiled with AOTInductor into the package `path`, its constants outside its library and the
    cache (`cache`: their names) not among them: aoti_compile_and_package's own two steps (torch 2.13
    torch/_inductor/__init__.py: aot_compile of ep.module() on its example inputs, then package_aoti
    of the files it lists), the list's Weights (a dict {fqn: (tensor, properties)}) filtered between them."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti
    from torch.export.pt2_archive._package_weights import Weights

    args, kwargs = ep.example_inputs
    try:
        files = aot_compile(_module_of(ep), args, kwargs, options=dict(PACKAGE_OPTIONS))
    except Exception as e:  # noqa: BLE001  (inductor's own error, named)
        raise ExportError(f"AOTInductor's compile failed ({type(e).__name__}: {str(e)[:400]}); export without "
                          "--package to serve the program itself")
    held = [f for f in files if isinstance(f, Weights)]
    if len(held) != 1 or not set(cache) <= set(held[0]):
        raise ExportError(f"AOTInductor's compile listed {len(held)} weight set(s) without every cache tensor "
                          f"({', '.join(cache)}) in them: this torch packages its constants otherwise; export "
                          "without --package to serve the program itself")
    package_aoti(path, [Weights({k: v for k, v in f.items() if k not in cache}) if f is held[0] else f
                        for f in files])


def write_tokenizer(src: str, tok, out: str) -> list:
    """tokenizer.json (the checkpoint's, else transformers' own as a tokenizers file), and
    tokenizer_config.json and chat_template.jinja where the checkpoint has them; the names written."""
    tok.save(os.path.join(out, TOKENIZER_FILES[0]))
    written = [TOKENIZER_FILES[0]]
    for name in TOKENIZER_FILES[1:]:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(out, name))
            written.append(name)
    return written


def record_generation(out: str, eos: list, source: str) -> None:
    """The end-of-sequence ids into artifact.json's `extra.generation` (cs-archive declares them)."""
    from handlers.artifact.metadata import read_spec, write_spec

    spec = read_spec(out)
    extra = {**spec.extra, "generation": {"eos_token_ids": eos, "from": source}}
    write_spec(type(spec)(**{**spec.__dict__, "extra": extra}), out)


def write(args, model, ep, tok, eos) -> None:
    """OUT_DIR: the program (or its package) imported with its checks, its cache left out (recorded
    by the import), the tokenizer, the eos ids."""
    import torch

    from compiled_serving.compile import pick_compiler
    from compiled_serving.import_artifact import ImportError_, import_artifact

    from handlers.artifact import cache
    from handlers.artifact.state import program_state

    written = program_state(ep).mutated  # the state the slot form writes: its cache, nothing else
    whole = args.package and getattr(args, "cache_inside", False)  # a torch that cannot leave the cache out of a package
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        program = os.path.join(args.out if args.package else tmp, "program.pt2")
        artifact = program
        if args.package:  # compiled from the program with its cache, packaged without it where it can be
            artifact = os.path.join(tmp, "package.pt2")
            pick_compiler(getattr(args, "cxx", None))  # g++-12 where present (the GPU image's g++ 13 builds crash)
            package_whole(ep, artifact) if whole else package(ep, artifact, written)
        # one element of each cache tensor, which the import records; all of it beside a whole package
        with contextlib.nullcontext() if whole else cache.left_out(ep, written):
            torch.export.save(ep, program)
        try:
            import_artifact(artifact, args.out, program if args.package else None, find_pad=False)
        except ImportError_ as e:
            raise ExportError(e.reason)
    names = write_tokenizer(args.model, tok, args.out)
    source = "generation_config.json" if os.path.isfile(os.path.join(args.model, "generation_config.json")) else "config.json"
    record_generation(args.out, eos, source)
    print(f"wrote {', '.join(names)}; end-of-sequence ids {eos or 'none'} (from {source})")


def target_gpu(args):
    """The GPU the cache is sized for (worker_sizing.GpuMemory): --gpu-memory-gib where given, else
    the export device where it is a GPU (lm_sizing.device_memory), else None (the CPU's defaults)."""
    from compiled_serving import lm_sizing, worker_sizing

    if args.gpu_memory_gib is not None:  # read and checked as cs-archive reads it
        try:
            return worker_sizing.target_gpu(args.gpu_memory_gib)
        except worker_sizing.SizingError as e:
            raise ExportError(str(e)) from None
    if getattr(args, "cache_inside", False):  # the cache is saved in the package: a GPU's worth only where asked
        return None
    return lm_sizing.device_memory(args.device) if str(args.device).startswith("cuda") else None


def size_cache(model, args):
    """The slots and positions (lm_sizing) for the GPU that will serve it (target_gpu), else the
    CPU's small defaults; ExportError with the numbers where they do not fit."""
    from compiled_serving import lm_sizing, slot_lm

    gpu = target_gpu(args)
    p = next(model.parameters())
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    try:
        return lm_sizing.size(slot_lm.layer_shapes(model), p.element_size(), weights,
                              getattr(model.config, "max_position_embeddings", None), gpu, args.slots, args.max_seq)
    except lm_sizing.LmSizingError as e:
        raise ExportError(str(e))
    except slot_lm.Unsupported as e:
        family = getattr(model.config, "model_type", type(model).__name__)
        raise ExportError(f"{family} ({type(model).__name__}) cannot go into the slot form this way: {e}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a transformers causal LM directory (save_pretrained, safetensors)")
    p.add_argument("--out", required=True, help="the artifact directory to write (cs-archive --artifact OUT_DIR)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="the weights' and cache's dtype (auto: the checkpoint's own)")
    p.add_argument("--slots", type=int, default=None,
                   help="sequences the cache holds at once (default: exported on a GPU or with --gpu-memory-gib, "
                        "what that GPU's memory holds, at most 64; on the CPU 8)")
    p.add_argument("--max-seq", type=int, default=None,
                   help="positions per sequence, prompt and generated (default: 2048 for a GPU, 512 on the CPU, "
                        "or the model's positions if fewer)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="size the cache for a GPU of this much memory (default: the export device's own memory "
                        "where it is a GPU); the cache is not in the artifact: it is allocated when it loads")
    p.add_argument("--device", default="auto",
                   help="where the model is exported, checked and (--package) compiled, so where the package runs: "
                        "auto (default: cuda where this machine has a GPU, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--package", action="store_true",
                   help="also compile it with AOTInductor and serve the package (program.pt2 kept beside it)")
    p.add_argument("--cxx", help="with --package: the C++ compiler of its wrapper (default: g++-12 if present, else $CXX)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "auto":  # a package runs only on the kind of device it was compiled for
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    why = split_package() if args.package else None
    args.cache_inside = why is not None
    if why:
        print(f"cs-export-lm: the package keeps its cache inside it ({why}): sized for a GPU only with "
              "--gpu-memory-gib; without --package the cache is left out of the program")
    model = load(args.model, args.dtype, args.device)
    check_lengths(model, args.slots or 2, args.max_seq or 2)  # what was given, before any sizing
    sizing = size_cache(model, args)
    args.slots, args.max_seq = sizing.slots, sizing.max_seq
    print(f"cs-export-lm: {sizing.line}")
    check_lengths(model, args.slots, args.max_seq)
    tok = tokenizer_of(args.model, model.config.vocab_size)
    eos = eos_ids(args.model, model)
    ep, worst = build_program(model, args)
    dtype = next(model.parameters()).dtype
    print(f"exported {model.config.model_type} in the slot form: {args.slots} slots x {args.max_seq} positions, "
          f"{str(dtype).replace('torch.', '')}, vocabulary {model.config.vocab_size}; its logits against the model's "
          f"own forward: max |difference| {worst:.2e}")
    write(args, model, ep, tok, eos)
    print(f"wrote {args.out}: cs-archive --artifact {args.out} --name NAME")
    return 0


if __name__ == "__main__":
    sys.exit(main())
