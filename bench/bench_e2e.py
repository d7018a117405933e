"""End-to-end benchmark through real TorchServe: this handler against the handler a user
would write without it, beside the limits measured in the same run.

  python -m bench.bench_e2e --artifact DIR --factory examples/models.py:resnet50 \
      --out docs/results/e2e_resnet50_fp16 [--gpus 1,all] [--clients 1,16,64,192] [--seconds 10]
  python -m bench.bench_e2e --artifact PACKAGE.pt2 --program PROGRAM.pt2 --factory FILE.py:FACTORY ...
      (a user's own files, imported as compiled_serving/archive.py imports them: padding tried; ours is
      then archived with no options, so it pads where the import found padding safe)
      [--batch-size N] [--max-batch-delay MS] [--workers-per-gpu N] [--cpu-workers N]
      [--thread-sweep 1,2,4] [--sweep-clients 64]

For each device set (one GPU, all GPUs; or the CPU when there is none) it archives and serves,
in one `torchserve --start` from the shipped config.properties (only ports and paths changed):
  ours   compiled_serving/archive.py's archive of the artifact, archive defaults plus the serving
         settings given here (the same for every handler)
  stock  bench/baselines/stock_handler.py: BaseHandler subclass, eager model from the
         factory, `.to(device)` on the default stream, `.cpu()`; texts of different lengths
         padded to the batch's longest with zeros (ids 0, mask 0) and run as one call, as users'
         handlers and Hugging Face pipelines do; given the thread budget our handler chose (read
         from its load line) so the comparison is not about threads
  stock_aoti  the same handler calling the AOTInductor package (`aoti_load_package`)
  stock_default  the same handler without a thread budget (what a user gets), at one point
  echo   bench/baselines/echo_handler.py: no model, a response of the model's output size
         (zeros, parsed and checked by the client like every answer): the transport limit
         (TorchServe's frontend + worker protocol + this client)
  ours_tN  our archive with handler.cpu_threads=N (the thread-budget sweep), at one point
and drives each with a multi-process keep-alive HTTP load generator (bounded in requests and
time, loopback only) sending one-row safetensors requests. Every answer is compared with the
eager model's output for its input (|d| <= atol + rtol * max|ref|; 1e-2 for fp16, 1e-4 fp32).
The GPU limit is the artifact's own forward at the served batch size, timed in this process.
Writes OUT.json (device, date, torch, command first), OUT.md and OUT.png
(`python -m bench.bench_e2e --replot OUT.json [--markdown] [--summary]` draws the PNG, and the Markdown, again
from the JSON; --summary computes its summary again from the same points).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import yaml

from bench.bench_load import first_request, run_point
from handlers import timeline
from compiled_serving.local_server import ROOT, LocalTorchServe, tool
from bench.results_meta import page_head


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True,
                   help="directory written by compiled_serving/compile.py or compiled_serving/import_artifact.py, or a .pt2 file "
                        "(torch.export.save, or an AOTInductor package with --program): imported first")
    p.add_argument("--program", help="with an AOTInductor package: the program it was compiled from")
    p.add_argument("--factory", required=True, help="FILE.py:FACTORY of the eager model (stock + reference)")
    p.add_argument("--out", required=True, help="results path without extension")
    p.add_argument("--gpus", default="1,all", help="device sets: comma list of counts or 'all'")
    # config.properties' job_queue_size (100) bounds the requests waiting for a worker; more
    # clients than that plus those in flight get 503 (counted as errors), so 128 is the top
    p.add_argument("--clients", default="1,16,64,128")
    p.add_argument("--seconds", type=float, default=10.0, help="measured time per point")
    p.add_argument("--warmup-seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every point this many times, every other round in reverse order")
    p.add_argument("--max-requests", type=int, default=500_000, help="per point")
    # the archive defaults (compiled_serving/archive.py)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-batch-delay", type=int, default=1)
    p.add_argument("--workers-per-gpu", type=int, default=6,
                   help="workers per GPU, every handler's (cs-archive's own default: 3 per 4 cores of the host, "
                        "feeding the GPU's engine)")
    p.add_argument("--cpu-workers", type=int, default=2, help="workers when serving on the CPU")
    p.add_argument("--thread-sweep", default="", help="cpu_threads values to try on our handler")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="also serve our archive with these handler options as ours_NAME, measured at "
                        "every client count (e.g. nographs:cuda_graphs=off; workers=N: its own workers per GPU)")
    p.add_argument("--sweep-clients", type=int, default=64, help="clients for sweep/stock_default points")
    p.add_argument("--processes", type=int, default=0, help="load-generator processes (0: auto)")
    p.add_argument("--distinct-inputs", type=int, default=8)
    p.add_argument("--lengths", default="",
                   help="named dynamic dimensions per request: uniform:LO:HI or choice:A,B,C (default: "
                        "uniform over each dimension's range)")
    p.add_argument("--mask-inputs", default="",
                   help="inputs sent as all ones (default: the inputs whose name contains 'mask')")
    p.add_argument("--handlers", default="ours,stock,stock_default,echo",
                   help="which of ours, stock, stock_default, echo to serve and measure")
    p.add_argument("--multi-gpu-clients", default=None,
                   help="the client counts on device sets of several GPUs (default: --clients)")
    p.add_argument("--multi-gpu-handlers", default=None,
                   help="the handlers served on device sets of several GPUs (default: --handlers)")
    p.add_argument("--first-request", action="store_true",
                   help="before the load points, time each model's first request after READY, then "
                        "steady and after-idle requests from one client (echo first: it takes the "
                        "frontend's own first-request cost)")
    p.add_argument("--idle-seconds", type=float, default=2.0, help="pause before each after-idle request")
    p.add_argument("--ts-config", action="append", default=[], metavar="KEY=VALUE",
                   help="a line added to the shipped config.properties of every server in the run "
                        "(e.g. number_of_netty_threads=8); the command records it")
    p.add_argument("--spy", type=int, default=0, metavar="RATE",
                   help="sample TorchServe's workers with py-spy at RATE per second during each point's "
                        "measured window of the first round: their time per request by stage "
                        "(bench/worker_spy.py)")
    p.add_argument("--cpu", action="store_true", help="serve on CPU workers (deviceType: cpu) even with GPUs")
    p.add_argument("--limit-batches", default="", metavar="N,N,...",
                   help="also measure the GPU limit (the artifact alone, gpu_limit) at these batch sizes: "
                        "what the GPU allows when one step runs N rows, beside the served batch size's")
    return heavy_options(p)


def heavy_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of heavy-load runs: other serving settings, the native load generator, the timeline."""
    p.add_argument("--serving", action="append", default=[], metavar="NAME:BATCH:DELAY",
                   help="also serve our archive and the echo handler with TorchServe's batchSize BATCH and "
                        "maxBatchDelay DELAY ms, as ours_NAME and echo_NAME, at every client count")
    p.add_argument("--load-generator", choices=("python", "native"), default="python",
                   help="native: wrk (bench/native_load.py) on cores of its own for every point of more "
                        "than one client (answers are then checked by the one-client points' Python client)")
    p.add_argument("--loadgen-cores", type=int, default=3, help="cores kept for the native load generator")
    p.add_argument("--timeline", action="store_true",
                   help="record our workers' batch cycles (handlers/timeline.py) and report "
                        "where each point's cycle went (bench/timeline_report.py)")
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    for line in args.ts_config:
        if not re.fullmatch(r"[A-Za-z_][\w.]*=\S.*", line):
            p.error(f"--ts-config {line!r}: expected KEY=VALUE, a config.properties line such as "
                    "number_of_netty_threads=8")
    args.spy_exe = ""
    if args.spy:
        # checked before anything starts: the samplers run inside each point's measured window,
        # which ends a second before the window does, so it must be at least two seconds long
        if args.seconds < 3:
            p.error(f"--spy needs --seconds 3 or more (got {args.seconds:g})")
        from bench import worker_spy

        args.spy_exe = worker_spy.executable()
    return args


def ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def load_factory(ref: str):
    from compiled_serving.compile import load_factory as lf

    return lf(ref)


def draw_lengths(text: str, dims: dict, g) -> dict:
    """One size per named dimension from `--lengths` (uniform:LO:HI or choice:A,B,C; default:
    uniform over the dimension's range), clamped into each dimension's range."""
    import torch

    out = {}
    for name, (lo, hi) in dims.items():
        kind, _, rest = (text or f"uniform:{lo}:{hi}").partition(":")
        if kind == "choice":
            options = [int(x) for x in rest.split(",")]
            n = options[int(torch.randint(0, len(options), (1,), generator=g))]
        elif kind == "uniform":
            a, b = (int(x) for x in rest.split(":"))
            n = int(torch.randint(a, b + 1, (1,), generator=g))
        else:
            raise SystemExit(f"--lengths {text!r}: expected uniform:LO:HI or choice:A,B,C")
        out[name] = min(hi, max(lo, n))
    return out


def one_request(spec, args, g) -> dict:
    """One row of every input: floats random normal, integers inside their valid values (the
    value contract's range, else 0..99), mask inputs all ones (a request carries exactly its own
    length), named dimensions drawn from --lengths."""
    from handlers.artifact.metadata import is_mask
    from handlers.run.padding import random_request

    sizes = draw_lengths(args.lengths, spec.dims, g)
    masks = set(args.mask_inputs.split(",")) if args.mask_inputs else {s.name for s in spec.inputs if is_mask(s.name)}
    return random_request(spec, sizes, g, masks, span=1_000_000)


def references(args, spec, device):
    """Distinct one-row requests: their safetensors bodies, the eager outputs, the tolerance and
    each request's named-dimension sizes."""
    import torch
    from safetensors.torch import save

    half = any(s.dtype == "float16" for s in spec.inputs + spec.outputs)
    model = load_factory(str(ROOT / args.factory) if not os.path.isabs(args.factory) else args.factory)()
    model = model.eval().to(device)
    if half:
        model = model.half()
    g = torch.Generator().manual_seed(0)
    bodies, refs, sizes = [], [], []
    for _ in range(args.distinct_inputs):
        x = one_request(spec, args, g)
        sizes.append({d: x[s.name].shape[a] for s in spec.inputs for a, d in enumerate(s.shape) if isinstance(d, str)})
        with torch.inference_mode():
            y = model(*[x[s.name].to(device) for s in spec.inputs])
        y = y if isinstance(y, dict) else dict(zip(spec.output_names, y if isinstance(y, (tuple, list)) else [y]))
        bodies.append(save(x))
        refs.append({k: v.float().cpu().numpy() for k, v in y.items()})
    tol = 1e-2 if half else 1e-4
    return bodies, refs, tol, sizes


def _median_ms(fn, device, iters: int) -> float:
    import torch

    times = []
    for i in range(iters + 5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def declared_pad(args) -> tuple:
    """(pad values, pad buckets) the first --variant declaring pad={...} gives (its pad_buckets
    too, where set), or ({}, ()) when none does."""
    for item in args.variant:
        opts = {}
        for kv in re.split(r",(?=\s*\w+=)", item.partition(":")[2]):
            key, _, value = kv.partition("=")
            opts[key.strip()] = value
        if "pad" in opts:
            return yaml.safe_load(opts["pad"]) or {}, tuple(yaml.safe_load(opts.get("pad_buckets", "[]")) or ())
    return {}, ()


def gpu_limit(spec, device, batch: int, sizes: list, pad: dict, iters: int = 30, pad_buckets=()) -> dict:
    """The artifact alone at the served batch size, inputs already on the device, over the
    named-dimension sizes the run sends (`sizes`: one dict per distinct request; every batch of
    one size, as a server grouping equal lengths would run it): per size a plain call and, where
    the artifact can be captured (as our handler does by default; with named dimensions only at
    the padded bucket lengths `pad` declares), a CUDA graph replay. Per size the faster counts;
    the limit is the served batch over their mean time (each distinct request is sent equally
    often)."""
    import torch

    from handlers.artifact.device import Placement
    from handlers.artifact.kinds import kind_of
    from handlers.artifact.load import load_artifact
    from handlers.batch import PadPlan
    from handlers.config import parse_config
    from handlers.run import graphs

    model = load_artifact(spec, Placement(device.type, device.index), parse_config({}))
    b = max(spec.batch_min, min(batch, spec.batch_max))
    plan = PadPlan.of(spec, pad, pad_buckets) if spec.dims else None
    capturable = device.type == "cuda" and graphs.why_not_capturable(kind_of(spec), spec, plan) is None
    stream = torch.cuda.Stream(device) if capturable else None
    pool = torch.cuda.graph_pool_handle() if capturable else None
    per_size, replays = [], {}
    counts = Counter(tuple(sorted(d.items())) for d in sizes or [{}])
    with torch.inference_mode():
        for dims in (dict(key) for key in sorted(counts)):
            xs = list(spec.example(b, device, dims or None).values())
            plain = _median_ms(lambda: model(*xs), device, iters)
            replay = None
            if capturable:
                at = {d: plan.bucket(d, n) for d, n in dims.items()} if plan else dims
                key = tuple(sorted(at.items()))
                if key not in replays:
                    bucket = graphs.capture(graphs.Target(model, spec, device, stream), b, pool, at or None)
                    replays[key] = _median_ms(bucket.graph.replay, device, iters)
                replay = replays[key]
            per_size.append({**dims, "forward_ms": round(plain, 4),
                             "graph_replay_ms": round(replay, 4) if replay else None})
    weights = [counts[key] for key in sorted(counts)]
    best = [min(r["forward_ms"], r["graph_replay_ms"] or r["forward_ms"]) for r in per_size]
    mean_ms = sum(w * t for w, t in zip(weights, best)) / sum(weights)
    one = per_size[0]
    out = {"batch": b, "forward_ms": one["forward_ms"], "graph_replay_ms": one["graph_replay_ms"],
           "img_s": round(b / mean_ms * 1e3, 1)}
    if spec.dims:
        out.update(forward_ms=None, graph_replay_ms=None, mean_batch_ms=round(mean_ms, 4), per_size=per_size,
                   padded_to=plan.describe() if plan and capturable else None)
    return out


def limits_by_batch(args, spec, device, sizes, pad, pad_buckets) -> dict:
    """{batch: rows/s and mean ms of one call} of gpu_limit at each --limit-batches size: the
    rows per second one GPU allows when every call runs that many rows (every call of one size,
    so an upper bound for calls of mixed lengths padded together)."""
    out = {}
    for b in [int(x) for x in args.limit_batches.split(",") if x.strip()]:
        lim = gpu_limit(spec, device, b, sizes, pad, pad_buckets=pad_buckets)
        ms = round(lim["batch"] / lim["img_s"] * 1e3, 4)
        out[str(lim["batch"])] = {"img_s": lim["img_s"], "mean_batch_ms": ms}
    return out


def imported(args, stack) -> None:
    """--artifact FILE.pt2 is imported as the archive imports a user's file (compiled_serving/import_artifact.py:
    the contract, the checks, padding tried on the program) into a directory kept for the run;
    args.artifact names that directory afterwards."""
    if os.path.isdir(args.artifact):
        return
    from compiled_serving.import_artifact import import_artifact

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_e2e_import_"))
    args.artifact = import_artifact(args.artifact, os.path.join(tmp, "artifact"), args.program)


def archive_ours(args, store: Path, name: str, workers: int, device_ids, extra=(), serving=None) -> Path:
    batch, delay = serving or (args.batch_size, args.max_batch_delay)
    cmd = [sys.executable, "-m", "compiled_serving.archive", "--artifact", args.artifact, "--name", name,
           "--out", str(store), "--workers", str(workers), "--batch-size", str(batch),
           "--max-batch-delay", str(delay), *extra]
    if device_ids:
        cmd += ["--device-ids", ",".join(map(str, device_ids))]
    else:
        cmd += ["--device-type", "cpu"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"archive {name} failed: {r.stderr or r.stdout}")
    for line in r.stdout.splitlines():  # the padding the archive chose for ours, and why
        if line.startswith(("cs-archive: pad=", "cs-archive: no padding")) and name == "ours":
            print(line, flush=True)
    return store / f"{name}.mar"


def archive_baseline(args, store: Path, name: str, handler: str, workers: int, device_ids, section: dict,
                     artifact=None, serving=None) -> Path:
    batch, delay = serving or (args.batch_size, args.max_batch_delay)
    cfg = {"minWorkers": workers, "maxWorkers": workers, "batchSize": batch,
           "maxBatchDelay": delay, "responseTimeout": 120, **section}
    if device_ids:
        cfg["deviceIds"] = list(device_ids)
    else:
        cfg["deviceType"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "model-config.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        files = Path(tmp) / "files"
        files.mkdir()
        shutil.copy2(ROOT / args.factory.rsplit(":", 1)[0], files / "models.py")
        if artifact:  # the stock AOTI handler: the package and the handler it extends
            shutil.copy2(artifact, files / os.path.basename(artifact))
            shutil.copy2(ROOT / "bench" / "baselines" / "stock_handler.py", files / "stock_handler.py")
        cmd = [tool("torch-model-archiver"), "--model-name", name, "--version", "1.0",
               "--handler", str(ROOT / "bench" / "baselines" / handler), "--extra-files", str(files),
               "--config-file", str(cfg_path), "--export-path", str(store), "--force"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"torch-model-archiver {name} failed: {r.stderr or r.stdout}")
    return store / f"{name}.mar"


def model_lines(log: str, name: str) -> str:
    """The lines of model `name`'s workers (TorchServe names the thread reading a worker's output
    W-PORT-MODEL_VERSION-stdout, log4j2.xml's %t), so ours is not read from a variant's lines
    (ours_cpu ...); the whole log where no line is so named."""
    own = [line for line in log.splitlines() if re.search(rf"W-\d+-{re.escape(name)}_\d", line)]
    return "\n".join(own) if own else log


def chosen_threads(log: str, name: str) -> Optional[int]:
    """The intra-op count our default worker logged in its load line ("CPU threads: N intra-op";
    the sweep archives log "(handler.cpu_threads)" and are skipped); None where the engine serves
    the model (its workers run no model: handlers/engine_worker.py logs "served by the engine")."""
    log = model_lines(log, name)
    if "served by the engine" in log and "CPU threads: " not in log:
        return None
    found = re.findall(r"CPU threads: (\d+) intra-op / \d+ inter-op thread\(s\) \((?!handler)", log)
    if not found:
        raise SystemExit(f"no 'CPU threads:' load line for {name} in the model log")
    return int(found[0])


def is_thread_sweep(handler: str) -> bool:
    return re.fullmatch(r"ours_t\d+", handler) is not None


def device_sets(args, n_gpu: int) -> list:
    if n_gpu == 0:
        return [0]
    out = []
    for item in args.gpus.split(","):
        n = n_gpu if item.strip() == "all" else int(item)
        if 1 <= n <= n_gpu and n not in out:
            out.append(n)
    return out


def serve_set(args, n: int, bodies, refs, tol, spec, work: Path) -> tuple:
    """Archives, serves and measures every handler on one device set (n GPUs; 0 = CPU):
    (load points, first-request rows)."""
    from handlers.torchserve import threads

    ids = list(range(n)) if n else None
    workers = args.workers_per_gpu * n if n else args.cpu_workers
    # What our handler will choose (the same function it calls); checked against its load line.
    budget = threads.decide("cuda" if n else "cpu", 0, workers, threads.usable_cores()).intra_op
    store = work / f"store{n}"
    store.mkdir(parents=True, exist_ok=True)
    wanted = ((args.multi_gpu_handlers or args.handlers) if n > 1 else args.handlers).split(",")
    models = {"ours": archive_ours(args, store, "ours", workers, ids)}
    for item, name in (zip(args.variant, variant_models(args)) if "ours" in wanted else ()):
        own, extra = variant_options(item, max(n, 1))
        models[name] = archive_ours(args, store, name, own or workers, ids, extra)
    for t in (ints(args.thread_sweep) if n <= 1 else []):
        models[f"ours_t{t}"] = archive_ours(args, store, f"ours_t{t}", workers, ids,
                                            ("--handler-option", f"cpu_threads={t}"))
    half = any(s.dtype == "float16" for s in spec.inputs + spec.outputs)
    stock = {"factory": "models.py:" + args.factory.rsplit(":", 1)[1], "inputs": spec.input_names,
             "outputs": spec.output_names, "precision": "fp16" if half else "fp32",
             # the axes that carry a variable length: the stock handler pads them to the batch's longest
             "in_axes": [[s.name, a, d] for s in spec.inputs for a, d in enumerate(s.shape) if isinstance(d, str)],
             "out_axes": [[s.name, a, d] for s in spec.outputs for a, d in enumerate(s.shape) if isinstance(d, str)]}
    if "stock" in wanted:
        models["stock"] = archive_baseline(args, store, "stock", "stock_handler.py", workers, ids,
                                           {"stock": {**stock, "cpu_threads": budget}})
    if "stock_aoti" in wanted:
        if spec.backend != "aoti":
            raise SystemExit("bench_e2e: --handlers stock_aoti needs an AOTInductor artifact (--backend aoti)")
        models["stock_aoti"] = archive_baseline(args, store, "stock_aoti", "stock_aoti_handler.py", workers, ids,
                                                {"stock": {**stock, "artifact": spec.artifact, "cpu_threads": 1}},
                                                spec.artifact_path)
    if "stock_default" in wanted:
        models["stock_default"] = archive_baseline(args, store, "stock_default", "stock_handler.py",
                                                   workers, ids, {"stock": stock})
    if "echo" in wanted:
        models["echo"] = archive_baseline(args, store, "echo", "echo_handler.py", workers, ids,
                                          {"echo": {"response": echo_response(spec, refs[0]).hex()}})
    models.update(serving_models(args, store, workers, ids, echo_response(spec, refs[0])))
    env = {**os.environ, timeline.ENV: str(work / f"timeline{n}")} if args.timeline else None
    if env:
        Path(env[timeline.ENV]).mkdir(parents=True, exist_ok=True)
        args.timeline_dir = env[timeline.ENV]
    server = LocalTorchServe(work / f"ts{n}", store, models, env=env, extra_config="\n".join(args.ts_config))
    try:
        ready_s = server.wait_ready()
        logged = chosen_threads(server.log(), "ours")
        args.ours_engine = "served by the engine" in model_lines(server.log(), "ours") and logged is None
        if logged is not None and logged != budget:
            raise SystemExit(f"our worker logged {logged} CPU threads, the benchmark expected {budget}")
        # what each of our variants launches with (CUDA graphs or why not), as its load line says
        for note in sorted(set(re.findall(r"; ((?:no )?CUDA graphs[^;]*);", server.log()))):
            print(f"load line: {note}", flush=True)
        return _measure_set(args, server, n, workers, budget, ready_s, bodies, refs, tol)
    finally:
        server.stop()


def serving_models(args, store: Path, workers: int, ids, echo_body: bytes) -> dict:
    """ours_NAME and echo_NAME of each --serving NAME:BATCH:DELAY, archived with those settings."""
    models = {}
    for name, batch, delay in serving_sets(args):
        models[f"ours_{name}"] = archive_ours(args, store, f"ours_{name}", workers, ids, serving=(batch, delay))
        models[f"echo_{name}"] = archive_baseline(args, store, f"echo_{name}", "echo_handler.py", workers, ids,
                                                  {"echo": {"response": echo_body.hex()}}, serving=(batch, delay))
    return models


def echo_response(spec, ref: dict) -> bytes:
    """A response body the size of ours: the outputs' shapes and served dtypes, zeros."""
    import torch
    from safetensors.torch import save

    dtypes = {o.name: getattr(torch, o.dtype) for o in spec.outputs}
    return save({k: torch.zeros(v.shape, dtype=dtypes.get(k, torch.float32)) for k, v in ref.items()})


def _echo_check(model: str, refs: list, tol: float):
    """The echo answers zeros of the output's shape: its answers are parsed and compared too,
    so the client does the same work per answer for every handler."""
    return ([{k: v * 0 for k, v in r.items()} for r in refs], tol) if model.startswith("echo") else (refs, tol)


def variant_options(item: str, gpus: int) -> tuple:
    """(workers or None, cs-archive arguments) of a --variant NAME:KEY=VALUE,...: the pairs split at
    the commas that start a new KEY= (a value may hold commas); workers=N is the variant's own
    workers per GPU (the engine's workers hold no GPU), every other pair a handler option."""
    pairs = [kv for kv in re.split(r",(?=\s*\w+=)", item.partition(":")[2]) if kv]
    own = [int(kv.partition("=")[2]) * gpus for kv in pairs if kv.startswith("workers=")]
    extra = [x for kv in pairs if not kv.startswith("workers=") for x in ("--handler-option", kv)]
    return (own[-1] if own else None), extra


def variant_models(args) -> list:
    """The model names of the --variant archives (NAME:KEY=VALUE,... is served as ours_NAME) and
    of the --serving ones (ours_NAME and echo_NAME)."""
    return [f"ours_{v.partition(':')[0]}" for v in args.variant] + [
        f"{h}_{name}" for name, _, _ in serving_sets(args) for h in ("ours", "echo")]


def serving_sets(args) -> list:
    """[(NAME, batchSize, maxBatchDelay)] of --serving NAME:BATCH:DELAY."""
    out = []
    for item in args.serving:
        name, batch, delay = item.split(":")
        out.append((name, int(batch), int(delay)))
    return out


def _first_requests(args, server, token, n, bodies, refs, tol) -> list:
    order = ["echo", "ours"] + variant_models(args) + ["stock"]
    rows = []
    for model in [m for m in order if m in server.models]:
        refs_m, tol_m = _echo_check(model, refs, tol)
        row = first_request(server.base, f"/predictions/{model}", token, bodies[0], (refs_m[0], tol_m),
                            idle_seconds=args.idle_seconds)
        row.update(handler=model, gpus=n)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _measure_set(args, server, n, workers, threads, ready_s, bodies, refs, tol) -> tuple:
    """(load points, first-request rows)."""
    token = server.key()
    firsts = _first_requests(args, server, token, n, bodies, refs, tol) if args.first_request else []
    points = []
    main = ["ours", "stock", "stock_aoti", "echo"] + variant_models(args)
    clients = ints(args.multi_gpu_clients or args.clients) if n > 1 else ints(args.clients)
    plan = [(m, c) for m in main if m in server.models for c in clients]
    extra = [m for m in server.models if is_thread_sweep(m) or m == "stock_default"]
    if extra and args.sweep_clients not in clients:  # the defaults beside the sweep
        extra = [m for m in ("ours", "stock") if m in server.models] + extra
    plan += [(m, args.sweep_clients) for m in extra]
    rounds = {}
    for r in range(args.rounds):
        # Later points ran faster than earlier ones on the GPU machines (each of four A/B
        # pairs favoured whichever ran last): every other round goes backwards, so drift over
        # the run falls on every handler alike.
        for model, clients in (plan if r % 2 == 0 else plan[::-1]):
            res = _point(args, server, token, model, clients, r, bodies, refs, tol)
            res.update(handler=model, gpus=n, workers=workers, clients=clients, round=r)
            print(json.dumps(res), flush=True)
            rounds.setdefault((model, clients), []).append(res)
    points = [combine_rounds(rounds[key]) for key in plan]
    restarts = len(re.findall(r"Backend worker process died", server.log("logs/ts_log.log")))
    for p in points:
        p["worker_deaths_in_run"] = restarts
        p["ready_s"] = round(ready_s, 1)
        p["ours_cpu_threads"] = threads
    return points, firsts


def _point(args, server, token, model, clients, r, bodies, refs, tol) -> dict:
    """One load point: wrk on its own cores for several clients with --load-generator native, else
    the Python clients (answers checked); with --timeline, where our workers' cycles went."""
    from bench import native_load, timeline_report

    t0 = time.perf_counter()
    if args.load_generator == "native" and clients > 1:
        headers = {"Content-Type": "application/x-safetensors", "Authorization": f"Bearer {token}"}
        res = native_load.run_bodies(server.base, f"/predictions/{model}", bodies, headers, clients, args.seconds,
                                     args.warmup_seconds, args.loadgen_cpus)
    else:
        res = run_point(server.base, f"/predictions/{model}", token, bodies, _echo_check(model, refs, tol),
                        clients, args.seconds, args.warmup_seconds, args.max_requests, args.processes,
                        args.spy if r == 0 else 0, args.spy_exe, server.proc.pid)
    t1 = time.perf_counter()
    if args.timeline and model.startswith("ours"):
        # the measured window: the point's last `seconds` before its clients stopped (0.5 s margins)
        end = t1 - (0.3 if args.load_generator == "native" and clients > 1 else 1.0)
        res["timeline"] = timeline_report.report(args.timeline_dir, max(t0, end - args.seconds + 0.5), end)
    return res


def combine_rounds(results: list) -> dict:
    """One point from its rounds: counts summed, req/s and latency percentiles averaged over the
    rounds (each round's req/s kept in `rounds_req_s`)."""
    out = {k: v for k, v in results[0].items() if k != "round"}
    if len(results) == 1:
        return out
    for k in ("requests", "ok", "errors"):
        out[k] = sum(r[k] for r in results)
    out["mismatches"] = None if results[0]["mismatches"] is None else sum(r["mismatches"] for r in results)
    out["error_samples"] = sorted({e for r in results for e in r["error_samples"]})[:3]
    for k in ("req_s", "p50_ms", "p99_ms"):
        out[k] = round(sum(r[k] for r in results) / len(results), 2)
    out["rounds_req_s"] = [r["req_s"] for r in results]
    if all(r.get("cpu_cores") for r in results):
        out["cpu_cores"] = _mean_cores([r["cpu_cores"] for r in results])
    return out


def _mean_cores(rounds: list) -> dict:
    """Core accounting averaged over rounds, key by key and into nested groups (the busiest
    process, the frontend's thread kinds). A key counts only in the rounds that have it: a thread
    kind absent from a round fell below that round's cut (the busiest 8), it was not idle. A value
    every round agrees on (the host's cores) is kept as it is."""
    out = {}
    for k in dict.fromkeys(k for r in rounds for k in r):
        have = [r[k] for r in rounds if k in r]
        if isinstance(have[0], dict):
            out[k] = _mean_cores(have)
        else:
            out[k] = have[0] if all(v == have[0] for v in have) else round(sum(have) / len(have), 2)
    return out


def summary(points: list, limits: dict, ours_engine: bool = False) -> dict:
    """Ratios a reader asks for: ours over stock and over the transport limit per point, the
    thread-budget default against the best tried, and scaling across GPUs; issue 64's keys
    (`engine_keys`) where an engine served (`ours_engine`: ours itself, the archive's default)."""
    by = {(p["handler"], p["gpus"], p["clients"]): p for p in points}

    def ratios(p, n, c, h="ours") -> dict:
        # ours_NAME of --serving NAME:... is held against echo_NAME, served with the same settings
        echo = by.get(("echo" + h[4:], n, c)) or by.get(("echo", n, c))
        stock, aoti = by.get(("stock", n, c)), by.get(("stock_aoti", n, c))
        img_limit = limits.get(str(n), {}).get("img_s")
        return {"vs_stock": round(p["req_s"] / stock["req_s"], 2) if stock and stock["req_s"] else None,
                "vs_stock_aoti": round(p["req_s"] / aoti["req_s"], 2) if aoti and aoti["req_s"] else None,
                "vs_transport": round(p["req_s"] / echo["req_s"], 2) if echo and echo["req_s"] else None,
                "vs_gpu_limit": round(p["req_s"] / img_limit, 2) if img_limit else None}

    rows, variant_rows = [], []
    for (h, n, c), p in sorted(by.items()):
        if h.startswith("ours_") and not is_thread_sweep(h):
            variant_rows.append({"handler": h, "gpus": n, "clients": c, "req_s": p["req_s"], "p50_ms": p["p50_ms"],
                                 **ratios(p, n, c, h)})
        if h != "ours":
            continue
        variants = {k[0]: v for k, v in by.items() if k[1:] == (n, c) and k[0].startswith("ours_")
                    and not is_thread_sweep(k[0])}
        rows.append({"gpus": n, "clients": c, "ours_req_s": p["req_s"], "ours_p50_ms": p["p50_ms"],
                     **{f"{k}_p50_ms": v["p50_ms"] for k, v in variants.items()},
                     **{f"{k}_req_s": v["req_s"] for k, v in variants.items()}, **ratios(p, n, c)})
    threads = {}
    for (h, n, c), p in by.items():
        if is_thread_sweep(h) or (h == "ours" and any(is_thread_sweep(k[0]) and k[1:] == (n, c) for k in by)):
            threads.setdefault(f"{n}:{c}", {})[h] = p["req_s"]
    thread_rows = [{"set": k, **v, "default_vs_best": round(v["ours"] / max(v.values()), 3)}
                   for k, v in threads.items() if "ours" in v]
    scaling = []
    sets = sorted({p["gpus"] for p in points})
    if len(sets) > 1 and sets[0] == 1:
        n = sets[-1]
        for c in sorted({p["clients"] for p in points}):
            one, many = by.get(("ours", 1, c)), by.get(("ours", n, c * n))
            if one and many and one["req_s"]:
                scaling.append({"gpus": n, "clients_1gpu": c, "clients_all": c * n,
                                "speedup": round(many["req_s"] / one["req_s"], 2)})
    return {"ours": rows, "variants": variant_rows, "thread_budget": thread_rows, "scaling": scaling,
            **engine_keys(by, ours_engine)}


ENGINE_NOT_HERE = ("gpu_mib_all_processes", "worker_restart_s", "engine_restart_s")


def engine_keys(by: dict, ours_engine: bool = False) -> dict:
    """Issue 64's keys where an engine served, ours itself (`ours_engine`: handler.engine auto, the
    archive's default on a GPU) or an ours_engine* variant (engine: on with its own worker count),
    and echo on one GPU: the engine over echo at 64 and 128 clients, the other engine variants
    beside. The memory and restart keys come from bench/bench_shared.py, not from this run (None
    here). The keys held against the per-worker path went with that path (retired, issue 64)."""
    def ratio(h, c):
        p, echo = by.get((h, 1, c)), by.get(("echo", 1, c))
        return round(p["req_s"] / echo["req_s"], 3) if p and echo and echo["req_s"] else None

    engines = (["ours"] if ours_engine else []) + list(dict.fromkeys(k[0] for k in by if k[0].startswith("ours_engine")))
    if not engines:
        return {}
    # the keys are the engine served with the archive's own worker count (ours where the
    # engine served it; in a run from before handler.engine auto, ours_engine), else the first
    # engine variant of the command
    main = "ours" if ours_engine else "ours_engine" if "ours_engine" in engines else engines[0]
    return {"engine_variant": main, "ours_over_echo_c64": ratio(main, 64), "ours_over_echo_c128": ratio(main, 128),
            # the other engine variants (other worker counts: ours_engine24 ...) beside
            **{f"{h[5:]}_over_echo_c{c}": ratio(h, c) for h in engines if h != main for c in (64, 128)},
            **{k: None for k in ENGINE_NOT_HERE}}


def write_markdown(path: Path, result: dict):
    lines = page_head(result, f"End-to-end through TorchServe: {result['model']}")
    lines += [f"Serving: batchSize {result['settings']['batch_size']}, maxBatchDelay "
             f"{result['settings']['max_batch_delay']} ms, {result['settings']['workers_per_gpu']} workers per GPU "
             f"({result['settings']['cpu_workers']} on CPU); one-row binary (safetensors) requests; every "
             "answer compared with the eager model."
             + (f" Each point measured in {result['settings']['rounds']} rounds, every other one in reverse "
                "order; req/s is their mean (each round in brackets)." if result["settings"].get("rounds", 1) > 1
                else ""), "",
             "| handler | GPUs | clients | req/s | p50 ms | p99 ms | errors | mismatches |",
             "|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        per_round = f" ({' / '.join(map(str, p['rounds_req_s']))})" if "rounds_req_s" in p else ""
        lines.append(f"| {p['handler']} | {p['gpus']} | {p['clients']} | {p['req_s']}{per_round} | {p['p50_ms']} | "
                     f"{p['p99_ms']} | {p['errors']} | {p['mismatches'] if p['mismatches'] is not None else '-'} |")
    lines += ["", "Limits measured in the same run (GPU limit: the artifact alone at the served batch "
              "size, plain call or CUDA graph replay whichever is faster, times the GPUs; with named "
              "dimensions, every batch at one of the sizes the run sends, graphs at the declared padding's "
              "buckets, over the sizes' mean time):", ""]
    for n, lim in result["limits"].items():
        lines.append(f"- {n} GPU(s): {lim}")
    for b, lim in result.get("limits_by_batch", {}).items():
        lines.append(f"- one GPU at batch {b}: {lim['img_s']} rows/s (a call of {lim['mean_batch_ms']} ms)")
    s = result["summary"]
    lines += ["", "| handler | GPUs | clients | req/s | / stock eager | / stock AOTI | / transport "
              "| / GPU limit |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| ours | {r['gpus']} | {r['clients']} | {r['ours_req_s']} | {r['vs_stock']} | {r.get('vs_stock_aoti')} | "
              f"{r['vs_transport']} | {r['vs_gpu_limit']} |" for r in s["ours"]]
    lines += [f"| {r['handler']} | {r['gpus']} | {r['clients']} | {r['req_s']} | {r['vs_stock']} | "
              f"{r['vs_stock_aoti']} | {r['vs_transport']} | {r['vs_gpu_limit']} |" for r in s.get("variants", [])]
    lines += _cores_table(result["points"])
    lines += _spy_table(result["points"])
    lines += _timeline_tables(result["points"])
    if s["thread_budget"]:
        lines += ["", "Thread budget (req/s; `ours` is the default, `ours_tN` forces N threads):", ""]
        lines += [f"- {r}" for r in s["thread_budget"]]
    if s["scaling"]:
        lines += ["", "Scaling across GPUs (clients scaled with the GPUs):", ""]
        lines += [f"- {r}" for r in s["scaling"]]
    if result.get("first_requests"):
        lines += ["", "First request after READY, one client (echo first, so the frontend's own first "
                  "request is paid there); steady = median of the next 20 back to back; after idle = "
                  "median of 5 requests each after a pause:", "",
                  "| handler | GPUs | first ms | steady ms | first / steady | after idle ms | after idle / steady |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['handler']} | {r['gpus']} | {r['first_ms']} | {r['steady_median_ms']} | "
                  f"{r['first_over_steady']} | {r.get('after_idle_median_ms', '-')} | "
                  f"{r.get('after_idle_over_steady', '-')} |" for r in result["first_requests"]]
    path.write_text("\n".join(lines) + "\n")


def _timeline_tables(points: list) -> list:
    """Where our workers' batch cycles went at each point (--timeline)."""
    from bench.timeline_report import markdown

    lines = []
    for p in points:
        if p.get("timeline", {}).get("batches"):
            if not lines:
                lines = ["", "Our workers' batch cycle at each point (handlers/timeline.py: the "
                         "wall time between two batches of one worker, every interval named; means and "
                         "medians per batch over the measured window):"]
            lines += ["", f"{p['handler']}, {p['gpus']} GPU(s), {p['clients']} clients: " + markdown(p["timeline"])]
    return lines


def _spy_table(points: list) -> list:
    """The workers' time per request by stage (--spy; bench/worker_spy.py), a column per point,
    beside the workers' CPU per request from /proc."""
    rows = [p for p in points if p.get("spy")]
    if not rows:
        return []
    stages = list(dict.fromkeys(k for p in rows for k in p["spy"]["stages"]))
    head = [f"{p['handler']} {p['clients']}c" for p in rows]
    out = ["", "Where the workers' time went (py-spy samples of every worker during the measured window, "
           "first round; microseconds of worker time per request; py-spy leaves out time a worker "
           "sleeps in the OS; the /proc row is the workers' CPU per request from the table above):", "",
           "| stage | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for stage in stages:
        out.append(f"| {stage} | " + " | ".join(str(p["spy"]["stages"].get(stage, 0.0)) for p in rows) + " |")
    out.append("| all sampled | " + " | ".join(str(p["spy"]["us_per_request"]) for p in rows) + " |")
    out.append("| processes sampled | " + " | ".join(str(p["spy"].get("processes", "-")) for p in rows) + " |")
    cpu = [p["spy"].get("workers_cpu_us_per_request") or
           (round(p["cpu_cores"]["workers"] / p["req_s"] * 1e6, 1) if p.get("cpu_cores") and p["req_s"] else "-")
           for p in rows]
    out.append("| workers' CPU (/proc) | " + " | ".join(map(str, cpu)) + " |")
    for p in rows:
        own = ", ".join(f"`{k}` {v}" for k, v in p["spy"]["top_own"][:8])
        out.append(f"\n- {p['handler']} {p['clients']}c, most own time (us/request): {own}")
        if p["spy"].get("failures"):  # a worker not sampled: its share of the time is missing above
            out.append(f"- {p['handler']} {p['clients']}c: NOT ALL WORKERS SAMPLED: {'; '.join(p['spy']['failures'])}")
    return out


def _cores_table(points: list) -> list:
    """Where the host's cores went during each point (bench/cpu_usage.py): cores busy on
    average in the measured window, per process group."""
    rows = [p for p in points if p.get("cpu_cores")]
    if not rows:
        return []
    lines = ["", "Where the host's cores went (cores busy on average during the measured window; "
             "frontend: TorchServe's Java process, workers: its Python workers, load generator: the "
             "client processes; irq: interrupt handling, where loopback networking is mostly "
             "accounted; in brackets the busiest single process of the group, where a Python "
             "process near 1.0 is bound by its interpreter lock):", "",
             "| handler | GPUs | clients | frontend | workers | load generator | irq | other | host busy | host cores |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in rows:
        c = p["cpu_cores"]
        top = c.get("busiest", {})
        workers, load = (f"{c[g]} ({top[g]})" if g in top else f"{c[g]}" for g in ("workers", "load_generator"))
        lines.append(f"| {p['handler']} | {p['gpus']} | {p['clients']} | {c['frontend']} | {workers} | "
                     f"{load} | {c.get('irq', '-')} | {c['other']} | {c['host_busy']} | {c['host_cores']} |")
    threads = [p for p in rows if p["cpu_cores"].get("frontend_threads")]
    if threads:
        lines += ["", "The frontend's cores by thread kind (thread names with digits as #; `epollEventLoopG`: "
                  "Netty's I/O threads for HTTP and for the workers' sockets, `W-#-...`: one per worker, "
                  "`GC Thread#`/`G1 ...`: the garbage collector, `C# CompilerThre`: the JIT):", ""]
        for p in threads:
            kinds = sorted(p["cpu_cores"]["frontend_threads"].items(), key=lambda kv: -kv[1])
            top = p["cpu_cores"].get("frontend_busiest_thread", {})
            lines.append(f"- {p['handler']}, {p['gpus']} GPU(s), {p['clients']} clients: "
                         + ", ".join(f"`{k}` {v}" + (f" (busiest thread {top[k]})" if k in top else "")
                                     for k, v in kinds))
    return lines


def plot(path: Path, result: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({p["gpus"] for p in result["points"]})
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.2), squeeze=False)
    for ax, n in zip(axes[0], sets):
        for h in ("ours", "stock", "stock_aoti", "echo"):
            pts = sorted((p["clients"], p["req_s"]) for p in result["points"] if p["handler"] == h and p["gpus"] == n)
            if pts:
                ax.plot(*zip(*pts), marker="o", label={"echo": "transport limit (echo)"}.get(h, h))
        lim = result["limits"].get(str(n), {}).get("img_s")
        if lim:
            ax.axhline(lim, color="gray", linestyle="--", label="GPU limit (forward only)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("requests/s (one image each)")
        ax.set_title(f"{result['model']} on {n} GPU(s)" if n else f"{result['model']} on CPU")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    from_cli = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--replot"]:  # the plot (and with --markdown the page) again from a results JSON
        path = Path(argv[1])
        result = json.loads(path.read_text())
        if "--summary" in argv[2:]:  # the summary computed again from the same points (keys added since)
            result["summary"] = summary(result["points"], result["limits"], result["settings"].get("ours_engine", False))
            path.write_text(json.dumps(result, indent=1) + "\n")
        if "--markdown" in argv[2:]:  # older pages were edited by hand: rewritten only when asked
            write_markdown(path.with_suffix(".md"), result)
        plot(path.with_suffix(".png"), result)
        return 0
    args = parse_args(argv)
    import contextlib

    with contextlib.ExitStack() as stack:
        imported(args, stack)
        return run(args, argv, from_cli)


def run(args, argv, from_cli: bool) -> int:
    import torch

    started = time.time()  # engine sample files older than this are another run's
    from handlers.artifact.metadata import read_spec

    spec = read_spec(args.artifact)
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu else 0
    if spec.device == "cuda" and n_gpu == 0:
        raise SystemExit("bench_e2e: the artifact was compiled for CUDA and this machine has no GPU")
    device = torch.device("cuda:0" if n_gpu else "cpu")
    bodies, refs, tol, sizes = references(args, spec, device)
    from bench import native_load

    args.loadgen_cpus = native_load.split_cores(args.loadgen_cores if args.load_generator == "native" else 0)
    pad, pad_buckets = declared_pad(args)
    if not pad:  # ours, archived with no options, pads where the import found padding safe
        pad = (spec.extra.get("padding") or {}).get("pad") or {}
    one = gpu_limit(spec, device, args.batch_size, sizes, pad, pad_buckets=pad_buckets)
    sets = device_sets(args, n_gpu)
    limits = {str(n): {**one, "img_s": round(one["img_s"] * max(n, 1), 1)} for n in sets}
    by_batch = limits_by_batch(args, spec, device, sizes, pad, pad_buckets)
    torch.cuda.empty_cache() if n_gpu else None
    points, firsts = [], []
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        for n in sets:
            got, first = serve_set(args, n, bodies, refs, tol, spec, Path(tmp))
            points += got
            firsts += first
    name = Path(args.factory.rsplit(":", 1)[1]).name + f"_{spec.inputs[0].dtype}_{spec.backend}"
    from bench.results_meta import header

    result = {
        **header(torch.cuda.get_device_name(0) + f" x{n_gpu}" if n_gpu else f"CPU ({os.cpu_count()} cores)",
                 None if from_cli else ["-m", "bench.bench_e2e", *argv]),
        "model": name, "host_cores": os.cpu_count(),
        "settings": {"batch_size": args.batch_size, "max_batch_delay": args.max_batch_delay,
                     "workers_per_gpu": args.workers_per_gpu, "cpu_workers": args.cpu_workers,
                     "seconds": args.seconds, "rounds": args.rounds, "tolerance": tol,
                     "serving": args.serving, "load_generator": args.load_generator,
                     "load_generator_cores": args.loadgen_cpus,
                     "ours_engine": getattr(args, "ours_engine", False)},
        "limits": limits, "points": points, "summary": summary(points, limits, getattr(args, "ours_engine", False)),
    }
    if by_batch:
        result["limits_by_batch"] = by_batch
    if firsts:
        result["first_requests"] = firsts
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(out.with_suffix(".md"), result)
    try:
        plot(out.with_suffix(".png"), result)
    except ImportError as e:
        print(f"bench_e2e: no plot ({e}); install matplotlib (pyproject's test extra)", file=sys.stderr)
    add_engine_seconds(out, started)
    print(out.with_suffix(".md").read_text())
    return 0


def add_engine_seconds(out: Path, started: float, wait_s: float = 15.0) -> None:
    """With CS_ENGINE_SAMPLE set (handlers/engine/sampler.py), the run's engines' own account
    (bench/engine_seconds.py) into the result: each engine writes its file when it exits, within
    seconds of its TorchServe's stop (handlers/engine/serve.py watch_lifetime), so the files are
    waited for until no engine process is left on the host (any engine's, not only this run's)
    or `wait_s` passes."""
    from bench import engine_seconds
    from handlers.engine.sampler import ENV

    stem = os.environ.get(ENV)
    if not stem:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and subprocess.run(["pgrep", "-f", "handlers.engine.serve"],
                                                         capture_output=True).returncode == 0:
        time.sleep(0.5)
    files = [f for f in glob.glob(f"{stem}.*.json") if os.path.getmtime(f) >= started]
    engine_seconds.merge_by_engine(out.with_suffix(".json"), files, 2000.0, f"bench_e2e, from the files of {ENV}={stem}")


if __name__ == "__main__":
    sys.exit(main())
