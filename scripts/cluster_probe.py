"""The pod's liveness and readiness probes (kserve/servingruntime.yaml runs them as exec probes):

  python -m scripts.cluster_probe live     the frontend answers /ping
  python -m scripts.cluster_probe ready    every model of model_snapshot has a READY worker AND
                                           its handler says ready (describe_handle's JSON) AND,
                                           where the entrypoint started the front door, it
                                           answers /v2/health/ready

Exit 0 when the answer is yes; else 1, with the reason on stdout (the kubelet records it in the
pod's events). TorchServe reports a worker READY even when its load failed and it only answers
503 (answer_load_failure): the handler's own "ready"/"load_error", which the management API
returns as customizedMetadata of `GET /models/NAME?customized=true`, is what tells the two apart.
So a revision whose model cannot load never becomes ready and a rollout keeps the old one.

Reads the config kserve/entrypoint.sh wrote ($RUNTIME_DIR/config.properties).
"""
from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def read_properties(path: str) -> dict:
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip() and not line.lstrip().startswith("#") and "=" in line:
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


def local(address: str) -> str:
    """A listener address as the probe dials it: 0.0.0.0 is this pod's loopback."""
    return address.replace("0.0.0.0", "127.0.0.1").rstrip("/")


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
        return json.loads(r.read())


def model_problem(mgmt: str, name: str) -> str | None:
    """None when `name` serves; else why not."""
    try:
        entries = get_json(f"{mgmt}/models/{name}?customized=true")
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{name}: management API: {e}"
    for entry in entries:
        if not any(w.get("status") == "READY" for w in entry.get("workers", [])):
            return f"{name}: no READY worker yet"
        raw = entry.get("customizedMetadata")
        try:
            state = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            state = None
        if not isinstance(state, dict):
            return f"{name}: the handler reported no state (customizedMetadata {raw!r})"
        if not state.get("ready"):
            return f"{name}: {state.get('load_error') or state.get('device_fault') or 'handler not ready'}"
    return None if entries else f"{name}: not registered"


def check(kind: str, cfg: dict) -> str | None:
    if kind == "live":
        try:
            get_json(f"{local(cfg['inference_address'])}/ping")
        except (urllib.error.URLError, OSError, ValueError) as e:
            return f"frontend: /ping: {e}"
        return None
    names = list(json.loads(cfg.get("model_snapshot", "{}")).get("models", {}))
    if not names:
        return "the config names no model (model_snapshot)"
    mgmt = local(cfg["management_address"])
    problems = [p for p in (model_problem(mgmt, n) for n in names) if p]
    door = front_door()
    if door and not problems:
        try:
            get_json(f"{door}/v2/health/ready")
        except (urllib.error.URLError, OSError, ValueError) as e:
            problems.append(f"front door: /v2/health/ready: {e}")
    return "; ".join(problems) or None


def runtime_dir() -> str:
    """Where kserve/entrypoint.sh wrote what it started (its RUNTIME_DIR)."""
    return os.environ.get("RUNTIME_DIR", "/tmp/torchserve")


def front_door() -> str | None:
    """The front door's address, which kserve/entrypoint.sh writes beside the config it started."""
    try:
        with open(os.path.join(runtime_dir(), "front_door")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in ("live", "ready"):
        print("usage: python -m scripts.cluster_probe live|ready", file=sys.stderr)
        return 2
    path = os.path.join(runtime_dir(), "config.properties")
    problem = check(argv[0], read_properties(path))
    print(f"{argv[0]}: {problem or 'yes'}")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
