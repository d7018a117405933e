"""A `torch.export.save` file read onto the CPU, whatever device its tensors and graph name.

`torch.export.load` puts each tensor back on the device it was saved from: a program exported on
cuda:1 fails to load where there is no cuda:1 (a host of one GPU, a worker confined to its GPU:
confine.py) and, where there is, makes a CUDA context on that GPU in a process serving another
(field report 001). torch.export.load takes no map_location, so the load here reads every tensor
onto the CPU and the caller relocates the program (relocate.py). Facts it relies on (torch
2.11-2.13, torch/export/pt2_archive/_package.py and torch/_export/serde/serialize.py):
- the weights and constants are built by `_build_file_map`, which reads each record into a CPU
  tensor and moves it to `deserialize_device(tensor_meta.device)` (that module's own name for it);
- the graph's recorded values and device arguments are read through serialize.py's own
  `deserialize_device` (a fake tensor on cuda:1 fails to deserialize where the process sees one GPU:
  seen on two H200s in a worker confined to its GPU);
- the example inputs are a torch.save payload read by serialize.py's `deserialize_torch_artifact`.
Where a torch lacks either name, the load is torch's own (tensors go back where they were saved).
"""
from __future__ import annotations

import contextlib
import io

import torch


class Saved:
    """The devices the file's tensors were saved from (read while mapping them to the CPU)."""

    def __init__(self):
        self.devices: list = []

    def saw(self, device) -> None:
        device = torch.device(device)
        if device not in self.devices:
            self.devices.append(device)

    @property
    def device(self) -> torch.device:
        """The device the program was exported on: its first non-CPU device, else the CPU."""
        return next((d for d in self.devices if d.type != "cpu"), torch.device("cpu"))


@contextlib.contextmanager
def _onto_cpu(saved: Saved):
    package = _module("torch.export.pt2_archive._package")
    serialize = _module("torch._export.serde.serialize")
    patches = []
    for mod in (package, serialize):  # the weights' and constants' devices; the graph's (values, arguments)
        if mod is not None and hasattr(mod, "deserialize_device"):
            patches.append((mod, "deserialize_device", mod.deserialize_device, _to_cpu(mod.deserialize_device, saved)))
    if serialize is not None and hasattr(serialize, "deserialize_torch_artifact"):
        real_artifact = serialize.deserialize_torch_artifact

        def artifact_on_cpu(serialized):
            if not isinstance(serialized, (bytes, bytearray)) or not serialized:
                return real_artifact(serialized)

            def where(storage, location):
                saved.saw(location)
                return storage  # torch.load's storages arrive on the CPU before map_location moves them
            try:
                return torch.load(io.BytesIO(serialized), weights_only=True, map_location=where)
            except Exception:  # noqa: BLE001  (custom objects: torch's own path, weights_only=False)
                return real_artifact(serialized)
        patches.append((serialize, "deserialize_torch_artifact", real_artifact, artifact_on_cpu))
    for mod, name, _, new in patches:
        setattr(mod, name, new)
    try:
        yield
    finally:
        for mod, name, old, _ in patches:
            setattr(mod, name, old)


def _to_cpu(real, saved: Saved):
    def to_cpu(d):
        saved.saw(real(d))
        return torch.device("cpu")
    return to_cpu


def _module(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def load_on_cpu(path: str) -> tuple:
    """(the program with every tensor on the CPU, Saved: the devices they were saved from)."""
    saved = Saved()
    with _onto_cpu(saved):
        ep = torch.export.load(path)
    return ep, saved
