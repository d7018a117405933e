"""Relocate an ExportedProgram to the worker's device, then prove nothing stayed behind.

A program exported on cuda:0 fails on cuda:1 when graph nodes carry `device=` kwargs or
state-dict tensors stay put. torch's `move_to_device_pass` rewrites
both; `leftovers` checks its work, so a program that torch cannot fully move fails the
load naming each offender instead of failing the first request.
"""
from __future__ import annotations

import torch

from handlers.errors import LoadError


def _devices_in(value):
    if isinstance(value, torch.device):
        yield value
    elif isinstance(value, torch.Tensor):
        yield value.device
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _devices_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _devices_in(v)


def _same(a: torch.device, b: torch.device) -> bool:
    # `cuda` without an index means the current device; we always relocate to an explicit one.
    return a.type == b.type and (a.index == b.index or b.index is None)


def leftovers(ep, device: torch.device) -> list:
    """Everything in the program that is not on `device`: parameters, buffers, constants, graph
    node device arguments and the devices recorded in node metadata."""
    found = []
    for name, t in ep.state_dict.items():
        if isinstance(t, torch.Tensor) and not _same(t.device, device):
            found.append(f"state_dict[{name!r}] on {t.device}")
    for name, t in ep.constants.items():
        if isinstance(t, torch.Tensor) and not _same(t.device, device):
            found.append(f"constant {name!r} on {t.device}")
    for node in ep.graph.nodes:
        devices = list(_devices_in((node.args, node.kwargs)))
        named = node.kwargs.get("device")
        if isinstance(named, str):  # move_to_device_pass writes the device as a string
            try:
                devices.append(torch.device(named))
            except RuntimeError:
                found.append(f"graph node {node.name} has unparseable device={named!r}")
        for d in devices:
            if not _same(d, device):
                found.append(f"graph node {node.name} ({node.target}) argument device={d}")
        val = node.meta.get("val")
        for d in _devices_in(val):
            if d.type != "meta" and not _same(d, device):
                found.append(f"graph node {node.name} output recorded on {d}")
    return found


def relocate(ep, device: torch.device):
    from torch.export.passes import move_to_device_pass

    # without autograd: the pass moves the graph's recorded (fake) values too, and a parameter's
    # with requires_grad would make a gradient edge on their device, which a torch without that
    # device's support aborts on (a CPU build relocating a program saved from cuda:1)
    with torch.no_grad():
        moved = move_to_device_pass(ep, device)
    left = leftovers(moved, device)
    if left:
        shown = "; ".join(left[:10]) + (f"; and {len(left) - 10} more" if len(left) > 10 else "")
        raise LoadError(f"relocating the exported program to {device} left {len(left)} item(s) "
                        f"behind: {shown}. Fix: re-export on the target device or with device-free "
                        "code (create tensors with `device=x.device`).")
    return moved
