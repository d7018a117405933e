"""The front door (scripts/front_door.py: the kserve SDK's ModelServer forwarding to TorchServe),
started by the image's entrypoint as the image starts it (FRONT_DOOR_PYTHON set), called with
standard clients: v2 REST (JSON), v1 with curl, the v2 metadata/ready/health routes,
tritonclient gRPC and HTTP, and the kserve SDK's REST and gRPC clients (the SDK and tritonclient
run in .venv-kserve, which scripts/setup_kserve_env.sh creates)."""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from conftest import ROOT, eager
from test_cluster_runtime import Container, layout, good_mar  # noqa: F401 (fixtures)
from test_serving import close, two

KPY = Path(ROOT) / ".venv-kserve" / "bin" / "python"


@pytest.fixture(scope="module")
def kserve_env():
    if not (Path(ROOT) / ".venv-kserve" / ".installed").exists():
        r = subprocess.run(["sh", "scripts/setup_kserve_env.sh"], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0:
            pytest.skip(f"scripts/setup_kserve_env.sh could not install the kserve SDK: {r.stderr[-500:]}")
    return KPY


@pytest.fixture(scope="module")
def door(kserve_env, layout, tmp_path_factory):  # noqa: F811
    """The image's entrypoint with FRONT_DOOR_PYTHON set, as the image runs it: TorchServe on the
    storage's loopback inference address, the front door on the container's ports."""
    c = Container(layout[0] / "storage", tmp_path_factory.mktemp("door"), front_door_python=kserve_env)
    try:
        c.wait("ready")  # the readiness probe includes the front door's /v2/health/ready
        yield {"base": c.base, "grpc": f"127.0.0.1:{c.grpc}", "container": c}
    finally:
        c.stop()


def v2_body(f, m):
    return {"inputs": [{"name": "features", "shape": list(f.shape), "datatype": "FP32", "data": f.flatten().tolist()},
                       {"name": "mask", "shape": list(m.shape), "datatype": "BOOL", "data": m.flatten().tolist()}]}


def check(outputs, f, m):
    ref = eager("two_input", f, m)
    close({o["name"]: torch.tensor(o["data"]).reshape(o["shape"]) for o in outputs}, ref)


def test_routes_metadata_and_rest_v1_v2_equal_eager(door):
    base = door["base"]
    assert requests.get(f"{base}/v2/health/live", timeout=5).json() == {"live": True}
    assert requests.get(f"{base}/v2/models/two/ready", timeout=5).json()["ready"] is True
    meta = requests.get(f"{base}/v2/models/two", timeout=5).json()
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 16]},
                              {"name": "mask", "datatype": "BOOL", "shape": [-1, 16]}]
    assert [o["name"] for o in meta["outputs"]] == list(eager("two_input", *two(1)))
    f, m = two(3, seed=11)
    r = requests.post(f"{base}/v2/models/two/infer", json=v2_body(f, m), timeout=60)
    assert r.status_code == 200, r.text
    check(r.json()["outputs"], f, m)
    v1 = {"instances": [{"features": f[j].tolist(), "mask": m[j].tolist()} for j in range(3)]}
    r = subprocess.run(["curl", "-sS", "-H", "Content-Type: application/json", "-d", json.dumps(v1),
                        f"{base}/v1/models/two:predict"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    ref = eager("two_input", f, m)
    for j, p in enumerate(json.loads(r.stdout)["predictions"]):
        close({k: torch.tensor(v) for k, v in p.items()}, {k: v[j] for k, v in ref.items()})
    bad = v2_body(f, m)
    bad["inputs"][1]["name"] = "nope"
    r = requests.post(f"{base}/v2/models/two/infer", json=bad, timeout=60)
    assert r.status_code == 400 and "unknown input 'nope'" in r.text, r.text
    r = requests.post(f"{base}/v1/models/two:predict", json={"instances": [{"features": [0.5] * 16,
                                                                            "mask": [0.5] * 16}]}, timeout=60)
    assert r.status_code == 400 and "input 'mask'" in r.text, r.text


def test_concurrent_requests_meet_in_one_batch_and_a_bad_one_fails_alone(door):
    inputs = [two(1, seed=30 + i) for i in range(4)]
    bad_at = 1
    barrier = threading.Barrier(len(inputs))

    def one(i):
        body = v2_body(*inputs[i])
        if i == bad_at:
            body["inputs"][0]["shape"] = [1, 15]
            body["inputs"][0]["data"] = body["inputs"][0]["data"][:15]
        barrier.wait()
        return requests.post(f"{door['base']}/v2/models/two/infer", json=body, timeout=60)

    with ThreadPoolExecutor(len(inputs)) as pool:
        responses = list(pool.map(one, range(len(inputs))))
    for i, r in enumerate(responses):
        if i == bad_at:
            assert r.status_code == 400 and "the artifact needs 16" in r.text, r.text
        else:
            assert r.status_code == 200, r.text
            check(r.json()["outputs"], *inputs[i])
    log = door["container"].log()
    sizes = [int(n) for n in re.findall(r"batch of (\d+): 1 of \d+ request\(s\) rejected", log)]
    assert sizes and max(sizes) > 1, log[-3000:]
    assert "process died" not in door["container"].log("ts_log.log")


GRPC_CLIENT = """
import sys, json, numpy as np, tritonclient.grpc as g
c = g.InferenceServerClient(sys.argv[1])
out = {"ready": c.is_model_ready("two"), "live": c.is_server_live()}
meta = c.get_model_metadata("two", as_json=True)
out["inputs"] = [i["name"] for i in meta["inputs"]]
f = np.array(json.loads(sys.argv[2]), np.float32); m = np.array(json.loads(sys.argv[3]), bool)
a = g.InferInput("features", list(f.shape), "FP32"); a.set_data_from_numpy(f)
b = g.InferInput("mask", list(m.shape), "BOOL"); b.set_data_from_numpy(m)
r = c.infer("two", [a, b])
out["outputs"] = [{"name": o.name, "shape": list(o.shape), "data": r.as_numpy(o.name).flatten().tolist()}
                  for o in r.get_response().outputs]
b = g.InferInput("mask", [f.shape[0], 15], "BOOL"); b.set_data_from_numpy(m[:, :15].copy())
try:
    c.infer("two", [a, b])
except g.InferenceServerException as e:
    out["bad"] = [e.status(), e.message()]
print(json.dumps(out))
"""


def test_tritonclient_grpc_reaches_the_standard_service(door, kserve_env):
    import json

    f, m = two(2, seed=21)
    r = subprocess.run([str(kserve_env), "-c", GRPC_CLIENT, door["grpc"], json.dumps(f.tolist()),
                        json.dumps(m.tolist())], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ready"] and out["live"] and out["inputs"] == ["features", "mask"]
    check(out["outputs"], f, m)
    assert out["bad"][0] == "StatusCode.INVALID_ARGUMENT" and "the artifact needs 16" in out["bad"][1], out


SDK_CLIENTS = """
import asyncio, sys, json, numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, RESTConfig
from kserve.protocol.infer_type import InferInput, InferRequest
base, grpc_url = sys.argv[1], sys.argv[2]
f = np.array(json.loads(sys.argv[3]), np.float32); m = np.array(json.loads(sys.argv[4]), bool)

def request(mask):
    a = InferInput("features", list(f.shape), "FP32"); a.set_data_from_numpy(f)
    b = InferInput("mask", list(mask.shape), "BOOL"); b.set_data_from_numpy(mask)
    return InferRequest(model_name="two", infer_inputs=[a, b])

def outputs(res):
    return [{"name": o.name, "shape": list(o.shape), "data": o.as_numpy().flatten().tolist()} for o in res.outputs]

async def main():
    out = {}
    rest = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
    out["rest"] = outputs(await rest.infer(base, request(m), model_name="two"))
    try:
        await rest.infer(base, request(m[:, :15].copy()), model_name="two")
        out["rest_bad"] = "answered"
    except Exception as e:
        out["rest_bad"] = f"{type(e).__name__}: {e}"
    await rest.close()
    grpc = InferenceGRPCClient(grpc_url, timeout=60)
    out["grpc"] = outputs(await grpc.infer(request(m)))
    try:
        await grpc.infer(request(m[:, :15].copy()))
        out["grpc_bad"] = "answered"
    except Exception as e:
        out["grpc_bad"] = f"{type(e).__name__}: {getattr(e, 'code', lambda: '')()} {e}"
    await grpc.close()
    print(json.dumps(out))

asyncio.run(main())
"""

TRITON_HTTP_CLIENT = """
import sys, json, numpy as np, tritonclient.http as h
c = h.InferenceServerClient(sys.argv[1])
f = np.array(json.loads(sys.argv[2]), np.float32); m = np.array(json.loads(sys.argv[3]), bool)
out = {"ready": c.is_model_ready("two")}
for binary in (False, True):
    a = h.InferInput("features", list(f.shape), "FP32"); a.set_data_from_numpy(f, binary_data=binary)
    b = h.InferInput("mask", list(m.shape), "BOOL"); b.set_data_from_numpy(m, binary_data=binary)
    r = c.infer("two", [a, b], outputs=[h.InferRequestedOutput(n, binary_data=binary) for n in sys.argv[4].split(",")])
    out[f"binary_{binary}"] = [{"name": o["name"], "shape": o["shape"], "data": r.as_numpy(o["name"]).flatten().tolist()}
                               for o in r.get_response()["outputs"]]
b = h.InferInput("mask", [f.shape[0], 15], "BOOL"); b.set_data_from_numpy(m[:, :15].copy())
try:
    c.infer("two", [a, b])
    out["bad"] = "answered"
except h.InferenceServerException as e:
    out["bad"] = [e.status(), e.message()]
print(json.dumps(out))
"""


def _run_client(kserve_env, code, *args) -> dict:
    import json

    r = subprocess.run([str(kserve_env), "-c", code, *args], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kserve_sdk_rest_and_grpc_clients_equal_eager_and_bad_input_is_the_clients_fault(door, kserve_env):
    """The kserve SDK's own InferenceRESTClient (v2) and InferenceGRPCClient, as a KServe user
    calls a model: answers equal eager; an input of the wrong shape fails with 400 /
    INVALID_ARGUMENT naming what the artifact needs."""
    import json

    f, m = two(3, seed=22)
    out = _run_client(kserve_env, SDK_CLIENTS, door["base"], door["grpc"], json.dumps(f.tolist()),
                      json.dumps(m.tolist()))
    check(out["rest"], f, m)
    check(out["grpc"], f, m)
    assert "400" in out["rest_bad"] and "the artifact needs 16" in out["rest_bad"], out["rest_bad"]
    assert "INVALID_ARGUMENT" in out["grpc_bad"] and "the artifact needs 16" in out["grpc_bad"], out["grpc_bad"]


def test_tritonclient_http_json_and_binary_equal_eager(door, kserve_env):
    """tritonclient.http, with JSON tensors and with the binary tensor extension both ways."""
    import json

    f, m = two(2, seed=23)
    names = ",".join(eager("two_input", f, m))
    out = _run_client(kserve_env, TRITON_HTTP_CLIENT, door["base"].removeprefix("http://"),
                      json.dumps(f.tolist()), json.dumps(m.tolist()), names)
    assert out["ready"]
    check(out["binary_False"], f, m)
    check(out["binary_True"], f, m)
    assert str(out["bad"][0]) == "400" and "the artifact needs 16" in out["bad"][1], out["bad"]


def test_a_pod_whose_only_model_cannot_load_serves_the_reason_and_is_never_ready(kserve_env, artifacts,
                                                                                 tmp_path_factory):
    """One broken archive and nothing else: the front door still comes up, its ready route says
    false, its metadata route answers with the load error, and the readiness probe fails naming it."""
    from conftest import build_mar, corrupt_inside_mar
    from test_cluster_runtime import lay_out

    store = tmp_path_factory.mktemp("door_broken_store")
    bad = build_mar(artifacts.get("cls_export"), "bad", store)
    corrupt_inside_mar(bad)
    out = tmp_path_factory.mktemp("door_broken_out")
    r = lay_out([bad], out)
    assert r.returncode == 0, r.stderr
    c = Container(out / "storage", tmp_path_factory.mktemp("door_broken"), front_door_python=kserve_env)
    needle = "does not match its own archive's record"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert c.proc.poll() is None, c.log("stdout.log")[-3000:]
            try:
                if requests.get(f"{c.base}/v2/health/live", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(1)
        ready = requests.get(f"{c.base}/v2/models/bad/ready", timeout=5)
        assert ready.status_code != 200 or ready.json().get("ready") is False, ready.text
        meta = requests.get(f"{c.base}/v2/models/bad", timeout=5)
        assert meta.status_code >= 400 and needle in meta.text, meta.text
        for _ in range(2):
            p = c.probe("ready")
            assert p.returncode == 1 and needle in p.stdout, p.stdout
            time.sleep(1)
    finally:
        c.stop()
