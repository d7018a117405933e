"""State a torch.export program keeps between calls: the buffers (or parameters, or tensor
constants) it writes.

A program that writes its own state (a language model's KV cache, a running statistic) answers
each call from what earlier calls left behind. Served as a stateless model, one client's request
is answered from another's state: a silently wrong answer. Such programs are found here, before
anything serves them.

torch.export writes such an update in one of two forms, both read here:
- functional: the graph returns the new value and `graph_signature.buffers_to_mutate` (output
  specs of kind BUFFER_MUTATION, PARAMETER_MUTATION) names the buffer it replaces: the form of
  `ep.run_decompositions()` and of older export paths;
- in place: an op that writes its argument (`index_put_`, `copy_`, `add_`, ... : the op schema
  marks the argument `Tensor(a!)`) on a state input, or on a view of one (`k_cache[:, :, pos]`):
  the form torch 2.13's default `torch.export.export` keeps.
AOTInductor compiles either into constants its loaded container owns and writes (one cache per
loaded package), so a package is judged by the program it was compiled from.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

_STATE_KINDS = ("BUFFER", "PARAMETER", "CONSTANT_TENSOR")
_MUTATION_KINDS = ("BUFFER_MUTATION", "PARAMETER_MUTATION")


@dataclass(frozen=True)
class ProgramState:
    """What a program writes of its own state: names (fully qualified, as in its state dict) in
    the order the graph first writes them, and how each was found."""

    mutated: tuple = ()
    how: str = ""

    @property
    def stateless(self) -> bool:
        return not self.mutated

    def record(self) -> dict:
        """artifact.json's `extra.state` entry."""
        return {"mutated": list(self.mutated), "checked": "torch.export program graph"}

    def describe(self, limit: int = 6) -> str:
        shown = ", ".join(self.mutated[:limit]) + (f" and {len(self.mutated) - limit} more"
                                                   if len(self.mutated) > limit else "")
        return f"{len(self.mutated)} of its state tensors ({shown}; {self.how})"


# Composite ops whose schema carries no write annotation though they update their running
# statistics in training mode (aten::batch_norm(input, weight, bias, running_mean, running_var,
# bool training, ...), instance_norm alike): {name: (training's position, written positions)}.
_UNANNOTATED = {"batch_norm": (5, (3, 4)), "instance_norm": (5, (3, 4))}


def _writes(node) -> list:
    """The arguments an aten op node writes in place (schema alias_info.is_write)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    name = schema.name.split("::")[-1]
    if name in _UNANNOTATED:
        training, written = _UNANNOTATED[name]
        if len(node.args) > training and node.args[training] is True:
            return [node.args[i] for i in written if hasattr(node.args[i], "op")]
    out = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if hasattr(v, "op"))
    return out


def _view_source(node):
    """The node a view op (`Tensor(a)` result aliasing its first argument: select, slice, view,
    transpose, ...) or a getitem of a tuple of views (split, unbind) reads from; None otherwise."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and node.args and hasattr(node.args[0], "op"):
        return _view_source(node.args[0])
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or not schema.returns:
        return None
    first, ret = schema.arguments[0].alias_info, schema.returns[0].alias_info
    if first is None or ret is None or first.is_write:
        return None
    shared = set(first.before_set) & set(ret.after_set if ret.after_set else ret.before_set)
    return node.args[0] if shared and node.args and hasattr(node.args[0], "op") else None


def _root(node):
    seen = 0
    while node is not None and node.op != "placeholder" and seen < 10_000:
        node, seen = _view_source(node), seen + 1
    return node


def _state_inputs(ep) -> dict:
    """{placeholder name: state name} for the program's buffers, parameters and tensor constants."""
    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name in _STATE_KINDS and spec.target is not None:
            out[spec.arg.name] = spec.target
    return out


def program_state(ep) -> ProgramState:
    """The state `ep` writes, in both graph forms (module docstring)."""
    found, how = [], []
    for spec in ep.graph_signature.output_specs:
        if spec.kind.name in _MUTATION_KINDS and spec.target not in found:
            found.append(spec.target)
    if found:
        how.append("returned as mutations (graph_signature.buffers_to_mutate)")
    state = _state_inputs(ep)
    in_place = []
    for node in ep.graph.nodes:
        for arg in _writes(node):
            root = _root(arg)
            name = state.get(root.name) if root is not None else None
            if name is not None and name not in found:
                found.append(name)
                in_place.append(f"{node.target}")
    if in_place:
        how.append("written in place by " + ", ".join(sorted(set(in_place))))
    return ProgramState(tuple(found), "; ".join(how))


def refusal(what: str, state: ProgramState) -> str:
    """Why a program that writes its own state is not served, and what to do instead."""
    return (f"{what} keeps state between calls: every call writes {state.describe()}. Served as a "
            "stateless model, one client's request would be answered from the state another client's "
            "request left behind, so it is refused. If the state is left over from training (BatchNorm "
            "running statistics, counters), call model.eval() before torch.export. If it is a language "
            "model's KV cache (TorchChat, gpt-fast, transformers' static-cache export), export it in the "
            "decoder form the handler generates with: forward(tokens int[1, S], positions int[S] or [1, S]) -> "
            "logits [1, S, vocab], the cache in buffers of (1, heads, length, head_dim) (docs/generation.md)")


def check_program(ep, what: str, record=None) -> ProgramState:
    """`ep`'s state record; raises StatefulArtifact (refusal) where it writes state, unless
    artifact.json's `record` (extra.state) names it a decoder writing exactly that state
    (handlers/artifact/decoder.py: served by generation, one sequence at a time)."""
    from handlers.errors import StatefulArtifact

    state = program_state(ep)
    decoder = record.get("decoder") if isinstance(record, dict) else None
    if not state.stateless and not (decoder and set(decoder.get("mutated", ())) == set(state.mutated)):
        raise StatefulArtifact(refusal(what, state))
    return state


def require_checked(spec, kind) -> None:
    """Before a worker loads `spec`: a native artifact (an AOTInductor package, a .so, a TensorRT
    module) cannot be read for the state its program writes, so artifact.json must record that
    its program was checked (extra.state, written by cs-import and cs-compile) and found to write
    none, or found to be a decoder (served by generation). An exported program is checked from its
    own graph when it is loaded."""
    from handlers.errors import StatefulArtifact

    record = spec.extra.get("state")
    if record is not None and not isinstance(record, dict):
        raise StatefulArtifact(f"{spec.artifact}: artifact.json's extra.state is {type(record).__name__}, not the "
                               "record cs-import writes; rebuild the archive with cs-archive")
    if record and record.get("mutated") and not record.get("decoder"):
        mutated = tuple(str(m) for m in record["mutated"])
        raise StatefulArtifact(refusal(spec.artifact, ProgramState(mutated, "recorded in artifact.json")))
    if record is None and not kind.checks_state_at_load:
        raise StatefulArtifact(
            f"{spec.artifact}: artifact.json does not record whether the program behind this {spec.backend} "
            "artifact writes state between calls (it was built before that check existed), and compiled "
            "code cannot be read for it. Rebuild the artifact with this version (cs-import --artifact "
            "PACKAGE.pt2 --program PROGRAM.pt2, or cs-compile), then cs-archive it again")
