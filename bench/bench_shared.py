"""One copy of the weights per GPU, held by the model's engine (issue 64: handler.engine, on a GPU
the default), measured through real TorchServe: the GPU memory of every process, throughput at
--clients, answers, kill -9 restarts of a worker and of the engine, and what is left after the
frontend stops. (Its earlier modes, issue 49's weights holder and each worker's own copy, went
with the per-worker GPU path, retired in issue 64.)

    python -m bench.bench_shared --artifact DIR --out docs/results/engine_memory_big_mlp_fp16_TAG

Modes (--modes, in order), each an archive with `--handler-option engine=on`:
  engine  --workers CPU-only workers fed to one engine process that owns the GPU; also the
          engine killed: seconds until a request is answered 200 again, and the statuses of the
          requests sent meanwhile
  engine_exec  the same with CS_PREFORK=off: every worker started by `python` itself (a killed
          worker's successor is otherwise forked from compiled_serving/prefork.py's warm process)
For each: nvidia-smi's memory.used on the GPU after READY less what it used before the server
started, and each process's own (--query-compute-apps: the workers, the engine); the SHA-256 of
the answer to one fixed request sent 12 times by one client (one request per batch, so the same
kernels every time: equal hashes are bit-identical answers across workers and modes); --clients
Python clients for --seconds (bench/bench_load.py); --restarts kills of one worker (seconds to
READY again, the new worker's start by step: bench/bench_start.py); then every worker killed at
once (seconds to the first answer and to all READY); and the engines and prefork's warm processes
left 5 s after the frontend's SIGTERM (what `torchserve --stop` sends). Also the memory of a bare
CUDA context (a process that made one tensor), which every process holding one pays.
Writes OUT.json (device, date, torch, command first) and OUT.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from bench import bench_load
from bench.bench_e2e import archive_ours
from bench.bench_start import kill_all, ready, restart_once, start_steps, wait_until
from bench.results_meta import header, page_head
from compiled_serving.local_server import LocalTorchServe

# each mode's environment for the server; engine_exec: every worker started by `python` itself,
# as before compiled_serving/prefork.py, whose restarted workers are forked
MODES = {"engine": {}, "engine_exec": {"CS_PREFORK": "off"}}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", help="directory written by compiled_serving/compile.py")
    p.add_argument("--modes", default="engine", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--gpu", type=int, default=0, help="the GPU; -1: CPU workers and the engine on the CPU, no "
                   "memory figures: a smoke run of the flow")
    p.add_argument("--clients", type=int, default=64, help="clients of the throughput point (0: none)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--restarts", type=int, default=3, help="kills of one worker per mode")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-batch-delay", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", required=True, help="results path without extension")
    p.add_argument("--render", action="store_true", help="only write OUT.md and OUT.png again from OUT.json")
    args = p.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown and not args.render:
        p.error(f"--modes: unknown {', '.join(sorted(unknown))} (the modes: {', '.join(MODES)})")
    return args


def smi(query: list) -> list:
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                         text=True, timeout=30).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def device_used(gpu: int) -> int:
    return int(smi(["--query-gpu=memory.used", "-i", str(gpu)])[0][0]) if gpu >= 0 else 0


def per_process() -> dict:
    try:
        return {int(p): int(m) for p, m in smi(["--query-compute-apps=pid,used_memory"]) if m.isdigit()}
    except OSError:  # no nvidia-smi: a CPU smoke run
        return {}


def engines(workdir: Path) -> list:
    """Pids of this server's engines (handlers.engine.serve; their socket lies under its TMPDIR)."""
    out = subprocess.run(["pgrep", "-af", "handlers.engine.serve"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if str(workdir / "tmp") in line]


def kill_engine(server, name: str, body: bytes, ct: str, timeout: float) -> dict:
    """kill -9 of the model's engine: seconds until a request is answered 200 again (the workers
    start a successor), and the statuses the requests sent meanwhile got (one client)."""
    (victim,) = engines(server.workdir)
    t0, statuses = time.perf_counter(), {}
    os.kill(victim, signal.SIGKILL)
    while time.perf_counter() - t0 < timeout:
        req = urllib.request.Request(f"{server.base}/predictions/{name}", data=body, method="POST",
                                     headers={**server.auth(), "Content-Type": ct})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        statuses[status] = statuses.get(status, 0) + 1
        if status == 200:
            break
        time.sleep(0.05)
    return {"kill_to_answer_s": round(time.perf_counter() - t0, 3), "statuses": statuses,
            "successor": engines(server.workdir)}


def context_mib(gpu: int) -> int:
    """A bare CUDA context's memory: a process that made one tensor on the GPU."""
    code = f"import torch,sys; torch.empty(1, device='cuda:{gpu}'); print('up', flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        time.sleep(1)
        return per_process().get(proc.pid, -1)
    finally:
        proc.kill()
        proc.wait()


def answer_hashes(server, name: str, body: bytes, ct: str, n: int = 12, retry: dict | None = None) -> list:
    """SHA-256 (16 hex) of the answers to `body` sent n times by one client, distinct values. With
    `retry` (after a kill), a 503 (retryable) is sent again after 0.1 s for up to 30 s, and
    `retry` gets how many were and the seconds until the n-th answer."""
    seen, t0, retried = set(), time.perf_counter(), 0
    for _ in range(n):
        while True:
            req = urllib.request.Request(f"{server.base}/predictions/{name}", data=body, method="POST",
                                         headers={**server.auth(), "Content-Type": ct})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    seen.add(hashlib.sha256(r.read()).hexdigest()[:16])
                break
            except urllib.error.HTTPError as e:
                if retry is None or e.code != 503 or time.perf_counter() - t0 > 30:
                    raise
                retried += 1
                time.sleep(0.1)
    if retry is not None:
        retry.update(retried_503=retried, all_answered_s=round(time.perf_counter() - t0, 3))
    return sorted(seen)


def measure(args, mode: str, store: Path, work: Path, body: bytes, ct: str) -> dict:
    n = args.workers
    archive_ours(SimpleNamespace(artifact=args.artifact, batch_size=args.batch_size,
                                 max_batch_delay=args.max_batch_delay), store, mode, n,
                 [args.gpu] if args.gpu >= 0 else [], ["--handler-option", "engine=on"])
    before = device_used(args.gpu)
    t0 = time.perf_counter()
    server = LocalTorchServe(work / mode, store, {mode: store / f"{mode}.mar"}, env={**os.environ, **MODES[mode]})
    point = {"mode": mode, "workers": n, "env": MODES[mode]}
    try:
        wait_until(lambda: ready(server, mode, n), args.timeout)
        point["start_to_all_ready_s"] = round(time.perf_counter() - t0, 3)
        wait_until(lambda: len(start_steps(server.log())) >= n, 30)
        point["answers_sha256"] = answer_hashes(server, mode, body, ct)
        point.update(memory(args, server, mode, before))
        if args.clients:
            token = server.key()
            r = bench_load.run_point(server.base, f"/predictions/{mode}", token, [body], None, args.clients,
                                     args.seconds, 2.0, 1_000_000)
            point["load"] = {k: r.get(k) for k in ("req_s", "p50_ms", "p99_ms", "errors", "cpu_cores")}
        point["restarts"] = [restart_once(server, mode, n, body, ct, args.timeout) for _ in range(args.restarts)]
        point["kill_all"] = kill_all(server, mode, n, body, ct, args.timeout)
        if mode == "engine":
            point["engine_kill"] = kill_engine(server, mode, body, ct, args.timeout)
        point["after_kills"] = {}  # a worker may reach the engine's successor after another has answered
        point["answers_sha256_after_kills"] = answer_hashes(server, mode, body, ct, retry=point["after_kills"])
        point["load_lines"] = [line for line in server.log().splitlines() if "served by the engine" in line][-2:]
    finally:
        keep_logs(args, server, mode)
        server.stop()
    t1 = time.perf_counter()
    while (engines(work / mode) or zygotes()) and time.perf_counter() - t1 < 5:
        time.sleep(0.1)
    point["engines_left_5s_after_stop"] = len(engines(work / mode))
    point["zygotes_left_5s_after_stop"] = len(zygotes())
    return point


def zygotes() -> list:
    """Pids of compiled_serving/prefork.py's warm processes, of any server."""
    out = subprocess.run(["pgrep", "-af", "prefork.py --zygote"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "pgrep" not in line]


def keep_logs(args, server, mode: str) -> None:
    """The server's model log and its engines' logs, beside the results (OUT_logs/MODE/)."""
    d = Path(f"{args.out}_logs") / mode
    d.mkdir(parents=True, exist_ok=True)
    (d / "model_log.log").write_text(server.log())
    (d / "ts_log.log").write_text(server.log("logs/ts_log.log"))
    for f in (server.workdir / "tmp" / "compiled-serving" / "engines").glob("*.log"):
        (d / f"engine_{f.name}").write_text(f.read_text(errors="replace"))


def memory(args, server, mode: str, before: int) -> dict:
    workers = {w.get("pid") for w in server.workers(mode, timeout=5)}
    engine = set(engines(server.workdir))
    procs = per_process()
    return {"device_used_mib": device_used(args.gpu) - before,
            "workers_mib": sorted(m for p, m in procs.items() if p in workers),
            "engines_mib": sorted(m for p, m in procs.items() if p in engine),
            "processes_seen": len(procs)}


def summarize(points: dict, context: int) -> dict:
    out = {"cuda_context_mib": context, **engine_summary(points)}
    hashes = {h for p in points.values() for h in p["answers_sha256"] + p["answers_sha256_after_kills"]}
    out["answers_bit_identical"] = len(hashes) == 1
    for m, p in points.items():
        out[f"{m}_restart_to_ready_s"] = [r["kill_to_ready_s"] for r in p["restarts"]]
        out[f"{m}_kill_all_to_first_answer_s"] = p["kill_all"]["kill_to_first_answer_s"]
    return out


def engine_summary(points: dict) -> dict:
    """Issue 64's keys where the engine mode ran: its GPU memory, its workers holding GPU memory
    (none is right), a worker's and the engine's restart."""
    e = points.get("engine")
    if not e:
        return {}
    out = {"gpu_mib_all_processes": e["device_used_mib"], "engine_workers_with_gpu_memory": len(e["workers_mib"]),
           "worker_restart_s": max(r["kill_to_ready_s"] for r in e["restarts"]),
           "engine_restart_s": e["engine_kill"]["kill_to_answer_s"]}
    if "engine_exec" in points:  # the same, every worker started by `python` (no prefork)
        out["worker_restart_exec_s"] = max(r["kill_to_ready_s"] for r in points["engine_exec"]["restarts"])
    return out


def write_markdown(path: Path, result: dict) -> None:
    s, pts = result["summary"], result["points"]
    lines = [*page_head(result, "One copy of the weights per GPU, in the engine: memory, throughput, restarts",
                        f"Artifact: {result['artifact']}."),
             "| mode | workers | device MiB | worker MiB | engine MiB | req/s | kill -9 one: to READY s | "
             "kill all: first answer s | engines left after stop |", "|---|---|---|---|---|---|---|---|---|"]
    for m, p in pts.items():
        lines.append(f"| {m} | {p['workers']} | {p['device_used_mib']} | {', '.join(map(str, p['workers_mib'])) or '-'} | "
                     f"{', '.join(map(str, p['engines_mib'])) or '-'} | {(p.get('load') or {}).get('req_s', '-')} | "
                     f"{', '.join(str(r['kill_to_ready_s']) for r in p['restarts'])} | "
                     f"{p['kill_all']['kill_to_first_answer_s']} | {p['engines_left_5s_after_stop']} |")
    lines += ["", "Summary: " + ", ".join(f"{k} {v}" for k, v in s.items()), ""]
    imports = result.get("imports")
    if imports:  # what a fresh worker process imports before the handler starts
        lines += ["## Imports of a fresh process", "", f"Command: `{imports['command']}` ({imports['note']}).", "",
                  "| import | wall s |", "|---|---|", *(f"| `{k}` | {v} |" for k, v in imports["wall_s"].items()), ""]
    lines += [f"![memory and restarts]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(list(pts), [p["device_used_mib"] for p in pts.values()], color="tab:blue")
    a.set_ylabel("GPU memory of the server's processes, MiB")
    a.set_title("memory after READY")
    for i, p in enumerate(pts.values()):
        b.scatter([i] * len(p["restarts"]), [r["kill_to_ready_s"] for r in p["restarts"]], color="tab:orange",
                  label="kill -9 one: to READY" if i == 0 else None)
        b.scatter([i], [p["kill_all"]["kill_to_first_answer_s"]], color="tab:red", marker="x",
                  label="kill -9 all: to first answer" if i == 0 else None)
    b.axhline(5, color="gray", linestyle="--", linewidth=1)
    b.set_xticks(range(len(pts)), list(pts))
    b.set_ylabel("seconds")
    b.set_title("restarts (target 5 s)")
    b.legend()
    fig.suptitle(f"{result['device']}, {result['artifact'].split(' (')[0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        out = Path(args.out)
        result = json.loads(out.with_suffix(".json").read_text())
        write_markdown(out.with_suffix(".md"), result)
        return plot(out.with_suffix(".png"), result)
    # `timeout`'s SIGTERM as an exception: the server is stopped and its logs kept (finally blocks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    from handlers.artifact.metadata import read_spec
    from handlers.wire import safetensors_io

    spec = read_spec(args.artifact)
    body = bytes(safetensors_io.dumps(spec.example(spec.batch_min)))
    points = {}
    with tempfile.TemporaryDirectory(prefix="bench_shared_") as tmp:
        work = Path(tmp)
        (work / "store").mkdir()
        context = context_mib(args.gpu) if args.gpu >= 0 else 0
        for mode in args.modes.split(","):
            points[mode] = measure(args, mode, work / "store", work, body, safetensors_io.CONTENT_TYPE)
            print(json.dumps(points[mode]), flush=True)
            result = {**header(torch.cuda.get_device_name(args.gpu) if args.gpu >= 0 else "cpu", argv,
                                 env=("PYTHONPYCACHEPREFIX",)),
                      "artifact": f"{spec.backend} {', '.join(s.describe() for s in spec.inputs)}",
                      "summary": summarize(points, context), "points": points}
            write(Path(args.out), result)  # after every mode: a run cut short keeps what it measured
    print(json.dumps(result["summary"], indent=1))


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(out.with_suffix(".md"), result)
    plot(out.with_suffix(".png"), result)


if __name__ == "__main__":
    main()
