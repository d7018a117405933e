"""What one batch costs a worker's CPU: `handle()` in process on batches of one-row binary
requests, as TorchServe hands a worker a batch of clients' requests, timed by the wall clock and
by this process's CPU clock (time.process_time: every thread).

On a GPU the handler is a worker served by the engine (handler.engine auto): the load starts the
engine, a process of its own that runs the model, and this process's CPU clock counts the
worker's side only (read, decode, admit, hand over, wait for the engine, encode), not the
engine's. Every `--sync` value is measured there: the engine's `cuda_sync` (`block`: it sleeps
while the GPU works; `spin`: it polls; auto spins, one engine per GPU). On the CPU the worker
runs the model itself and its CPU time is the whole call's. The cost of building the request
bytearrays (TorchServe's worker builds one per request before `handle()`) is measured alone and
reported beside, not subtracted.

    python -m bench.cpu_per_call --artifact DIR --batch-sizes 1,8 --out docs/results/cpu_per_call_TAG.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.results_meta import header, page_head, write_pages


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="directory written by compiled_serving/compile.py")
    p.add_argument("--batch-sizes", default="1,8", help="requests per batch, one row each")
    p.add_argument("--sync", default="block,spin", help="the engine's cuda_sync values to measure (GPU only)")
    p.add_argument("--calls", type=int, default=300, help="timed calls per round")
    p.add_argument("--rounds", type=int, default=5, help="the median of this many rounds is reported")
    p.add_argument("--out", required=True, help="results JSON path (the Markdown goes beside it)")
    return p.parse_args(argv)


def _bodies(spec, n: int) -> list:
    import torch

    from handlers.wire import safetensors_io

    g = torch.Generator().manual_seed(0)
    return [safetensors_io.dumps({i.name: torch.randn((1,) + tuple(i.shape[1:]), generator=g)
                                  .to(getattr(torch, i.dtype)) for i in spec.inputs}) for _ in range(n)]


def measure(handler, ctx, bodies: list, calls: int, rounds: int) -> dict:
    """Median over rounds of wall and CPU ms per handle() call on these requests."""
    from handlers.wire import safetensors_io
    from bench.bench import set_requests

    headers = [{"body": {"content-type": safetensors_io.CONTENT_TYPE}}] * len(bodies)

    def call():
        set_requests(ctx, headers)
        out = handler.handle([{"body": bytearray(b)} for b in bodies], ctx)
        if len(out) != len(bodies) or any(ctx.get_response_status(i)[0] not in (None, 200) for i in range(len(out))):
            raise RuntimeError(f"handle() failed: {out[0][:300]!r}")

    for _ in range(max(10, calls // 10)):
        call()
    wall, cpu, build = [], [], []
    for _ in range(rounds):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            call()
        wall.append((time.perf_counter() - t0) / calls * 1e3)
        cpu.append((time.process_time() - c0) / calls * 1e3)
        c0 = time.process_time()
        for _ in range(calls):
            [bytearray(b) for b in bodies]
        build.append((time.process_time() - c0) / calls * 1e3)
    return {"wall_ms": round(statistics.median(wall), 4), "cpu_ms": round(statistics.median(cpu), 4),
            "bytearrays_cpu_ms": round(statistics.median(build), 4)}


def markdown(report: dict) -> str:
    lines = page_head(report, f"CPU per batch of one-row requests: {report['artifact_kind']} artifact, "
                      f"inputs {report['inputs']}", "Written by `bench/cpu_per_call.py` from the JSON beside it.")
    lines += ["`handle()` in process on a batch of one-row binary requests; wall and CPU time per call "
             "(the process's CPU clock: all its threads), medians of rounds. On a GPU the handler is a "
             "worker served by the engine, a process of its own whose CPU is not counted; `block`: the "
             "engine sleeps while the GPU works; `spin`: it polls. Building the requests' bytearrays is in "
             "each call and shown alone beside it.", "",
             "| requests | sync | wall ms | CPU ms | CPU / wall | bytearrays CPU ms |",
             "|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['requests']} | {r['sync']} | {r['wall_ms']} | {r['cpu_ms']} | "
                     f"{round(r['cpu_ms'] / r['wall_ms'], 3)} | {r['bytearrays_cpu_ms']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import torch

    from handlers.artifact.metadata import read_spec
    from bench.bench import StageRecorder, new_handler

    args = parse_args(argv)
    spec = read_spec(args.artifact)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    gpu = 0 if torch.cuda.is_available() else None
    syncs = [s for s in args.sync.split(",") if s] if gpu is not None else ["cpu"]
    results = []
    for sync in syncs:
        opts = {"crash_safe_load": False} | ({"cuda_sync": sync} if gpu is not None else {})
        handler, ctx = new_handler(args.artifact, gpu, opts, batch_size=max(sizes))
        ctx.metrics = StageRecorder()
        for n in sizes:
            row = {"requests": n, "sync": sync, **measure(handler, ctx, _bodies(spec, n), args.calls, args.rounds)}
            print(json.dumps(row), flush=True)
            results.append(row)
        del handler, ctx
    report = {**header(torch.cuda.get_device_name(0) if gpu is not None else "cpu"),
              "artifact_kind": spec.backend,
              "inputs": ", ".join(f"{i.name}: {i.dtype}[1x{'x'.join(map(str, i.shape[1:]))}]" for i in spec.inputs),
              "results": results}
    write_pages(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
