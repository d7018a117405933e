"""Value contracts: the values an input may hold, checked per request before anything runs.

An integer input that indexes a table (an embedding's token ids, say) reaches native code that
does not check its indices on every backend: an AOTInductor package on the CPU aborts the whole
worker process on an id past the table, and on a GPU the kernel's device-side assert poisons the
CUDA context so the worker must restart. artifact.json records each such input's valid range
(scripts/contract.py derives it from the graph; the user may tighten it), and every request is
checked here, in admission, so a bad id is the client's 400 and never reaches the model.
Optionally, floating-point inputs may be refused when they hold NaN or infinity
(handler.refuse_nonfinite).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from handlers.errors import RequestError


@dataclass(frozen=True)
class ValueCheck:
    name: str
    lo: int
    hi: int
    source: str


@dataclass(frozen=True)
class ValueContract:
    ranges: tuple = ()  # of ValueCheck
    finite: tuple = ()  # float inputs that must hold finite values
    unchecked: tuple = ()  # (name, why): integer inputs reaching native indexing with no bound

    @classmethod
    def of(cls, spec, config) -> "ValueContract":
        """From the artifact's inputs and the handler options (handler.check_values,
        handler.value_ranges, handler.refuse_nonfinite)."""
        if not getattr(config, "check_values", True):
            return cls()
        extra = dict(getattr(config, "value_ranges", {}) or {})
        ranges, unchecked = [], []
        for s in spec.inputs:
            r, source = s.value_range, (s.values or {}).get("source", "")
            if s.name in extra:
                lo, hi = extra[s.name]
                if r:
                    lo, hi = max(lo, r[0]), min(hi, r[1])
                r, source = (lo, hi), "handler.value_ranges" + (f"; {source}" if source else "")
            if r:
                ranges.append(ValueCheck(s.name, r[0], r[1], source))
            elif s.values and s.values.get("checked") is False:
                unchecked.append((s.name, s.values.get("why", "no bound derived")))
        finite = tuple(s.name for s in spec.inputs if s.dtype.startswith(("float", "bfloat"))) \
            if getattr(config, "refuse_nonfinite", False) else ()
        return cls(tuple(ranges), finite, tuple(unchecked))

    def describe(self) -> str:
        parts = [f"{c.name} in [{c.lo}, {c.hi}]" for c in self.ranges]
        parts += [f"{n} finite" for n in self.finite]
        text = "values checked: " + (", ".join(parts) if parts else "none")
        if self.unchecked:
            text += "; UNCHECKED: " + "; ".join(f"{n} ({why})" for n, why in self.unchecked)
        return text

    def check(self, tensors: dict) -> None:
        """Raises RequestError naming the input, the first offending value, its position and
        the valid range. One min/max pass per checked input."""
        for c in self.ranges:
            t = tensors[c.name]
            if t.numel() == 0:
                continue
            if t.dtype == torch.bool:
                if c.lo <= 0 and c.hi >= 1:
                    continue
                lo, hi = int(t.min()), int(t.max())
            else:
                # Python numbers (int for integer dtypes, exact; float for floating ones):
                # comparing 0-d tensors costs an op each
                lo, hi = (x.item() for x in torch.aminmax(t))
            if lo < c.lo or hi > c.hi:
                _refuse(c, t)
        for name in self.finite:
            t = tensors[name]
            if not bool(torch.isfinite(t).all()):
                bad = (~torch.isfinite(t)).nonzero()[0].tolist()
                raise RequestError(f"input {name!r} holds {t[tuple(bad)].item()} at position {bad}; this "
                                   "model refuses NaN and infinity (handler.refuse_nonfinite)")


def _refuse(c: ValueCheck, t: torch.Tensor) -> None:
    wide = t.to(torch.int64) if t.dtype == torch.bool else t
    pos = ((wide < c.lo) | (wide > c.hi)).nonzero()[0].tolist()
    value = wide[tuple(pos)].item()
    raise RequestError(f"input {c.name!r} holds {value} at position {pos}; this model accepts values "
                       f"from {c.lo} to {c.hi} ({c.source})")
