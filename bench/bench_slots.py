"""Continuous batching on the GPU machine (issue 50 item 3): a 0.5 B Llama-architecture decoder in
the slot form (examples/slot_decoder.py: random weights, fp16, a cache of SLOTS rows of MAX_SEQ
positions), exported and packaged with plain torch calls, archived with no options (cs-archive
--artifact PKG --program PROGRAM) and served by real TorchServe; then 1, 8, 32 and 64 concurrent
streams (one client process each, all started together after a warm-up round), each a 128-token
prompt and 256 new tokens (greedy, ignore_eos), read token by token over HTTP chunked:

- aggregate decode tokens/s (every stream's tokens over the round's wall time; the median of
  --rounds rounds: one round of one stream is 0.4 s, and a single stall moved it by a fifth),
- time to first token p50 / p99 (request sent to first token line, every round's streams),
- inter-token latency p50 / p99 (between consecutive token lines of a stream, all streams and
  rounds pooled),
- the worker's GPU memory (nvidia-smi; this process's own, which loaded the package for the limits
  below, left out) beside the weights' and the cache's bytes,
- the greedy tokens of one stream against the same stream's among 32 (equal or not),
- before the server starts, the package's own decode step at each stream count in this process
  (the handler's runner and graphs, no server): the tokens/s limit the GPU sets at each count.

  python -m bench.bench_slots --out docs/results/slots_llama05b_fp16_h200

With --baseline, an earlier run's .json is set beside this run's (the committed page: the engine
before batched prefill, run first on the same machine and package, then this code):

  mkdir base && git archive 8f5278f | tar -x -C base
  (cd base && python -m bench.bench_slots --reuse /tmp/slotpkg --out /tmp/base_slots)
  python -m bench.bench_slots --reuse /tmp/slotpkg --baseline /tmp/base_slots.json --out ...
"""
from __future__ import annotations

import argparse
import gc
import http.client
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.native_load import split_cores
from bench.results_meta import header, page_head, plot_or_say, write_pages
from compiled_serving.local_server import ROOT, LocalTorchServe
from examples import slot_decoder
from examples.tiny_decoder import Config


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-seq", type=int, default=512)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--streams", default="1,8,32,64")
    p.add_argument("--client-cores", type=int, default=0,
                   help="cores of this host set apart for the stream clients (the last N; the server gets the "
                        "rest). Default 0, no split: on 4 cores of an H100 host 64 Python clients sent their "
                        "requests spread over more engine turns (353 against 321, TTFT p50 272 ms against 207)")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds of warm-up rounds before each point's measured rounds (at least one round)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per point (after the warm-up): "
                   "tokens/s the median round's, latency percentiles over all rounds")
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only checks the script")
    p.add_argument("--reuse", help="a directory to keep the program and package in and take them from when "
                                   "present (a second run on a machine still warm skips the compile)")
    p.add_argument("--log", help="also write the worker's log (TorchServe's model_log.log) here")
    p.add_argument("--frontend-warmup", type=int, default=64,
                   help="one-token requests sent one after another before the points (TorchServe's JIT warm-up)")
    p.add_argument("--handler-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to cs-archive (e.g. engine=on: the batch in the engine process, issue 64)")
    p.add_argument("--out", required=True, help="results path without suffix (.json, .md, .png)")
    p.add_argument("--baseline", help="the .json of an earlier run of this bench (other code, same machine and "
                                      "package): its points are set beside this run's")
    return p


def first_difference(a: list, b: list):
    """The first index where two token lists differ (None when equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def package(args, work: Path) -> tuple:
    """(program path, package path, parameter count, cache bytes, compile seconds)."""
    cfg = Config(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                 max_seq_length=args.max_seq)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    model = slot_decoder.build(cfg, slots=args.slots, std=0.02, device=args.device, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    cache = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "cache" in n)
    t0 = time.perf_counter()
    program, pkg = work / "program.pt2", work / "model.pt2"
    if program.exists() and pkg.exists():
        return program, pkg, params, cache, 0.0
    ep = slot_decoder.export(model)
    torch.export.save(ep, program)
    from torch._inductor import aoti_compile_and_package

    aoti_compile_and_package(ep, package_path=str(pkg))
    del model, ep
    return program, pkg, params, cache, time.perf_counter() - t0


def stream_once(a) -> dict:
    """One streaming request, started at wall time `start`: its token arrival times and tokens."""
    port, token, prompt, n, start = a
    time.sleep(max(0.0, start - time.time()))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"input_ids": prompt, "parameters": {"max_tokens": n, "ignore_eos": True}})
    t0 = time.time()
    conn.request("POST", "/predictions/lm", body, {"Authorization": f"Bearer {token}",
                                                    "Content-Type": "application/json"})
    resp = conn.getresponse()
    times, last = [], None
    for line in resp:
        if line.strip():
            times.append(time.time())
            last = json.loads(line)
    conn.close()
    if resp.status != 200 or last is None or "token_ids" not in last:
        raise RuntimeError(f"status {resp.status}: {last}")
    return {"t0": t0, "times": times[:-1], "end": times[-1], "tokens": last["token_ids"]}


def warm_frontend(port, token, prompt: list, n: int) -> dict:
    """`n` one-token requests, one after another, before any point: TorchServe's frontend (a JVM)
    answers its first requests slowly while its JIT compiles the request path (measured on an
    H200 host with bench/ttft_hops: a request's way into the worker took 10-15 ms for the first
    4-21 requests after the start, 2-3 ms after), which a point of a few streams' rounds would
    otherwise measure. The TTFT of the first and the last ten, p50, ms."""
    if n <= 0:
        return {"requests": 0}
    ttft = []
    for _ in range(n):
        r = stream_once((port, token, prompt, 1, time.time()))
        ttft.append(((r["times"][0] if r["times"] else r["end"]) - r["t0"]) * 1e3)
    return {"requests": n, "ttft_ms_p50_first10": pct(ttft[:10], 0.5), "ttft_ms_p50_last10": pct(ttft[-10:], 0.5)}


def make_prompts(vocab: int, length: int, count: int) -> list:
    """`count` seeded random prompts of `length` token ids; the first two the same (one stream
    alone against the same prompt in a crowd)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(max(count, 2))]
    return [prompts[0]] * 2 + prompts[2:count]


def pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def one_point(pool, port, token, prompts, n: int, decode: int, rounds: int) -> dict:
    """`rounds` rounds of n streams started together: aggregate tokens/s the median round's (each
    round's every token over its wall time), TTFT and inter-token percentiles over every round's
    streams pooled; the first round's tokens, and where each later round's first differ from them
    (None: the same; greedy, so one stream alone gives the same tokens every round unless its
    kernels differ between rounds; in a crowd the steps' batches may differ too)."""
    rates, walls, ttft, itl, tokens, drift = [], [], [], [], None, []
    for _ in range(rounds):
        start = time.time() + 1.0
        runs = pool.map(stream_once, [(port, token, prompts[i], decode, start) for i in range(n)])
        wall = max(r["end"] for r in runs) - min(r["t0"] for r in runs)
        rates.append(n * decode / wall)
        walls.append(wall)
        ttft += [(r["times"][0] - r["t0"]) * 1e3 for r in runs]
        itl += [(b - a) * 1e3 for r in runs for a, b in zip(r["times"], r["times"][1:])]
        tokens = tokens or [r["tokens"] for r in runs]
        at = [d for d in (first_difference(a, r["tokens"]) for a, r in zip(tokens, runs)) if d is not None]
        drift.append(min(at, default=None))
    return {"streams": n, "aggregate_tok_s": statistics.median(rates), "rounds_tok_s": rates, "wall_s": walls,
            "rounds_first_difference": drift[1:],
            "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
            "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99), "tokens": tokens}


def gpu_memory_mib() -> dict:
    """{pid: MiB} of the GPU's processes (nvidia-smi); {} without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(p): float(m) for p, m in (ln.split(",") for ln in out.strip().splitlines() if ln.strip())}


def loaded_package(pkg: Path, dev):
    """(tokens, positions, slots) -> {"logits": ...} of the package, its runner single-threaded (CUDA
    graphs): loaded as the handler loads it where the artifact.json beside it names it (cs-export-lm's
    package keeps its weights outside its library and its cache out of them, which torch's
    aoti_load_package does not load: handlers/artifact/kinds/aoti_constants.py), else by aoti_load_package."""
    from handlers.artifact.metadata import METADATA_FILE, read_spec

    if (pkg.parent / METADATA_FILE).is_file() and read_spec(str(pkg.parent)).artifact == pkg.name:
        from handlers.artifact.device import Placement
        from handlers.artifact.kinds.aoti_package import load_aoti_package

        index = (dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else None
        return load_aoti_package(read_spec(str(pkg.parent)), Placement(dev.type, index), "aoti_package", True)
    from torch._inductor import aoti_load_package

    compiled = aoti_load_package(str(pkg), run_single_threaded=True)
    return lambda *a: {"logits": compiled(*a)}


def step_limits(args, pkg: Path, counts: list) -> list:
    """The package's own decode step in this process, no server: for each stream count, the
    handler's runner (handlers/run/slots.py: CUDA graphs, rows padded to the graph's size) timed
    over 50 steps at position prompt + decode / 2; the tokens/s the GPU allows at that count."""
    from types import SimpleNamespace

    from handlers.run.slots import SlotRunner

    dec = SimpleNamespace(slots=args.slots, cache_length=args.max_seq, vocab=args.vocab, logits="logits",
                          chunk_max=args.max_seq, all_positions=True)
    dev = torch.device(args.device)
    compiled = loaded_package(pkg, dev)
    runner = SlotRunner(compiled, dec, dev, SimpleNamespace(stream_priority=0))
    out = []
    with torch.inference_mode(), runner.stream_context():
        note = runner.capture("auto")
        for n in counts:
            tokens = torch.zeros(n, dtype=torch.int64, device=dev)
            args_n = (list(range(n)), tokens, [args.prompt + args.decode // 2] * n,
                      [(s, 0) for s in range(n, args.slots)])
            for _ in range(5):
                runner.step(*args_n)
            if runner.cuda:
                runner.stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                runner.step(*args_n)
            if runner.cuda:
                runner.stream.synchronize()
            ms = (time.perf_counter() - t0) / 50 * 1e3
            out.append({"streams": n, "step_ms": ms, "tok_s": n / ms * 1e3, **round_limit(runner, args, n, ms)})
            print(out[-1], flush=True)
        # the graphs' buffers are inference tensors, written in place only in inference mode
        out[0]["prefill_ms"] = prefill_ms(runner, args.prompt, args.slots)
    out[0]["graphs"] = note
    del runner, compiled
    gc.collect()  # the graphs and the loaded package, before the server's worker starts beside this process
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def worker_ttft(ts, before=None):
    """The worker's own time to first token (handlers/generation/metrics.py: from the request
    reaching the worker to its first token handed to the frontend), from the metrics port's
    histogram: (sum s, count) now, or with `before` (mean ms, count) since then (None without any)."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ts.ports['metrics']}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    got = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'(?m)^generation_time_to_first_token_seconds_(sum|count)\{[^}]*ModelName="lm"[^}]*\} (\S+)$', text)}
    now = (got.get("sum", 0.0), got.get("count", 0.0))
    if before is None:
        return now
    n = now[1] - before[1]
    return ((now[0] - before[0]) / n * 1e3, int(n)) if n > 0 else None


def round_limit(runner, args, n: int, step_ms: float) -> dict:
    """The package's own time for a round's whole work at n streams, no server: n prompts filled
    in calls of as many rows as the runner takes (as the engine fills prompts that arrive
    together), then `decode` steps of n rows; the tokens/s that allows. The step limit alone
    leaves the prompts out, which a served round pays for."""
    rows = min(n, runner.prompt_rows)
    calls = -(-n // rows)
    fill = calls * prefill_ms(runner, args.prompt, args.slots, rows, repeats=5)
    return {"prefill_round_ms": fill, "round_tok_s": n * args.decode / (fill + args.decode * step_ms) * 1e3}


def prefill_ms(runner, prompt: int, slots: int, rows: int = 1, repeats: int = 20) -> float:
    """`rows` prompts of `prompt` tokens in one call per chunk, as the engine fills prompts with
    no sequence decoding (handlers/generation/engine.py `_fill`: chunks of the runner's
    chunk_limit into slots 0..rows-1), the first tokens picked and read back to the host; with
    one row, the package's own share of a one-stream TTFT."""
    ids = [(7 * k) % 97 + 1 for k in range(prompt)]
    spare = [(s, 0) for s in range(rows, slots)]

    def once() -> list:
        logits, filled = None, 0
        while filled < prompt:
            chunk = ids[filled:filled + runner.chunk_limit]
            logits = runner.prefill_rows(list(range(rows)), [chunk] * rows, [filled] * rows, spare)
            filled += len(chunk)
        return logits.argmax(-1).tolist()  # the host waits for the device here, as the engine's .tolist()

    for _ in range(3):
        once()
    t0 = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - t0) / repeats * 1e3


def _pin(cores) -> None:
    """A client process on the cores set apart for the clients (None: wherever)."""
    if cores:
        os.sched_setaffinity(0, cores)


def served(args, program: Path, pkg: Path, work: Path, pool, counts: list) -> dict:
    return serve_archive(args, ["--artifact", str(pkg), "--program", str(program)], work, pool, counts)


def is_load_line(line: str) -> bool:
    """The worker's load line: its own decoder's, or (handler.engine on) the line naming the engine."""
    return "MODEL_LOG - " in line and ("loaded aoti decoder" in line or "served by the engine" in line)


def serve_archive(args, artifact: list, work: Path, pool, counts: list) -> dict:
    """cs-archive `artifact` (its arguments) --name lm with no options, served by TorchServe; the
    points at each stream count (args: vocab, prompt, decode, warmup, rounds, log)."""
    store = work / "store"
    cmd = [sys.executable, "-m", "compiled_serving.archive", *artifact, "--name", "lm", "--out", str(store),
           *[x for kv in getattr(args, "handler_option", None) or () for x in ("--handler-option", kv)]]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stdout + r.stderr)
    archive_s = time.perf_counter() - t0
    ts = LocalTorchServe(work / "ts", store, {"lm": store / "lm.mar"})
    try:
        ts.wait_ready(timeout=500)
        # the load line now, not only in the page: a run cut off by its time limit still shows
        # what the worker serves prompts with (graphs kept or not)
        print(next((ln.split("MODEL_LOG - ", 1)[1] for ln in ts.log().splitlines() if is_load_line(ln)),
                   "no load line"), flush=True)
        port, token = ts.ports["inf"], ts.key()
        prompts = make_prompts(args.vocab, args.prompt, max(counts))
        out = {"archive": r.stdout.strip().splitlines(), "archive_command": cmd[2:], "archive_s": archive_s,
               "frontend_warmup": warm_frontend(port, token, prompts[0], getattr(args, "frontend_warmup", 64)),
               "points": []}
        print(f"frontend warm-up: {out['frontend_warmup']}", flush=True)
        for n in counts:
            warm = time.time()  # warm-up rounds for --warmup seconds, at least one
            while True:
                one_point(pool, port, token, prompts, n, args.decode, 1)
                if time.time() - warm >= args.warmup:
                    break
            time.sleep(2.0)  # the warm-up's metrics flushed (each second) before they are read as the base
            before = worker_ttft(ts)  # None: no metrics to read, and no worker TTFT below
            point = one_point(pool, port, token, prompts, n, args.decode, args.rounds)
            time.sleep(2.0)  # the engine logs its turns when it goes idle; the metrics flush each second
            point["worker_ttft_ms_mean"], point["worker_ttft_count"] = (before and worker_ttft(ts, before)) or (None, 0)
            point["engine"] = next((ln.split("MODEL_LOG - ", 1)[1] for ln in reversed(ts.log().splitlines())
                                    if "continuous batching:" in ln), "")
            print({k: v for k, v in point.items() if k != "tokens"}, flush=True)
            out["points"].append(point)
        out["gpu_mib"] = {pid: mib for pid, mib in gpu_memory_mib().items() if pid != os.getpid()}  # the worker's
        log = ts.log()
        if args.log:
            Path(args.log).write_text(log)
        out["load_line"] = next((ln.split("MODEL_LOG - ", 1)[1] for ln in log.splitlines() if is_load_line(ln)), "")
        return out
    finally:
        ts.stop()


def page(report: dict) -> str:
    lines = page_head(report, "Continuous batching: a 0.5 B slot-form decoder, many streams on one cache")
    lines += [f"Model: {report['model']}.", "",
              "| concurrent streams | aggregate tokens/s | x one stream | TTFT p50 (ms) | TTFT p99 (ms) | "
              "inter-token p50 (ms) | inter-token p99 (ms) | x one stream's p99 |", "|---|---|---|---|---|---|---|---|"]
    one = report["points"][0]
    for p in report["points"]:
        lines.append(f"| {p['streams']} | {p['aggregate_tok_s']:.0f} | {p['aggregate_tok_s'] / one['aggregate_tok_s']:.2f} | "
                     f"{p['ttft_ms_p50']:.1f} | {p['ttft_ms_p99']:.1f} | {p['itl_ms_p50']:.2f} | {p['itl_ms_p99']:.2f} | "
                     f"{p['itl_ms_p99'] / one['itl_ms_p99']:.2f} |")
    t = report["targets"]
    lim = {x["streams"]: x for x in report.get("step_limits", [])}
    if lim:
        base = report["step_limits"][0]
        lines += ["", "The package's own decode step in one process, no server (the handler's runner and CUDA graphs, "
                      "rows at mid-sequence): the limit the GPU sets at each stream count, and what TorchServe served "
                      "of it:", "", "| streams | step ms | tokens/s | x one stream's | served / limit |", "|---|---|---|---|---|"]
        for p in report["points"]:
            x = lim.get(p["streams"])
            if x:
                lines.append(f"| {x['streams']} | {x['step_ms']:.3f} | {x['tok_s']:.0f} | "
                             f"{x['tok_s'] / base['tok_s']:.2f} | {p['aggregate_tok_s'] / x['tok_s']:.2f} |")
    lines += ["", "The engine's own account of each point (logged by the worker when it goes idle):", ""]
    lines += [f"- {p['streams']} streams: {p.get('engine', '')}" for p in report["points"]]
    lines += ["", f"Targets at 32 streams: aggregate >= 12x one stream's ({t['aggregate_x']:.2f}x: "
                  f"{'met' if t['aggregate_x'] >= 12 else 'NOT met'}); inter-token p99 <= 3x one stream's "
                  f"({t['itl_p99_x']:.2f}x: {'met' if t['itl_p99_x'] <= 3 else 'NOT met'}).", "",
              f"Greedy tokens of one stream alone and the same prompt among 32: {report['same_tokens']} "
              f"(first index where they differ: {report.get('first_difference')}).", "",
              f"GPU memory: {report['memory']}.", "", "Archive (cs-archive, no options):", ""]
    lines += [f"    {ln}" for ln in report["archive"]]
    lines += ["", f"Worker's load line: {report['load_line']}", ""]
    if "baseline" in report:
        lines += baseline_table(report)
    return "\n".join(lines)


def baseline_table(report: dict) -> list:
    """This run's points beside an earlier run's (--baseline): the same streams, other code."""
    b = report["baseline"]
    mine = {p["streams"]: p for p in report["points"]}
    lines = ["## Against the earlier code", "", f"Earlier run: `{b['command']}` ({b['date']}); its load line: "
             f"{b['load_line']}", "", "| streams | tokens/s earlier | tokens/s now | now / earlier | TTFT p99 earlier "
             "(ms) | TTFT p99 now | inter-token p99 earlier (ms) | inter-token p99 now |",
             "|---|---|---|---|---|---|---|---|"]
    for p in b["points"]:
        q = mine.get(p["streams"])
        if q:
            lines.append(f"| {p['streams']} | {p['aggregate_tok_s']:.0f} | {q['aggregate_tok_s']:.0f} | "
                         f"{q['aggregate_tok_s'] / p['aggregate_tok_s']:.2f} | {p['ttft_ms_p99']:.1f} | "
                         f"{q['ttft_ms_p99']:.1f} | {p['itl_ms_p99']:.2f} | {q['itl_ms_p99']:.2f} |")
    t = b["targets"]
    return lines + ["", f"Earlier targets at 32 streams: {t['aggregate_x']:.2f}x one stream's tokens/s, inter-token "
                        f"p99 {t['itl_p99_x']:.2f}x one stream's; greedy tokens alone and among 32 the same: "
                        f"{b.get('same_tokens')} (first difference: {b.get('first_difference')}).", ""]


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = report["points"]
    n = [p["streams"] for p in pts]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(n, [p["aggregate_tok_s"] for p in pts], "o-", label="served (continuous batching)")
    ax1.plot(n, [pts[0]["aggregate_tok_s"] * k for k in n], ":", label="one stream x N")
    ax1.set_xlabel("concurrent streams")
    ax1.set_ylabel("aggregate decode tokens/s")
    ax1.legend()
    ax2.plot(n, [p["itl_ms_p50"] for p in pts], "o-", label="inter-token p50")
    ax2.plot(n, [p["itl_ms_p99"] for p in pts], "s-", label="inter-token p99")
    ax2.set_xlabel("concurrent streams")
    ax2.set_ylabel("ms")
    ax2.legend()
    fig.suptitle(f"{report['model'][:80]} on {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]
    # The stream clients, forked now: before this process starts CUDA, and without importing
    # anything (spawned clients each imported torch while the first points ran: one stream's
    # first rounds went at a quarter of its later rate on an H100, GPU waits of 4 ms a token).
    clients = split_cores(args.client_cores)  # before the server starts: it inherits the other cores
    with mp.get_context("fork").Pool(max(counts), initializer=_pin, initargs=(clients,)) as pool, \
            tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        keep = Path(args.reuse) if args.reuse else work
        keep.mkdir(parents=True, exist_ok=True)
        program, pkg, params, cache, compile_s = package(args, keep)
        print(f"packaged {params / 1e9:.3f} B parameters, cache {cache / 2**20:.0f} MiB in {compile_s:.0f}s", flush=True)
        limits = step_limits(args, pkg, counts)
        ours = served(args, program, pkg, work, pool, counts)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    pts = ours["points"]
    by_n = {p["streams"]: p for p in pts}
    crowd = by_n.get(32, pts[-1])
    report = {**header(device, argv), "model": (
        f"Llama-architecture decoder in the slot form, {params / 1e9:.3f} B parameters (dim {args.dim}, {args.layers} "
        f"layers, {args.heads} heads, vocabulary {args.vocab}), fp16, {args.slots} slots of {args.max_seq} positions, "
        f"random weights; AOTInductor package compiled in {compile_s:.0f}s (0: reused); prompts {args.prompt} tokens, "
        f"{args.decode} new tokens per stream"),
        "points": [{k: v for k, v in p.items() if k != "tokens"} for p in pts],
        "targets": {"aggregate_x": crowd["aggregate_tok_s"] / pts[0]["aggregate_tok_s"],
                    "itl_p99_x": crowd["itl_ms_p99"] / pts[0]["itl_ms_p99"]},
        "step_limits": limits,
        "same_tokens": (pts[0]["tokens"][0] == crowd["tokens"][1]) if len(crowd["tokens"]) > 1 else None,
        # where they part: alone against among 32, and the crowd's two streams of one prompt
        "first_difference": ({"alone_vs_crowd": first_difference(pts[0]["tokens"][0], crowd["tokens"][1]),
                              "crowd_0_vs_1": first_difference(crowd["tokens"][0], crowd["tokens"][1])}
                             if len(crowd["tokens"]) > 1 else None),
        "memory": {"worker_mib": ours["gpu_mib"], "weights_mib": round(params * 2 / 2**20, 1),
                   "cache_mib": round(cache / 2**20, 1)},
        "archive": ours["archive"], "load_line": ours["load_line"], "frontend_warmup": ours.get("frontend_warmup")}
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
        report["baseline"] = {k: base.get(k) for k in ("command", "date", "points", "targets", "load_line",
                                                       "same_tokens", "first_difference")}
    write_pages(args.out + ".json", report, page(report))
    plot_or_say(plot, report, args.out, "bench.bench_slots")
    print(page(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
