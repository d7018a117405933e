"""Value contracts: the values an input may hold, checked per request before anything runs.

An integer input that indexes a table (an embedding's token ids, say) reaches native code that
does not check its indices on every backend: an AOTInductor package on the CPU aborts the whole
worker process on an id past the table, and on a GPU the kernel's device-side assert poisons the
CUDA context so the worker must restart. artifact.json records each such input's valid range
(compiled_serving/contract.py derives it from the graph; the user may narrow it), or a range per column
where the positions along one fixed dimension index different tables (a recommender's sparse
features), and every request is checked here, in admission, so a bad id is the client's 400 and
never reaches the model. Optionally, floating-point inputs may be refused when they hold NaN or
infinity (handler.refuse_nonfinite).

User ranges (--input-range at import or compile, handler.value_ranges at load) are keyed
"NAME" (every value of the input) or "NAME[COL]" (one position along the column dimension). A
range wider than the model's own bound (the table it indexes) is refused with that bound: a value
past the table would reach native code, so the model's bound can be narrowed, never widened.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from handlers.artifact.metadata import describe_columns
from handlers.config import HandlerConfig
from handlers.errors import ConfigError, RequestError

_KEY = re.compile(r"^\s*([^\[\]\s]+)\s*(?:\[\s*(\d+)\s*\])?\s*$")


@dataclass(frozen=True)
class ValueCheck:
    name: str
    lo: int
    hi: int
    source: str
    axis: Optional[int] = None  # with columns: the dimension whose positions have their own range
    columns: tuple = ()  # per position along `axis`: (lo, hi, source), or None (any value)
    bounds: tuple = ()  # with columns: (lows, highs) tensors broadcasting against the input

    @classmethod
    def of(cls, name: str, entry: dict, rank: int) -> "ValueCheck":
        """From an input's "values" entry (handlers/artifact/metadata.py)."""
        if entry.get("columns") is None:
            return cls(name, int(entry["min"]), int(entry["max"]), entry.get("source", ""))
        axis = int(entry["axis"])
        cols = tuple(None if c is None else (int(c["min"]), int(c["max"]), c.get("source", ""))
                     for c in entry["columns"])
        info = torch.iinfo(torch.int64)
        shape = [1] * rank
        shape[axis] = len(cols)
        lows = torch.tensor([info.min if c is None else c[0] for c in cols]).reshape(shape)
        highs = torch.tensor([info.max if c is None else c[1] for c in cols]).reshape(shape)
        bounded = [c for c in cols if c is not None] or [(info.min, info.max)]
        return cls(name, min(c[0] for c in bounded), max(c[1] for c in bounded), entry.get("source", ""), axis, cols,
                   (lows, highs))

    def describe(self) -> str:
        if self.axis is None:
            return f"{self.name} in [{self.lo}, {self.hi}]"
        return f"{self.name} per column of dimension {self.axis}: " + describe_columns(
            [None if c is None else c[:2] for c in self.columns])


@dataclass(frozen=True)
class ValueContract:
    ranges: tuple = ()  # of ValueCheck
    finite: tuple = ()  # float inputs that must hold finite values
    unchecked: tuple = ()  # (name, why): integer inputs reaching native indexing with no bound

    @classmethod
    def of(cls, spec, config) -> "ValueContract":
        """From the artifact's inputs and the handler options (handler.check_values,
        handler.value_ranges, handler.refuse_nonfinite; None: their defaults)."""
        config = config or HandlerConfig()
        if not config.check_values:
            return cls()
        shapes = {s.name: s.shape for s in spec.inputs}
        try:
            values = with_ranges({s.name: s.values for s in spec.inputs if s.values},
                                 dict(config.value_ranges), shapes, "handler.value_ranges")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        ranges, unchecked = [], []
        for s in spec.inputs:
            v = values.get(s.name) or {}
            if "min" in v or v.get("columns") is not None:
                ranges.append(ValueCheck.of(s.name, v, len(s.shape)))
            elif v.get("checked") is False:
                unchecked.append((s.name, v.get("why", "no bound derived")))
        finite = tuple(s.name for s in spec.inputs if s.dtype.startswith(("float", "bfloat"))) \
            if config.refuse_nonfinite else ()
        return cls(tuple(ranges), finite, tuple(unchecked))

    def describe(self) -> str:
        parts = [c.describe() for c in self.ranges]
        parts += [f"{n} finite" for n in self.finite]
        text = "values checked: " + (", ".join(parts) if parts else "none")
        if self.unchecked:
            text += "; UNCHECKED: " + "; ".join(f"{n} ({why})" for n, why in self.unchecked)
        return text

    def check(self, tensors: dict) -> None:
        """Raises RequestError naming the input, the first offending value, its position and
        the valid range (and column). One min/max pass per checked input; with columns one
        vectorized comparison against every column's bounds at once."""
        for c in self.ranges:
            t = tensors[c.name]
            if t.numel() == 0:
                continue
            if c.axis is not None:
                lows, highs = c.bounds
                if bool(((t < lows) | (t > highs)).any()):
                    _refuse(c, t)
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
    if c.axis is None:
        pos = ((wide < c.lo) | (wide > c.hi)).nonzero()[0].tolist()
        raise RequestError(f"input {c.name!r} holds {wide[tuple(pos)].item()} at position {pos}; this model "
                           f"accepts values from {c.lo} to {c.hi} ({c.source})")
    pos = ((wide < c.bounds[0]) | (wide > c.bounds[1])).nonzero()[0].tolist()
    lo, hi, source = c.columns[pos[c.axis]]
    raise RequestError(f"input {c.name!r} holds {wide[tuple(pos)].item()} at position {pos}; column "
                       f"{pos[c.axis]} of this input (dimension {c.axis}) accepts values from {lo} to {hi} ({source})")


def split_key(key: str) -> tuple:
    """"NAME" -> (NAME, None); "NAME[COL]" -> (NAME, COL); ValueError otherwise."""
    m = _KEY.match(str(key))
    if not m:
        raise ValueError(f"{key!r} is not NAME or NAME[COL] (a position along the input's column dimension)")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def with_ranges(values: dict, given: dict, shapes: dict, what: str) -> dict:
    """`values` ({input: its "values" entry}) with the user's ranges `given` ({"NAME" or
    "NAME[COL]": (lo, hi)}) set: a NAME range on every column, then each NAME[COL] on its own.
    Raises ValueError naming the fix for an unknown input or column, or a range wider than the
    model's own bound."""
    out, per_input = dict(values), {}
    for key, rng in given.items():
        name, col = split_key(key)
        if name not in shapes:
            raise ValueError(f"{what} {key}: no input of that name ({', '.join(shapes)})")
        per_input.setdefault(name, {})[col] = (int(rng[0]), int(rng[1]))
    for name, ranges in per_input.items():
        out[name] = _set_ranges(name, out.get(name) or {}, ranges, shapes[name], what)
    return out


def _column_axis(name: str, entry: dict, shape) -> int:
    if entry.get("columns") is not None:
        return int(entry["axis"])
    fixed = [a for a, d in enumerate(shape) if a > 0 and isinstance(d, int)]
    if len(fixed) != 1:
        raise ValueError(f"input {name!r} (shape {list(shape)}) has {len(fixed) or 'no'} fixed dimensions besides "
                         "the batch; a range per column needs exactly one, or one derived from the model")
    return fixed[0]


def _set_ranges(name: str, entry: dict, ranges: dict, shape, what: str) -> dict:
    """One input's entry with its user ranges ({None or column: (lo, hi)}) set, each checked
    against the model's own bound for the values it covers."""
    tag = f"given with {what}"
    cols = [k for k in ranges if k is not None]
    if not cols and entry.get("columns") is None:
        lo, hi = ranges[None]
        _within(f"{what} {name}={lo}:{hi}", (lo, hi), entry, f"input {name!r}")
        return {"min": lo, "max": hi, "source": tag + (f"; {entry['source']}" if entry.get("source") else "")}
    axis = _column_axis(name, entry, shape)
    own = entry.get("columns") or [entry if "min" in entry else None] * shape[axis]
    new = list(own)
    for col, (lo, hi) in sorted(ranges.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        for c in (range(len(own)) if col is None else [col]):
            if c >= len(own):
                raise ValueError(f"{what} {name}[{col}]: input {name!r} has {len(own)} columns along dimension "
                                 f"{axis} (0 to {len(own) - 1})")
            key = f"{name}={lo}:{hi}" if col is None else f"{name}[{col}]={lo}:{hi}"
            _within(f"{what} {key}", (lo, hi), own[c] or {}, f"column {c} of input {name!r}",
                    f", or one per column: {name}[{c}]=LO:HI" if col is None else "")
            source = (own[c] or {}).get("source")
            new[c] = {"min": lo, "max": hi, "source": tag + (f"; {source}" if source else "")}
    return columns_entry(axis, new)


def columns_entry(axis: int, per: list) -> dict:
    """An input's "values" entry with a range per position along `axis` (`per`: {"min", "max",
    "source"} or None each); "min"/"max" the values every column accepts, where some value is."""
    bounded = [p for p in per if p is not None]
    lo, hi = max(p["min"] for p in bounded), min(p["max"] for p in bounded)
    return {**({"min": lo, "max": hi} if lo <= hi else {}), "source": f"a range per position along dimension {axis}",
            "axis": axis, "columns": per}


def _within(given: str, rng: tuple, own: dict, what: str, hint: str = "") -> None:
    if "min" in own and not (own["min"] <= rng[0] and rng[1] <= own["max"]):
        raise ValueError(f"{given} is wider than what the model accepts: {what} takes values from {own['min']} to "
                         f"{own['max']} ({own.get('source') or 'the model'}); a value outside would index past it. "
                         f"Give a range inside [{own['min']}, {own['max']}]{hint}")
