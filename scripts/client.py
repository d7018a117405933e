#!/usr/bin/env python3
"""A small REST client for a served model: reads the token from key_file.json, sends a request
in one of the supported formats and prints the answer.

  python -m scripts.client --model NAME --example NAME:SHAPE:DTYPE [--example ...]
      [--format json|v1|v2|safetensors] [--url http://127.0.0.1:8080] [--key-file key_file.json]
      [--wait SECONDS] [--check-eager --factory FILE.py:FACTORY]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def inference_key(path: str) -> str:
    with open(path) as f:
        return json.load(f)["inference"]["key"]


def post(url: str, body: bytes, content_type: str, key: str, timeout=60):
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": content_type, "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--example", action="append", required=True, help="NAME:SHAPE:DTYPE, seeded random data")
    p.add_argument("--format", default="json", choices=("json", "v1", "v2", "safetensors"))
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--key-file", default="key_file.json")
    p.add_argument("--wait", type=float, default=0, help="seconds to wait for the model to answer")
    p.add_argument("--check-eager", action="store_true")
    p.add_argument("--factory", help="FILE.py:FACTORY for --check-eager")
    args = p.parse_args(argv)

    import torch

    from handlers import safetensors_io
    from handlers.dtypes import BY_TORCH
    from scripts.compile import example_inputs, load_factory, parse_input

    specs = [parse_input(e) for e in args.example]
    tensors = dict(zip([s.name for s in specs], example_inputs(specs, "cpu")))
    if args.format == "safetensors":
        body, ct = bytes(safetensors_io.dumps(tensors)), safetensors_io.CONTENT_TYPE
    elif args.format == "v2":
        body = json.dumps({"inputs": [{"name": n, "shape": list(t.shape), "datatype": BY_TORCH[t.dtype].v2,
                                       "data": t.reshape(-1).tolist()} for n, t in tensors.items()]}).encode()
        ct = "application/json"
    elif args.format == "v1":
        n = next(iter(tensors.values())).shape[0]
        inst = [{k: v[i].tolist() for k, v in tensors.items()} for i in range(n)]
        body, ct = json.dumps({"instances": inst}).encode(), "application/json"
    else:
        body = json.dumps({"inputs": {n: t.tolist() for n, t in tensors.items()}}).encode()
        ct = "application/json"
    url = f"{args.url}/predictions/{args.model}"
    deadline = time.time() + args.wait
    while True:
        try:
            key = inference_key(args.key_file) if os.path.exists(args.key_file) else ""
            status, rct, data = post(url, body, ct, key)
        except (urllib.error.URLError, OSError, ValueError) as e:
            status, rct, data = None, "", str(e).encode()
        # Not up yet, or the worker is still loading (AOTI load + warm-up): worth waiting for.
        if status in (None, 404, 503) and time.time() < deadline:
            time.sleep(2)
            continue
        break
    print(f"POST {url} -> HTTP {status} ({rct})")
    if status != 200:
        print(data.decode(errors="replace"))
        return 1
    if rct.startswith(safetensors_io.CONTENT_TYPE):
        outputs = safetensors_io.loads(data)
        for k, v in outputs.items():
            print(f"{k}: shape {list(v.shape)} {v.dtype}\n{v}")
    else:
        answer = json.loads(data)
        print(json.dumps(answer)[:2000])
        outputs = {k: torch.tensor(v) for k, v in answer.get("outputs", {}).items()} if args.format == "json" else {}
    if args.check_eager and outputs:
        model = load_factory(args.factory)()
        with torch.no_grad():
            ref = model(*tensors.values())
        ref = ref if isinstance(ref, dict) else {"output": ref}
        worst = max((outputs[k].float() - ref[k].float()).abs().max().item() for k in ref)
        top = {k: v.argmax(-1).tolist() for k, v in outputs.items()}
        print(f"predicted classes {top}; max |served - eager| = {worst:.2e} "
              f"({'OK' if worst < 1e-4 else 'MISMATCH'})")
        return 0 if worst < 1e-4 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
