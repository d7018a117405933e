"""The serving contract read from a torch.export program: input and output names, dtypes, every
dimension (fixed, the batch, or a named dynamic dimension with its range) and, for integer
inputs that index something, the values the model can take.

Used by scripts/compile.py (the program it just exported) and scripts/import_artifact.py (a
program the user exported), so both write the same artifact.json.

Value ranges come from a walk of the graph: an integer input that reaches an indexing operation
(embedding, index_select, gather, take, advanced indexing, one_hot, embedding_bag), directly or
through views, casts between integer types and additions or subtractions of a constant, may
hold only the indices that operation accepts; several such uses intersect. An integer input that
reaches an indexing operation any other way gets no bound and is reported as unchecked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Ops whose output holds the same values as their first argument (reshaped, a subset, or cast
# to another integer type): the bound on the output is the bound on the input.
_PASS = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "clone", "contiguous",
         "permute", "transpose", "t", "slice", "select", "flatten", "alias", "detach", "lift_fresh_copy",
         "_to_copy", "to", "repeat", "narrow", "unflatten", "view_copy", "expand_copy", "squeeze_copy",
         "unsqueeze_copy", "permute_copy", "_assert_tensor_metadata"}
_SHIFT = {"add": 1, "sub": -1}  # value + sign * constant


@dataclass(frozen=True)
class Contract:
    inputs: list  # [(name, dtype, shape)] shape: None (dynamic batch) / int / dim name
    outputs: list  # [(name, dtype, shape)]
    batch: tuple  # (min, max)
    dims: dict  # name -> (min, max)
    values: dict  # input name -> {"min", "max", "source"} or {"checked": False, "why"}


class ContractError(ValueError):
    pass


def _op(node) -> tuple:
    """(name, overload) of a call_function node on an aten op, else ("", "")."""
    target = node.target
    if node.op != "call_function" or not hasattr(target, "_schema"):
        return "", ""
    return target._schema.name.split("::")[-1], target._overloadname


def _size(node, dim: int):
    val = node.meta.get("val") if hasattr(node, "meta") else None
    if val is None or not hasattr(val, "shape") or val.dim() == 0:
        return None
    d = val.shape[dim % val.dim()]
    return int(d) if isinstance(d, int) else None  # a symbolic size gives no fixed bound


def _numel(node):
    val = node.meta.get("val") if hasattr(node, "meta") else None
    try:
        return int(val.numel()) if val is not None else None
    except TypeError:  # symbolic
        return None


def _index_bounds(node, arg_pos: int):
    """The inclusive bounds an indexing op needs of its argument at `arg_pos`, with a label;
    None where the op does not index with that argument or the size is not fixed."""
    name, _ = _op(node)
    args = node.args
    if name in ("embedding",) and arg_pos == 1:
        rows = _size(args[0], 0)
        return (0, rows - 1, f"embedding table of {rows} rows") if rows else None
    if name in ("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only") and arg_pos == 1:
        rows = _size(args[0], 0)
        return (0, rows - 1, f"embedding_bag table of {rows} rows") if rows else None
    if name in ("index_select", "gather") and arg_pos == 2:
        n = _size(args[0], int(args[1]))
        return (0, n - 1, f"{name} over a dimension of {n}") if n else None
    if name == "take" and arg_pos == 1:
        n = _numel(args[0])
        return (-n, n - 1, f"take from {n} elements") if n else None
    if name == "one_hot" and arg_pos == 0:
        classes = args[1] if len(args) > 1 else node.kwargs.get("num_classes", -1)
        return (0, int(classes) - 1, f"one_hot with {classes} classes") if isinstance(classes, int) and classes > 0 else None
    return None


def _indexing_use(node, user) -> tuple:
    """(is an indexing use, bounds or None) for `node` used by `user`."""
    name, _ = _op(user)
    if name == "index" and len(user.args) > 1 and isinstance(user.args[1], (list, tuple)):
        for k, idx in enumerate(user.args[1]):
            if idx is node:
                n = _size(user.args[0], k)
                return True, ((-n, n - 1, f"indexing a dimension of {n}") if n else None)
        return False, None
    for pos, a in enumerate(user.args):
        if a is node:
            b = _index_bounds(user, pos)
            if b is not None or name in ("embedding", "embedding_bag", "_embedding_bag", "index_select",
                                         "gather", "take", "one_hot"):
                return True, b
    return False, None


def _is_integer(node) -> bool:
    val = node.meta.get("val")
    return val is not None and hasattr(val, "dtype") and not val.dtype.is_floating_point \
        and not val.dtype.is_complex and val.dtype != torch.bool


def _walk(start, name: str) -> dict:
    """Follows one integer input through value-preserving ops; returns its entry for "values"
    (or None when it indexes nothing)."""
    lo, hi, sources, unchecked = None, None, [], []
    stack, seen = [(start, 0)], set()
    while stack:
        node, shift = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            indexing, bounds = _indexing_use(node, user)
            op, _ = _op(user)
            if indexing:
                if bounds is None:
                    unchecked.append(f"aten.{op} with a size known only at run time")
                    continue
                blo, bhi, why = bounds
                lo = blo - shift if lo is None else max(lo, blo - shift)
                hi = bhi - shift if hi is None else min(hi, bhi - shift)
                sources.append(why + (f" (after adding {shift})" if shift else ""))
            elif op in _PASS and user.args and user.args[0] is node and _is_integer(user):
                stack.append((user, shift))
            elif op in _SHIFT and user.args and user.args[0] is node and len(user.args) > 1 \
                    and isinstance(user.args[1], int) and _is_integer(user):
                alpha = user.kwargs.get("alpha", 1)
                stack.append((user, shift + _SHIFT[op] * user.args[1] * alpha))
            elif _is_integer(user) and _reaches_indexing(user):
                unchecked.append(f"aten.{op or user.op} before an indexing operation")
    if unchecked:
        return {"checked": False, "why": f"{name} reaches " + "; ".join(sorted(set(unchecked)))}
    if lo is None:
        return None
    if lo > hi:
        raise ContractError(f"input {name!r}: its uses need values in empty range [{lo}, {hi}] "
                            f"({'; '.join(sources)})")
    return {"min": lo, "max": hi, "source": "; ".join(sources)}


def _reaches_indexing(node, limit: int = 200) -> bool:
    stack, seen = [node], set()
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if _indexing_use(n, u)[0]:
                return True
            stack.append(u)
    return False


def value_ranges(ep) -> dict:
    """{integer input name: its "values" entry} for the program's user inputs that index."""
    user = set(ep.graph_signature.user_inputs)
    out = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in user and _is_integer(node):
            entry = _walk(node, node.name)
            if entry is not None:
                out[node.name] = entry
    return out


def tighten(values: dict, user_ranges: dict, input_names) -> dict:
    """`values` with the user's bounds ({name: (lo, hi)}) added or intersected."""
    out = dict(values)
    for name, (lo, hi) in user_ranges.items():
        if name not in input_names:
            raise ContractError(f"--input-range {name}: no input of that name ({', '.join(input_names)})")
        old = out.get(name) or {}
        if "min" in old:
            lo, hi = max(lo, old["min"]), min(hi, old["max"])
            if lo > hi:
                raise ContractError(f"--input-range {name}: [{lo}, {hi}] is empty against the model's "
                                    f"own bound [{old['min']}, {old['max']}] ({old['source']})")
        source = "given with --input-range" + (f"; {old['source']}" if old.get("source") else "")
        out[name] = {"min": lo, "max": hi, "source": source}
    return out


def parse_ranges(items) -> dict:
    """--input-range NAME=LO:HI values as {name: (lo, hi)}."""
    out = {}
    for text in items or ():
        name, _, rng = text.partition("=")
        try:
            lo, hi = (int(x) for x in rng.split(":"))
        except ValueError:
            raise ContractError(f"--input-range {text!r}: expected NAME=LO:HI with integers, e.g. "
                                "input_ids=0:30521") from None
        if lo > hi:
            raise ContractError(f"--input-range {text!r}: LO must not exceed HI")
        out[name] = (lo, hi)
    return out


def _dim_of(d, symbols: dict, where: str, hints: dict):
    if isinstance(d, int):
        return d
    expr = d.node.expr
    if not getattr(expr, "is_Symbol", False):
        raise ContractError(f"{where} is the expression {expr} of other dimensions; the handler checks "
                            "each dimension on its own. Export it as its own Dim, or fix it.")
    if expr not in symbols:  # the user's own name (compile's --dim), else D1, D2, ... in order
        symbols[expr] = hints.get(where) or f"D{sum(1 for v in symbols.values() if v != 'batch') + 1}"
    return symbols[expr]


def _range(ep, sym) -> tuple:
    vr = ep.range_constraints.get(sym)
    lo = int(vr.lower) if vr is not None else 0
    upper = vr.upper if vr is not None else None
    hi = None
    if upper is not None and getattr(upper, "is_finite", True) is not False:  # sympy's int_oo is not
        try:
            hi = int(upper)
        except (TypeError, ValueError, OverflowError, AttributeError):
            hi = None
    if hi is None or hi > 2**31:
        raise ContractError(f"dimension {sym} has no upper bound in the program; export it with "
                            "torch.export.Dim(name, min=..., max=...) so requests can be bounded")
    return max(lo, 0), hi


def _tensors(nodes, names) -> list:
    out = []
    for node, name in zip(nodes, names):
        val = node.meta.get("val")
        if val is None or not hasattr(val, "shape"):
            raise ContractError(f"{name}: not a tensor ({type(val).__name__}); the handler serves tensors only")
        out.append((name, val))
    return out


def _children(spec) -> list:
    if spec is None:
        return []
    if callable(getattr(spec, "children", None)):  # torch >= 2.12
        return list(spec.children())
    return list(getattr(spec, "children_specs", None) or [])


def output_layout(ep) -> tuple:
    """("tensor" | "tuple" | "dict", output names) from the program's output pytree: names are
    the dict keys, output_i for a tuple, output for one tensor (as scripts/compile.py names
    them). Nested outputs are refused: the handler answers with flat named tensors."""
    spec = ep.call_spec.out_spec
    kids = _children(spec)
    if spec is None or spec.type is None or not kids:
        return "tensor", ["output"]
    if any(k.type is not None and _children(k) for k in kids):
        raise ContractError(f"the program returns a nested structure ({spec}); return a tensor, a "
                            "tuple of tensors or a dict of tensors")
    if spec.type is dict:
        return "dict", [str(k) for k in spec.context]
    if spec.type in (tuple, list):
        return "tuple", [f"output_{i}" for i in range(len(kids))]
    raise ContractError(f"the program returns {spec.type.__name__}; return a tensor, a tuple or a dict of tensors")


def read(ep, output_names: list, hints: dict | None = None) -> Contract:
    """The contract of `ep`. `output_names` name the flattened outputs; `hints` maps
    "input.axis" to a dimension name the user chose (compile's --dim)."""
    from handlers.artifact.metadata import dtype_name

    hints = hints or {}
    user = list(ep.graph_signature.user_inputs)
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    ins = _tensors([by_name[n] for n in user], user)
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outs = _tensors(list(out_node.args[0]), output_names)
    symbols = {}
    shaped = {}
    hints = {**{f"{n}.0": "batch" for n, _ in ins}, **hints}
    for kind, items in (("in", ins), ("out", outs)):
        for name, val in items:
            shaped[(kind, name)] = [_dim_of(d, symbols, f"{name}.{a}", hints) for a, d in enumerate(val.shape)]
    batch_dims = {tuple([shaped[("in", n)][0]]) for n, _ in ins}
    if len(batch_dims) != 1:
        firsts = ", ".join(f"{n}: {shaped[('in', n)][0]}" for n, _ in ins)
        raise ContractError(f"inputs disagree on dimension 0 ({firsts}); the handler batches along "
                            "dimension 0 of every input")
    (batch,) = batch_dims.pop()
    batch_sym = next((s for s, n in symbols.items() if n == batch), None) if isinstance(batch, str) else None
    brange = _range(ep, batch_sym) if batch_sym is not None else (batch, batch)
    dims = {n: _range(ep, s) for s, n in symbols.items() if n != batch}

    def entry(kind, name, val):
        shape = shaped[(kind, name)]
        if kind == "out" and shape and shape[0] != batch:
            raise ContractError(f"output {name} has dimension 0 {shape[0]}, not the batch ({batch}); "
                                "the handler needs batch-first outputs")
        return (name, dtype_name(val.dtype), [None if batch_sym is not None else brange[0]] + shape[1:])

    return Contract(inputs=[entry("in", n, v) for n, v in ins], outputs=[entry("out", n, v) for n, v in outs],
                    batch=brange, dims=dims, values=value_ranges(ep))
