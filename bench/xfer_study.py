#!/usr/bin/env python3
"""Transfer experiment on the GPU machine: where does request bytes -> pinned -> device go?

  python -m bench.xfer_study [--mb 19.3] [--out xfer.json]

TorchServe hands a worker each request body as a freshly received bytearray (pageable). The
handler copies it into a pinned staging buffer and uploads that asynchronously. This times,
for a ResNet-50 batch-64 fp16 sized body, each part alone and in combination, with ordinary
pinned memory (torch pin_memory) and write-combined pinned memory (cudaHostAlloc flag), with
a fresh body per iteration (as TorchServe gives) and with the same body reused after the
caches were flushed. Each figure is the median of --iters runs, each ending in a synchronize.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def write_combined_buffer(nbytes: int):
    """Pinned host memory allocated with cudaHostAllocWriteCombined (torch offers no flag for
    it), through the CUDA runtime torch loaded. Freed at process exit; this is an experiment."""
    import ctypes

    import torch

    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        path = next(line.split()[-1] for line in maps if "libcudart.so" in line)
    lib = ctypes.CDLL(path)
    lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
    ptr = ctypes.c_void_p()
    err = lib.cudaHostAlloc(ctypes.byref(ptr), nbytes, 0x01 | 0x04)  # portable | write-combined
    if err:
        raise RuntimeError(f"cudaHostAlloc failed with error {err}")
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr.value), dtype=torch.uint8)


class Transfers:
    """The buffers of the experiment and the timed operations over them; `state["src"]` is the
    request body of the current iteration."""

    def __init__(self, mb: float, iters: int):
        import torch

        self.torch, self.iters = torch, iters
        self.dev = dev = torch.device("cuda:0")
        self.n = n = int(mb * 1e6) // 2
        self.template = bytearray(torch.randn(n).half().numpy().tobytes())
        self.flush = torch.empty(256 << 20, dtype=torch.uint8)  # larger than any last-level cache
        self.pin = torch.empty(n, dtype=torch.float16, pin_memory=True)
        self.pin_clean = torch.empty(n, dtype=torch.float16, pin_memory=True)
        self.wc = write_combined_buffer(n * 2).view(torch.float16)
        self.d = torch.empty(n, dtype=torch.float16, device=dev)
        self.d2 = torch.empty(n, dtype=torch.float16, device=dev)
        self.s = torch.cuda.Stream(dev)
        self.state = {}

    def fresh(self):  # what TorchServe does before calling the handler: not timed
        self.state["src"] = self.torch.frombuffer(bytearray(self.template), dtype=self.torch.float16)

    def cold(self):
        self.flush.fill_(1)
        self.state.setdefault("reused", self.torch.frombuffer(self.template, dtype=self.torch.float16))
        self.state["src"] = self.state["reused"]

    def med(self, fn, prep):
        torch, times = self.torch, []
        for i in range(self.iters + 5):
            prep()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 5:
                times.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(times), 4)

    def copy_into(self, buf):
        return lambda: buf.copy_(self.state["src"])

    def h2d(self, buf):
        return lambda: self.d.copy_(buf, non_blocking=True)

    def copy_then_h2d(self, buf):
        def fn():
            buf.copy_(self.state["src"])
            with self.torch.cuda.stream(self.s):
                self.d.copy_(buf, non_blocking=True)
            self.s.synchronize()
        return fn

    def pieces(self, buf, k):
        n, d, state = self.n, self.d, self.state
        step = (n + k - 1) // k

        def fn():
            with self.torch.cuda.stream(self.s):
                for a in range(0, n, step):
                    b = min(n, a + step)
                    buf[a:b].copy_(state["src"][a:b])
                    d[a:b].copy_(buf[a:b], non_blocking=True)
            self.s.synchronize()
        return fn

    def overlap(self, buf):  # an upload of other, clean pinned memory while the host fills buf
        def fn():
            with self.torch.cuda.stream(self.s):
                self.d2.copy_(self.pin_clean, non_blocking=True)
            buf.copy_(self.state["src"])
            self.s.synchronize()
        return fn

    def dirty_then(self, buf):  # write buf untimed, then time only its upload
        def prep():
            self.fresh()
            buf.copy_(self.state["src"])
        return prep

    def run(self) -> dict:
        """Every measurement's median milliseconds."""
        r = {}
        for body, prep in (("fresh", self.fresh), ("cold", self.cold)):
            for kind, buf in (("pinned", self.pin), ("wc", self.wc)):
                r[f"{body}_{kind}_host_copy"] = self.med(self.copy_into(buf), prep)
                r[f"{body}_{kind}_copy_then_h2d"] = self.med(self.copy_then_h2d(buf), prep)
                for k in (2, 4):
                    r[f"{body}_{kind}_pieces{k}"] = self.med(self.pieces(buf, k), prep)
                r[f"{body}_{kind}_h2d_during_other_host_copy"] = self.med(self.overlap(buf), prep)
        r["h2d_clean_pinned"] = self.med(self.h2d(self.pin_clean), lambda: None)
        r["h2d_just_written_pinned"] = self.med(self.h2d(self.pin), self.dirty_then(self.pin))
        r["h2d_just_written_wc"] = self.med(self.h2d(self.wc), self.dirty_then(self.wc))
        r["h2d_pageable_fresh"] = self.med(lambda: self.d.copy_(self.state["src"]), self.fresh)
        return r


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=64 * 3 * 224 * 224 * 2 / 1e6)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--out")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("xfer_study.py measures host-to-GPU transfers and needs a CUDA GPU; none is visible "
              "here (torch.cuda.is_available() is False). Run it on the GPU machine.", file=sys.stderr)
        return 2
    study = Transfers(args.mb, args.iters)
    r = study.run()
    from bench.results_meta import header

    report = {**header(torch.cuda.get_device_name(study.dev),
                       None if argv is None else ["-m", "bench.xfer_study", *argv]),
              "bytes": study.n * 2, "cpu_threads": torch.get_num_threads(), "median_ms": r}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0

if __name__ == "__main__":
    sys.exit(main())
