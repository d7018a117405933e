"""What the KServe tests share (tests/test_kserve.py, test_cluster_runtime.py, test_kserve_sizing.py,
test_pod.py): the storage URI they lay out for, KServe's InferenceService CRD schema and the strict
field check the API server applies, the layout command, and the pod as its container runs it.
Their archive and layout fixtures (cluster_mar, cluster_layout) are in conftest.py."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import requests

from handlers import protowire
from pod.local_pod import LocalPod
from compiled_serving.local_server import server_env
from conftest import cs_command

ROOT = Path(__file__).resolve().parents[1]
STORAGE_URI = "gs://example-bucket/models/compiled-serving"


def crd_schema() -> dict:
    """KServe's InferenceService v1beta1 schema (tests/data, as its CRD publishes it)."""
    with gzip.open(Path(__file__).parent / "data" / "kserve_inferenceservice_v1beta1.schema.json.gz") as f:
        return json.load(f)


def unknown_fields(obj, schema, path="") -> list:
    """Fields the API server's strict field validation (kubectl apply --validate=strict) rejects."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    bad = []
    if isinstance(obj, dict) and "properties" in schema:
        for k, v in obj.items():
            if k not in schema["properties"]:
                bad.append(f"{path}.{k}")
            else:
                bad += unknown_fields(v, schema["properties"][k], f"{path}.{k}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, v in obj.items():
            bad += unknown_fields(v, schema["additionalProperties"], f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            bad += unknown_fields(v, schema["items"], f"{path}[{i}]")
    return bad


def lay_out(mars, out, *extra):
    """`python -m compiled_serving.kserve` on these archives into `out` (the storage layout and manifests)."""
    cmd = [*cs_command("kserve"), "--storage-uri", STORAGE_URI, "--out", str(out), "--name", "compiled", *extra]
    for m in mars:
        cmd += ["--mar", str(m)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=server_env())


class Container(LocalPod):
    """The pod as its container runs it (pod/local_pod.py), with the probes' answers in the
    shape of a finished process (returncode 0 when the probe passed, stdout its body)."""

    def probe(self, kind):
        ok, body = super().probe(kind)
        return subprocess.CompletedProcess([], 0 if ok else 1, body, "")

    def wait(self, kind, timeout=180):
        return subprocess.CompletedProcess([], 0, super().wait(kind, timeout), "")

    def management(self, path: str, method: str = "GET"):
        """TorchServe's management API inside the pod, with its key: token authorization is on
        there (pod/start.py), the key in the runtime directory's key_file.json."""
        keys = json.loads((self.root / "run" / "key_file.json").read_text())
        return requests.request(method, f"http://127.0.0.1:{self.ports['management']}{path}",
                                headers={"Authorization": f"Bearer {keys['management']['key']}"}, timeout=10)

    def worker_rss_mib(self):
        import psutil

        rss = []
        for p in self.processes():
            try:  # a process that ended between the listing and its reading (a guardian, a reaper) is skipped
                if "model_service_worker" in " ".join(p.cmdline()):
                    rss.append(p.memory_info().rss / 2**20)
            except psutil.NoSuchProcess:
                continue
        return rss


def grpc_infer_request(name: str, inputs: list, raw: list | None = None, params=(), rid: str = "") -> bytes:
    """A ModelInferRequest: model_name (1), id (3), parameters (4: (key, int or str) entries),
    inputs (5: name 1, datatype 2, shape 3, contents 5), raw_input_contents (7); each input is
    (name, datatype, shape, contents bytes or None)."""
    w = protowire.Writer()
    w.string(1, name)
    if rid:
        w.string(3, rid)
    for key, value in params:
        p = protowire.Writer()
        p.varint(2, value) if isinstance(value, int) else p.string(3, value)
        entry = protowire.Writer()
        entry.string(1, key)
        entry.message(2, p.bytes())
        w.message(4, entry.bytes())
    for n, dt, shape, contents in inputs:
        t = protowire.Writer()
        t.string(1, n)
        t.string(2, dt)
        t.packed_varints(3, shape)
        if contents is not None:
            t.message(5, contents)
        w.message(5, t.bytes())
    for r in raw or []:
        w.bytes_field(7, r)
    return w.bytes()
