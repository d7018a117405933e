#!/usr/bin/env python3
"""Soak a running TorchServe with concurrent requests; every output is compared with its own
reference computed in this process by the eager model on the GPU's default stream.

  python -m bench.soak --model NAME=FILE.py:FACTORY:CxHxW:MAXROWS:DTYPE [--model ...]
      --requests N --concurrency C [--url URL] [--key-file key_file.json] [--out soak.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--requests", type=int, default=200, help="per model")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--key-file", default="key_file.json")
    p.add_argument("--out")
    return p


def soak_model(item, args, key, dev) -> dict:
    """Send one model --requests requests from --concurrency threads, each answer checked
    against eager; the counts."""
    import requests
    import torch

    from handlers.wire import safetensors_io
    from compiled_serving.compile import load_factory

    lock = threading.Lock()
    name, ref = item.split("=", 1)
    path, factory, chw, max_rows, dtype = ref.rsplit(":", 4)
    dt = getattr(torch, dtype)
    eager = load_factory(f"{path}:{factory}")().to(dev)
    if dt == torch.float16:
        eager = eager.half()
    shape = tuple(int(x) for x in chw.split("x"))
    stats = {"model": name, "dtype": dtype, "input_chw": list(shape), "requests": 0, "ok": 0,
             "mismatches": 0, "all_zero_outputs": 0, "http_errors": 0, "max_rel_err": 0.0}

    def one(i):
        g = torch.Generator().manual_seed(i)
        rows = 1 + i % int(max_rows)
        x = torch.randn((rows,) + shape, generator=g).to(dt)
        r = requests.post(f"{args.url}/predictions/{name}", data=bytes(safetensors_io.dumps({"image": x})),
                          headers={"Authorization": f"Bearer {key}",
                                   "Content-Type": safetensors_io.CONTENT_TYPE}, timeout=300)
        with lock:
            stats["requests"] += 1
            if r.status_code != 200:
                stats["http_errors"] += 1
                return
            out = next(iter(safetensors_io.loads(r.content).values())).float()
            with torch.no_grad():
                ref_out = eager(x.to(dev)).float().cpu()
            rel = ((out - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-6)).item()
            stats["max_rel_err"] = max(stats["max_rel_err"], rel)
            if not out.abs().sum().item():
                stats["all_zero_outputs"] += 1
            elif out.shape != ref_out.shape or rel > (2e-2 if dt == torch.float16 else 1e-4):
                stats["mismatches"] += 1
            else:
                stats["ok"] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, range(args.requests)))
    stats["wall_s"] = round(time.perf_counter() - t0, 2)
    return stats


def main(argv=None):
    args = build_parser().parse_args(argv)

    import torch

    key = json.load(open(args.key_file))["inference"]["key"]
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    from bench.results_meta import header

    report = {**header(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                       None if argv is None else ["-m", "bench.soak", *argv]),
              "concurrency": args.concurrency, "models": []}
    for item in args.model:
        stats = soak_model(item, args, key, dev)
        print(json.dumps(stats), flush=True)
        report["models"].append(stats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    bad = sum(m["mismatches"] + m["all_zero_outputs"] + m["http_errors"] for m in report["models"])
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
