"""The load-time check of declared padding (handler.pad): padding along a named dimension is
safe only for a model that ignores padded positions (an attention mask); on one that does not,
every padded request would get a silently different answer. So before a worker serves, it runs
the model on random valid requests at lengths that need padding, once padded through the
runner and once at their own length through the artifact's own call, and refuses to load when
the answers differ beyond the precision's tolerance."""
from __future__ import annotations

import torch

from handlers.artifact.metadata import is_mask
from handlers.errors import LoadError


def trial_sizes(plan, dims: dict) -> list:
    """Named-dimension sizes that the plan pads: one past the smallest bucket (little padding)
    and one past the largest bucket below the range's maximum (much padding), each inside its
    dimension's range."""
    out = []
    for pick in (0, -1):
        sizes = {}
        for d, buckets in plan.buckets.items():
            lo, hi = dims[d]
            inner = [b for b in buckets if b < hi] or [lo]
            sizes[d] = min(hi, max(lo, inner[pick] + 1))
        if any(plan.bucket(d, n) > n for d, n in sizes.items()) and sizes not in out:
            out.append(sizes)
    return out


def random_request(spec, sizes: dict, g: torch.Generator, masks=None, span: int = 999) -> dict:
    """One row of every input at `sizes`: floats random normal, integers inside their value
    range, per column where it has one per column (else 0..99; at most `span` + 1 values from its
    low end), the inputs in `masks` (default: those named like a mask) all ones, so a request
    carries exactly its own length."""
    if masks is None:
        masks = {s.name for s in spec.inputs if is_mask(s.name)}
    out = {}
    for s in spec.inputs:
        shape, dtype = s.concrete(1, sizes), getattr(torch, s.dtype)
        if s.name in masks:
            out[s.name] = torch.ones(shape, dtype=dtype)
        elif dtype.is_floating_point:
            out[s.name] = torch.randn(shape, generator=g).to(dtype)
        elif dtype == torch.bool:
            out[s.name] = torch.rand(shape, generator=g) > 0.5
        else:  # per column where the contract has a range per column
            out[s.name] = s.draw_ints(shape, g, span)
    return out


def first_difference(want: dict, got: dict):
    """(output, max |difference|, bound) of the first output differing beyond its tolerance
    (floating outputs: in half precision ten of the dtype's units in the last place
    (10 x finfo.eps: 9.8e-3 for float16, 7.8e-2 for bfloat16, whose mantissa is 3 bits shorter),
    absolute and relative; 1e-4 otherwise; others exactly), or None."""
    for name, ref in want.items():
        out = got[name]
        if not ref.is_floating_point():
            if out.shape != ref.shape or not torch.equal(out, ref):
                return name, "values differ", "equal"
            continue
        tol = 10 * torch.finfo(ref.dtype).eps if ref.dtype in (torch.float16, torch.bfloat16) else 1e-4
        ref, out = ref.float(), out.float()
        if out.shape != ref.shape:
            return name, f"shape {list(out.shape)} against {list(ref.shape)}", "equal shapes"
        diff = (out - ref).abs().max().item() if ref.numel() else 0.0
        bound = tol + tol * (ref.abs().max().item() if ref.numel() else 0.0)
        if not diff <= bound:  # also NaN
            return name, f"{diff:.3g}", f"{bound:.3g}"
    return None


def verify_padding(model, runner, spec, device) -> str:
    """Raises LoadError naming the output, the sizes and the fix when the declared padding
    changes an answer; returns a note for the load line."""
    plan = runner.pad
    g = torch.Generator().manual_seed(0)
    trials = trial_sizes(plan, spec.dims)
    for sizes in trials:
        req = random_request(spec, sizes, g)
        with torch.inference_mode():
            alone = model(*[req[s.name].to(device) for s in spec.inputs])
            want = {k: v.detach().to("cpu") for k, v in alone.items()}
            got = {k: v.clone() for k, v in runner.run([req])[0].items()}
        bad = first_difference(want, got)
        if bad:
            to = {d: plan.bucket(d, n) for d, n in sizes.items()}
            raise LoadError(
                f"handler.pad is declared ({plan.values}) but padding changes this model's answers: output "
                f"{bad[0]!r} differs by {bad[1]} (allowed {bad[2]}) for a request of sizes {sizes} padded to "
                f"{to}, against the same request at its own length. The model does not ignore padded "
                "positions with these pad values. Fix: give the mask input the value that marks padding "
                "(usually 0) in handler.pad, or remove handler.pad (requests of different lengths then run "
                "as groups of equal length).")
    return f"padding checked ({len(trials)} trial{'s' if len(trials) != 1 else ''}: answers unchanged)"
