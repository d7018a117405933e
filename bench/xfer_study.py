#!/usr/bin/env python3
"""Transfer experiment on the GPU machine: where does request bytes -> pinned -> device go?

  python -m scripts.xfer_study [--mb 19.3] [--out xfer.json]

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
    dev = torch.device("cuda:0")
    n = int(args.mb * 1e6) // 2
    template = bytearray(torch.randn(n).half().numpy().tobytes())
    flush = torch.empty(256 << 20, dtype=torch.uint8)  # larger than any last-level cache
    pin = torch.empty(n, dtype=torch.float16, pin_memory=True)
    pin_clean = torch.empty(n, dtype=torch.float16, pin_memory=True)
    wc = write_combined_buffer(n * 2).view(torch.float16)
    d = torch.empty(n, dtype=torch.float16, device=dev)
    d2 = torch.empty(n, dtype=torch.float16, device=dev)
    s = torch.cuda.Stream(dev)
    state = {}

    def fresh():  # what TorchServe does before calling the handler: not timed
        state["src"] = torch.frombuffer(bytearray(template), dtype=torch.float16)

    def cold():
        flush.fill_(1)
        state.setdefault("reused", torch.frombuffer(template, dtype=torch.float16))
        state["src"] = state["reused"]

    def med(fn, prep):
        times = []
        for i in range(args.iters + 5):
            prep()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 5:
                times.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(times), 4)

    def copy_into(buf):
        return lambda: buf.copy_(state["src"])

    def h2d(buf):
        return lambda: d.copy_(buf, non_blocking=True)

    def copy_then_h2d(buf):
        def fn():
            buf.copy_(state["src"])
            with torch.cuda.stream(s):
                d.copy_(buf, non_blocking=True)
            s.synchronize()
        return fn

    def pieces(buf, k):
        step = (n + k - 1) // k

        def fn():
            with torch.cuda.stream(s):
                for a in range(0, n, step):
                    b = min(n, a + step)
                    buf[a:b].copy_(state["src"][a:b])
                    d[a:b].copy_(buf[a:b], non_blocking=True)
            s.synchronize()
        return fn

    def overlap(buf):  # an upload of other, clean pinned memory while the host fills buf
        def fn():
            with torch.cuda.stream(s):
                d2.copy_(pin_clean, non_blocking=True)
            buf.copy_(state["src"])
            s.synchronize()
        return fn

    def dirty_then(buf):  # write buf untimed, then time only its upload
        def prep():
            fresh()
            buf.copy_(state["src"])
        return prep

    r = {}
    for body, prep in (("fresh", fresh), ("cold", cold)):
        for kind, buf in (("pinned", pin), ("wc", wc)):
            r[f"{body}_{kind}_host_copy"] = med(copy_into(buf), prep)
            r[f"{body}_{kind}_copy_then_h2d"] = med(copy_then_h2d(buf), prep)
            for k in (2, 4):
                r[f"{body}_{kind}_pieces{k}"] = med(pieces(buf, k), prep)
            r[f"{body}_{kind}_h2d_during_other_host_copy"] = med(overlap(buf), prep)
    r["h2d_clean_pinned"] = med(h2d(pin_clean), lambda: None)
    r["h2d_just_written_pinned"] = med(h2d(pin), dirty_then(pin))
    r["h2d_just_written_wc"] = med(h2d(wc), dirty_then(wc))
    r["h2d_pageable_fresh"] = med(lambda: d.copy_(state["src"]), fresh)
    from scripts.results_meta import header

    report = {**header(torch.cuda.get_device_name(dev), None if argv is None else ["-m", "scripts.xfer_study", *argv]),
              "bytes": n * 2, "cpu_threads": torch.get_num_threads(), "median_ms": r}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
