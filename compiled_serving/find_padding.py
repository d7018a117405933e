"""Padding found by itself: whether a model with a dynamic length answers the same when its
requests are padded, tried on the torch.export program before anything is archived.

compiled_serving/import_artifact.py runs `search` on the program and records the finding in
artifact.json (`extra.padding`); compiled_serving/archive.py declares what it found as the handler
option `pad=` (the same option a user passes by hand), unless `--pad none` or an explicit
`--handler-option pad=...` says otherwise. The worker still checks declared padding at load
(handlers/run/padding.py).

How: pad values are proposed per input with the dynamic length (0 for integer ids and for
mask-like inputs, the lowest valid id where 0 is not one; a few values for other floating-point
inputs), then the program runs on random valid requests, lengths drawn across the range and
values inside the contract (handlers/run/padding.py random_request: ids inside their value
range, masks all ones over the request's own positions; padding positions get the pad value).
Each trial puts 1 to 3 requests of different lengths in one call padded to a common length
(their own bucket or any longer one, up to the range's maximum, as the serving runner may), cuts
every output back to each request's own length and compares it with that request run alone,
within each output dtype's tolerance (padding.first_difference). One difference rejects the
values. A model that pools over every position (no mask) changes its answer when padded and is
found unsafe; so is a masked model whose mask would be padded with 1.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from handlers.artifact.metadata import is_mask

TRIALS = 16
FLOAT_CANDIDATES = (0.0, 1.0, -1.0)
MAX_COMBINATIONS = 8
MAX_REQUESTS = 3  # requests of different lengths sharing one padded call per trial


@dataclass(frozen=True)
class Finding:
    pad: dict | None  # {input: pad value}, or None where no values kept every answer
    why: str

    def record(self) -> dict:
        return {"pad": self.pad, "why": self.why}


def show(pad: dict) -> str:
    """The values as the handler option is written: {input_ids: 0, attention_mask: 0}."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in pad.items()) + "}"


def candidates(spec) -> dict:
    """{input with a named dimension: its pad values to try, most likely first}."""
    out = {}
    for s in spec.inputs:
        if not any(isinstance(d, str) for d in s.shape):
            continue
        dtype = getattr(torch, s.dtype)
        if is_mask(s.name) or dtype == torch.bool:
            out[s.name] = [0]
        elif not dtype.is_floating_point:
            # a pad id must be one the model accepts, in every column where columns index different
            # tables (the contract's per-column ranges); none where no value is valid in all of them
            ranges = [r for r in [s.value_range] + list((s.columns or (0, ()))[1]) if r]
            lo, hi = max([r[0] for r in ranges], default=0), min([r[1] for r in ranges], default=0)
            out[s.name] = [0 if lo <= 0 <= hi else lo] if lo <= hi else []
        else:
            out[s.name] = list(FLOAT_CANDIDATES)
    return out


def combinations(cands: dict) -> list:
    names = list(cands)
    return [dict(zip(names, vals)) for vals in itertools.islice(itertools.product(*cands.values()), MAX_COMBINATIONS)]


def _trials(spec, plan, g, n: int) -> list:
    """[(own sizes of each request, the common sizes they are padded to)]: the worker's own
    trial sizes at their buckets, the shortest length padded to the longest, then random."""
    from handlers.run.padding import trial_sizes

    dims = {d: spec.dims[d] for d in plan.buckets}
    out = [([s], {d: plan.bucket(d, v) for d, v in s.items()}) for s in trial_sizes(plan, dims)]
    out.append(([{d: lo for d, (lo, _) in dims.items()}], {d: hi for d, (_, hi) in dims.items()}))
    rows = min(MAX_REQUESTS, spec.batch_max)
    while len(out) < n:
        k = int(torch.randint(1, rows + 1, (1,), generator=g))
        own = [{d: int(torch.randint(lo, hi, (1,), generator=g)) for d, (lo, hi) in dims.items()} for _ in range(k)]
        target = {}
        for d in dims:
            longer = [b for b in plan.buckets[d] if b >= max(s[d] for s in own)]
            target[d] = longer[int(torch.randint(0, len(longer), (1,), generator=g))]
        out.append((own, target))
    return out


def _call(module, spec, rows: list, device) -> list:
    """The program on `rows` (one-row requests) stacked, repeated up to the batch minimum;
    per row {output: tensor on the CPU}."""
    n = len(rows)
    rows = rows + [rows[-1]] * (spec.batch_min - n)
    with torch.no_grad():
        out = module(*[torch.cat([r[s.name] for r in rows]).to(device) for s in spec.inputs])
    if not isinstance(out, dict):
        out = dict(zip(spec.output_names, out if isinstance(out, (tuple, list)) else [out]))
    return [{k: out[k][i:i + 1].cpu() for k in spec.output_names} for i in range(n)]


def _first_change(module, spec, plan, device, trials, pad_values, seed: int):
    """None when every trial answers as alone, else (output, difference, bound, own, target)."""
    from handlers.run.padding import first_difference, random_request

    plan = type(plan)(plan.buckets, pad_values, plan.in_axes, plan.out_axes)
    g = torch.Generator().manual_seed(seed)
    for own, target in trials:
        reqs = [random_request(spec, s, g, span=1 << 62) for s in own]
        padded = _call(module, spec, [plan.pad(r, target) for r in reqs], device)
        for r, s, got in zip(reqs, own, padded):
            bad = first_difference(_call(module, spec, [r], device)[0], plan.cut(got, s))
            if bad:
                return (*bad, s, target)
    return None


def search(module, spec, device="cpu", trials: int = TRIALS, seed: int = 0) -> Finding:
    """The first candidate pad values under which every trial answers as the requests alone,
    or None with the reason (the most likely values' first difference)."""
    from handlers.batch import PadPlan

    cands = candidates(spec)
    empty = [n for n, v in cands.items() if not v]
    if empty:
        return Finding(None, f"no one pad value is valid in every column of {', '.join(empty)}")
    plan = PadPlan.of(spec, {n: v[0] for n, v in cands.items()}) if cands else None
    if plan is None or all(lo == hi for d, (lo, hi) in spec.dims.items() if d in plan.buckets):
        return Finding(None, "no input has a dynamic length that padding could fill")
    lo_hi = ", ".join(f"{d} {spec.dims[d][0]}..{spec.dims[d][1]}" for d in plan.buckets)
    runs = _trials(spec, plan, torch.Generator().manual_seed(seed), trials)
    first = None
    for values in combinations(cands):
        try:
            change = _first_change(module, spec, plan, device, runs, values, seed)
        except Exception as e:  # the program itself failed on a valid request: say so, never guess
            return Finding(None, f"the program failed on a random valid request ({type(e).__name__}: "
                                 f"{str(e)[:200]}); padding not tried")
        if change is None:
            return Finding(values, f"answers unchanged on {len(runs)} trials of 1 to {MAX_REQUESTS} random "
                                   f"requests ({lo_hi}) padded with {show(values)} up to a shared length, each "
                                   "output compared at the request's own length within its dtype's tolerance")
        first = first or (values, change)
    values, (out, diff, bound, own, target) = first
    return Finding(None, f"padding changes the answers: output {out!r} differs by {diff} (allowed {bound}) for a "
                         f"request of sizes {own} padded to {target} with {show(values)}, against the same request "
                         "alone; the model does not ignore padded positions (it has no mask, or uses it otherwise)")
