"""A worker's shared-memory arena: tensor bytes between a worker and the engine, written once.

One anonymous memory file (memfd_create) per worker, mapped MAP_SHARED by both processes: the
worker creates it and hands its descriptor to the engine on the Hello frame (SCM_RIGHTS), so
the memory has no name in /dev/shm or anywhere else and the kernel frees it when the last
descriptor and mapping are gone, whichever process dies first: nothing to leak, nothing another
user can open. The engine maps it once per worker (step 2 registers that mapping with CUDA,
cudaHostRegister, once, so uploads from it are pinned DMA).

The arena has two parts, each allocated by one side only, so no allocator state is shared:
[0, worker_bytes) holds the worker's inputs, [worker_bytes, size) the engine's outputs for this
worker. Blocks are 64-byte aligned (a cache line; CUDA's own alignment needs no more than 256
for a pinned copy's speed, and any for correctness). The allocator is first fit over a sorted
free list that merges neighbours on release; a request that finds no block raises ArenaFull
(503, retryable) instead of waiting or growing.
"""
from __future__ import annotations

import bisect
import functools
import mmap
import os
import threading

import torch

from handlers.engine.protocol import TensorRef
from handlers.dtypes import dtype_name, torch_dtype
from handlers.errors import ArenaFull

ALIGN = 64


class Allocator:
    """First fit over [start, start + size): free blocks as sorted (offset, length) pairs."""

    def __init__(self, start: int, size: int):
        self.start, self.size = start, size
        self._free = [(start, size)] if size else []
        self._used = {}  # offset -> length
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int:
        n = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            for i, (at, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[i]
                    else:
                        self._free[i] = (at + n, length - n)
                    self._used[at] = n
                    return at
        raise ArenaFull(f"the arena has no free block of {n} bytes ({self.free_bytes()} of {self.size} free "
                        f"in pieces, {len(self._used)} block(s) in use); retry when requests in flight are answered")

    def free(self, offset: int) -> None:
        with self._lock:
            n = self._used.pop(offset)  # KeyError: a block freed twice or never allocated
            i = bisect.bisect(self._free, (offset, n))
            self._free.insert(i, (offset, n))
            # merge with the next block, then the previous one, where they touch
            if i + 1 < len(self._free) and offset + n == self._free[i + 1][0]:
                self._free[i] = (offset, n + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                at, length = self._free.pop(i - 1)
                self._free[i - 1] = (at, length + self._free[i - 1][1])

    def free_bytes(self) -> int:
        return sum(n for _at, n in self._free)

    def in_use(self) -> int:
        return len(self._used)


class Arena:
    """One worker's arena as one side maps it; `side` is "worker" or "engine": the part it
    allocates in. Use Arena.create on the worker, Arena.attach on the engine."""

    def __init__(self, fd: int, worker_bytes: int, engine_bytes: int, side: str):
        self.fd = fd
        self.worker_bytes, self.engine_bytes = worker_bytes, engine_bytes
        self.size = worker_bytes + engine_bytes
        self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # the whole mapping as one byte tensor, made through a memoryview: the tensor keeps a
        # reference to it, and a live memoryview holds an export of the mapping, which stops
        # close() unmapping it under any view (torch.frombuffer on the mmap itself holds no
        # export: a tensor outliving close() would read unmapped memory). Views are slices of
        # it (a slice keeps its base alive), so one block costs a slice, not a new buffer.
        self.base = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8)
        # the mapping as each dtype a view asked for (views of `base`: the same storage), so a
        # block's view is one as_strided call rather than a slice and two reinterpretations
        # (the engine makes one per input and output of every job)
        self._typed: dict = {}
        own = (0, worker_bytes) if side == "worker" else (worker_bytes, engine_bytes)
        self.allocator = Allocator(*own)
        self.side = side
        self.closed = False

    @classmethod
    def create(cls, worker_bytes: int, engine_bytes: int, name: str = "cs-arena") -> "Arena":
        """A new arena (the worker's side). MFD_CLOEXEC: the worker's children do not inherit it."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, worker_bytes + engine_bytes)
            return cls(fd, worker_bytes, engine_bytes, "worker")
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, worker_bytes: int, engine_bytes: int) -> "Arena":
        """The engine's side of an arena whose descriptor came with a Hello; takes the fd over."""
        size = os.fstat(fd).st_size
        if size != worker_bytes + engine_bytes:
            os.close(fd)
            raise ValueError(f"the arena's file holds {size} bytes, the Hello says {worker_bytes + engine_bytes}")
        return cls(fd, worker_bytes, engine_bytes, "engine")

    def put(self, name: str, tensor: torch.Tensor) -> TensorRef:
        """Copies `tensor` (any device, any strides) into a new block of this side's part."""
        ref, view = self.alloc(name, tensor.dtype, tuple(tensor.shape))
        if tensor.numel():
            view.copy_(tensor)
        return ref

    def put_rows(self, name: str, parts: list) -> TensorRef:
        """Copies the row blocks `parts` (tensors of one dtype and one shape after the first
        dimension) into one new block, one after the other: several requests sent as one."""
        first = parts[0]
        ref, view = self.alloc(name, first.dtype, (sum(t.shape[0] for t in parts),) + tuple(first.shape[1:]))
        at = 0
        for t in parts:
            n = t.shape[0]
            if t.numel():
                view[at:at + n].copy_(t)
            at += n
        return ref

    def alloc(self, name: str, dtype: torch.dtype, shape: tuple) -> tuple:
        """(ref, writable tensor view) of a new block for a tensor of this dtype and shape."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        ref = TensorRef(name, dtype_name(dtype), tuple(shape), self.allocator.alloc(nbytes), nbytes)
        return ref, self.view(ref)

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The tensor `ref` names, on this mapping, no copy (valid until `ref` is released)."""
        if ref.offset < 0 or ref.offset + ref.nbytes > self.size:
            raise ValueError(f"{ref.name}: bytes [{ref.offset}, {ref.offset + ref.nbytes}) are outside the "
                             f"{self.size}-byte arena")
        dtype = torch_dtype(ref.dtype)
        size = dtype.itemsize
        if ref.offset % size:  # a view of another dtype must start at a multiple of its element size
            raise ValueError(f"{ref.name}: offset {ref.offset} is not a multiple of {ref.dtype}'s {size} bytes")
        strides, n = _contiguous(ref.shape)
        if n * size != ref.nbytes:  # the bounds above are the nbytes': the shape must not reach past them
            raise ValueError(f"{ref.name}: shape {tuple(ref.shape)} of {ref.dtype} is {n * size} bytes, "
                             f"the ref says {ref.nbytes}")
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        typed = self._typed.get(dtype)
        if typed is None:
            if self.size % size:  # a mapping that is no whole number of elements: slice and reinterpret
                return self.base[ref.offset:ref.offset + ref.nbytes].view(dtype).view(ref.shape)
            typed = self._typed[dtype] = self.base.view(dtype)
        return typed.as_strided(ref.shape, strides, ref.offset // size)

    def release(self, ref: TensorRef) -> None:
        """Frees a block this side allocated (the other side's blocks are its to free)."""
        self.allocator.free(ref.offset)

    def close(self) -> None:
        """Unmaps and closes the descriptor. Tensors still viewing the mapping keep it alive
        (mmap refuses to close while a memoryview of it lives: BufferError); the mmap object,
        which holds its own dup of the descriptor, then unmaps and closes when the last of
        them is collected."""
        if self.closed:
            return
        self.closed = True
        self.base = None  # its memoryview goes with the last view of it
        self._typed = {}
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            pass
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@functools.lru_cache(maxsize=4096)  # a model's jobs repeat a few shapes; bounded against a peer's many
def _contiguous(shape: tuple) -> tuple:
    """(C-contiguous strides in elements, element count) of `shape`; a negative size is refused."""
    strides, n = [], 1
    for d in reversed(shape):
        if d < 0:
            raise ValueError(f"shape {tuple(shape)} has a negative size")
        strides.append(n)
        n *= d
    return tuple(reversed(strides)), n
