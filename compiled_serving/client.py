#!/usr/bin/env python3
"""A small REST client for a served model: reads the token from key_file.json, sends a request
in one of the supported formats and prints the answer.

  python -m compiled_serving.client --model NAME --example NAME:SHAPE:DTYPE [--example ...]
      [--format json|v1|v2|safetensors] [--url http://127.0.0.1:8080] [--key-file key_file.json]
      [--wait SECONDS] [--check-eager --factory FILE.py:FACTORY]

The token comes from --key-file, else key_file.json in this directory, else in the repository
root (where scripts/quickstart.sh starts TorchServe, which writes the file into the directory
it was started from). --check-eager compares the answer of every format with eager PyTorch.
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


def find_key_file(explicit):
    """The key file to read, or None (with a hint on stderr)."""
    if explicit and not os.path.exists(explicit):  # named, so meant: never send without its token
        raise SystemExit(f"client: error: --key-file {explicit}: no such file. TorchServe writes key_file.json "
                         "into the directory it was started from")
    candidates = [explicit] if explicit else ["key_file.json", os.path.join(ROOT, "key_file.json")]
    for c in candidates:
        if os.path.exists(c):
            return c
    print(f"client: no key file at {' or '.join(candidates)}; sending no token. TorchServe writes "
          "key_file.json into the directory it was started from: pass --key-file PATH", file=sys.stderr)
    return None


def outputs_of(answer: dict, fmt: str) -> dict:
    """{output name: tensor} from a JSON answer in any of our JSON formats."""
    import torch

    if fmt == "v2":
        return {o["name"]: torch.tensor(o["data"]).reshape(o["shape"]) for o in answer.get("outputs", [])}
    if fmt == "v1":
        preds = answer.get("predictions", [])
        if preds and isinstance(preds[0], dict):
            return {k: torch.tensor([p[k] for p in preds]) for k in preds[0]}
        return {"output": torch.tensor(preds)}
    return {k: torch.tensor(v) for k, v in answer.get("outputs", {}).items()}


def _tensor(name: str, value):
    import numpy as np
    import torch
    try:
        return torch.from_numpy(np.ascontiguousarray(np.asarray(value)))
    except (ValueError, TypeError) as e:
        raise ValueError(f"input {name!r}: not a rectangular numeric array ({e})") from None


def read_inputs(items) -> dict:
    """{name: CPU tensor} from --input items: NAME=FILE (.npy or .json, one array) or FILE
    (.safetensors or .json object, every input). JSON numbers keep numpy's reading of them
    (float64 / int64): a JSON request sends the values, and the handler casts to the input's dtype."""
    import numpy as np

    from handlers.wire import safetensors_io
    out = {}
    for item in items:
        name, _, path = item.rpartition("=")
        ext = os.path.splitext(path)[1].lower()
        if ext == ".safetensors" and not name:
            with open(path, "rb") as f:
                out.update(safetensors_io.loads(f.read()))
        elif ext == ".json":
            with open(path) as f:
                value = json.load(f)
            if name:
                out[name] = _tensor(name, value)
            elif isinstance(value, dict):
                out.update({k: _tensor(k, v) for k, v in _named_arrays(value).items()})
            else:
                raise ValueError(f"--input {item}: a JSON file without NAME= must hold an object "
                                 "{name: array}; for one array write --input NAME=FILE.json")
        elif ext == ".npy" and name:
            out[name] = _tensor(name, np.load(path, allow_pickle=False))
        else:
            raise ValueError(f"--input {item!r}: expected NAME=FILE.npy, NAME=FILE.json, FILE.json "
                             "or FILE.safetensors")
    return out


def _named_arrays(value: dict) -> dict:
    """{name: array} of a JSON file: the object itself, or the inputs of a request body in our
    JSON ({"inputs": {name: array}}), the form the README's request.json has."""
    inputs = value.get("inputs")
    if len(value) == 1 and isinstance(inputs, dict):
        return inputs
    if len(value) == 1 and isinstance(inputs, list):
        raise ValueError("a KServe v2 request body ({\"inputs\": [...]}): send it with curl, or write "
                         "{name: array} for --input")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--example", action="append", default=[], help="NAME:SHAPE:DTYPE, seeded random data")
    p.add_argument("--input", action="append", default=[], metavar="[NAME=]FILE",
                   help="input values from a file: NAME=FILE.npy or NAME=FILE.json (one array), or "
                        "FILE.safetensors / FILE.json holding {name: array} (all inputs)")
    p.add_argument("--format", default="json", choices=("json", "v1", "v2", "safetensors"))
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--key-file", help="default: ./key_file.json, else the repository root's")
    p.add_argument("--wait", type=float, default=0, help="seconds to wait for the model to answer")
    p.add_argument("--check-eager", action="store_true")
    p.add_argument("--factory", help="FILE.py:FACTORY for --check-eager")
    return p


def request_body(tensors, fmt):
    """(body, Content-Type) of the request in format `fmt`."""
    from handlers.dtypes import BY_TORCH
    from handlers.wire import safetensors_io

    if fmt == "safetensors":
        return bytes(safetensors_io.dumps(tensors)), safetensors_io.CONTENT_TYPE
    if fmt == "v2":
        body = json.dumps({"inputs": [{"name": n, "shape": list(t.shape), "datatype": BY_TORCH[t.dtype].v2,
                                       "data": t.reshape(-1).tolist()} for n, t in tensors.items()]}).encode()
        return body, "application/json"
    if fmt == "v1":
        n = next(iter(tensors.values())).shape[0]
        inst = [{k: v[i].tolist() for k, v in tensors.items()} for i in range(n)]
        return json.dumps({"instances": inst}).encode(), "application/json"
    return json.dumps({"inputs": {n: t.tolist() for n, t in tensors.items()}}).encode(), "application/json"


def post_until_up(url, body, ct, key_file, wait):
    """(status, Content-Type, body) of the answer, retried for `wait` seconds while the model is
    not up yet or its worker still loads."""
    deadline = time.time() + wait
    while True:
        try:
            key = inference_key(key_file) if key_file else ""
            status, rct, data = post(url, body, ct, key)
        except (urllib.error.URLError, OSError, ValueError) as e:
            status, rct, data = None, "", str(e).encode()
        # Not up yet, or the worker is still loading (AOTI load + warm-up): worth waiting for.
        if status in (None, 404, 503) and b"ModelLoadFailed" not in data and time.time() < deadline:
            time.sleep(2)
            continue
        return status, rct, data


def explain_failure(args, key_file, status, data) -> None:
    print(data.decode(errors="replace"))
    if b"Token Authorization failed" in data:
        print(f"client: the token from {key_file or '(none)'} was refused; use the key_file.json of the "
              "running server (--key-file)", file=sys.stderr)
    elif status == 404:
        print(f"client: no model {args.model!r} on {args.url}; list them with the management API "
              "(GET :8081/models) or check the name given to torchserve --models", file=sys.stderr)


def show_outputs(rct, data, fmt) -> dict:
    """Print the answer; its outputs by name."""
    from handlers.wire import safetensors_io

    if rct.startswith(safetensors_io.CONTENT_TYPE):
        outputs = safetensors_io.loads(data)
        for k, v in outputs.items():
            print(f"{k}: shape {list(v.shape)} {v.dtype}\n{v}")
        return outputs
    answer = json.loads(data)
    print(json.dumps(answer)[:2000])
    return outputs_of(answer, fmt)


def summary(outputs: dict) -> str:
    """What the answer says: the predicted class per row for an output of scores (a float
    [rows, classes] with several classes), else each output's shape and first values."""
    parts = []
    for k, v in outputs.items():
        if v.dim() == 2 and v.shape[-1] > 1 and v.is_floating_point():
            parts.append(f"{k}: predicted classes {v.argmax(-1).tolist()}")
        else:
            first = [round(x, 4) if isinstance(x, float) else x for x in v.flatten()[:4].tolist()]
            parts.append(f"{k}: shape {list(v.shape)}, values {first}{' ...' if v.numel() > 4 else ''}")
    return "; ".join(parts)


def check_eager(factory, tensors, outputs) -> int:
    """Compare the served outputs with the eager model's: 0 when they agree."""
    import torch

    from compiled_serving.compile import load_factory

    model = load_factory(factory)()
    with torch.no_grad():
        ref = model(*tensors.values())
    ref = ref if isinstance(ref, dict) else {"output": ref}
    worst = max((outputs[k].float() - ref[k].float()).abs().max().item() for k in ref)
    print(f"{summary(outputs)}; max |served - eager| = {worst:.2e} "
          f"({'OK' if worst < 1e-4 else 'MISMATCH'})")
    return 0 if worst < 1e-4 else 1


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)

    from handlers.errors import RequestError
    from compiled_serving.compile import example_inputs, parse_input

    if not args.example and not args.input:
        p.error("give the inputs: --input FILE (values from a file) or --example NAME:SHAPE:DTYPE (random)")
    specs = [parse_input(e) for e in args.example]
    tensors = dict(zip([s.name for s in specs], example_inputs(specs, "cpu")))
    try:
        tensors.update(read_inputs(args.input))
    except (OSError, ValueError, RequestError) as e:
        p.error(str(e))
    body, ct = request_body(tensors, args.format)
    url = f"{args.url}/predictions/{args.model}"
    key_file = find_key_file(args.key_file)
    status, rct, data = post_until_up(url, body, ct, key_file, args.wait)
    print(f"POST {url} -> HTTP {status} ({rct})")
    if status != 200:
        explain_failure(args, key_file, status, data)
        return 1
    outputs = show_outputs(rct, data, args.format)
    if args.check_eager and not outputs:
        print("client: --check-eager: the answer holds no outputs to compare", file=sys.stderr)
        return 1
    if args.check_eager:
        return check_eager(args.factory, tensors, outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
