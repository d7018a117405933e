#!/usr/bin/env python3
"""Where a worker's CPU goes per request: `handle()` in process under cProfile, on batches of
one-row safetensors requests (as TorchServe hands a worker a batch of clients' requests).

    python -m bench.profile_handle --artifact DIR --batch-sizes 1,8 --out docs/results/profile_TAG.json

For each batch size: the handler's own stage split (decode = admission, run, encode; its
HandlerDecodeTime/RunTime/EncodeTime gauges emitted every call), the wall and CPU microseconds
per request without the profiler, then one profiled pass whose functions are grouped by the
module they live in (handlers/*, torch, TorchServe's ts, the standard library) and listed by
their own time (tottime) per request. The profiler slows Python calls down by a roughly constant
factor, so its shares are read as "where", the unprofiled figures as "how much". On a GPU the
handler is a worker served by the engine (handler.engine auto), which runs the model in a process
of its own: the profile and the stage split are the worker's side, its wait for the engine in
`run`. Writes OUT.json (device, date, torch, command first) and OUT.md beside it.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

from bench.results_meta import header, page_head, write_pages


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="directory written by compiled_serving/compile.py")
    p.add_argument("--batch-sizes", default="1,8", help="one-row requests per handle() call")
    p.add_argument("--calls", type=int, default=400, help="calls per measurement")
    p.add_argument("--rounds", type=int, default=3, help="unprofiled rounds; the median is reported")
    p.add_argument("--top", type=int, default=25, help="functions listed per batch size")
    p.add_argument("--lengths", default="",
                   help="named dynamic dimensions per request, as bench.bench_e2e draws them "
                        "(uniform:LO:HI or choice:A,B,C; default: uniform over each range)")
    p.add_argument("--handler-option", action="append", default=[], metavar="KEY=VALUE",
                   help="handler options for the load (e.g. engine_wait_spin_us=0)")
    p.add_argument("--out", required=True, help="results JSON path (the Markdown goes beside it)")
    return p.parse_args(argv)


def _group(filename: str) -> str:
    """The module group a profiled function belongs to."""
    f = filename.replace("\\", "/")
    if "/handlers/" in f:
        return "handlers/" + f.split("/handlers/", 1)[1]
    for key, name in (("/torch/", "torch"), ("/ts/", "torchserve (ts)"), ("/safetensors/", "safetensors"),
                      ("/numpy/", "numpy")):
        if key in f:
            return name
    if f.startswith("~") or f.startswith("<"):
        return "builtins (C)"
    return "python stdlib / other"


def _caller(handler, ctx, bodies):
    from handlers.wire import safetensors_io
    from bench.bench import set_requests

    headers = [{"body": {"content-type": safetensors_io.CONTENT_TYPE}}] * len(bodies)

    def call():
        set_requests(ctx, headers)
        out = handler.handle([{"body": bytearray(b)} for b in bodies], ctx)
        if len(out) != len(bodies) or any(ctx.get_response_status(i)[0] not in (None, 200)
                                          for i in range(len(out))):
            raise RuntimeError(f"handle() failed: {out[0][:300]!r}")
    return call


def measure(handler, ctx, bodies: list, args) -> dict:
    call = _caller(handler, ctx, bodies)
    n = len(bodies)
    for _ in range(50):
        call()
    wall, cpu, stages = [], [], {"decode": [], "run": [], "encode": []}
    for _ in range(args.rounds):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(args.calls):
            call()
            for s in stages:
                stages[s].append(ctx.metrics.last.get(f"Handler{s.capitalize()}Time", float("nan")))
        wall.append((time.perf_counter() - t0) / args.calls / n * 1e6)
        cpu.append((time.process_time() - c0) / args.calls / n * 1e6)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    st = pstats.Stats(prof)
    per_req = args.calls * n
    groups, funcs = {}, []
    for (fname, line, func), (_cc, ncalls, tt, _ct, _callers) in st.stats.items():
        g = _group(fname)
        groups[g] = groups.get(g, 0.0) + tt
        where = g if g.startswith("handlers/") or g.startswith("builtins") else f"{g} {os.path.basename(fname)}"
        funcs.append((tt, ncalls, f"{where}:{line}({func})"))
    total = sum(groups.values())
    funcs.sort(reverse=True)
    return {
        "requests_per_call": n,
        "wall_us_per_request": round(statistics.median(wall), 2),
        "cpu_us_per_request": round(statistics.median(cpu), 2),
        "stage_ms_per_call": {s: round(statistics.median(v), 4) for s, v in stages.items()},
        "profiled_us_per_request": round(total / per_req * 1e6, 2),
        "by_module_share": {g: round(t / total, 4) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_functions": [{"function": name, "calls_per_request": round(c / per_req, 2),
                           "profiled_us_per_request": round(t / per_req * 1e6, 2)}
                          for t, c, name in funcs[:args.top]],
    }


def markdown(report: dict) -> str:
    lines = page_head(report, f"Where handle() spends its time: {report['artifact_kind']} artifact, "
                      f"inputs {report['inputs']}", "Written by `bench/profile_handle.py` from the JSON beside it.")
    lines += ["Unprofiled: wall and CPU microseconds per request, and the handler's own stage gauges "
              "(ms per call, medians). Profiled (cProfile, which slows Python calls down): the share of "
              "each module group and the functions with the most own time.", ""]
    for r in report["results"]:
        s = r["stage_ms_per_call"]
        lines += [f"## {r['requests_per_call']} request(s) per call", "",
                  f"wall {r['wall_us_per_request']} us/request, CPU {r['cpu_us_per_request']} us/request; "
                  f"stages per call: decode {s['decode']} ms, run {s['run']} ms, encode {s['encode']} ms", "",
                  "| module group | share of profiled time |", "|---|---|"]
        lines += [f"| {g} | {share} |" for g, share in r["by_module_share"].items()]
        lines += ["", "| function | calls/request | profiled us/request |", "|---|---|---|"]
        lines += [f"| `{f['function']}` | {f['calls_per_request']} | {f['profiled_us_per_request']} |"
                  for f in r["top_functions"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch
    import yaml

    from handlers.artifact.metadata import read_spec
    from bench.bench import EVERY_CALL_STAGES, StageRecorder, new_handler
    from bench.cpu_per_call import _bodies

    def bodies(n):
        if not spec.dims:
            return _bodies(spec, n)
        from handlers.wire import safetensors_io
        from bench.bench_e2e import one_request

        g = torch.Generator().manual_seed(0)
        how = argparse.Namespace(lengths=args.lengths, mask_inputs="")  # masks: inputs named *mask*
        return [safetensors_io.dumps(one_request(spec, how, g)) for _ in range(n)]

    args = parse_args(argv)
    spec = read_spec(args.artifact)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    gpu = 0 if torch.cuda.is_available() else None
    opts = {"crash_safe_load": False, **EVERY_CALL_STAGES}
    for kv in args.handler_option:
        key, _, value = kv.partition("=")
        opts[key] = yaml.safe_load(value)
    handler, ctx = new_handler(args.artifact, gpu, opts, batch_size=max(sizes))
    ctx.metrics = StageRecorder()
    results = []
    for n in sizes:
        row = measure(handler, ctx, bodies(n), args)
        print(json.dumps({k: row[k] for k in ("requests_per_call", "wall_us_per_request",
                                              "cpu_us_per_request", "stage_ms_per_call")}), flush=True)
        results.append(row)
    report = {**header(torch.cuda.get_device_name(0) if gpu is not None else "cpu"), "lengths": args.lengths,
              "artifact_kind": spec.backend, "handler_options": opts,
              "inputs": ", ".join(s.describe() for s in spec.inputs), "results": results}
    write_pages(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
