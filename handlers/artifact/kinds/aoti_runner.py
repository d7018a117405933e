"""AOTInductor's container runner (`torch._C._aoti.AOTIModelContainerRunnerCuda/Cpu`) on a
wrapper library: built, its constants read out once, and pointed at those shared tensors instead of
its own copy (the engine's lanes: handlers/run/lanes.py, handlers/weights/pack.py).

Facts this relies on (torch 2.13, tests/test_shared_weights.py checks them on CPU):
- the runner's `update_constant_buffer(map, use_inactive, validate_full_updates, user_managed)`
  takes the internal constant names (`get_constant_names_to_original_fqns` maps them to the
  `state_dict` names) and, with `user_managed`, stores the caller's tensors without copying;
- `swap_constant_buffer` makes the inactive buffer active and `free_inactive_constant_buffer`
  frees the copy the library filled at load;
- `extract_constants_map(False)` names the active constants by their original fqn.
The package loader torch's `aoti_load_package` wraps has no swap or free, hence the runner.
"""
from __future__ import annotations

import os
import zipfile

from handlers.errors import LoadError

LIBRARY_DIR = "data/aotinductor/model/"  # where aoti_compile_and_package writes the wrapper .so


def package_library(package: str, dest: str) -> tuple:
    """(wrapper .so, its kernel directory) of a `.pt2` package, extracted under `dest`. Raises
    LoadError when the package keeps its weights outside the library (`data/weights/`, written
    with `package_constants_on_disk_format`) or holds no single wrapper library."""
    with zipfile.ZipFile(package) as z:
        names = z.namelist()
        if any("/data/weights/" in n for n in names):
            raise LoadError("the package keeps its weights outside its library (data/weights/)")
        mine = [n for n in names if LIBRARY_DIR in n and not n.endswith("/")]
        libraries = [n for n in mine if n.endswith(".so")]
        if len(libraries) != 1:
            raise LoadError(f"the package holds {len(libraries)} wrapper libraries under {LIBRARY_DIR}, "
                            "expected one")
        for n in mine:
            z.extract(n, dest)
    so = os.path.join(dest, libraries[0])
    return so, os.path.dirname(so)


def new_runner(so: str, placement, cubin_dir: str, single_threaded: bool = False):
    """The container runner of the placement's device kind on library `so`. single_threaded: no
    per-call handoff to the container's thread pool (a CUDA graph capture needs that); a torch
    whose CUDA runner lacks the flag gets the default runner, whose graphs the capture check
    then refuses or keeps on their own merits (handlers/run/graphs.py)."""
    import torch

    runners = torch._C._aoti
    try:
        if placement.kind != "cuda":
            return runners.AOTIModelContainerRunnerCpu(so, 1)
        try:
            return runners.AOTIModelContainerRunnerCuda(so, 1, str(placement), cubin_dir, single_threaded)
        except TypeError:  # an older signature: (so, num_models, device, cubin_dir)
            return runners.AOTIModelContainerRunnerCuda(so, 1, str(placement), cubin_dir)
    except LoadError:
        raise
    except Exception as e:  # torch raises RuntimeError with the C++ message
        raise LoadError(f"the AOTInductor container runner failed to load {os.path.basename(so)} on "
                        f"{placement}: {e}") from e


def constants(runner) -> dict:
    """{state_dict name: tensor} of the runner's active constants: views of its own copy, valid
    only while the runner lives."""
    return dict(runner.extract_constants_map(False))


def adopt(runner, weights: dict) -> int:
    """Points the runner at `weights` ({state_dict name: tensor}, which must outlive it) and frees
    its own copy; returns the bytes it now reads from `weights`. Raises LoadError naming a
    constant `weights` lacks, or any mismatch the runner's full-update check finds (shape,
    dtype).

    The container keeps two constant buffers, primary and secondary, and a folding state for
    each (aoti_runtime/model_container.h): update_constant_buffer marks the buffer it fills
    INITIALIZED, free_inactive_constant_buffer marks the freed one NONE, and the single-threaded
    run reads the primary's state (on torch 2.11 CUDA a run after one swap failed with "Unknown
    constant state: ConstantState::NONE" while the threaded run answered). So the held weights
    go in twice: into the secondary, swap, free the primary (the library's copy), then into the
    primary, swap back; both buffers then point at the held tensors and the primary is active."""
    names = runner.get_constant_names_to_original_fqns()
    missing = sorted(fqn for fqn in names.values() if fqn not in weights)
    if missing:
        raise LoadError(f"the held weights lack {len(missing)} constant(s) the library reads: "
                        f"{', '.join(missing[:5])}")
    mine = {inner: weights[fqn] for inner, fqn in names.items()}
    try:
        for _ in range(2):
            runner.update_constant_buffer(mine, True, True, True)  # inactive buffer, full update, user-managed
            runner.swap_constant_buffer()
            runner.free_inactive_constant_buffer()
    except Exception as e:  # noqa: BLE001  (torch raises RuntimeError with the C++ check's text)
        raise LoadError(f"the library refused the held weights: {e}") from e
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in mine.values()}.values())


def smoke(runner, spec, placement) -> None:
    """One call on the artifact's example inputs at its smallest batch, so a runner that cannot
    run on held weights fails the load here (and the worker loads its own copy), not a request."""
    import torch

    try:
        with torch.inference_mode():
            runner.run(list(spec.example(spec.batch_min, placement.torch_device).values()))
        if placement.kind == "cuda":
            torch.cuda.synchronize(placement.torch_device)
    except Exception as e:  # noqa: BLE001
        raise LoadError(f"a call on the held weights failed: {type(e).__name__}: {e}") from e
