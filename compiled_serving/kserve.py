"""Lay out built archives for KServe's TorchServe runtime and write InferenceService manifests.

  python -m compiled_serving.kserve --mar model_store/NAME.mar [--mar ...] --storage-uri URI --out DIR
      [--name ISVC] [--namespace NS] [--protocol v1|v2|grpc-v2 ...] [--device cpu|gpu ...]
      [--cpu N] [--memory SIZE] [--gpus N] [--force-gpu] [--no-gpu-memory-affinity] [--force] [--digests FILE]
      [--image REPO] [--image-torch X.Y] [--builtin-runtime]

Writes
  DIR/storage/config/config.properties   kserve/config.properties plus model_snapshot
  DIR/storage/config/log4j2.xml          the frontend's logging (log4j2.xml), named by its vmargs
  DIR/storage/model-store/NAME.mar       the archives, copied
  DIR/manifests/ISVC-PROTOCOL[-gpu].yaml one InferenceService per protocol and device, naming
                                         our ClusterServingRuntime (kserve/servingruntime.yaml)
  DIR/manifests/servingruntime.yaml      that runtime with the image the archives need
  DIR/digests.sha256                     the archives' SHA-256 (outside storage/), for
                                         `python -m compiled_serving.verify_store check`

--digests FILE (an operator-kept list, compiled_serving/verify_store.py) refuses any archive whose
SHA-256 differs from the list, before anything is copied.

Upload DIR/storage to URI (e.g. `gsutil cp -r DIR/storage/* gs://bucket/path/`), then
`kubectl apply -f DIR/manifests/<one of them>`. The runtime mounts URI at /mnt/models and runs
`torchserve --start --model-store=/mnt/models/model-store
--ts-config=/mnt/models/config/config.properties`.

model_snapshot lists each archive under its model name with the workers, batchSize,
maxBatchDelay and responseTimeout of the model-config.yaml inside it (what
compiled_serving/archive.py wrote), so TorchServe loads every model at start with its own settings.

The gpu manifests require nodes whose GPUs have the memory the archives' engines need (each
archive's handler.worker_gpu_mb, once per GPU, summed): a node affinity on NVIDIA GPU feature
discovery's nvidia.com/gpu.memory label (MiB), with an annotation stating the GPU memory each
archive was sized for (docs/kserve.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import zipfile

import yaml

from compiled_serving import verify_store
from handlers.torchserve.direct_memory import DIRECT_POOL_MIB, LARGE_BODY_BYTES, large_bodies_at_once, pool_tiers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_TEMPLATE = os.path.join(ROOT, "kserve", "config.properties")
PROTOCOLS = ("v1", "v2", "grpc-v2")
DEVICES = ("cpu", "gpu")
# Our ClusterServingRuntime (kserve/servingruntime.yaml, image built from kserve/Dockerfile).
RUNTIME = "compiled-torchserve"
RUNTIME_TEMPLATE = os.path.join(ROOT, "kserve", "servingruntime.yaml")
# KServe's built-in runtime: its image pins TorchServe 0.12.0 with torch 2.4, older than this
# handler needs (torch >= 2.7); usable only with --builtin-runtime, for archives whose artifacts
# are not native AOTInductor packages AND a handler build that supports that torch -- i.e. none
# of this repository's archives today. Kept for clusters that still have it.
BUILTIN_RUNTIME = "kserve-torchserve"
IMAGE_REPO = "ghcr.io/example/compiled-serving"
# Memory a pod needs: the Java frontend, the pod's fronts (nginx, the gRPC bridge processes, the
# status process: pod/) and each worker's resident memory, MiB. WORKER_CPU_MIB is the RSS of one
# CPU worker of the example model measured here, FRONTS_MIB the fronts' RSS with bodies in flight
# (tests/test_cluster_runtime.py and tests/test_pod.py assert the measurements stay below them);
# a GPU's device memory is not a Kubernetes resource: each archive states what its engine needs
# (handler.worker_gpu_mb, compiled_serving/worker_sizing.py) and the GPU manifests require nodes
# whose GPU has that much for all of them (gpu_memory_affinity).
# The Java frontend: a capped heap, Netty's direct buffers (the request bodies it holds, up to
# DIRECT_BODIES of the pod's body limit at once, plus its pools) and the JVM's own memory (code,
# threads, metaspace). Both caps go into config.properties' vmargs; frontend_mib() is the total
# at the pod's body limit.
JVM_HEAP_MIB = 384
JVM_NATIVE_MIB = 256
DIRECT_BODIES = 4
MIB = 1 << 20
FRONTS_MIB = 256
WORKER_CPU_MIB = 512
CPU_PER_WORKER = 1
# CPU for the fronts: nginx and the bridge forward bytes, about a core at a few thousand
# requests per second (docs/kserve.md)
FRONTS_CPU = 1
# The pod's gRPC port (pod/grpc_bridge.py, GRPC_PORT of kserve/Dockerfile): a grpc-v2
# InferenceService names it as its h2c port, so KServe routes gRPC there.
GRPC_PORT = 8081
# The kubelet's probes: pod.status's own listener (PROBE_PORT of kserve/Dockerfile, pod/config.py),
# off nginx's connections, which a client's flood of half-sent headers can hold
PROBE_PORT = 8083
PROBES = ("livenessProbe", "readinessProbe")
# KServe's built-in runtime serves gRPC on TorchServe's own port (grpc_inference_port).
BUILTIN_GRPC_PORT = 7070
# A grpc-v2 InferenceService on our runtime has two container ports once KServe merges it with
# the runtime's container (a strategic merge keyed by containerPort: the runtime's 8080 http1 and
# its own 8081 h2c). Knative (KServe's Serverless mode) refuses a revision with more than one
# port ("more than one container port is set", knative/serving k8s_validation.go), and it would
# move the kubelet's HTTP/1.1 liveness probe onto the h2c port, which nginx serves as HTTP/2
# only. So these go as KServe's plain Deployment and Service, whose Service exposes every
# container port (the first as port 80, the others under their own numbers; KServe's
# service_reconciler.go). "RawDeployment" is also read by KServe releases that call the mode
# "Standard".
DEPLOYMENT_MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
RAW_DEPLOYMENT = "RawDeployment"
# model-config.yaml key -> model_snapshot key, and TorchServe's default when absent
SNAPSHOT_FIELDS = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 1, "maxBatchDelay": 100,
                   "responseTimeout": 120}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# NVIDIA GPU feature discovery (part of the GPU operator) labels each GPU node with its GPUs' memory
# in MiB; Kubernetes cannot request GPU memory, so the GPU manifests select nodes by this label.
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
# The GPU manifests' annotation stating what the worker counts were sized for.
SIZING_ANNOTATION = "compiled-serving/gpu-memory"


def fail(msg):
    raise SystemExit(f"kserve: error: {msg}")


def read_mar(path: str) -> dict:
    """Model name, version, model-config.yaml and the devices its variants were compiled for."""
    try:
        z = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        fail(f"{path}: not a readable .mar ({e})")
    with z:
        names = z.namelist()
        try:
            manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
        except (KeyError, ValueError) as e:
            fail(f"{path}: no valid MAR-INF/MANIFEST.json ({e}); build it with compiled_serving/archive.py")
        model = manifest.get("model", {})
        cfg_name = model.get("configFile")
        if not cfg_name or cfg_name not in names:
            fail(f"{path}: has no model-config.yaml; build it with compiled_serving/archive.py")
        cfg = yaml.safe_load(z.read(cfg_name)) or {}
        devices, torches, bodies = set(), set(), []
        for n in names:
            if n == "artifact.json" or n.endswith("/artifact.json"):
                art = json.loads(z.read(n))
                devices.add(art.get("device"))
                torches.add(major_minor(str(art.get("torch_version", ""))))
                bodies.append(largest_body_of(art, cfg, path))
    name = model.get("modelName")
    if not name:
        fail(f"{path}: MANIFEST.json names no model")
    return {"name": name, "version": model.get("modelVersion") or "1.0", "config": cfg,
            "devices": devices, "torches": torches, "path": path, "body_bytes": max(bodies, default=0)}


def largest_body_of(artifact: dict, cfg: dict, path: str) -> int:
    """The largest request body one variant of an archive accepts (handlers/admission.largest_body),
    from its artifact.json and model-config.yaml."""
    from handlers.admission import Limits, largest_body
    from handlers.artifact.decoder import of as decoder_of
    from handlers.artifact.metadata import spec_from_dict
    from handlers.config import parse_config
    from handlers.errors import LoadError

    try:
        spec, config = spec_from_dict(artifact), parse_config(cfg)
    except LoadError as e:
        fail(f"{path}: {e}")
    return largest_body(Limits.of(config, spec), spec, generates=decoder_of(spec) is not None)


def major_minor(version: str) -> str:
    """'2.11.0+cu130' -> '2.11' (a native AOTInductor package needs this torch major.minor)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else "unknown"


def image_tag(repo: str, torch_mm: str, device: str) -> str:
    """The serving image an archive needs: kserve/Dockerfile built with TORCH_VERSION=torch_mm.*."""
    return f"{repo}:torch{torch_mm}-{'cuda' if device == 'gpu' else 'cpu'}"


def check_image_torch(mars: list, image_torch: str | None) -> str:
    """The torch major.minor of the image the archives need: --image-torch if given, else the
    one their artifact.json files record; a mismatch or a mixture is refused."""
    if image_torch is None:
        found = sorted(set().union(*(m["torches"] for m in mars)))
        if len(found) != 1:
            fail(f"the archives were compiled with different torch versions ({', '.join(found)}); "
                 "one image serves one torch: lay them out separately, each with its own --name")
        return found[0]
    for m in mars:
        other = sorted(t for t in m["torches"] if t != image_torch)
        if other:
            fail(f"{m['path']}: compiled with torch {', '.join(other)}, the image has torch {image_torch}; "
                 f"a native AOTInductor package loads only under the torch it was compiled with. Build "
                 f"the image with --build-arg TORCH_VERSION={other[0]}.* and pass --image-torch {other[0]}, "
                 f"or recompile the artifact under torch {image_torch}")
    return image_torch


def workers(m: dict) -> int:
    return max(int(m["config"].get("minWorkers", 1)), 1)


def body_limit(mars: list) -> int:
    """The pod's request body limit, bytes: the largest body any of its models accepts
    (handlers/admission.largest_body), with a sixteenth more for the transport's framing; nginx,
    the gRPC bridge and TorchServe refuse anything larger (max_request_size)."""
    largest = max(m["body_bytes"] for m in mars)
    return largest + largest // 16


def direct_mib(limit: int) -> int:
    return DIRECT_POOL_MIB + DIRECT_BODIES * -(-limit // MIB)


def frontend_mib(limit: int) -> int:
    return JVM_HEAP_MIB + JVM_NATIVE_MIB + direct_mib(limit)


def sized_resources(mars: list, device: str, gpus: int, fronts: bool = True) -> dict:
    """CPU and memory from the archives' worker counts (requests = limits: Guaranteed QoS), plus
    our pod's fronts (nginx, the status process, the gRPC bridge) where our runtime serves, and the
    frontend's capped JVM at the pod's body limit."""
    # an archive served by the engine (sized for a GPU) runs one more process per GPU: counted as a
    # worker (its host memory on a GPU was not measured here; a CPU worker's is WORKER_CPU_MIB)
    n = sum(workers(m) + (gpus if device == "gpu" and by_engine(m) else 0) for m in mars)
    mem = frontend_mib(body_limit(mars)) + (FRONTS_MIB if fronts else 0) + n * WORKER_CPU_MIB
    res = {"cpu": str(n * CPU_PER_WORKER + (FRONTS_CPU if fronts else 0)), "memory": f"{mem}Mi"}
    out = {"requests": dict(res), "limits": dict(res)}
    if device == "gpu":
        # Extended resources are set as limits (Kubernetes copies them to requests).
        out["limits"]["nvidia.com/gpu"] = str(gpus)
    return out


def by_engine(m: dict) -> bool:
    """Whether the archive was sized for a GPU (gpuSizing, compiled_serving/worker_sizing.py record),
    whose engine then holds the model on each GPU, the workers no GPU memory. An archive sized
    before the engine (per worker, no gpuSizing.engine) is served by the engine today all the same,
    and its worker_gpu_mb (one copy of the weights plus overhead) is what the engine needs."""
    return bool(m["config"].get("gpuSizing"))


def gpu_memory_need(mars: list) -> tuple | None:
    """(MiB each of the pod's GPUs needs for the archives' engines, the statement of what each archive
    was sized for); None where no archive states its need (CPU archives, archives built before
    compiled_serving/worker_sizing.py, handler.worker_gpu_mb: 0). Each GPU its one engine per archive,
    whatever the worker count and the GPU count (TorchServe spreads the workers; each GPU's engine
    holds the whole model)."""
    total, parts = 0, []
    for m in mars:
        need = (m["config"].get("handler") or {}).get("worker_gpu_mb") or 0
        if not isinstance(need, (int, float)) or need <= 0:
            continue
        sized = m["config"].get("gpuSizing") or {}
        total += need
        held = f"one engine per GPU x {need:g} MiB"
        parts.append(f"{m['name']}: {held}, counted for a {sized.get('gpuMiB', '?')} MiB GPU "
                     f"({sized.get('gpuMemory', 'not recorded')})")
    return (math.ceil(total), "; ".join(parts)) if parts else None


def gpu_memory_affinity(need_mib: int) -> dict:
    """Nodes whose GPUs have at least `need_mib` MiB (the label's value is an integer, so Gt works;
    a nodeSelector can only match one exact size)."""
    term = {"key": GPU_MEMORY_LABEL, "operator": "Gt", "values": [str(need_mib - 1)]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [term]}]}}}


def model_snapshot(mars: list) -> dict:
    models = {}
    for m in mars:
        entry = {"defaultVersion": True, "marName": os.path.basename(m["path"])}
        for key, default in SNAPSHOT_FIELDS.items():
            value = m["config"].get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                fail(f"{m['path']}: model-config.yaml {key}={value!r} is not a non-negative integer")
            entry[key] = value
        models[m["name"]] = {m["version"]: entry}
    return {"name": "startup.cfg", "modelCount": len(models), "models": models}


def config_text(snapshot: dict, limit: int) -> str:
    """The storage's config.properties: the template with the pod's body limit (`limit`), the
    JVM's caps and the models TorchServe loads."""
    with open(CONFIG_TEMPLATE) as f:
        text = f.read()
    if re.search(r"(?m)^model_snapshot=", text):
        fail(f"{CONFIG_TEMPLATE} already sets model_snapshot; it is generated")
    text, n = re.subn(r"(?m)^max_request_size=\d+$", f"max_request_size={limit}", text)
    text, m = re.subn(r"(?m)^(vmargs=.*)$", lambda v: f"{v.group(1)} -Xmx{JVM_HEAP_MIB}m "
                      f"-XX:MaxDirectMemorySize={direct_mib(limit)}m", text)
    if n != 1 or m != 1:
        fail(f"{CONFIG_TEMPLATE} must set max_request_size and vmargs once each (they are filled in)")
    return (text.rstrip("\n") + "\n\n# Generated by `python -m compiled_serving.kserve`: the models TorchServe loads at start "
            "(name -> version -> settings from each archive's model-config.yaml). KServe's wrapper "
            "serves the same names.\n"
            f"model_snapshot={json.dumps(snapshot, separators=(',', ':'))}\n")


def manifest(name, namespace, protocol, storage_uri, resources, runtime, gpu_memory=None) -> dict:
    """One InferenceService; `gpu_memory`: (MiB a GPU needs, statement) from gpu_memory_need, for
    the node affinity and the annotation, or None."""
    model = {
        "modelFormat": {"name": "pytorch"},
        "runtime": runtime,
        "protocolVersion": protocol,
        "storageUri": storage_uri,
        "resources": resources,
    }
    meta, annotations = {"name": name}, {}
    if protocol == "grpc-v2":
        port = BUILTIN_GRPC_PORT if runtime == BUILTIN_RUNTIME else GRPC_PORT
        model["ports"] = [{"name": "h2c", "containerPort": port, "protocol": "TCP"}]
        if runtime != BUILTIN_RUNTIME:
            annotations[DEPLOYMENT_MODE_ANNOTATION] = RAW_DEPLOYMENT
    if namespace:
        meta["namespace"] = namespace
    predictor = {"model": model}
    if gpu_memory:
        annotations[SIZING_ANNOTATION] = f"each GPU needs {gpu_memory[0]} MiB: {gpu_memory[1]}"
        predictor["affinity"] = gpu_memory_affinity(gpu_memory[0])
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": meta,
            "spec": {"predictor": predictor}}


def runtime_docs(repo: str, torch_mm: str, devices: list) -> list:
    """kserve/servingruntime.yaml with the image tag the archives need, one runtime per device
    (the GPU one named RUNTIME-gpu)."""
    with open(RUNTIME_TEMPLATE) as f:
        template = yaml.safe_load(f)
    docs = []
    for device in devices:
        doc = json.loads(json.dumps(template))
        if device == "gpu":
            doc["metadata"]["name"] = f"{RUNTIME}-gpu"
        doc["spec"]["containers"][0]["image"] = image_tag(repo, torch_mm, device)
        for probe in PROBES:  # the port that serves them, whatever the template says
            doc["spec"]["containers"][0][probe]["httpGet"]["port"] = PROBE_PORT
        docs.append(doc)
    return docs


def check_digests(paths, digests_file) -> None:
    if not digests_file:
        print("kserve: note: no --digests list given; the archives are copied unverified. Keep a digest "
              "list outside the archives: python -m compiled_serving.verify_store record ...", file=sys.stderr)
        return
    listed = verify_store.read_digests(digests_file)
    for path in paths:
        name = os.path.basename(path)
        if name not in listed:
            fail(f"{path} is not in {digests_file}")
        if verify_store.sha256(path) != listed[name]:
            fail(f"{path}: SHA-256 differs from {digests_file}; the archive changed after it was recorded")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cs-kserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mar", action="append", required=True, help="archive built by cs-archive; repeat")
    p.add_argument("--storage-uri", required=True,
                   help="where DIR/storage will be uploaded (gs://, s3://, pvc://, https:// ...)")
    p.add_argument("--out", required=True, help="output directory (storage/ and manifests/)")
    p.add_argument("--name", help="InferenceService name prefix (default: the first model's name)")
    p.add_argument("--namespace")
    p.add_argument("--protocol", action="append", choices=PROTOCOLS, help="default: all three")
    p.add_argument("--device", action="append", choices=DEVICES, help="default: cpu and gpu")
    p.add_argument("--cpu", help=f"CPU request and limit (default: one per worker of the archives + {FRONTS_CPU} "
                                 "for the pod's fronts)")
    p.add_argument("--memory", help=f"memory request and limit (default: the frontend's capped JVM, "
                                    f"{frontend_mib(8 * MIB)}Mi at an 8 MiB body limit, + {FRONTS_MIB}Mi + "
                                    f"{WORKER_CPU_MIB}Mi per worker)")
    p.add_argument("--force-gpu", action="store_true",
                   help="write gpu manifests even when an archive has no cuda variant")
    p.add_argument("--image", default=IMAGE_REPO, help=f"serving image repository (default {IMAGE_REPO})")
    p.add_argument("--image-torch",
                   help="torch major.minor the image was built with (default: the torch the "
                        "archives' artifact.json records)")
    p.add_argument("--builtin-runtime", action="store_true",
                   help=f"name KServe's {BUILTIN_RUNTIME} instead of ours (it cannot load archives "
                        "compiled with torch >= 2.5; see docs/kserve.md)")
    p.add_argument("--gpus", type=int, default=1, help="nvidia.com/gpu limit of the gpu manifests")
    p.add_argument("--no-gpu-memory-affinity", action="store_true",
                   help=f"leave out the gpu manifests' node affinity on {GPU_MEMORY_LABEL} (for clusters "
                        "without NVIDIA GPU feature discovery: then check the GPU's memory yourself)")
    p.add_argument("--force", action="store_true", help="replace an existing DIR/storage and DIR/manifests")
    p.add_argument("--digests", help="operator-kept digest list (cs-verify record): "
                                     "every --mar must match it")
    return p


def service_name(args, mars) -> str:
    """The InferenceService name prefix, after checking that no two archives share a name."""
    seen = {}
    for m in mars:
        for key, what in (("name", "model name"), ("path", "file name")):
            value = m[key] if key == "name" else os.path.basename(m[key])
            if (key, value) in seen:
                fail(f"{m['path']} and {seen[(key, value)]} have the same {what} {value!r}")
            seen[(key, value)] = m["path"]
    isvc = args.name or mars[0]["name"].replace("_", "-").lower()
    if not DNS_LABEL.match(isvc) or len(isvc) > 45:
        fail(f"InferenceService name {isvc!r} must be a DNS label (lowercase letters, digits, '-', "
             "starting with a letter, at most 45 characters here); pass --name")
    return isvc


def write_storage(args, mars, storage, manifests) -> None:
    """DIR/storage (the archives, config.properties, log4j2.xml) and the digests of its archives."""
    for d in (storage, manifests):
        if os.path.exists(d):
            if not args.force:
                fail(f"{d} exists; pass --force to replace it")
            shutil.rmtree(d)
    os.makedirs(os.path.join(storage, "config"))
    os.makedirs(os.path.join(storage, "model-store"))
    os.makedirs(manifests)
    for m in mars:
        shutil.copy2(m["path"], os.path.join(storage, "model-store", os.path.basename(m["path"])))
    limit = body_limit(mars)
    with open(os.path.join(storage, "config", "config.properties"), "w") as f:
        f.write(config_text(model_snapshot(mars), limit))
    widest = max(mars, key=lambda m: m["body_bytes"])
    print(f"kserve: request bodies up to {limit} bytes ({widest['name']} accepts {widest['body_bytes']}, the most "
          f"of the pod's models, plus a sixteenth); the frontend's JVM capped at {JVM_HEAP_MIB} MiB heap and "
          f"{direct_mib(limit)} MiB direct buffers")
    print_large_bodies(mars, limit)
    # config.properties' vmargs names /mnt/models/config/log4j2.xml
    shutil.copy2(os.path.join(ROOT, "log4j2.xml"), os.path.join(storage, "config", "log4j2.xml"))
    verify_store.main(["record", "--store", os.path.join(storage, "model-store"),
                       "--digests", os.path.join(args.out, "digests.sha256")])


def print_large_bodies(mars, limit) -> None:
    """How many large bodies the pod passes to TorchServe at once (pod/config.py, nginx's gate),
    from the frontend's direct memory, the body limit and the largest batchSize."""
    batch = max(int(m["config"].get("batchSize", 1)) for m in mars)
    n, words = large_bodies_at_once(direct_mib(limit), limit, batch)
    tiers, tiers_words = pool_tiers(batch)
    print(f"kserve: at most {n} request bodies of {LARGE_BODY_BYTES:,} bytes or more reach TorchServe at once "
          f"({words}), and of smaller ones {tiers_words}; the pod answers more 503 with Retry-After "
          f"(gRPC: UNAVAILABLE) at once, and bodies under {tiers[-1][0]:,} bytes pass uncounted")


def device_resources(args, mars, device):
    """(resources, GPU memory need or None) of one device's manifests, with the notes printed."""
    resources = sized_resources(mars, device, args.gpus, fronts=not args.builtin_runtime)
    for key, value in (("cpu", args.cpu), ("memory", args.memory)):
        if value:
            resources["requests"][key] = resources["limits"][key] = str(value)
    gpu_memory = gpu_memory_need(mars) if device == "gpu" else None
    if gpu_memory and args.no_gpu_memory_affinity:
        print(f"kserve: note: no node affinity on {GPU_MEMORY_LABEL}: each GPU must have {gpu_memory[0]} MiB "
              f"for the archives' engines ({gpu_memory[1]})", file=sys.stderr)
        gpu_memory = None
    elif gpu_memory:
        print(f"kserve: gpu manifests require nodes labelled {GPU_MEMORY_LABEL} >= {gpu_memory[0]} MiB "
              f"({gpu_memory[1]}; NVIDIA GPU feature discovery sets the label; --no-gpu-memory-affinity "
              "leaves it out)")
    return resources, gpu_memory


def write_manifests(args, mars, isvc, manifests):
    """One InferenceService manifest per device and protocol: (paths written, devices)."""
    wanted = {"cpu": "cpu", "gpu": "cuda"}
    written = []
    runtime = BUILTIN_RUNTIME if args.builtin_runtime else RUNTIME
    devices = []
    for device in args.device or DEVICES:
        lacking = [m["name"] for m in mars if wanted[device] not in m["devices"]]
        if lacking and device == "gpu" and not args.force_gpu:
            print(f"kserve: note: no gpu manifests: {', '.join(lacking)} has no cuda variant "
                  "(archive one, or pass --force-gpu)", file=sys.stderr)
            continue
        if lacking:
            print(f"kserve: warning: {', '.join(lacking)} has no {wanted[device]} variant; the {device} "
                  f"manifests will not serve it until you archive one (cs-archive --artifact ...)",
                  file=sys.stderr)
        devices.append(device)
        resources, gpu_memory = device_resources(args, mars, device)
        for protocol in args.protocol or PROTOCOLS:
            name = f"{isvc}-{protocol}" + ("-gpu" if device == "gpu" else "")
            rt = f"{runtime}-gpu" if device == "gpu" and runtime == RUNTIME else runtime
            doc = manifest(name, args.namespace, protocol, args.storage_uri, resources, rt, gpu_memory)
            path = os.path.join(manifests, f"{name}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(doc, f, sort_keys=False)
            written.append(path)
    return written, devices


def main(argv=None):
    args = build_parser().parse_args(argv)
    if "://" not in args.storage_uri:
        fail(f"--storage-uri {args.storage_uri!r}: expected a URI such as gs://bucket/path or pvc://claim/path")
    if args.gpus < 1:
        fail("--gpus must be at least 1")
    check_digests(args.mar, args.digests)
    mars = [read_mar(m) for m in args.mar]
    image_torch = check_image_torch(mars, args.image_torch)
    isvc = service_name(args, mars)
    storage = os.path.join(args.out, "storage")
    manifests = os.path.join(args.out, "manifests")
    write_storage(args, mars, storage, manifests)
    written, devices = write_manifests(args, mars, isvc, manifests)
    if not args.builtin_runtime:
        path = os.path.join(manifests, "servingruntime.yaml")
        with open(path, "w") as f:
            yaml.safe_dump_all(runtime_docs(args.image, image_torch, devices), f, sort_keys=False)
        written.append(path)
    names = ", ".join(m["name"] for m in mars)
    print(f"wrote {storage} (models: {names}) and {len(written)} manifest(s) in {manifests}\n"
          f"upload {storage}/ to {args.storage_uri}, then: kubectl apply -f <manifest>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
