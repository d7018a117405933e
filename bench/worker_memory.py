"""Where one GPU worker's device memory goes, step by step, no server: the handler's own
initialize and handle() (bench/bench.py's context), each configuration in a fresh process.

    python -m bench.worker_memory --artifact DIR --config own --config held \\
        --config "own_nographs:cuda_graphs=off" --config "own_ws4:env:CUBLAS_WORKSPACE_CONFIG=:4096:1" \\
        --out OUT.json

A configuration is NAME[:OPTION=VALUE,...][:env:K=V,...]; NAME own sets shared_weights=off,
held leaves the default (auto: a GPU worker attaches to the holder, which it starts). Steps: the
CUDA context (one tensor), the handler's initialize (load, warm-up), 24 requests of 1..16 rows
with pauses (graphs that wait for after ready are captured between them), then 3 s idle. At each:
the process's own device memory as nvidia-smi lists it (context and everything else), torch's
caching allocator's reserved and allocated bytes, and smi less reserved (what lives outside the
allocator: the context, loaded kernels, library handles, an AOTInductor library's own constants).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def smi_mib() -> dict:
    """{pid: MiB} of every process on the GPUs, as nvidia-smi lists them."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return {int(p): int(m) for p, m in (line.split(",") for line in out.splitlines() if line.strip())}


def child(artifact: str, opts: dict) -> None:
    import torch

    from bench.bench import new_handler, set_requests
    from handlers.artifact.metadata import read_spec
    from handlers.wire import safetensors_io

    rows = []

    def mark(step):
        torch.cuda.synchronize()
        r, a = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        apps = smi_mib()
        smi = apps.pop(os.getpid(), -1)
        rows.append({"step": step, "smi_mib": smi, "reserved_mib": round(r / 2**20), "allocated_mib": round(a / 2**20),
                     "outside_allocator_mib": smi - round(r / 2**20), "other_processes_mib": sum(apps.values())})

    torch.zeros(1, device="cuda")
    mark("context (one tensor)")
    spec = read_spec(artifact)
    h, ctx = new_handler(artifact, 0, opts, batch_size=16)
    mark("initialize (load, warm-up)")
    for i in range(24):
        rows_n = [1, 2, 4, 8, 16][i % 5]
        body = bytes(safetensors_io.dumps(spec.example(rows_n)))
        set_requests(ctx, [{"body": {"content-type": safetensors_io.CONTENT_TYPE}}])
        h.handle([{"body": body}], ctx)
        assert ctx.get_response_status(0)[0] in (None, 200), ctx.get_response_status(0)
        time.sleep(0.1)
    mark("24 requests of 1..16 rows")
    time.sleep(3)
    mark("3 s idle")
    print(json.dumps(rows), flush=True)


def parse_config(text: str) -> tuple:
    name, _, rest = text.partition(":")
    options, _, env = (":" + rest).partition(":env:")  # the leading ":" lets "env:..." alone match

    def pairs(s: str) -> dict:
        return dict(kv.partition("=")[::2] for kv in s.split(",") if kv)

    return name, {**({"shared_weights": "off"} if name.startswith("own") else {}), **pairs(options[1:])}, pairs(env)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True)
    p.add_argument("--config", action="append", default=[])
    p.add_argument("--out", default="")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.artifact, json.loads(args.child))
    result = {}
    for text in args.config or ["own", "held"]:
        name, opts, env = parse_config(text)
        cmd = [sys.executable, "-m", "bench.worker_memory", "--artifact", args.artifact, "--child", json.dumps(opts)]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
        try:
            rows = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            rows = [{"error": r.returncode, "stderr": r.stderr[-3000:]}]
        result[name] = {"options": opts, "env": env, "steps": rows}
        print(name, json.dumps(rows, indent=None), flush=True)
    if args.out:
        from bench.results_meta import header

        import torch

        with open(args.out, "w") as f:
            json.dump({**header(torch.cuda.get_device_name(0), argv, env=("PYTHONPYCACHEPREFIX",)), "configs": result},
                      f, indent=1)


if __name__ == "__main__":
    main()
