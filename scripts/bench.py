#!/usr/bin/env python3
"""In-process benchmark: the handler's handle() on encoded requests next to the raw floor,
measured side by side (interleaved) in one run.

  python -m scripts.bench --artifact DIR [--batch-sizes 1,64] [--iters 40] [--out results.json]

Raw floor = pinned host batch -> device (non-blocking, side stream) + model forward + copy of
outputs into pinned host memory + synchronize: the least any server must do. handle() adds
decoding the request, validation, staging, batching and encoding; each timed call gets a freshly
built request body, as TorchServe hands one to its worker per request. Also reports the first
request after load (with warm-up, and for contrast without) against the steady state.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_context(model_dir: str, gpu, handler_opts: dict, batch_size: int):
    from ts.context import Context

    return Context("bench", model_dir, {"model": {"modelName": "bench"}}, batch_size, gpu, "0.12.0",
                   model_yaml_config={"handler": handler_opts})


def set_requests(ctx, headers_list):
    from ts.context import RequestProcessor

    ctx.request_processor = [RequestProcessor(h) for h in headers_list]


def new_handler(model_dir, gpu, opts, batch_size=1):
    from handlers.ts_entry import CompiledModelHandler

    h = CompiledModelHandler()
    ctx = make_context(model_dir, gpu, opts, batch_size)
    h.initialize(ctx)
    return h, ctx


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, prep=None):
    if prep is not None:
        prep()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1000.0


def png_bars(path: str, title_values: list):
    """A dependency-free PNG bar chart: one group per label, bars for each series (ratio)."""
    w, h, pad = 640, 320, 20
    img = [[(255, 255, 255)] * w for _ in range(h)]
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    vmax = max(v for _, vals in title_values for v in vals) * 1.1 or 1.0
    group_w = (w - 2 * pad) // max(1, len(title_values))
    for gi, (_, vals) in enumerate(title_values):
        bw = max(4, (group_w - 20) // max(1, len(vals)))
        for si, v in enumerate(vals):
            x0 = pad + gi * group_w + 10 + si * bw
            top = h - pad - int((h - 2 * pad) * v / vmax)
            for y in range(top, h - pad):
                for x in range(x0, x0 + bw - 2):
                    img[y][x] = colors[si % len(colors)]
    y1 = h - pad - int((h - 2 * pad) * 1.0 / vmax)  # the ratio-1.0 line
    for x in range(pad, w - pad):
        img[y1][x] = (0, 0, 0)
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--formats", default="safetensors,json")
    p.add_argument("--out", help="write JSON results here (and a PNG beside it)")
    p.add_argument("--pieces", default="0,1,4,16", type=lambda v: [float(x) for x in v.split(",") if x],
                   help="also time handle() with these staging piece sizes in MiB (CUDA only)")
    p.add_argument("--profile-handle", action="store_true",
                   help="print where handle() spends Python time at the largest batch (cProfile)")
    p.add_argument("--graphs-contrast", action="store_true",
                   help="also time a second handler with handler.cuda_graphs=off (handle_no_graphs)")
    p.add_argument("--load-profile", action="store_true",
                   help="profile the first load in this process (cProfile, plus a stack dump every 20 s)")
    args = p.parse_args(argv)

    import torch

    from handlers import safetensors_io
    from handlers.admission import Limits, admit
    from handlers.metadata import read_spec
    from handlers.run.cuda import upload
    from handlers.stage import StagingBuffers

    spec = read_spec(args.artifact)
    limits = Limits(1 << 62, 1 << 30, spec.batch_max, True)

    def decode(request, spec, ct):
        return admit(request, spec, limits, ct)
    gpu = 0 if spec.device == "cuda" or torch.cuda.is_available() else None
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    # First request after load: with warm-up (our default) and, for contrast, without.
    t0 = time.perf_counter()
    profile_top = None
    if args.load_profile:
        import cProfile
        import faulthandler
        import io
        import pstats

        faulthandler.dump_traceback_later(20, repeat=True, file=sys.stderr)
        prof = cProfile.Profile()
        prof.enable()
    cold, cold_ctx = new_handler(args.artifact, gpu, {"warmup": False, "crash_safe_load": False})
    load_cold_s = time.perf_counter() - t0
    if args.load_profile:
        prof.disable()
        faulthandler.cancel_dump_traceback_later()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
        profile_top = text.getvalue()
        print(profile_top, flush=True)
    t0 = time.perf_counter()
    handler, ctx = new_handler(args.artifact, gpu, {"crash_safe_load": False})
    load_warm_s = time.perf_counter() - t0
    device = handler.device
    off = None
    if args.graphs_contrast:
        off = new_handler(args.artifact, gpu, {"crash_safe_load": False, "cuda_graphs": "off"})
    print(f"graphs: {getattr(handler.runner, 'graphs', None) and handler.runner.graphs.describe()}", flush=True)
    g = torch.Generator().manual_seed(0)

    def inputs(b):
        out = {}
        for s in spec.inputs:
            dt = getattr(torch, s.dtype)
            shape = (b,) + tuple(s.shape[1:])
            out[s.name] = (torch.randn(shape, generator=g).to(dt) if dt.is_floating_point
                           else torch.zeros(shape, dtype=dt))
        return out

    first = {}
    firsts = {"no_warmup": (cold, cold_ctx), "warmup": (handler, ctx)}
    if off:
        firsts["warmup_no_graphs"] = off
    for name, (h, c) in firsts.items():
        for b in sorted({sizes[0], sizes[-1]}):
            body = safetensors_io.dumps(inputs(b))
            set_requests(c, [{"body": {"content-type": safetensors_io.CONTENT_TYPE}}])
            fresh = {}  # a new bytearray per call, as TorchServe's worker builds one, outside the timing

            def prep(body=body):
                fresh["b"] = bytearray(body)

            first_ms = timed(lambda: h.handle([{"body": fresh["b"]}], c), device, prep)
            steady = [timed(lambda: h.handle([{"body": fresh["b"]}], c), device, prep)
                      for _ in range(args.iters // 2)]
            first[f"{name}_b{b}"] = {"batch": b, "first_ms": first_ms, "steady_median_ms": statistics.median(steady),
                                     "first_over_steady": first_ms / statistics.median(steady)}
    del cold

    results = []
    model = handler.model
    for b in sizes:
        x = inputs(b)
        names = spec.input_names
        pinned = [x[n].pin_memory() if device.type == "cuda" else x[n] for n in names]
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        out_bufs = {}

        def floor():
            if stream is None:
                with torch.inference_mode():
                    model(*pinned)
                return
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.inference_mode(), torch.cuda.stream(stream):
                dev = [t.to(device, non_blocking=True) for t in pinned]
                out = model(*dev)
                for k, v in out.items():
                    if k not in out_bufs or out_bufs[k].shape != v.shape:
                        out_bufs[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                    out_bufs[k].copy_(v, non_blocking=True)
            stream.synchronize()

        for fmt in args.formats.split(","):
            if fmt == "safetensors":
                body = safetensors_io.dumps(x)
                hdr = {"body": {"content-type": safetensors_io.CONTENT_TYPE}}
            else:  # TorchServe hands the handler application/json bodies already parsed
                body = {"inputs": {n: t.tolist() for n, t in x.items()}}
                hdr = {"body": {"content-type": "application/json"}}
            set_requests(ctx, [hdr])
            if off:
                set_requests(off[1], [hdr])
            ct = hdr["body"]["content-type"]
            cur = {"body": body, "req": decode({"body": body}, spec, ct)}
            refresh = None
            if fmt == "safetensors":
                def refresh():
                    # Untimed, before every timed call: TorchServe hands each request to the
                    # handler as a bytearray it has just filled from the socket (fresh memory,
                    # as warm in the CPU caches as its size allows), never a reused one.
                    cur["body"] = bytearray(body)
                    cur["req"] = decode({"body": cur["body"]}, spec, ct)

            def handle(request_body=None, h=handler, c=ctx):
                res = h.handle([{"body": cur["body"] if request_body is None else request_body}], c)
                assert c.get_response_status(0)[0] in (None, 200), res[0][:300]

            def with_pieces(mib):
                def fn():  # the same request, uploaded in pieces of `mib` MiB (0: one piece)
                    keep, handler.runner.piece_bytes = handler.runner.piece_bytes, int(mib * (1 << 20))
                    try:
                        handle()
                    finally:
                        handler.runner.piece_bytes = keep
                return fn

            # The handler's stages alone, to show where the time over the floor goes.
            def decode_only():
                return decode({"body": cur["body"]}, spec, ct)

            outs = {}

            def run_only():
                with torch.inference_mode():
                    outs["o"] = handler.runner.run([cur["req"].tensors])[0]

            stages = {"floor": floor, "handle": handle, "decode": decode_only, "run": run_only,
                      "encode": lambda: cur["req"].encode(outs["o"], "bench")}
            if off:
                stages["handle_no_graphs"] = lambda: handle(None, *off)
            if fmt == "safetensors" and device.type == "cuda":
                def floor_from_pageable():
                    # TorchServe hands a worker the request in pageable memory: the least any
                    # handler must do is copy it into pinned memory before the floor's steps.
                    for dst, n in zip(pinned, names):
                        dst.copy_(cur["req"].tensors[n])
                    floor()

                stages["floor_from_pageable"] = floor_from_pageable
                pinned_copy = torch.empty_like(cur["req"].tensors[names[0]]).pin_memory()
                stages["host_copy_first_input"] = lambda: pinned_copy.copy_(cur["req"].tensors[names[0]])
                stages["h2d_first_input"] = lambda: pinned[0].to(device, non_blocking=True)
                probe = StagingBuffers(pinned=True)
                probe_dev = StagingBuffers(device=device)

                def xfer(mib):
                    def fn():  # transfer only: host copy into pinned memory + upload, no model
                        first_in = cur["req"].tensors[names[0]]
                        with torch.cuda.stream(stream):
                            dev = probe_dev.view("x", first_in.shape, first_in.dtype)
                            upload(probe, "x", [first_in], dev, int(mib * (1 << 20)))
                        stream.synchronize()
                    return fn

                # For contrast: one body reused, long out of the CPU caches by the next call.
                stages["handle_reused_body"] = lambda: handle(body)
                for mib in args.pieces:
                    stages[f"handle_pieces_{mib:g}MiB"] = with_pieces(mib)
                    stages[f"xfer_pieces_{mib:g}MiB"] = xfer(mib)
            for _ in range(args.warmup):
                for fn in stages.values():
                    timed(fn, device, refresh)
            times = {k: [] for k in stages}
            for _ in range(args.iters):  # interleaved so drift hits all alike
                for k, fn in stages.items():
                    times[k].append(timed(fn, device, refresh))
            med = {k: statistics.median(v) for k, v in times.items()}
            mf, mh = med["floor"], med["handle"]
            row = {"batch": b, "format": fmt, "floor_ms": round(mf, 4), "handle_ms": round(mh, 4),
                   "ratio": round(mh / mf, 4),
                   "stages_ms": {k: round(v, 4) for k, v in med.items()
                                 if k not in ("floor", "handle", "floor_from_pageable")}}
            if "floor_from_pageable" in med:
                row["floor_from_pageable_ms"] = round(med["floor_from_pageable"], 4)
                row["ratio_vs_floor_from_pageable"] = round(mh / med["floor_from_pageable"], 4)
            if "handle_no_graphs" in med:
                row["handle_no_graphs_ms"] = round(med["handle_no_graphs"], 4)
                row["graphs_over_no_graphs"] = round(mh / med["handle_no_graphs"], 4)
            for k in med:
                if k.startswith(("handle_pieces_", "handle_reused")):
                    row["ratio_" + k[len("handle_"):]] = round(med[k] / mf, 4)
            results.append(row)
            if args.profile_handle and fmt == "safetensors" and b == sizes[-1]:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.iters):
                    handle()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(20)
            print(f"batch {b:4d} {fmt:12s} floor {mf:8.3f} ms  handle {mh:8.3f} ms  ratio {mh / mf:6.3f}  "
                  + "  ".join(f"{k} {v:.3f}" for k, v in row["stages_ms"].items()), flush=True)
    for name, r in first.items():
        print(f"first request ({name}): {r['first_ms']:.2f} ms vs steady {r['steady_median_ms']:.2f} ms "
              f"-> {r['first_over_steady']:.2f}x")
    from scripts.results_meta import header

    report = {
        **header(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 None if argv is None else ["-m", "scripts.bench", *argv]),
        "artifact": {"backend": spec.backend, "inputs": [s.describe() for s in spec.inputs],
                     "batch_range": [spec.batch_min, spec.batch_max]},
        "results": results,
        "first_request": first,
        "load_s": {"first_in_process_without_warmup": round(load_cold_s, 3),
                   "second_with_warmup": round(load_warm_s, 3)},
        "cpu_threads": torch.get_num_threads(),
    }
    if profile_top:
        report["first_load_profile"] = profile_top.splitlines()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        png_bars(os.path.splitext(args.out)[0] + ".png",
                 [(f"b{r['batch']}-{r['format']}", [r["ratio"]]) for r in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
