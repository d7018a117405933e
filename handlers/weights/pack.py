"""The weights a model reads, packed on its device as views of one allocation per dtype, with
their shapes and strides: the one copy the engine's lanes (handlers/run/lanes.py) all read, each
lane's load adopting them in place (artifact/kinds: `held_weights`, `load(..., weights=...)`)."""
from __future__ import annotations

# each tensor starts a multiple of 256 bytes into its allocation (CUDA's caching allocator hands
# out blocks aligned to 512 bytes), as aligned as the library's own constants, which its kernels'
# vectorised loads may assume
ALIGN_BYTES = 256


def span(t) -> int:
    """Elements from a tensor's first to its last, by its strides (its size in memory)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def pack(tensors: dict, device) -> dict:
    """Copies of `tensors` on `device` with their shapes and strides, as views of one allocation
    per dtype (one IPC handle each)."""
    import torch

    by_dtype: dict = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    out = {}
    for dtype, names in by_dtype.items():
        step = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        offsets, total = {}, 0
        for name in names:
            offsets[name] = total
            total += -(-span(tensors[name]) // step) * step
        flat = torch.empty(max(total, 1), dtype=dtype, device=device)
        with torch.no_grad():  # a parameter's copy would otherwise track grad, which no pickle crosses
            for name in names:
                t = tensors[name]
                view = flat.as_strided(t.shape, t.stride(), offsets[name])
                view.copy_(t)
                out[name] = view
    return out
