"""The pod's settings, read once: the storage's config.properties (what `python -m compiled_serving.kserve`
wrote, with /mnt/models replaced by MODEL_ROOT) and the container's environment.

Every process of the pod (pod.start, pod.status, pod.grpc_bridge, the probes) reads the same
PodConfig, so the ports and limits they use cannot drift apart.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from handlers.torchserve.direct_memory import (  # noqa: F401  (re-exported: nginx.py, tests)
    DIRECT_POOL_MIB, LARGE_BODY_BYTES, MIB, POOL_TIERS, bodies_within, large_bodies_at_once, pool_tiers)


class PodConfigError(SystemExit):
    def __init__(self, msg: str):
        super().__init__(f"pod: error: {msg}")


def read_properties(path: str) -> dict:
    """Java properties as TorchServe's kserve config uses them: key=value lines, # comments."""
    out = {}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise PodConfigError(f"{path} cannot be read ({e}); upload the storage/ that "
                             "`python -m compiled_serving.kserve` wrote to the storageUri") from None
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def host_port(address: str, key: str) -> tuple:
    """'http://127.0.0.1:8085' -> ('127.0.0.1', 8085); 0.0.0.0 is dialled as loopback."""
    parts = urlsplit(address)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise PodConfigError(f"{key}={address!r}: expected http://HOST:PORT (the pod dials TorchServe "
                             "over plain HTTP on loopback)")
    return parts.hostname.replace("0.0.0.0", "127.0.0.1"), parts.port


GATE_SOCKET = "gate.sock"  # the gate's unix socket, in RUNTIME_DIR
ABORT_SOCKET = "abort.sock"  # nginx's log of abandoned generations to pod/aborts.py, in RUNTIME_DIR
ABORT_DIR = "aborts"  # pod/aborts.py's marks, read by the workers (handlers/generation/abandon.py)
# TorchServe 0.12 with token authorization writes its keys here, in the directory it was started
# from (pod/start.py starts it in RUNTIME_DIR): {"management": {"key", "expiration time"},
# "inference": {...}, "API": {"key"}}, readable by its owner alone
KEY_FILE = "key_file.json"


def torchserve_keys(runtime_dir: str, wait_s: float = 0.0) -> dict:
    """{"management": key, "inference": key} from RUNTIME_DIR/key_file.json, waiting up to
    `wait_s` for TorchServe to write it; PodConfigError when it never does."""
    path = os.path.join(runtime_dir, KEY_FILE)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path) as f:
                keys = json.load(f)
            return {k: keys[k]["key"] for k in ("management", "inference")}
        except (OSError, ValueError, KeyError, TypeError) as e:
            if time.monotonic() >= deadline:
                raise PodConfigError(f"{path} holds no TorchServe keys ({type(e).__name__}: {e}); TorchServe writes "
                                     "it at start with token authorization on: its logs under RUNTIME_DIR/logs say why not") from None
        time.sleep(0.2)


def direct_memory_mib(props: dict) -> int:
    """-XX:MaxDirectMemorySize of the frontend's vmargs, MiB (cs-kserve writes it)."""
    found = re.findall(r"-XX:MaxDirectMemorySize=(\d+)([mMgG])\b", props.get("vmargs", ""))
    if len(found) != 1:
        raise PodConfigError("config.properties' vmargs must cap the frontend's direct memory once "
                             "(-XX:MaxDirectMemorySize=NNNm): the pod bounds the bodies it passes to "
                             "TorchServe by it; regenerate the storage with `python -m compiled_serving.kserve`")
    value, unit = found[0]
    return int(value) * (1024 if unit in "gG" else 1)


def largest_batch(props: dict) -> int:
    """The largest batchSize of the pod's models (model_snapshot), at least 1."""
    snap = json.loads(props.get("model_snapshot", "{}") or "{}").get("models", {})
    return max([1] + [int(e.get("batchSize", 1)) for versions in snap.values() for e in versions.values()
                      if isinstance(e, dict)])


def large_bodies(props: dict) -> tuple:
    """(n, arithmetic) of large_bodies_at_once for this pod's settings, or a fix-it error."""
    limit = int(props.get("max_request_size", 6553500))
    direct = direct_memory_mib(props)
    n, words = large_bodies_at_once(direct, limit, largest_batch(props))
    if n < 1:
        need = DIRECT_POOL_MIB + 2 * -(-limit // MIB)
        raise PodConfigError(f"-XX:MaxDirectMemorySize={direct}m cannot hold one body of max_request_size "
                             f"{limit} bytes ({DIRECT_POOL_MIB} MiB pool + the body received + the body in a batch's encoding): "
                             f"raise it to at least {need}m, "
                             "or regenerate the storage with `python -m compiled_serving.kserve`")
    return n, words


@dataclass(frozen=True)
class Model:
    name: str
    version: str
    mar: str  # path of the archive in the model store


def _int_env(env: dict, key: str, default: int, low: int = 1) -> int:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise PodConfigError(f"{key}={raw!r} is not an integer") from None
    if value < low:
        raise PodConfigError(f"{key}={value} must be at least {low}")
    return value


@dataclass(frozen=True)
class PodConfig:
    properties: str  # the config TorchServe runs with
    runtime_dir: str
    model_store: str
    models: tuple  # Model, in model_snapshot order
    inference: tuple  # TorchServe's inference API (host, port), loopback
    management: tuple
    metrics: tuple
    http_port: int  # the pod's REST port (nginx)
    grpc_port: int  # the pod's gRPC port (nginx, h2c)
    bridge_port: int  # pod.grpc_bridge, loopback: status calls, and ModelInfer with several models
    metrics_port: int  # GET /metrics only, proxied to TorchServe's loopback metrics
    status_port: int  # pod.status, loopback: health, ready and metadata
    probe_port: int  # pod.status, every address: the kubelet's probes alone, off nginx's connections
    max_request_bytes: int
    max_response_bytes: int
    response_timeout_s: int  # longest_response_timeout
    bridge_processes: int
    nginx_workers: int
    large_bodies: int  # bodies of LARGE_BODY_BYTES or more passed to TorchServe at once (nginx's gate)
    large_bodies_why: str  # the arithmetic of large_bodies, for the refusal's message
    pool_tiers: tuple  # (smallest, largest body, n at once) of the smaller bodies the gate counts
    pool_tiers_why: str
    stop_drain_s: int  # after SIGTERM: readiness fails, and the pod serves on this long before it stops
    worker_lost_s: int  # a model that served and has not served again for this long fails liveness

    @property
    def state_file(self) -> str:
        """pod.status writes every model's state here; the bridge and probes read it."""
        return os.path.join(self.runtime_dir, "pod_state.json")

    @property
    def gate_socket(self) -> str:
        """nginx's gate (kserve/nginx.conf): every inference body goes to TorchServe through it."""
        return os.path.join(self.runtime_dir, GATE_SOCKET)

    @property
    def abort_socket(self) -> str:
        """pod/aborts.py's datagram socket: nginx's syslog of the generations it finalized unanswered."""
        return os.path.join(self.runtime_dir, ABORT_SOCKET)

    @property
    def abort_dir(self) -> str:
        """Where pod/aborts.py marks them; the workers get it in handlers/generation/abandon.ENV."""
        return os.path.join(self.runtime_dir, ABORT_DIR)

    @property
    def stopping_file(self) -> str:
        """pod.start writes this on SIGTERM; pod.status then reports the pod not ready."""
        return os.path.join(self.runtime_dir, "pod_stopping")

    def url(self, which: str) -> str:
        host, port = getattr(self, which)
        return f"http://{host}:{port}"


def snapshot_models(props: dict, store: str) -> tuple:
    try:
        snap = json.loads(props.get("model_snapshot", "{}")).get("models", {})
    except ValueError as e:
        raise PodConfigError(f"model_snapshot is not JSON ({e}); regenerate the storage with "
                             "`python -m compiled_serving.kserve`") from None
    if not snap:
        raise PodConfigError("config.properties lists no model (model_snapshot); regenerate the storage "
                             "with `python -m compiled_serving.kserve --mar ...`")
    models = []
    for name, versions in snap.items():
        version, entry = next(iter(versions.items()))
        models.append(Model(name, str(version), os.path.join(store, entry.get("marName", f"{name}.mar"))))
    return tuple(models)


def longest_response_timeout(props: dict) -> int:
    """Seconds the fronts (nginx, the bridge) wait for TorchServe's answer, before their own 5 s:
    the longest responseTimeout of any model (its model-config.yaml, in model_snapshot), at
    least default_response_timeout; one model archived with --response-timeout 600 would
    otherwise be cut at the default by the fronts while its worker still computes."""
    snap = json.loads(props.get("model_snapshot", "{}") or "{}").get("models", {})
    per_model = [int(entry["responseTimeout"]) for versions in snap.values() for entry in versions.values()
                 if isinstance(entry, dict) and "responseTimeout" in entry]
    return max([int(props.get("default_response_timeout", 120))] + per_model)


def load(properties: str, env=None) -> PodConfig:
    env = os.environ if env is None else env
    props = read_properties(properties)
    store = env.get("MODEL_STORE") or os.path.join(env.get("MODEL_ROOT", "/mnt/models"), "model-store")
    nproc = os.cpu_count() or 1
    n_large, large_why = large_bodies(props)
    tiers, tiers_why = pool_tiers(largest_batch(props))
    runtime_dir = env.get("RUNTIME_DIR", "/tmp/torchserve")
    if max(len(os.fsencode(os.path.join(runtime_dir, s))) for s in (GATE_SOCKET, ABORT_SOCKET)) > 107:  # sun_path: 108
        raise PodConfigError(f"RUNTIME_DIR={runtime_dir!r} is too long for nginx's unix sockets in it "
                             "(a unix socket's path holds 107 bytes); choose a shorter directory")
    return PodConfig(
        properties=properties, runtime_dir=runtime_dir, model_store=store,
        models=snapshot_models(props, store),
        inference=host_port(props.get("inference_address", ""), "inference_address"),
        management=host_port(props.get("management_address", ""), "management_address"),
        metrics=host_port(props.get("metrics_address", ""), "metrics_address"),
        http_port=_int_env(env, "HTTP_PORT", 8080), grpc_port=_int_env(env, "GRPC_PORT", 8081),
        bridge_port=_int_env(env, "GRPC_BRIDGE_PORT", 8089),
        metrics_port=_int_env(env, "METRICS_PORT", 8082), status_port=_int_env(env, "STATUS_PORT", 8087),
        # the probes' own listener, in pod.status: a flood of connections on the public ports
        # (which share nginx's worker_connections) cannot fail the liveness probe
        probe_port=_int_env(env, "PROBE_PORT", 8083),
        max_request_bytes=int(props.get("max_request_size", 6553500)),
        max_response_bytes=int(props.get("max_response_size", 6553500)),
        response_timeout_s=longest_response_timeout(props),
        # measured defaults (docs/kserve.md): nginx carries every ModelInfer call of a one-model
        # pod, so one bridge process (status calls; ModelInfer of several-model pods) suffices;
        # two nginx workers kept the pod's routes at direct TorchServe's throughput
        bridge_processes=_int_env(env, "GRPC_BRIDGE_PROCESSES", 1),
        nginx_workers=_int_env(env, "NGINX_WORKERS", min(2, nproc)),
        # Kubernetes sends SIGTERM while it removes the pod from the Service's endpoints, and
        # kube-proxy and ingresses drop it only some seconds later: connections keep arriving
        # meanwhile, and a pod that closed its ports at once refused them. (Under Knative, the
        # queue-proxy's preStop hook has drained the pod before SIGTERM: the wait costs only time.)
        large_bodies=n_large, large_bodies_why=large_why,
        pool_tiers=tiers, pool_tiers_why=tiers_why,
        stop_drain_s=_int_env(env, "STOP_DRAIN_S", 5, low=0),
        # a worker that died comes back within seconds (TorchServe restarts an ordinary one, the
        # guardian an async one, handlers/torchserve/guardian.py) plus its load; one that has not
        # in 5 minutes will not (a restart back-off grown to minutes, memory held by a stray
        # process): the container's restart is the cure. Set it above the slowest model's load.
        worker_lost_s=_int_env(env, "WORKER_LOST_S", 300))
