"""How long a worker takes to serve: at TorchServe's start (1 and N workers) and after a worker
is killed (kill -9, as a device fault, an OOM kill or a crash ends one), through real TorchServe
started from the shipped config.

    python -m bench.bench_start --artifact DIR --workers 1,6 --restarts 3 --out docs/results/start_TAG.json

For each worker count: the seconds from `torchserve --start` until every worker is READY, and each
worker's own start, step by step, as its load line gives it (the process's age when the handler
began -- interpreter, TorchServe's and torch's imports, the load message -- then its steps: on a
GPU, a worker served by the engine (handlers/engine_worker.py): variant, load (its connection to
the engine, the first worker's start of it with the engine's load, warm-up and CUDA graphs),
request-path warm-up; on the CPU, handlers/startup.py's: variant, trial load, load, warm-up,
CUDA graphs (no work there), request-path warm-up). Then `--restarts` times: one worker killed
with SIGKILL, and the seconds until TorchServe lists the model's workers READY again, until a
request is answered 200 (with one worker, nothing else can answer it), and the new worker's own
start. Writes OUT.json (device, date, torch, command first), OUT.md and OUT.png beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import signal
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from bench.bench_e2e import archive_ours, imported
from compiled_serving.local_server import LocalTorchServe
from bench.results_meta import header, page_head

START_LINE = re.compile(r"started in ([0-9.]+)s(?: since the process began)? \(([^)]*)\)")
POLL_S = 0.05
# TorchServe 0.12's frontend logs this once for each worker whose connection ends, a kill -9
# included (tests/test_bench_start.py); "Worker died", counted before, never followed a kill
DISCONNECTED = "Worker disconnected."


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="directory written by compiled_serving/compile.py, or a "
                   "user's .pt2 file (imported as cs-archive imports it)")
    p.add_argument("--program", default=None, help="with a .pt2 package: the exported program it came from "
                   "(the archive tries padding on it)")
    p.add_argument("--workers", default="1,6", help="worker counts to start, one server each")
    p.add_argument("--restarts", type=int, default=3, help="workers killed (SIGKILL) per server, one at a time")
    p.add_argument("--kill-all", action="store_true", help="after the restarts, every worker killed at once: "
                   "seconds to the first answer and to all READY")
    p.add_argument("--gpu", type=int, default=None, help="GPU id the workers use (default: 0 where CUDA is, else CPU)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-batch-delay", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for READY")
    p.add_argument("--out", required=True, help="results JSON path (Markdown and plot beside it)")
    return p.parse_args(argv)


def start_steps(log: str) -> list:
    """[{step: seconds, "total": seconds}] of every load line in `log`, in order."""
    out = []
    for m in START_LINE.finditer(log):
        steps = {}
        for part in m.group(2).split(", "):
            name, _, secs = part.rpartition(" ")
            if secs.endswith("s"):
                steps[name] = float(secs[:-1])
        out.append({**steps, "total": float(m.group(1))})
    return out


def answered(server, name: str, body: bytes, content_type: str) -> bool:
    req = urllib.request.Request(f"{server.base}/predictions/{name}", data=body, method="POST",
                                 headers={**server.auth(), "Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):
        return False


def wait_until(cond, timeout: float) -> float:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"not reached in {timeout}s")
        time.sleep(POLL_S)
    return time.perf_counter() - t0


def ready(server, name: str, n: int, exclude=()) -> bool:
    ws = server.workers(name, timeout=5)
    return (len(ws) == n and all(w.get("status") == "READY" for w in ws)
            and not any(w.get("pid") in exclude for w in ws))


def restart_once(server, name: str, n: int, body: bytes, content_type: str, timeout: float) -> dict:
    """Kill one READY worker; seconds until all n are READY again (and, with one worker, until
    a request is answered), and the new worker's own start from its load line."""
    log_at = len(server.log())
    pids = [w.get("pid") for w in server.workers(name, timeout=5)]
    victim = next((p for p in pids if isinstance(p, int) and p > 1), None)
    if victim is None:  # never kill(-1) or kill(0): they would reach other processes
        raise SystemExit(f"{name}: no worker pid to kill in the management API's answer ({pids})")
    t0 = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    out, first = {}, {}

    def both() -> bool:
        # one loop for both, each time taken when its call returns (a request sent while no
        # worker is up waits in TorchServe's queue and returns once the new worker answers it)
        if "ready" not in first and ready(server, name, n, exclude={victim}):
            first["ready"] = time.perf_counter() - t0
        if n == 1 and "answer" not in first and answered(server, name, body, content_type):
            first["answer"] = time.perf_counter() - t0
        return "ready" in first and (n != 1 or "answer" in first)

    wait_until(both, timeout)
    out["kill_to_ready_s"] = round(first["ready"], 3)
    if n == 1:
        out["kill_to_answer_s"] = round(first["answer"], 3)
    wait_until(lambda: start_steps(server.log()[log_at:]), 30)  # the load line follows READY closely
    out["worker_start"] = start_steps(server.log()[log_at:])[-1]
    return out


def kill_all(server, name: str, n: int, body: bytes, ct: str, timeout: float) -> dict:
    """Every worker of `name` killed with SIGKILL at once: seconds to the first answer 200 and
    to all `n` READY again (none of the killed)."""
    pids = [w.get("pid") for w in server.workers(name, timeout=5)]
    pids = [p for p in pids if isinstance(p, int) and p > 1]
    t0 = time.perf_counter()
    for p in pids:
        os.kill(p, signal.SIGKILL)
    first = wait_until(lambda: answered(server, name, body, ct), timeout)
    wait_until(lambda: ready(server, name, n, exclude=set(pids)), timeout)
    return {"killed": len(pids), "kill_to_first_answer_s": round(first, 3),
            "kill_to_all_ready_s": round(time.perf_counter() - t0, 3)}


def measure(args, n: int, store: Path, work: Path, body: bytes, content_type: str, index: int = 0) -> dict:
    device_ids = [args.gpu] if args.gpu is not None else []
    name = f"start{n}_{index}"  # a server of its own per entry of --workers (a count may repeat: cold starts)
    archive_ours(SimpleNamespace(artifact=args.artifact, batch_size=args.batch_size,
                                 max_batch_delay=args.max_batch_delay), store, name, n, device_ids)
    t0 = time.perf_counter()
    server = LocalTorchServe(work / name, store, {name: store / f"{name}.mar"})
    try:
        wait_until(lambda: ready(server, name, n), args.timeout)
        all_ready = time.perf_counter() - t0
        wait_until(lambda: len(start_steps(server.log())) >= n, 30)
        point = {"workers": n, "torchserve_start_to_all_ready_s": round(all_ready, 3),
                 "worker_start": start_steps(server.log())[:n], "restarts": []}
        if not answered(server, name, body, content_type):
            raise SystemExit(f"{name}: a request was not answered 200: {server.log()[-3000:]}")
        for _ in range(args.restarts):
            point["restarts"].append(restart_once(server, name, n, body, content_type, args.timeout))
        if args.kill_all:
            point["kill_all"] = kill_all(server, name, n, body, content_type, args.timeout)
        # workers that died on their own (the restarts above kill one each on purpose), and
        # loads TorchServe reported as out of memory (its answer to any exception at load)
        logs = server.log("logs/ts_log.log") + server.log()
        planned = len(point["restarts"]) + point.get("kill_all", {}).get("killed", 0)
        point["unplanned_worker_deaths"] = logs.count(DISCONNECTED) - planned
        point["load_reported_oom"] = logs.count("System out of memory")
        return point
    finally:
        server.stop()


def summarize(points: list) -> dict:
    def med(xs):
        return round(statistics.median(xs), 3) if xs else None

    one = next((p for p in points if p["workers"] == 1), None)
    out = {}
    for p in points:
        starts = [w["total"] for w in p["worker_start"]]
        rs = p["restarts"]
        out[str(p["workers"])] = {
            "slowest_worker_start_s": round(max(starts), 3) if starts else None,
            "median_worker_start_s": med(starts),
            "median_kill_to_ready_s": med([r["kill_to_ready_s"] for r in rs]),
            "median_kill_to_answer_s": med([r["kill_to_answer_s"] for r in rs if "kill_to_answer_s" in r]),
            "median_restarted_worker_start_s": med([r["worker_start"]["total"] for r in rs]),
            "kill_all_to_first_answer_s": (p.get("kill_all") or {}).get("kill_to_first_answer_s"),
            "slowest_over_one_worker": (round(max(starts) / one["worker_start"][0]["total"], 3)
                                        if one and one["worker_start"] and starts else None),
        }
    return out


def write_markdown(path: Path, result: dict) -> None:
    lines = page_head(result, "Worker start and restart through TorchServe",
                      f"Artifact: {result['artifact']}.")
    lines += [("| workers | torchserve start to all READY (s) | slowest worker's start (s) | over one worker | "
               "kill -9 to READY again (s, median) | kill -9 to an answer (s, median) | restarted worker's own start (s) |"),
              "|---|---|---|---|---|---|---|"]
    killed = [p for p in result["points"] if p.get("kill_all")]
    for n, s in result["summary"].items():
        p = next(p for p in result["points"] if str(p["workers"]) == n)
        lines.append(f"| {n} | {p['torchserve_start_to_all_ready_s']} | {s['slowest_worker_start_s']} | "
                     f"{s['slowest_over_one_worker']} | {s['median_kill_to_ready_s']} | "
                     f"{s['median_kill_to_answer_s'] if s['median_kill_to_answer_s'] is not None else '-'} | "
                     f"{s['median_restarted_worker_start_s']} |")
    lines += [f"\nAll {p['workers']} workers killed at once: the first answer after "
              f"{p['kill_all']['kill_to_first_answer_s']} s, all READY after {p['kill_all']['kill_to_all_ready_s']} s."
              for p in killed]
    steps = _step_names(result)
    lines += ["", "Each worker's start, step by step (seconds; the load line's breakdown):", "",
              "| workers | worker | " + " | ".join(steps) + " | total |", "|---" * (len(steps) + 3) + "|"]
    for p in result["points"]:
        rows = [(f"start {i}", w) for i, w in enumerate(p["worker_start"])]
        rows += [(f"restart {i}", r["worker_start"]) for i, r in enumerate(p["restarts"])]
        for label, w in rows:
            lines.append(f"| {p['workers']} | {label} | " + " | ".join(f"{w.get(s, 0):.2f}" for s in steps)
                         + f" | {w['total']:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def _step_names(result: dict) -> list:
    names = []
    for p in result["points"]:
        for w in p["worker_start"] + [r["worker_start"] for r in p["restarts"]]:
            names += [k for k in w if k != "total" and k not in names]
    return names


def plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _step_names(result)
    bars = []
    for p in result["points"]:
        slowest = max(p["worker_start"], key=lambda w: w["total"])
        bars.append((f"{p['workers']} worker(s):\nslowest start", slowest))
        if p["restarts"]:
            bars.append((f"{p['workers']} worker(s):\na restart", p["restarts"][-1]["worker_start"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    left = [0.0] * len(bars)
    for s in steps:
        widths = [w.get(s, 0.0) for _, w in bars]
        ax.barh([b for b, _ in bars], widths, left=left, label=s)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds")
    ax.set_title(f"Worker start by step ({result['device']})")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parse_args(argv)
    import torch

    from handlers.artifact.metadata import read_spec
    from handlers.wire import safetensors_io

    if args.gpu is None and torch.cuda.is_available():
        args.gpu = 0
    device = torch.cuda.get_device_name(args.gpu) if args.gpu is not None else "cpu"
    points = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench_start_") as tmp:
        imported(args, stack)  # a user's .pt2 file: imported as the archive imports it
        spec = read_spec(args.artifact)
        body = bytes(safetensors_io.dumps(spec.example(spec.batch_min)))
        work = Path(tmp)
        (work / "store").mkdir()
        for i, n in enumerate(int(x) for x in args.workers.split(",")):
            points.append(measure(args, n, work / "store", work, body, safetensors_io.CONTENT_TYPE, i))
            print(json.dumps(points[-1]), flush=True)
    result = {**header(device, argv, env=("PYTHONPYCACHEPREFIX",)),
              "artifact": f"{spec.backend} {', '.join(s.describe() for s in spec.inputs)}",
              "summary": summarize(points), "points": points}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(out.with_suffix(".md"), result)
    plot(out.with_suffix(".png"), result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
