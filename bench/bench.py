#!/usr/bin/env python3
"""In-process benchmark: the handler's handle() on encoded requests next to the raw floor,
measured side by side (interleaved) in one run.

  python -m bench.bench --artifact DIR [--batch-sizes 1,64] [--iters 40] [--out results.json]

Raw floor = pinned host batch -> device (non-blocking, side stream) + model forward + copy of
outputs into pinned host memory + synchronize: the least any server must do. handle() adds
decoding the request, validation, staging, batching and encoding; each timed call gets a freshly
built request body, as TorchServe hands one to its worker per request. Also reports the first
request after load (with warm-up, and for contrast without) against the steady state and against
calls after an idle pause, with its stage times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

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


# first_requests reads every call's stage times: the handler emits them after every batch
# (StageRecorder stands in for TorchServe's metrics, so emitting costs nothing here)
EVERY_CALL_STAGES = {"stage_metrics_s": 0}


class StageRecorder:
    """Stands in for TorchServe's metrics object: keeps the handler's stage times
    (HandlerDecodeTime, HandlerRunTime, HandlerEncodeTime, HandlerTime) of the last call."""

    def __init__(self):
        self.last = {}

    def add_time(self, name, value, idx=None, unit="ms"):
        self.last[name] = value


def first_requests(handler, ctx, sizes, inputs, args, idle_repeats=0) -> dict:
    """Called right after the handler loaded: its first call at the smallest and the largest
    batch size (each the first of its size), then that size's steady state; after both, calls
    at the smallest size after `--idle-seconds` of idleness (median of `--idle-repeats`; last, so
    no first call follows a pause). A first call that costs more than the steady state but no
    more than an idle one pays no first-execution cost of its own: what it pays, every call
    after a pause pays (clocks and caches going cold), and no warm-up can pay that in advance.
    Stage times come from the handler's own metrics."""
    from handlers.wire import safetensors_io

    device = handler.worker.loaded.device
    ctx.metrics = rec = StageRecorder()
    out, calls = {}, {}
    for b in sorted({sizes[0], sizes[-1]}):
        body = safetensors_io.dumps(inputs(b))
        fresh = {}  # a new bytearray per call, as TorchServe's worker builds one, outside the timing

        def prep(body=body):
            set_requests(ctx, [{"body": {"content-type": safetensors_io.CONTENT_TYPE}}])
            fresh["b"] = bytearray(body)

        def call():
            res = handler.handle([{"body": fresh["b"]}], ctx)
            assert ctx.get_response_status(0)[0] in (None, 200), res[0][:300]

        calls[b] = (call, prep)
        first_ms = timed(call, device, prep)
        first_stages = dict(rec.last)
        steady, stages = [], []
        for _ in range(max(5, args.iters // 2)):
            steady.append(timed(call, device, prep))
            stages.append(dict(rec.last))
        med = statistics.median(steady)
        out[f"b{b}"] = {
            "batch": b, "first_ms": round(first_ms, 4), "steady_median_ms": round(med, 4),
            "first_over_steady": round(first_ms / med, 4),
            # how a single call spreads: the first call set against the steady calls
            "steady_p90_ms": round(statistics.quantiles(steady, n=10)[-1], 4),
            "steady_calls_slower_than_first": sum(t > first_ms for t in steady), "steady_calls": len(steady),
            "first_stages_ms": {k: round(v, 4) for k, v in first_stages.items()},
            "steady_stages_ms": {k: round(statistics.median(s.get(k, 0.0) for s in stages), 4)
                                 for k in first_stages}}
    idle, idle_stages, (call, prep) = [], [], calls[sizes[0]]
    for _ in range(idle_repeats):
        pause(args.idle_seconds, args.idle_spin)
        idle.append(timed(call, device, prep))
        idle_stages.append(dict(rec.last))
    if idle:
        row, med = out[f"b{sizes[0]}"], statistics.median(idle)
        row.update(after_idle_median_ms=round(med, 4), idle_seconds=args.idle_seconds,
                   idle_spin=args.idle_spin,
                   after_idle_over_steady=round(med / row["steady_median_ms"], 4),
                   first_over_after_idle=round(row["first_ms"] / med, 4),
                   after_idle_stages_ms={k: round(statistics.median(s.get(k, 0.0) for s in idle_stages), 4)
                                         for k in idle_stages[0]})
    return out


def pause(seconds: float, spin: bool) -> None:
    """Idle for `seconds`: asleep (the core may drop into a power-saving state and its caches
    go cold, as a worker's does between requests), or spinning on the clock (the core stays
    busy: what is left of the after-idle cost is then not the CPU's)."""
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def load_and_time_first(args, gpu, opts, sizes, inputs):
    """`--first-loads` fresh loads of the handler with `opts`, each one's first requests timed
    right after its load (first_requests; after-idle calls on the last load only). A first call
    is one sample: the loads give several. Returns the last handler, its context, its load time
    in seconds and the rows of the last load with every load's first/steady ratio beside them."""
    import gc

    import torch

    runs = []
    for i in range(args.first_loads):
        if runs:
            del h, c
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        t0 = time.perf_counter()
        h, c = new_handler(args.artifact, gpu, {**opts, **EVERY_CALL_STAGES})
        if not runs:
            load_s = time.perf_counter() - t0
        last = i == args.first_loads - 1
        runs.append(first_requests(h, c, sizes, inputs, args, args.idle_repeats if last else 0))
    rows = runs[-1]
    for b, row in rows.items():
        ratios = [r[b]["first_over_steady"] for r in runs]
        row.update(first_over_steady_loads=ratios, first_over_steady_median=round(statistics.median(ratios), 4))
    return h, c, load_s, rows


def plot(path: str, results: list, first: dict):
    """Left: handle() over the raw floor per batch and format (with graphs over without, where
    measured). Right: first request and after-idle calls over the steady state, per handler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"b{r['batch']} {r['format']}" for r in results]
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [r["ratio"] for r in results], 0.4, label="handle() / floor")
    if any("graphs_over_no_graphs" in r for r in results):
        ax.bar([x + 0.2 for x in xs], [r.get("graphs_over_no_graphs", 0) for r in results], 0.4,
               label="graphs / no graphs")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(list(xs), labels, rotation=20)
    ax.set_ylabel("ratio")
    ax.legend()
    rows = [(f"{h} b{r['batch']}", r) for h, per in first.items() for r in per.values()]
    ys = range(len(rows))
    bx.bar([y - 0.2 for y in ys], [r.get("first_over_steady_median", r["first_over_steady"]) for _, r in rows],
           0.4, label="first / steady (median over loads)")
    bx.bar([y + 0.2 for y in ys], [r.get("after_idle_over_steady", 0) for _, r in rows], 0.4,
           label="after idle / steady")
    bx.axhline(1.1, color="red", lw=0.8, ls="--", label="1.1")
    bx.set_xticks(list(ys), [n for n, _ in rows], rotation=20)
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    """The results page of a bench.py JSON: its header and command, the side-by-side table and
    the first-request table, every figure as the JSON holds it."""
    from bench.results_meta import page_head

    art = report["artifact"]
    lines = page_head(report, f"handle() in process: {art['backend']} artifact, inputs {', '.join(art['inputs'])}",
                      f"CPU threads: {report['cpu_threads']}. Written by `bench/bench.py` from the JSON beside it.")
    lines += ["Medians of interleaved rounds. Floor: pinned host batch to the device, the model, outputs "
             "into pinned host memory, one synchronize; the pageable floor first copies the request out "
             "of its pageable body, as any handler must.", "",
             "| batch | format | floor pinned ms | floor pageable ms | handle() ms | handle() no graphs ms "
             "| handle / pinned | handle / pageable | graphs / no graphs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        cells = [r["batch"], r["format"], r["floor_ms"], r.get("floor_from_pageable_ms", "-"), r["handle_ms"],
                 r.get("handle_no_graphs_ms", "-"), r["ratio"], r.get("ratio_vs_floor_from_pageable", "-"),
                 r.get("graphs_over_no_graphs", "-")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "First request, each handler timed right after its own load (`no_warmup`: warm-up and CUDA "
              "graphs off; `warmup`: the defaults; `warmup_no_graphs`: CUDA graphs off); over several "
              "loads where a median is given. Stage times are the handler's own metrics of that call "
              "(decode / run / encode ms):", "",
              "| handler | batch | first ms | steady ms | first / steady | first / steady, each load "
              "| median | steady p90 ms | after idle ms | after idle / steady | first stages | steady stages |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in report["first_request"].items():
        for r in rows.values():
            stages = [" / ".join(str(r[k].get(m, "-")) for m in ("HandlerDecodeTime", "HandlerRunTime",
                                                                   "HandlerEncodeTime"))
                      for k in ("first_stages_ms", "steady_stages_ms")]
            cells = [name, r["batch"], r["first_ms"], r["steady_median_ms"], r["first_over_steady"],
                     ", ".join(map(str, r.get("first_over_steady_loads") or [])) or "-",
                     r.get("first_over_steady_median", "-"), r.get("steady_p90_ms", "-"),
                     r.get("after_idle_median_ms", "-"), r.get("after_idle_over_steady", "-"), *stages]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    idle = next((r for rows in report["first_request"].values() for r in rows.values()
                 if "idle_seconds" in r), None)
    if idle is not None:
        how = "spinning on the clock" if idle.get("idle_spin") else "asleep"
        lines += ["", f"After idle: the median of calls each made after {idle['idle_seconds']:g} s without "
                  f"requests ({how}), after both first calls; their stages (decode / run / encode ms):", ""]
        lines += [f"- {name}: " + " / ".join(str(r["after_idle_stages_ms"].get(m, "-")) for m in
                                             ("HandlerDecodeTime", "HandlerRunTime", "HandlerEncodeTime"))
                  for name, rows in report["first_request"].items() for r in rows.values()
                  if r.get("after_idle_stages_ms")]
    return "\n".join(lines) + "\n"


def render(path: str) -> int:
    """Rewrites the Markdown page (and plot) of an existing bench.py JSON."""
    with open(path) as f:
        report = json.load(f)
    base = os.path.splitext(path)[0]
    with open(base + ".md", "w") as f:
        f.write(markdown(report))
    plot(base + ".png", report["results"], report["first_request"])
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact")
    p.add_argument("--render", metavar="JSON", help="only rewrite the Markdown page and plot of a results JSON")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--formats", default="safetensors,json")
    p.add_argument("--out", help="write JSON results here (and a Markdown page and a PNG beside it)")
    p.add_argument("--pieces", default="0,1,4,16", type=lambda v: [float(x) for x in v.split(",") if x],
                   help="also time handle() with these staging piece sizes in MiB (CUDA only)")
    p.add_argument("--profile-handle", action="store_true",
                   help="print where handle() spends Python time at the largest batch (cProfile)")
    p.add_argument("--graphs-contrast", action="store_true",
                   help="also time a second handler with handler.cuda_graphs=off (handle_no_graphs)")
    p.add_argument("--idle-seconds", type=float, default=2.0,
                   help="pause before each after-idle call of the first-request measurement")
    p.add_argument("--idle-spin", action="store_true",
                   help="spin on the clock during each idle pause instead of sleeping (the core stays busy; "
                        "the spin is Python in this thread, holding the interpreter lock)")
    p.add_argument("--idle-repeats", type=int, default=5, help="after-idle calls (0: none)")
    p.add_argument("--first-loads", type=int, default=3,
                   help="fresh loads of the warmed-up handler(s) whose first requests are timed")
    p.add_argument("--load-profile", action="store_true",
                   help="profile the first load in this process (cProfile, plus a stack dump every 20 s)")
    return p


def load_cold(args, gpu):
    """(handler, ctx) loaded with no warm-up and no CUDA graphs (capture replays the model: a
    warm-up of its own), its load seconds, and with --load-profile the load's profile."""
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
    cold = new_handler(args.artifact, gpu, {"warmup": False, "crash_safe_load": False, "cuda_graphs": "off",
                                            **EVERY_CALL_STAGES})
    load_cold_s = time.perf_counter() - t0
    if args.load_profile:
        prof.disable()
        faulthandler.cancel_dump_traceback_later()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
        profile_top = text.getvalue()
        print(profile_top, flush=True)
    return cold, load_cold_s, profile_top


def input_maker(spec):
    """inputs(b): seeded random inputs of batch b (zeros for integer inputs)."""
    import torch

    g = torch.Generator().manual_seed(0)

    def inputs(b):
        out = {}
        for s in spec.inputs:
            dt = getattr(torch, s.dtype)
            shape = (b,) + tuple(s.shape[1:])
            out[s.name] = (torch.randn(shape, generator=g).to(dt) if dt.is_floating_point
                           else torch.zeros(shape, dtype=dt))
        return out
    return inputs


class Case:
    """One batch size of the run: the raw floor's pinned inputs, stream and output buffers."""

    def __init__(self, run, b):
        import torch

        self.run, self.b = run, b
        self.x = run.inputs(b)
        self.names = run.spec.input_names
        device = run.device
        self.pinned = [self.x[n].pin_memory() if device.type == "cuda" else self.x[n] for n in self.names]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.out_bufs = {}

    def floor(self):
        import torch

        model, device, stream = self.run.model, self.run.device, self.stream
        if stream is None:
            with torch.inference_mode():
                model(*self.pinned)
            return
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            dev = [t.to(device, non_blocking=True) for t in self.pinned]
            out = model(*dev)
            for k, v in out.items():
                if k not in self.out_bufs or self.out_bufs[k].shape != v.shape:
                    self.out_bufs[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                self.out_bufs[k].copy_(v, non_blocking=True)
        stream.synchronize()


def request_of(fmt, x):
    """(body, TorchServe's request headers) of a request in `fmt`."""
    from handlers.wire import safetensors_io

    if fmt == "safetensors":
        return safetensors_io.dumps(x), {"body": {"content-type": safetensors_io.CONTENT_TYPE}}
    # TorchServe hands the handler application/json bodies already parsed
    return {"inputs": {n: t.tolist() for n, t in x.items()}}, {"body": {"content-type": "application/json"}}


def handler_stages(run, case, cur, body, ct):
    """The stages timed for every format: the floor, handle(), and the handler's stages alone
    (to show where the time over the floor goes)."""
    import torch

    handler, ctx, off, spec = run.handler, run.ctx, run.off, run.spec

    def handle(request_body=None, h=handler, c=ctx):
        res = h.handle([{"body": cur["body"] if request_body is None else request_body}], c)
        assert c.get_response_status(0)[0] in (None, 200), res[0][:300]

    def decode_only():
        return run.decode({"body": cur["body"]}, spec, ct)

    outs = {}

    def run_only():
        with torch.inference_mode():
            outs["o"] = handler.worker.loaded.runner.run([cur["req"].tensors])[0]

    stages = {"floor": case.floor, "handle": handle, "decode": decode_only, "run": run_only,
              "encode": lambda: cur["req"].encode(outs["o"], "bench")}
    if off:
        stages["handle_no_graphs"] = lambda: handle(None, *off)
    return stages, handle


def cuda_stages(run, case, cur, body, handle) -> dict:
    """safetensors on CUDA: the floor from pageable memory, the transfers alone, and handle()
    with the staging uploads in pieces."""
    import torch

    from handlers.run.cuda import upload
    from handlers.staging import StagingBuffers

    handler, device, stream, pinned, names = run.handler, run.device, case.stream, case.pinned, case.names
    stages = {}

    def floor_from_pageable():
        # TorchServe hands a worker the request in pageable memory: the least any
        # handler must do is copy it into pinned memory before the floor's steps.
        for dst, n in zip(pinned, names):
            dst.copy_(cur["req"].tensors[n])
        case.floor()

    stages["floor_from_pageable"] = floor_from_pageable
    pinned_copy = torch.empty_like(cur["req"].tensors[names[0]]).pin_memory()
    stages["host_copy_first_input"] = lambda: pinned_copy.copy_(cur["req"].tensors[names[0]])
    stages["h2d_first_input"] = lambda: pinned[0].to(device, non_blocking=True)
    probe = StagingBuffers(pinned=True)
    probe_dev = StagingBuffers(device=device)

    def with_pieces(mib):
        def fn():  # the same request, uploaded in pieces of `mib` MiB (0: one piece)
            runner = handler.worker.loaded.runner
            keep, runner.piece_bytes = runner.piece_bytes, int(mib * (1 << 20))
            try:
                handle()
            finally:
                runner.piece_bytes = keep
        return fn

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
    # handle() with the uploads in pieces where the handler's own runner uploads (not where its
    # GPU's engine does: there staging_piece_mb is the engine's setting); the transfers alone always
    own_uploads = hasattr(handler.worker.loaded.runner, "piece_bytes")
    for mib in run.args.pieces:
        if own_uploads:
            stages[f"handle_pieces_{mib:g}MiB"] = with_pieces(mib)
        stages[f"xfer_pieces_{mib:g}MiB"] = xfer(mib)
    return stages


def medians(stages, args, device, refresh) -> dict:
    """Each stage's median milliseconds, after warm-up, the stages interleaved."""
    for _ in range(args.warmup):
        for fn in stages.values():
            timed(fn, device, refresh)
    times = {k: [] for k in stages}
    for _ in range(args.iters):  # interleaved so drift hits all alike
        for k, fn in stages.items():
            times[k].append(timed(fn, device, refresh))
    return {k: statistics.median(v) for k, v in times.items()}


def result_row(b, fmt, med) -> dict:
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
    return row


def profile_calls(handle, iters) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        handle()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def measure_format(run, case, fmt) -> dict:
    """One (batch, format) row: every stage timed side by side with the floor."""
    args, spec, b = run.args, run.spec, case.b
    body, hdr = request_of(fmt, case.x)
    set_requests(run.ctx, [hdr])
    if run.off:
        set_requests(run.off[1], [hdr])
    ct = hdr["body"]["content-type"]
    cur = {"body": body, "req": run.decode({"body": body}, spec, ct)}
    refresh = None
    if fmt == "safetensors":
        def refresh():
            # Untimed, before every timed call: TorchServe hands each request to the
            # handler as a bytearray it has just filled from the socket (fresh memory,
            # as warm in the CPU caches as its size allows), never a reused one.
            cur["body"] = bytearray(body)
            cur["req"] = run.decode({"body": cur["body"]}, spec, ct)

    stages, handle = handler_stages(run, case, cur, body, ct)
    if fmt == "safetensors" and run.device.type == "cuda":
        stages.update(cuda_stages(run, case, cur, body, handle))
    med = medians(stages, args, run.device, refresh)
    row = result_row(b, fmt, med)
    if args.profile_handle and fmt == "safetensors" and b == run.sizes[-1]:
        profile_calls(handle, args.iters)
    mf, mh = med["floor"], med["handle"]
    print(f"batch {b:4d} {fmt:12s} floor {mf:8.3f} ms  handle {mh:8.3f} ms  ratio {mh / mf:6.3f}  "
          + "  ".join(f"{k} {v:.3f}" for k, v in row["stages_ms"].items()), flush=True)
    return row


def print_first(first) -> None:
    for name, rows in first.items():
        for r in rows.values():
            idle = (f"; after {r['idle_seconds']:g} s idle {r['after_idle_median_ms']:.2f} ms "
                    f"(first / after idle {r['first_over_after_idle']:.2f}x)" if "idle_seconds" in r else "")
            loads = (f" (over {len(r['first_over_steady_loads'])} loads: median "
                     f"{r['first_over_steady_median']:.2f}x)" if "first_over_steady_loads" in r else "")
            print(f"first request ({name}, batch {r['batch']}): {r['first_ms']:.2f} ms vs steady "
                  f"{r['steady_median_ms']:.2f} ms -> {r['first_over_steady']:.2f}x{loads}{idle}")


def floor_model(run) -> tuple:
    """(the model the raw floor calls, its device): the handler's own where its worker runs it (the
    CPU); where its GPU's engine does (the GPU default, handlers/engine_worker.py), the artifact
    loaded here on that GPU, as the engine places it."""
    loaded = run.handler.worker.loaded
    if loaded.model is not None:
        return loaded.model, loaded.device
    from handlers.artifact.load import load_artifact
    from handlers.artifact.variants import choose_variant
    from handlers.config import parse_config

    spec, placement, _ = choose_variant(run.args.artifact, run.gpu, parse_config({}))
    return load_artifact(spec, placement), placement.torch_device


def load_handlers(run) -> dict:
    """Load the handlers (cold, warmed up, and with --graphs-contrast one without CUDA graphs),
    timing each one's first requests; sets run.handler, ctx, model, device, off, load times."""
    args, sizes, inputs = run.args, run.sizes, run.inputs
    # First request after load: each handler's first call right after its load, against its
    # steady state and against calls after an idle pause (see first_requests).
    cold, run.load_cold_s, run.profile_top = load_cold(args, run.gpu)
    first = {"no_warmup": first_requests(*cold, sizes, inputs, args, args.idle_repeats)}
    del cold
    run.handler, run.ctx, run.load_warm_s, first["warmup"] = load_and_time_first(
        args, run.gpu, {"crash_safe_load": False}, sizes, inputs)
    run.model, run.device = floor_model(run)
    run.off = None
    if args.graphs_contrast:
        h_off, c_off, _, first["warmup_no_graphs"] = load_and_time_first(
            args, run.gpu, {"crash_safe_load": False, "cuda_graphs": "off"}, sizes, inputs)
        run.off = (h_off, c_off)
    return first


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.render:
        return render(args.render)
    if not args.artifact:
        p.error("--artifact is required (or --render JSON)")

    from types import SimpleNamespace

    import torch

    from handlers import wire
    from handlers.admission import Limits, admit
    from handlers.artifact.metadata import read_spec
    from handlers.torchserve.headers import RequestHeaders

    spec = read_spec(args.artifact)
    limits = Limits(1 << 62, 1 << 30, spec.batch_max, True)

    def decode(request, spec, ct):  # as the pipeline reads and admits one request
        return admit(wire.read(request, RequestHeaders(ct, None, None), limits), spec, limits)
    run = SimpleNamespace(args=args, spec=spec, decode=decode,
                          gpu=0 if spec.device == "cuda" or torch.cuda.is_available() else None,
                          sizes=[int(b) for b in args.batch_sizes.split(",")], inputs=input_maker(spec))
    first = load_handlers(run)
    handler, device = run.handler, run.device
    runner = handler.worker.loaded.runner
    print(f"graphs: {getattr(runner, 'graphs', None) and runner.graphs.describe()}", flush=True)
    results = []
    for b in run.sizes:
        case = Case(run, b)
        for fmt in args.formats.split(","):
            results.append(measure_format(run, case, fmt))
    print_first(first)
    from bench.results_meta import header

    report = {
        **header(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 None if argv is None else ["-m", "bench.bench", *argv]),
        "artifact": {"backend": spec.backend, "inputs": [s.describe() for s in spec.inputs],
                     "batch_range": [spec.batch_min, spec.batch_max]},
        "results": results,
        "first_request": first,
        "load_s": {"first_in_process_without_warmup": round(run.load_cold_s, 3),
                   "second_with_warmup": round(run.load_warm_s, 3)},
        "cpu_threads": torch.get_num_threads(),
    }
    if run.profile_top:
        report["first_load_profile"] = run.profile_top.splitlines()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        render(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
