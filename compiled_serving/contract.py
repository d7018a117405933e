"""The serving contract read from a torch.export program: input and output names, dtypes, every
dimension (fixed, the batch, or a named dynamic dimension with its range) and, for integer
inputs that index something, the values the model can take.

Used by compiled_serving/compile.py (the program it just exported) and compiled_serving/import_artifact.py (a
program the user exported), so both write the same artifact.json.

Value ranges come from a walk of the graph: an integer input that reaches an indexing operation
(embedding, index_select, gather, take, advanced indexing, one_hot, embedding_bag), directly or
through views, casts between integer types and additions or subtractions of a constant, may
hold only the indices that operation accepts; several such uses intersect. An integer input that
reaches an indexing operation any other way gets no bound and is reported as unchecked.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

# Ops whose output holds the same values as their first argument (reshaped, a subset, or cast
# to another integer type): the bound on the output is the bound on the input.
_PASS = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "clone", "contiguous",
         "permute", "transpose", "t", "slice", "select", "flatten", "alias", "detach", "lift_fresh_copy",
         "_to_copy", "to", "repeat", "narrow", "unflatten", "view_copy", "expand_copy", "squeeze_copy",
         "unsqueeze_copy", "permute_copy", "_assert_tensor_metadata", "slice_copy", "select_copy",
         "index", "index_select", "gather", "take"}  # the last four: when the input is their source
# Ops returning a tuple of tensors, each a part of their first argument (taken by getitem).
_TUPLES = {"unbind", "split", "split_with_sizes", "chunk", "tensor_split", "unbind_copy", "split_copy"}
_SHIFT = {"add": 1, "sub": -1}  # value + sign * constant
_INDEX_ARG = {"embedding": 1, "embedding_bag": 1, "_embedding_bag": 1, "_embedding_bag_forward_only": 1,
              "index_select": 2, "gather": 2, "take": 1, "one_hot": 0}  # where the indices go
MAX_COLUMNS = 4096  # positions along a fixed dimension tracked one by one at most


@dataclass(frozen=True)
class Contract:
    inputs: list  # [(name, dtype, shape)] shape: None (dynamic batch) / int / dim name
    outputs: list  # [(name, dtype, shape)]
    batch: tuple  # (min, max)
    dims: dict  # name -> (min, max)
    values: dict  # input name -> {"min", "max", "source"} or {"checked": False, "why"}
    state: dict  # artifact.json's extra.state: what the program writes between calls (none)


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
    pos = _INDEX_ARG.get(name)
    if pos is not None and len(user.args) > pos and user.args[pos] is node:
        return True, _index_bounds(user, pos)
    return False, None


def _is_integer(node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)) and val:  # an op returning several tensors
        val = val[0]
    return val is not None and hasattr(val, "dtype") and not val.dtype.is_floating_point \
        and not val.dtype.is_complex and val.dtype != torch.bool


@dataclass(frozen=True)
class _At:
    """What a node of the walk holds of the input: its values plus `shift`, from the input's
    positions `cols` along the tracked dimension, enumerated in order along dimension `dim` of
    the node, or mixed together where `dim` is None (a bound then applies to each of them)."""
    shift: int
    cols: tuple
    dim: int | None


def _shape(node):
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return tuple(val.shape) if val is not None and hasattr(val, "shape") else None


def _ints(*xs) -> bool:
    return all(isinstance(x, int) for x in xs)


def _picked(at: _At, positions) -> _At:
    """`at` with its columns re-indexed by `positions` (a list of ints, or a slice) along its dim."""
    cols = at.cols[positions] if isinstance(positions, slice) else tuple(at.cols[i] for i in positions)
    return _At(at.shift, cols, at.dim)


def _constant(node, ep):
    """The 1-D integer values of a lifted tensor constant (through its copies), or None."""
    while node is not None and node.op == "call_function" and _op(node)[0] in ("lift_fresh_copy", "detach_",
                                                                                 "detach", "clone", "_to_copy"):
        node = node.args[0]
    if node is None or node.op != "placeholder" or ep is None:
        return None
    sig = ep.graph_signature
    key = getattr(sig, "inputs_to_lifted_tensor_constants", {}).get(node.name)
    t = ep.constants.get(key) if key is not None else None
    return [int(v) for v in t.tolist()] if t is not None and t.dim() == 1 and not t.is_floating_point() else None


def _moved_dim(at: _At, node, user, name: str, ep):
    """Where `at.dim` of `node` lands in `user` (an op of _PASS with `node` first), with the columns
    it then enumerates: an _At, whose dim is None where it cannot be followed."""
    a, d = user.args, at.dim
    rin, rout = len(_shape(node) or ()), len(_shape(user) or ())
    mixed = _At(at.shift, at.cols, None)
    if not rin:
        return mixed
    if name in ("select", "select_copy"):
        sd, i = a[1] % rin, a[2]
        if sd == d:
            return _At(at.shift, (at.cols[i],), None) if isinstance(i, int) else mixed
        return _At(at.shift, at.cols, d - 1 if sd < d else d)
    if name in ("slice", "slice_copy", "narrow"):
        sd = (a[1] if len(a) > 1 else 0) % rin
        if sd != d:
            return at
        if name == "narrow":
            return _picked(at, slice(a[2], a[2] + a[3])) if _ints(a[2], a[3]) else mixed
        start, end, step = (list(a[2:]) + [None, None, 1])[:3]
        plain = all(x is None or isinstance(x, int) for x in (start, end, step))
        return _picked(at, slice(start, end, step)) if plain else mixed
    if name in ("unsqueeze", "unsqueeze_copy"):
        return _At(at.shift, at.cols, d + 1 if a[1] % rout <= d else d)
    if name in ("permute", "permute_copy"):
        return _At(at.shift, at.cols, [x % rin for x in a[1]].index(d))
    if name in ("transpose", "t"):
        if rin < 2:
            return at
        x, y = (a[1] % rin, a[2] % rin) if name == "transpose" else (0, 1)
        return _At(at.shift, at.cols, y if d == x else x if d == y else d)
    if name in ("squeeze", "squeeze_copy"):
        return _squeezed(at, node, a)
    if name in ("index", "index_select"):
        return _indexed(at, user, name, ep)
    if name in ("gather", "take", "repeat", "expand", "expand_copy"):
        return mixed
    if name in ("view", "_unsafe_view", "reshape", "flatten", "unflatten", "view_copy"):
        before, after = _shape(node), _shape(user)
        same = before and after and len(after) > d and all(str(x) == str(y)
                                                           for x, y in zip(before[:d + 1], after[:d + 1]))
        return at if same else mixed
    return at if rin == rout else mixed  # clone, casts, detach: the same shape


def _squeezed(at: _At, node, args) -> _At:
    shape = _shape(node) or ()
    dims = range(len(shape)) if len(args) < 2 else [args[1]] if isinstance(args[1], int) else args[1]
    gone = {x % len(shape) for x in dims if isinstance(shape[x % len(shape)], int) and shape[x % len(shape)] == 1}
    if at.dim in gone:
        return _At(at.shift, at.cols, None)
    return _At(at.shift, at.cols, at.dim - sum(1 for x in gone if x < at.dim))


def _indexed(at: _At, user, name: str, ep) -> _At:
    """index.Tensor / index_select with the input as the source: a constant 1-D index along the
    tracked dimension re-indexes its columns; a 1-D index along another dimension leaves it in place."""
    mixed = _At(at.shift, at.cols, None)
    if name == "index_select":
        sd, idx = user.args[1] % len(_shape(user.args[0]) or (1,)), user.args[2]
    else:
        given = [(k, i) for k, i in enumerate(user.args[1]) if i is not None]
        if len(given) != 1:
            return mixed
        (sd, idx), = given
    if len(_shape(idx) or ()) != 1:
        return mixed
    if sd != at.dim:
        return at
    values = _constant(idx, ep)
    ok = values is not None and all(-len(at.cols) <= v < len(at.cols) for v in values)
    return _picked(at, values) if ok else mixed


def _parts(at: _At, node, user, name: str) -> list:
    """Per output of a tuple-returning op (unbind, split, chunk), what it holds of the input."""
    outs, args = user.meta.get("val") or (), user.args
    unbind = name.startswith("unbind")
    sd = (args[1] if len(args) > 1 else 0) if unbind else (args[2] if len(args) > 2 else user.kwargs.get("dim", 0))
    sd %= max(len(_shape(node) or ()), 1)
    if at.dim is None:
        parts = [at] * len(outs)
    elif sd != at.dim:
        parts = [_At(at.shift, at.cols, at.dim - 1 if unbind and sd < at.dim else at.dim)] * len(outs)
    elif unbind:
        parts = [_At(at.shift, (c,), None) for c in at.cols]
    else:
        sizes = [o.shape[sd] for o in outs]
        if not _ints(*sizes) or sum(sizes) != len(at.cols):
            return [_At(at.shift, at.cols, None)] * len(outs)
        parts = [_picked(at, slice(sum(sizes[:k]), sum(sizes[:k + 1]))) for k in range(len(outs))]
    return [_checked(p, tuple(o.shape)) for p, o in zip(parts, outs)]


def _checked(at: _At, shape) -> _At:
    """A safety net: the positions along `at.dim` must be exactly the columns they are taken for,
    else the columns count as mixed."""
    size = shape[at.dim] if at.dim is not None and at.dim < len(shape or ()) else None
    return at if at.dim is None or (isinstance(size, int) and size == len(at.cols)) else _At(at.shift, at.cols, None)


def _passed(node, user, at, ep):
    """What `user` holds of the input where it passes `node`'s values on (an _At, or a list of
    them for a tuple-returning op), else None."""
    if isinstance(at, list):  # node returns several tensors: getitem takes one
        k = user.args[1] if user.target is operator.getitem and len(user.args) > 1 else None
        return at[k] if isinstance(k, int) and -len(at) <= k < len(at) else None
    name, _ = _op(user)
    if not (user.args and user.args[0] is node and _is_integer(user)):
        return None
    if name in _SHIFT and len(user.args) > 1 and isinstance(user.args[1], int):
        return _At(at.shift + _SHIFT[name] * user.args[1] * user.kwargs.get("alpha", 1), at.cols, at.dim)
    if name in _TUPLES:
        return _parts(at, node, user, name)
    if name not in _PASS:
        return None
    return at if at.dim is None else _checked(_moved_dim(at, node, user, name, ep), _shape(user))


def _walk(start, cols: tuple = (0,), dim: int | None = None, ep=None) -> tuple:
    """Follows one integer input through ops that pass its values on, tracking which of its
    positions `cols` along dimension `dim` each node holds. Returns ({column: [lo, hi, sources]}
    for the columns some indexing bounds, [why unchecked])."""
    bounds, unchecked = {}, []
    stack, seen = [(start, _At(0, cols, dim))], set()
    while stack:
        node, at = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            indexing, found = (False, None) if isinstance(at, list) else _indexing_use(node, user)
            if indexing:
                if found is None:
                    unchecked.append(f"aten.{_op(user)[0]} with a size known only at run time")
                    continue
                blo, bhi, why = found
                for c in set(at.cols):
                    lo, hi, sources = bounds.get(c, (None, None, []))
                    lo = blo - at.shift if lo is None else max(lo, blo - at.shift)
                    hi = bhi - at.shift if hi is None else min(hi, bhi - at.shift)
                    bounds[c] = (lo, hi, sources + [why + (f" (after adding {at.shift})" if at.shift else "")])
                continue
            nxt = _passed(node, user, at, ep)
            if nxt is not None:
                stack.append((user, nxt))
            elif _is_integer(user) and _reaches_indexing(user):
                unchecked.append(f"aten.{_op(user)[0] or user.op} before an indexing operation")
    return bounds, unchecked


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


def _range_entry(name: str, where: str, found) -> dict | None:
    if found is None:
        return None
    lo, hi, sources = found
    if lo > hi:
        raise ContractError(f"input {name!r}{where}: its uses need values in empty range [{lo}, {hi}] "
                            f"({'; '.join(sources)})")
    return {"min": lo, "max": hi, "source": "; ".join(dict.fromkeys(sources))}


def _entry(node, name: str, ep) -> dict | None:
    """The input's "values" entry: one range, a range per column along the first fixed
    dimension whose positions the graph bounds differently, or unchecked; None where it indexes
    nothing."""
    shape = _shape(node) or ()
    for axis in range(1, len(shape)):
        n = shape[axis]
        if not isinstance(n, int) or not 2 <= n <= MAX_COLUMNS:
            continue
        bounds, unchecked = _walk(node, tuple(range(n)), axis, ep)
        if unchecked or not bounds:
            break
        per = [_range_entry(name, f" column {c} (dimension {axis})", bounds.get(c)) for c in range(n)]
        if len({None if p is None else (p["min"], p["max"]) for p in per}) > 1:
            from handlers.values import columns_entry

            return columns_entry(axis, per)
    bounds, unchecked = _walk(node, ep=ep)
    if unchecked:
        return {"checked": False, "why": f"{name} reaches " + "; ".join(sorted(set(unchecked)))}
    return _range_entry(name, "", bounds.get(0))


def value_ranges(ep) -> dict:
    """{integer input name: its "values" entry} for the program's user inputs that index."""
    user = set(ep.graph_signature.user_inputs)
    out = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in user and _is_integer(node):
            entry = _entry(node, node.name, ep)
            if entry is not None:
                out[node.name] = entry
    return out


def tighten(values: dict, user_ranges: dict, inputs) -> dict:
    """`values` with the user's ranges (parse_ranges: {"NAME" or "NAME[COL]": (lo, hi)}) set:
    `inputs` the contract's [(name, dtype, shape)]. A range wider than the model's own bound (the
    table it indexes) is refused, naming that bound."""
    from handlers.values import with_ranges

    shapes = {n: shape for n, _dt, shape in inputs}
    try:
        return with_ranges(values, user_ranges, shapes, "--input-range")
    except ValueError as e:
        raise ContractError(str(e)) from None


def parse_named_ranges(items, flag: str, expected: str, error=None) -> dict:
    """NAME=LO:HI command-line values as {NAME: (lo, hi)} with integers lo <= hi, the one parser
    of that spelling (cs-import's and cs-compile's --input-range, cs-compile's --dim); raises
    `error` (ContractError unless given) naming the flag, the item and `expected`."""
    error = error or ContractError
    out = {}
    for text in items or ():
        name, _, rng = text.partition("=")
        try:
            lo, hi = (int(x) for x in rng.split(":"))
        except ValueError:
            raise error(f"{flag} {text!r}: expected {expected}") from None
        if lo > hi:
            raise error(f"{flag} {text!r}: the low end must not exceed the high end; expected {expected}")
        out[name.strip()] = (lo, hi)
    return out


def parse_ranges(items) -> dict:
    """--input-range NAME=LO:HI or NAME[COL]=LO:HI values as {"NAME" or "NAME[COL]": (lo, hi)}."""
    return parse_named_ranges(items, "--input-range", "NAME=LO:HI or NAME[COL]=LO:HI with integers, "
                              "e.g. input_ids=0:30521 or sparse[1]=0:4999")


def _dim_of(d, symbols: dict, where: str, hints: dict, first: dict, kind: str = "input"):
    """The contract's name of dimension `d` ("name.axis" `where` of an input or output, `kind`);
    `first` records, per symbol, where it was first seen ("kind name.axis", for messages)."""
    if isinstance(d, int):
        return d
    expr = d.node.expr
    if not getattr(expr, "is_Symbol", False):
        raise ContractError(f"{where} is the expression {expr} of other dimensions; the handler checks "
                            "each dimension on its own. Export it as its own Dim, or fix it.")
    if expr not in symbols:  # the user's own name (compile's --dim), else D1, D2, ... in order
        symbols[expr] = hints.get(where) or f"D{sum(1 for v in symbols.values() if v != 'batch') + 1}"
        first[expr] = f"{kind} {where}"
    return symbols[expr]


def _range(ep, sym, where: str = "", hint: str = "") -> tuple:
    """The (min, max) of dimension `sym`, first seen at `where` ("kind name.axis"); refused
    naming that input and dimension where it has no upper bound."""
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
        kind, _, at = where.partition(" ")
        name, _, axis = at.rpartition(".")
        dim = hint or ("batch" if axis == "0" else "seq")
        raise ContractError(f"{kind or 'input'} {name or '?'!r} dimension {axis or '?'} has no upper bound; export "
                            f"with Dim({dim!r}, max=...) (dynamic_shapes={{{name or 'x'!r}: {{{axis or 1}: "
                            f"torch.export.Dim({dim!r}, max=...)}}}}) so requests can be bounded")
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
    the dict keys, output_i for a tuple, output for one tensor (as compiled_serving/compile.py names
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


def decoder_contract(ep, state) -> Contract:
    """The contract of a program that writes its own state: a decoder's (handlers/artifact/
    decoder.py), with the token ids bounded by the vocabulary and the positions by the cache;
    anything else is refused naming the state it writes and why it is not a decoder."""
    from handlers.artifact.decoder import NotADecoder, recognise
    from handlers.artifact.state import refusal

    try:
        dec = recognise(ep, state.mutated)
    except NotADecoder as e:
        raise ContractError(f"{refusal('the program', state)}. It is not served as a decoder either: {e}") from None
    seq = "seq" if dec.chunk_max > 1 else 1
    values = {dec.tokens: {"min": 0, "max": dec.vocab - 1, "source": "the decoder's vocabulary"},
              dec.positions: {"min": 0, "max": dec.cache_length - 1, "source": "the decoder's KV cache length"}}
    dims = {"seq": (1, dec.chunk_max)} if seq == "seq" else {}
    logits_seq = seq if dec.all_positions else 1
    if dec.slotted:  # many sequences: a row per busy slot (handlers/continuous.py)
        values[dec.slot_input] = {"min": 0, "max": dec.slots - 1, "source": "the decoder's slot count"}
        inputs = [(dec.tokens, "int64", [None, seq]), (dec.positions, "int64", [None, seq]),
                  (dec.slot_input, "int64", [None])]
        outputs, batch = [(dec.logits, dec.logits_dtype, [None, logits_seq, dec.vocab])], (1, dec.slots)
    else:
        pos_shape = [seq] if dec.positions_rank == 1 else [1, seq]
        inputs = [(dec.tokens, "int64", [1, seq]), (dec.positions, "int64", pos_shape)]
        outputs, batch = [(dec.logits, dec.logits_dtype, [1, logits_seq, dec.vocab])], (1, 1)
    return Contract(inputs=inputs, outputs=outputs, batch=batch, dims=dims, values=values,
                    state={**state.record(), "decoder": dec.record()})


def read(ep, output_names: list, hints: dict | None = None) -> Contract:
    """The contract of `ep`. `output_names` name the flattened outputs; `hints` maps
    "input.axis" to a dimension name the user chose (compile's --dim)."""
    from handlers.artifact.metadata import dtype_name
    from handlers.artifact.state import program_state, refusal

    # first: a program that writes its own state is served only as a decoder (its KV cache),
    # refused whatever its inputs look like otherwise
    state = program_state(ep)
    if not state.stateless:
        return decoder_contract(ep, state)
    hints = hints or {}
    user = list(ep.graph_signature.user_inputs)
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    ins = _tensors([by_name[n] for n in user], user)
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outs = _tensors(list(out_node.args[0]), output_names)
    symbols, first = {}, {}
    shaped = {}
    user_hints = dict(hints)
    hints = {**{f"{n}.0": "batch" for n, _ in ins}, **hints}
    for kind, items in (("in", ins), ("out", outs)):
        for name, val in items:
            label = "input" if kind == "in" else "output"
            shaped[(kind, name)] = [_dim_of(d, symbols, f"{name}.{a}", hints, first, label)
                                    for a, d in enumerate(val.shape)]

    def rng(sym):
        where = first.get(sym, "")
        return _range(ep, sym, where, user_hints.get(where.partition(" ")[2], ""))
    batch_dims = {tuple([shaped[("in", n)][0]]) for n, _ in ins}
    if len(batch_dims) != 1:
        firsts = ", ".join(f"{n}: {shaped[('in', n)][0]}" for n, _ in ins)
        raise ContractError(f"inputs disagree on dimension 0 ({firsts}); the handler batches along "
                            "dimension 0 of every input")
    (batch,) = batch_dims.pop()
    batch_sym = next((s for s, n in symbols.items() if n == batch), None) if isinstance(batch, str) else None
    brange = rng(batch_sym) if batch_sym is not None else (batch, batch)
    dims = {n: rng(s) for s, n in symbols.items() if n != batch}

    def entry(kind, name, val):
        shape = shaped[(kind, name)]
        if kind == "out" and shape and shape[0] != batch:
            raise ContractError(f"output {name} has dimension 0 {shape[0]}, not the batch ({batch}); "
                                "the handler needs batch-first outputs")
        return (name, dtype_name(val.dtype), [None if batch_sym is not None else brange[0]] + shape[1:])

    return Contract(inputs=[entry("in", n, v) for n, v in ins], outputs=[entry("out", n, v) for n, v in outs],
                    batch=brange, dims=dims, values=value_ranges(ep), state=state.record())
