"""The KServe pod's routes beside direct TorchServe, in one run, on one pod:

  python -m bench.bench_pod --artifact DIR --factory examples/models.py:resnet50 \
      --out docs/results/pod_resnet50_fp16 [--clients 1,64] [--seconds 10] [--rounds 2]
      [--lengths uniform:16:128] [--archive-option=--handler-option=pad=...]

The artifact is archived with compiled_serving/archive.py (its defaults, plus any --archive-option), laid
out with compiled_serving/kserve.py and served by the pod as its container runs it (pod/local_pod.py:
kserve/entrypoint.sh -> pod/start.py: TorchServe on loopback, nginx, the gRPC bridge). The same
one-row requests then go, at each client count, by each route (ROUTES): straight to TorchServe's
inference port (what a TorchServe user gets) and through the pod's ports, in three encodings:
safetensors and the KServe v2 binary extension over REST, a ModelInferRequest with raw contents
over HTTP to TorchServe and over gRPC to the pod. Every answer is compared with the eager model
(bench/bench_load.py). Also one request at the artifact's largest batch by each pod route
(bytes through unchanged, answers equal eager). Writes OUT.json (device, date, torch, command
first), OUT.md (ratios pod / direct side by side) and OUT.png.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import native_load
from bench.bench_load import _mismatch, run_point
from pod.local_pod import LocalPod
from compiled_serving.local_server import ROOT
from bench.results_meta import header, page_head

# name: (where it is sent, path, body encoding); the pod's counterpart of each direct route is
# the pair's second entry (PAIRS)
ROUTES = {
    "direct_safetensors": ("direct", "/predictions/{m}", "safetensors"),
    "pod_safetensors": ("pod", "/v2/models/{m}/infer", "safetensors"),
    "direct_v2_binary": ("direct", "/predictions/{m}", "v2_binary"),
    "pod_v2_binary": ("pod", "/v2/models/{m}/infer", "v2_binary"),
    "direct_protobuf": ("direct", "/predictions/{m}", "protobuf"),
    "pod_grpc": ("grpc", "/inference.GRPCInferenceService/ModelInfer", "protobuf"),
}
PAIRS = (("direct_safetensors", "pod_safetensors"), ("direct_v2_binary", "pod_v2_binary"),
         ("direct_protobuf", "pod_grpc"))
MODEL = "m"
HEADERS = {"safetensors": {"Content-Type": "application/x-safetensors"},
           "protobuf": {"Content-Type": "application/x-kserve-v2-protobuf"}}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True)
    p.add_argument("--factory", required=True, help="FILE.py:FACTORY of the eager model (the reference)")
    p.add_argument("--out", required=True)
    p.add_argument("--clients", default="1,64")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup-seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=1, help="every other round in reverse route order")
    p.add_argument("--routes", default=",".join(ROUTES))
    p.add_argument("--distinct-inputs", type=int, default=8)
    p.add_argument("--lengths", default="")
    p.add_argument("--mask-inputs", default="")
    p.add_argument("--archive-option", action="append", default=[], metavar="=--FLAG=VALUE",
                   help="passed to compiled_serving/archive.py (e.g. --archive-option=--handler-option=pad=...)")
    p.add_argument("--pod-env", action="append", default=[], metavar="KEY=VALUE",
                   help="the pod's environment (e.g. GRPC_BRIDGE_PROCESSES=4, NGINX_WORKERS=4)")
    p.add_argument("--max-requests", type=int, default=500_000)
    p.add_argument("--loadgen-cores", type=int, default=2,
                   help="with --load-generator native: cores of its own for the load generator (the last N of "
                        "this process's; the pod and TorchServe run on the others, as with clients on other hosts); "
                        "0: shared")
    p.add_argument("--largest-rows", type=int, default=0,
                   help="rows of the one large request by each pod route (default: the artifact's largest batch)")
    p.add_argument("--load-generator", choices=("python", "native"), default="python",
                   help="python: bench/bench_load.py's clients, every answer checked; native: wrk (HTTP/1.1) "
                        "and h2load (gRPC), C clients (bench/native_load.py: $LOADGEN or on PATH), one body "
                        "per route, its answer checked by a real client before and after each point")
    return p.parse_args(argv)


def v2_binary(tensors: dict) -> tuple:
    """(body, headers) of a v2 binary-extension request asking for binary outputs."""
    from handlers.dtypes import BY_TORCH
    from handlers.wire import v2_binary as vb

    raws = [vb.raw_bytes(t) for t in tensors.values()]
    head = json.dumps({"inputs": [{"name": n, "shape": list(t.shape), "datatype": BY_TORCH[t.dtype].v2,
                                   "parameters": {"binary_data_size": len(r)}}
                                  for (n, t), r in zip(tensors.items(), raws)],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + b"".join(raws), {vb.HEADER: str(len(head))}


def protobuf(model: str, tensors: dict) -> bytes:
    """A ModelInferRequest (model_name 1; inputs 5: name 1, datatype 2, shape 3; raw_input_contents 7)."""
    from handlers import protowire
    from handlers.dtypes import BY_TORCH
    from handlers.wire import v2_binary as vb

    w = protowire.Writer()
    w.string(1, model)
    for n, t in tensors.items():
        tw = protowire.Writer()
        tw.string(1, n)
        tw.string(2, BY_TORCH[t.dtype].v2)
        tw.packed_varints(3, list(t.shape))
        w.message(5, tw.bytes())
    for t in tensors.values():
        w.bytes_field(7, vb.raw_bytes(t))
    return w.bytes()


def encodings(bodies: list) -> dict:
    """{encoding: (bodies, headers)} from the safetensors bodies of bench_e2e.references."""
    from safetensors.torch import load

    tensors = [load(b) for b in bodies]
    v2 = [v2_binary(t) for t in tensors]  # each with its own header length
    return {"safetensors": (bodies, HEADERS["safetensors"]), "v2_binary": ([b for b, _ in v2], [h for _, h in v2]),
            "protobuf": ([protobuf(MODEL, t) for t in tensors], HEADERS["protobuf"])}


def start_pod(args, work: Path) -> LocalPod:
    store, out = work / "store", work / "layout"
    store.mkdir()
    r = subprocess.run([sys.executable, "-m", "compiled_serving.archive", "--artifact", args.artifact, "--name", MODEL,
                        "--out", str(store), *args.archive_option], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"bench_pod: archive failed: {r.stderr or r.stdout}")
    print(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "", file=sys.stderr)
    r = subprocess.run([sys.executable, "-m", "compiled_serving.kserve", "--mar", str(store / f"{MODEL}.mar"),
                        "--storage-uri", "pvc://bench/pod", "--out", str(out), "--name", "bench"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"bench_pod: kserve layout failed: {r.stderr or r.stdout}")
    pod = LocalPod(out / "storage", work / "pod", env=dict(kv.split("=", 1) for kv in args.pod_env))
    pod.wait("ready", timeout=600)
    return pod


def route_target(pod: LocalPod, route: str) -> tuple:
    where, path, _ = ROUTES[route]
    url = {"direct": pod.direct, "pod": pod.base, "grpc": f"grpc://{pod.grpc_target}"}[where]
    return url, path.format(m=MODEL)


def measure(args, pod, route, clients, enc, refs, tol) -> dict:
    url, path = route_target(pod, route)
    kind = ROUTES[route][2]
    bodies, headers = enc[kind]
    if ROUTES[route][0] == "direct":  # TorchServe itself requires its inference key inside the pod
        auth = {"Authorization": f"Bearer {pod.inference_key()}"}
        headers = [{**h, **auth} for h in headers] if isinstance(headers, list) else {**(headers or {}), **auth}
    if args.load_generator == "native":
        return {"route": route, "clients": clients, **measure_native(args, url, path, bodies[0],
                                                                     headers, clients, (refs[0], tol, kind))}
    res = run_point(url, path, "", bodies, (refs, tol, kind), clients, args.seconds, args.warmup_seconds,
                    args.max_requests, headers=headers)
    return {"route": route, "clients": clients, **res}


def answer_ok(url: str, path: str, body: bytes, headers: dict, check: tuple) -> bool:
    """Whether one request by a real client answers 200 with outputs equal to the eager model's."""
    from urllib.parse import urlparse

    from bench.bench_load import Connection, GrpcConnection, build_request

    u = urlparse(url)
    if u.scheme == "grpc":
        conn = GrpcConnection(u.netloc, path)
        status, data = conn.exchange(body)
    else:
        conn = Connection(u.hostname, u.port)
        status, data = conn.exchange(build_request(u.hostname, u.port, path, headers, body))
    conn.close()
    return status == 200 and not _mismatch(data, *check)


def measure_native(args, url, path, body, headers, clients, check) -> dict:
    """One point by the C load generators on the first body; that body's answer checked by a real client
    before and after (they see HTTP statuses only, not the answer nor gRPC's status trailer)."""
    headers = headers[0] if isinstance(headers, list) else headers
    before = answer_ok(url, path, body, headers, check)
    res = native_load.run_point(url, path, body, headers, clients, args.seconds, args.warmup_seconds,
                                grpc=url.startswith("grpc://"), cores=args.loadgen_cpus)
    after = answer_ok(url, path, body, headers, check)
    res["checked_by"] = "one request by a real client before and after, compared with eager"
    res["mismatches"] = int(not before) + int(not after)
    return res


def largest(pod, spec, model, device, tol, rows: int = 0) -> list:
    """One request of `rows` rows (default: the artifact's largest batch) by each pod route, checked
    against eager."""
    import torch

    from handlers.run.padding import random_request
    from bench.bench_load import GrpcConnection

    sizes = {d: hi for d, (lo, hi) in spec.dims.items()}
    x = random_request(spec, sizes, torch.Generator().manual_seed(7), None, span=1_000_000)
    rows = rows or spec.batch_max
    x = {n: t.expand(rows, *t.shape[1:]).contiguous() for n, t in x.items()}
    with torch.inference_mode():
        y = model(*[x[s.name].to(device) for s in spec.inputs])
    y = y if isinstance(y, dict) else dict(zip(spec.output_names, y if isinstance(y, (tuple, list)) else [y]))
    ref = {k: v.float().cpu().numpy() for k, v in y.items()}
    mb = sum(t.numel() * t.element_size() for t in x.values()) / 2**20
    import requests

    out = []
    body, headers = v2_binary(x)
    r = requests.post(f"{pod.base}/v2/models/{MODEL}/infer", data=body, headers=headers, timeout=120)
    out.append({"route": "pod_v2_binary", "batch": rows, "request_mib": round(mb, 2), "status": r.status_code,
                "equal_eager": r.status_code == 200 and not _mismatch(r.content, ref, tol, "v2_binary")})
    status, reply = GrpcConnection(pod.grpc_target, ROUTES["pod_grpc"][1]).exchange(protobuf(MODEL, x))
    out.append({"route": "pod_grpc", "batch": rows, "request_mib": round(mb, 2), "status": status,
                "equal_eager": status == 200 and not _mismatch(reply, ref, tol, "protobuf")})
    return out


def summary(points: list) -> list:
    rows = []
    for clients in sorted({p["clients"] for p in points}):
        at = {p["route"]: p for p in points if p["clients"] == clients}
        for direct, via_pod in PAIRS:
            if direct in at and via_pod in at:
                d, v = at[direct], at[via_pod]
                rows.append({"clients": clients, "pod_route": via_pod, "direct_route": direct,
                             "pod_req_s": v["req_s"], "direct_req_s": d["req_s"],
                             "throughput_ratio": round(v["req_s"] / d["req_s"], 3) if d["req_s"] else None,
                             "p50_delta_ms": round(v["p50_ms"] - d["p50_ms"], 2)})
    return rows


def fronts_rss_mib(pod: LocalPod) -> dict:
    out = {}
    for p in pod.processes():
        cmd = " ".join(p.cmdline())
        key = "nginx" if "nginx" in p.name() else "grpc_bridge" if "pod.grpc_bridge" in cmd else \
            "status" if "pod.status" in cmd else None
        if key:
            out[key] = round(out.get(key, 0) + p.memory_info().rss / 2**20, 1)
    return out


def run(args, spec, device) -> dict:
    from bench import bench_e2e

    ns = argparse.Namespace(factory=args.factory, distinct_inputs=args.distinct_inputs, lengths=args.lengths,
                            mask_inputs=args.mask_inputs)
    bodies, refs, tol, _ = bench_e2e.references(ns, spec, device)
    enc = encodings(bodies)
    routes = [r for r in args.routes.split(",") if r]
    args.loadgen_cpus = native_load.split_cores(args.loadgen_cores if args.load_generator == "native" else 0)
    with tempfile.TemporaryDirectory(prefix="bench_pod_") as tmp:
        pod = start_pod(args, Path(tmp))
        try:
            points = []
            for rnd in range(args.rounds):
                for clients in [int(c) for c in args.clients.split(",")]:
                    for route in (routes if rnd % 2 == 0 else routes[::-1]):
                        points.append(dict(measure(args, pod, route, clients, enc, refs, tol), round=rnd))
                        print(f"bench_pod: {points[-1]['route']} x{clients}: {points[-1]['req_s']} req/s, "
                              f"p50 {points[-1]['p50_ms']} ms, errors {points[-1]['errors']}", file=sys.stderr)
            model = bench_e2e.load_factory(str(ROOT / args.factory))().eval().to(device)
            if any(s.dtype == "float16" for s in spec.inputs):
                model = model.half()
            big = largest(pod, spec, model, device, tol, args.largest_rows)
            rss = fronts_rss_mib(pod)
        finally:
            pod.stop()
    return {"points": combine(points), "largest": big, "fronts_rss_mib": rss, "tolerance": tol,
            "load_generator_cores": args.loadgen_cpus}


def combine(points: list) -> list:
    """Rounds of one (route, clients) point: req/s their mean (each kept), latency of the first."""
    out = {}
    for p in points:
        key = (p["route"], p["clients"])
        if key not in out:
            out[key] = dict(p, rounds_req_s=[p["req_s"]])
            out[key].pop("round", None)
        else:
            q = out[key]
            q["rounds_req_s"].append(p["req_s"])
            q["req_s"] = round(sum(q["rounds_req_s"]) / len(q["rounds_req_s"]), 1)
            q["errors"] += p["errors"]
            q["mismatches"] = (q["mismatches"] or 0) + (p["mismatches"] or 0)
    return list(out.values())


def write_markdown(path: Path, result: dict) -> None:
    lines = page_head(result, f"The KServe pod beside direct TorchServe: {result['model']}")
    lines += ["Archive defaults" + (f" plus `{' '.join(result['archive_options'])}`" if result["archive_options"] else "")
              + (f"; pod environment `{' '.join(result['pod_env'])}`" if result.get("pod_env") else "")
              + ("; one-row requests; every answer compared with the eager model" if result.get("load_generator") != "native"
                 else "; load by C clients (wrk for HTTP/1.1, h2load for gRPC), one one-row body per route, its answer compared with "
                      "the eager model by a real client before and after each point (mismatches counts those)"
                      + (f"; the load generator on cores {result['load_generator_cores']} of its own, TorchServe and the "
                         "pod on the others" if result.get("load_generator_cores") else ""))
              + ". `direct_*`: TorchServe's inference port; `pod_*`: nginx (REST and gRPC h2c).", "",
              "| route | clients | req/s | p50 ms | p99 ms | errors | mismatches |", "|---|---|---|---|---|---|---|"]
    for p in sorted(result["points"], key=lambda p: (p["clients"], p["route"])):
        per_round = f" ({' / '.join(map(str, p['rounds_req_s']))})" if len(p.get("rounds_req_s", [])) > 1 else ""
        lines.append(f"| {p['route']} | {p['clients']} | {p['req_s']}{per_round} | {p['p50_ms']} | {p['p99_ms']} | "
                     f"{p['errors']} | {p['mismatches']} |")
    lines += ["", "| clients | pod route | direct route | pod req/s | direct req/s | pod / direct | p50 pod - direct ms |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['clients']} | {r['pod_route']} | {r['direct_route']} | {r['pod_req_s']} | {r['direct_req_s']} | "
              f"{r['throughput_ratio']} | {r['p50_delta_ms']} |" for r in result["summary"]]
    lines += ["", "Largest batch by the pod's routes: " + "; ".join(
        f"{b['route']} batch {b['batch']} ({b['request_mib']} MiB): {b['status']}, equal to eager {b['equal_eager']}"
        for b in result["largest"]), "", f"Fronts' memory after the run (RSS MiB): {result['fronts_rss_mib']}", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    clients = sorted({r["clients"] for r in rows})
    fig, axes = plt.subplots(1, len(clients), figsize=(5.5 * len(clients), 4), squeeze=False)
    for ax, c in zip(axes[0], clients):
        at = [r for r in rows if r["clients"] == c]
        xs = range(len(at))
        ax.bar([x - 0.2 for x in xs], [r["direct_req_s"] for r in at], 0.4, label="direct TorchServe")
        ax.bar([x + 0.2 for x in xs], [r["pod_req_s"] for r in at], 0.4, label="through the pod")
        ax.set_xticks(list(xs), [r["pod_route"].removeprefix("pod_") for r in at])
        ax.set_ylabel("requests/s")
        ax.set_title(f"{result['model']}, {c} client(s)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    from_cli = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import torch

    from handlers.artifact.metadata import read_spec

    spec = read_spec(args.artifact)
    device = torch.device("cuda:0" if spec.device == "cuda" else "cpu")
    got = run(args, spec, device)
    name = Path(args.factory.rsplit(":", 1)[1]).name + f"_{spec.inputs[0].dtype}_{spec.backend}"
    gpu = torch.cuda.get_device_name(0) if spec.device == "cuda" else None
    import os

    result = {**header(gpu or f"CPU ({os.cpu_count()} cores)", None if from_cli else ["-m", "bench.bench_pod", *argv]),
              "model": name, "host_cores": os.cpu_count(), "archive_options": args.archive_option,
              "pod_env": args.pod_env, "load_generator": args.load_generator,
              "seconds": args.seconds, "rounds": args.rounds, **got, "summary": summary(got["points"])}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(out.with_suffix(".md"), result)
    plot(out.with_suffix(".png"), result)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
