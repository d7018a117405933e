"""A slot-form decoder's KV cache allocated at load instead of carried in the artifact.

The cache is state the program writes (artifact/state.py), all zeros until the first call, and as
large as slots x positions x the cache's bytes per position (896 MiB for Qwen2.5-1.5B at 64 x 512,
3.5 GiB at 64 x 2048). An artifact written by cs-export-lm carries none of it:

- its program (`torch.export.save`) holds each cache tensor as a placeholder, a zero scalar
  expanded to the cache's shape (`torch.zeros((), dtype).expand(shape)`): torch 2.13's archive
  writes a tensor's untyped storage (torch/export/pt2_archive/_package.py `_get_raw_tensor_bytes`),
  here one element, and reads it back as the same expanded view (`torch.as_strided` over it);
- its AOTInductor package keeps its constants outside its library and leaves the cache out of
  them (kinds/aoti_constants.py);
- artifact.json records the cache (`extra.cache`: each tensor's name, dtype and shape, which makes
  the file layout 4: metadata.py), and the loader allocates it as zeros on the serving device.

A placeholder run as it is does not fail: index_put_ into an expanded tensor only warns (torch
2.13: "Use of index_put_ on expanded tensors is deprecated") and writes every row into its one
element, a silently wrong cache. So a program whose written state holds a placeholder that the
record does not name is refused, as is a record that does not match what the artifact holds.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from handlers.dtypes import BY_NAME, dtype_name
from handlers.errors import LoadError

KEY = "cache"  # artifact.json's extra.cache
HOW = "zeros on the serving device, allocated at load: not in the artifact"
FIX = ("Fix: export it again with cs-export-lm (or import its program.pt2 with cs-import, which records the "
       "cache it leaves out), then cs-archive the directory again")


@dataclass(frozen=True)
class CacheTensor:
    name: str  # as in the program's state dict or constants, and the package's constant fqns
    dtype: str  # torch's dtype name (handlers/dtypes.py)
    shape: tuple

    @property
    def nbytes(self) -> int:
        n = BY_NAME[self.dtype].torch.itemsize
        for d in self.shape:
            n *= d
        return n

    def zeros(self, device) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=BY_NAME[self.dtype].torch, device=device)

    def describe(self) -> str:
        return f"{self.name} {self.dtype}{list(self.shape)}"


def placeholder(t: torch.Tensor) -> torch.Tensor:
    """What the program file holds for cache tensor `t`: a zero of its dtype expanded to its shape, on
    the CPU whatever `t`'s device (the writer copies a tensor to the CPU before it takes its storage,
    and a copy of an expanded tensor is a whole one: `_to_copy` keeps the strides of dense tensors only)."""
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def is_placeholder(t) -> bool:
    """Whether `t` has more elements than its storage holds (an expanded scalar: no values of its own)."""
    return (isinstance(t, torch.Tensor) and t.numel() > 1
            and t.untyped_storage().nbytes() < t.numel() * t.element_size())


@contextlib.contextmanager
def left_out(ep, names):
    """`ep` with its tensors `names` (the cache) replaced by placeholders while the block runs
    (torch.export.save then writes one element of each), put back after it. The writer's warning
    that a tensor is not its storage's whole ("No complete tensor found in the group!") is what a
    placeholder is: silenced for the block."""
    swapped = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No complete tensor found in the group")
        try:
            for table in (ep.state_dict, ep.constants):
                for name in names:
                    if isinstance(table.get(name), torch.Tensor):
                        swapped.append((table, name, table[name]))
                        table[name] = placeholder(table[name])
            yield
        finally:
            for table, name, t in swapped:
                table[name] = t


def of_program(ep, mutated) -> tuple:
    """The CacheTensors of the placeholders among the state `ep` writes (`mutated`): what its record names."""
    tensors = {**ep.state_dict, **ep.constants}
    return tuple(CacheTensor(n, dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in mutated
                 if is_placeholder(tensors.get(n)))


def record(tensors) -> dict:
    """artifact.json's extra.cache for `tensors` (CacheTensors)."""
    return {"how": HOW, "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in tensors]}


def read(spec) -> tuple:
    """The CacheTensors artifact.json records (extra.cache), () where it records none; LoadError
    naming the fix where the record is malformed or names what the decoder does not write."""
    raw = spec.extra.get(KEY)
    if raw is None:
        return ()
    try:
        out = tuple(CacheTensor(str(t["name"]), str(t["dtype"]), tuple(int(d) for d in t["shape"]))
                    for t in raw["tensors"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LoadError(f"{spec.artifact}: artifact.json's extra.cache is malformed ({type(e).__name__}: {e}); "
                        f"expected {{tensors: [{{name, dtype, shape}}, ...]}}. {FIX}") from None
    bad = [t.describe() for t in out if t.dtype not in BY_NAME or not t.shape or min(t.shape) < 1]
    if not out or bad:
        raise LoadError(f"{spec.artifact}: artifact.json's extra.cache names {', '.join(bad) if bad else 'no tensor'}; "
                        f"expected each cache tensor with a dtype of {', '.join(BY_NAME)} and a shape of "
                        f"positive sizes. {FIX}")
    state = spec.extra.get("state")
    decoder = state.get("decoder") if isinstance(state, dict) else None
    written = set((decoder or {}).get("mutated", ()))
    stray = [t.name for t in out if t.name not in written]
    if stray:
        raise LoadError(f"{spec.artifact}: artifact.json's extra.cache names {', '.join(stray)}, which its decoder "
                        f"(extra.state.decoder.mutated) does not write: only a decoder's cache is allocated at "
                        f"load. {FIX}")
    return out


def materialize(ep, recorded: tuple, mutated, device, what: str) -> int:
    """The program's cache tensors `recorded` (CacheTensors) as zeros on `device` in place of its
    placeholders, before the program moves there (relocate.py: nothing else to copy); the bytes
    allocated. LoadError where a tensor the program writes is a placeholder no record names, or a
    record names a tensor the program does not write with that dtype and shape."""
    tables = {n: table for table in (ep.constants, ep.state_dict) for n in table}
    named = {t.name for t in recorded}
    unnamed = [n for n in mutated if n in tables and is_placeholder(tables[n][n]) and n not in named]
    if unnamed:
        raise LoadError(f"{what} holds no values for {', '.join(unnamed)} (state its program writes, each a "
                        f"placeholder of one element: the cache, left out of the artifact) and artifact.json "
                        f"records no cache to allocate for {'them' if len(unnamed) > 1 else 'it'} (extra.cache); "
                        f"served as it is, every sequence would write into one element. {FIX}")
    for t in recorded:
        held = tables[t.name][t.name] if t.name in tables else None
        if held is None or t.name not in mutated or tuple(held.shape) != t.shape or dtype_name(held.dtype) != t.dtype:
            found = "nothing it writes" if held is None or t.name not in mutated else \
                f"{dtype_name(held.dtype)}{list(held.shape)}"
            raise LoadError(f"{what}: artifact.json's extra.cache records {t.describe()}, the program holds "
                            f"{found} there: the record belongs to another export. {FIX}")
        tables[t.name][t.name] = t.zeros(device)
    return sum(t.nbytes for t in recorded)


def allocate(recorded: tuple, table: dict, device, what: str) -> dict:
    """{name: zeros on `device`} of the cache `recorded` (CacheTensors) for a package whose constants
    table (`table`: {fqn: (dtype name, shape)}) lists each with that dtype and shape; LoadError
    naming the first that it does not."""
    for t in recorded:
        have = table.get(t.name)
        if have != (t.dtype, t.shape):
            found = ("no such constant" if have is None else
                     f"{have[0]}{list(have[1]) if have[1] is not None else ' of a layout other than contiguous'}")
            raise LoadError(f"{what}: artifact.json's extra.cache records {t.describe()}, the package's constants "
                            f"table has {found}: the record belongs to another export. {FIX}")
    return {t.name: t.zeros(device) for t in recorded}


def nbytes(spec) -> int:
    """The bytes of the cache artifact.json records, 0 where none."""
    return sum(t.nbytes for t in read(spec))
