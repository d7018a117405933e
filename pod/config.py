"""The pod's settings, read once: the storage's config.properties (what `python -m compiled_serving.kserve`
wrote, with /mnt/models replaced by MODEL_ROOT) and the container's environment.

Every process of the pod (pod.start, pod.status, pod.grpc_bridge, the probes) reads the same
PodConfig, so the ports and limits they use cannot drift apart.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from urllib.parse import urlsplit


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
    stop_drain_s: int  # after SIGTERM: readiness fails, and the pod serves on this long before it stops
    worker_lost_s: int  # a model that served and has not served again for this long fails liveness

    @property
    def state_file(self) -> str:
        """pod.status writes every model's state here; the bridge and probes read it."""
        return os.path.join(self.runtime_dir, "pod_state.json")

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
    return PodConfig(
        properties=properties, runtime_dir=env.get("RUNTIME_DIR", "/tmp/torchserve"), model_store=store,
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
        stop_drain_s=_int_env(env, "STOP_DRAIN_S", 5, low=0),
        # a worker that died comes back within seconds (TorchServe restarts an ordinary one, the
        # guardian an async one, handlers/torchserve/guardian.py) plus its load; one that has not
        # in 5 minutes will not (a restart back-off grown to minutes, memory held by a stray
        # process): the container's restart is the cure. Set it above the slowest model's load.
        worker_lost_s=_int_env(env, "WORKER_LOST_S", 300))
