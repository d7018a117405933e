"""The KServe pod (pod/: nginx in front of TorchServe's inference API, the gRPC bridge, the
status process), started by the image's entrypoint as the image starts it, called with the
clients KServe users have: v2 REST (JSON and binary), v1 with curl, the v2 metadata/ready/health
routes, tritonclient gRPC and HTTP, and the kserve SDK's REST and gRPC clients (the SDK and
tritonclient run in .venv-kserve, which scripts/setup_kserve_env.sh creates). Then what a
stranger on the pod's ports may try (the repository API), client errors on every route, bodies
over the limit, a worker killed mid-request, and broken archives."""
from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import psutil
import pytest
import requests
import torch

from conftest import ROOT, close, eager, two
from handlers import protowire
from kserve_kit import Container, grpc_infer_request, lay_out

pytestmark = pytest.mark.server

KPY = Path(ROOT) / ".venv-kserve" / "bin" / "python"
OIP = "/inference.GRPCInferenceService/"
# the pod's max_request_size as cs-kserve derives it for the model "two" (its 8 MiB JSON limit and
# a sixteenth; tests/test_cluster_runtime.py checks the derivation)
LIMIT = (8 << 20) + (8 << 20) // 16


@pytest.fixture(scope="module")
def door(cluster_layout, tmp_path_factory):
    """The image's entrypoint as the image runs it: TorchServe on the storage's loopback
    addresses, nginx, the gRPC bridge and the status process on the container's ports."""
    c = Container(cluster_layout[0] / "storage", tmp_path_factory.mktemp("door"),
                  properties={"max_response_size": LIMIT})
    try:
        c.wait("ready")
        yield {"base": c.base, "grpc": c.grpc_target, "container": c}
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
    """Four requests at once, one malformed: the three good ones answer right and the bad one
    alone gets 400, in every round; and in some round they met in one batch (the log's batch of
    more than 1 with one rejection). Up to three rounds: on a loaded CI host the four may miss the
    batch window (maxBatchDelay 300 ms) once."""
    rounds = []
    for attempt in range(3):
        log_at = len(door["container"].log())
        concurrent_round(door, seed=30 + 10 * attempt)
        log = door["container"].log()[log_at:]
        rounds.append([int(n) for n in re.findall(r"batch of (\d+): 1 of \d+ request\(s\) rejected", log)])
        if rounds[-1] and max(rounds[-1]) > 1:
            break
    assert any(r and max(r) > 1 for r in rounds), rounds
    assert "process died" not in door["container"].log("ts_log.log")


def concurrent_round(door, seed: int) -> None:
    inputs = [two(1, seed=seed + i) for i in range(4)]
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


def test_a_pod_whose_archives_are_broken_serves_the_reasons_and_is_never_ready(artifacts, cluster_mar,
                                                                              tmp_path_factory):
    """A good archive, one whose artifact was damaged after archiving and one truncated in
    transfer: the pod comes up and stays up (liveness passes, no crash loop), the good model
    answers, and the server's and each broken model's ready and metadata routes, over REST and
    gRPC, name the reason; the readiness probe fails naming both."""
    from conftest import build_mar, corrupt_inside_mar

    store = tmp_path_factory.mktemp("door_broken_store")
    bad = build_mar(artifacts.get("cls_export"), "bad", store)
    corrupt_inside_mar(bad)
    cut = build_mar(artifacts.get("cls_export"), "cut", store)
    out = tmp_path_factory.mktemp("door_broken_out")
    r = lay_out([cluster_mar, bad, cut], out)
    assert r.returncode == 0, r.stderr
    stored = out / "storage" / "model-store" / "cut.mar"
    stored.write_bytes(stored.read_bytes()[: stored.stat().st_size // 2])
    c = Container(out / "storage", tmp_path_factory.mktemp("door_broken"))
    needle = "does not match its own archive's record"
    try:
        c.wait("live")
        deadline = time.time() + 180
        while needle not in c.probe("ready").stdout and time.time() < deadline:
            time.sleep(1)
        p = c.probe("ready")
        assert p.returncode == 1 and needle in p.stdout and "cut.mar is not a readable .mar" in p.stdout, p.stdout
        ready = requests.get(f"{c.base}/v2/models/bad/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["ready"] is False and needle in ready.json()["reason"]
        meta = requests.get(f"{c.base}/v2/models/cut", timeout=5)
        assert meta.status_code == 503 and "BadZipFile" in meta.json()["error"], meta.text
        assert str(out) not in meta.text and "model-store/" not in meta.text, meta.text  # no host path
        deadline = time.time() + 180
        while requests.get(f"{c.base}/v2/models/two/ready", timeout=5).status_code != 200 and time.time() < deadline:
            time.sleep(1)
        assert requests.get(f"{c.base}/v2/models/two/ready", timeout=5).json()["ready"] is True
        assert c.probe("ready").returncode == 1  # the good model alone does not make the pod ready
        with grpc.insecure_channel(c.grpc_target) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(OIP + "ModelMetadata")(protowire.encode_string(1, "bad"), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and needle in e.value.details()
            answer, call = ch.unary_unary(OIP + "ServerReady").with_call(b"", timeout=10)
            assert answer == protowire.encode_bool(1, False)
            assert needle in dict(call.trailing_metadata())["ready-reason"], call.trailing_metadata()
            answer, call = ch.unary_unary(OIP + "ModelReady").with_call(protowire.encode_string(1, "bad"), timeout=10)
            assert answer == protowire.encode_bool(1, False)
            assert needle in dict(call.trailing_metadata())["ready-reason"], call.trailing_metadata()
        f, m = two(2, seed=3)
        good = requests.post(f"{c.base}/v2/models/two/infer", json=v2_body(f, m), timeout=60)
        assert good.status_code == 200, good.text
        # inference on a broken model says it is not ready, and why where the handler knows:
        # its failed load's own words pass through nginx; TorchServe's "Model not found" for the
        # archive it could not register becomes "not ready" (the reason is on the ready route)
        failed = requests.post(f"{c.base}/v2/models/bad/infer", json=v2_body(f, m), timeout=60)
        assert failed.status_code == 503 and needle in failed.json()["message"], failed.text
        cut_answer = requests.post(f"{c.base}/v2/models/cut/infer", json=v2_body(f, m), timeout=60)
        assert cut_answer.status_code == 503, cut_answer.text
        assert "not ready" in cut_answer.json()["error"] and "not found" not in cut_answer.text.lower(), cut_answer.text
        time.sleep(3)
        c.wait("live")
        assert c.proc.poll() is None and "exited" not in c.log("stdout.log"), c.log("stdout.log")[-2000:]
    finally:
        c.stop()


# ---------------------------------------------------------------------------------------------
# What a stranger on the pod's ports may try, and client errors on every route


def raw_two(f, m) -> bytes:
    return grpc_infer_request("two", [("features", "FP32", list(f.shape), None), ("mask", "BOOL", list(m.shape), None)],
                              [f.numpy().tobytes(), m.numpy().astype("uint8").tobytes()])


def test_the_generate_routes_on_a_model_that_does_not_generate_say_so(door):
    for route in ("generate", "generate_stream"):
        r = requests.post(f"{door['base']}/v2/models/two/{route}", json={"text_input": "hi"}, timeout=60)
        assert r.status_code == 400 and "not a language model" in r.json()["message"], r.text


def test_no_route_on_the_pods_ports_can_change_the_server(door):
    """The KServe repository API over REST (403) and gRPC (UNIMPLEMENTED), TorchServe's
    management routes and its other inference routes (404): none reaches TorchServe; the model
    still answers afterwards."""
    base = door["base"]
    for path in ("/v2/repository/models/two/unload", "/v2/repository/models/two/load", "/v2/repository/index"):
        r = requests.post(f"{base}{path}", json={}, timeout=10)
        assert r.status_code == 403 and "cannot be loaded, unloaded or changed" in r.json()["error"], (path, r.text)
    for method, path in (("POST", "/models?url=two.mar"), ("DELETE", "/models/two"), ("PUT", "/models/two?min_worker=0"),
                         ("GET", "/models"), ("GET", "/api-description"), ("POST", "/predictions/two"),
                         ("DELETE", "/v2/models/two"), ("GET", "/metrics")):
        r = requests.request(method, f"{base}{path}", timeout=10)
        assert r.status_code in (403, 404, 405), (method, path, r.status_code, r.text)
    with grpc.insecure_channel(door["grpc"]) as ch:
        for rpc in ("RepositoryModelUnload", "RepositoryModelLoad", "RepositoryIndex"):
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(OIP + rpc)(protowire.encode_string(2, "two"), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, rpc
        f, m = two(2, seed=9)
        out = ch.unary_unary(OIP + "ModelInfer")(raw_two(f, m), timeout=60)
        assert protowire.first_string(out, 1) == "two"
    assert requests.get(f"{base}/v2/models/two/ready", timeout=5).json()["ready"] is True
    f, m = two(1, seed=10)
    assert requests.post(f"{base}/v2/models/two/infer", json=v2_body(f, m), timeout=60).status_code == 200
    # metrics are served, read-only, on their own port
    metrics = requests.get(f"http://127.0.0.1:{door['container'].public_metrics}/metrics", timeout=10)
    assert metrics.status_code == 200 and "ts_inference_requests_total" in metrics.text
    assert requests.post(f"http://127.0.0.1:{door['container'].public_metrics}/metrics", timeout=10).status_code == 403


REST_ERRORS = [
    # (what, body, headers, status, words the message must hold)
    ("shape and data disagree", lambda f, m: json.dumps({"inputs": [
        {"name": "features", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 15}]}), {}, 400, "needs 16 values"),
    ("strings declared FP32", lambda f, m: json.dumps({"inputs": [
        {"name": "features", "shape": [1, 2], "datatype": "FP32", "data": ["a", "b"]}]}), {}, 400, "features"),
    ("NaN token", lambda f, m: '{"inputs": [{"name": "features", "shape": [1, 1], "datatype": "FP32", "data": [NaN]}]}',
     {}, 400, "NaN"),
    ("empty body", lambda f, m: b"", {"Content-Type": "application/json"}, 400, ""),
    ("not JSON", lambda f, m: b"{not json", {"Content-Type": "application/json"}, 400, "JSON"),
    ("unsupported media type", lambda f, m: b"abc", {"Content-Type": "image/png"}, 415, "Content-Type"),
    ("wrong binary_data_size", lambda f, m: json.dumps({"inputs": [
        {"name": "features", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 60}},
        {"name": "mask", "shape": [1, 16], "datatype": "BOOL", "parameters": {"binary_data_size": 16}}]}).encode()
     + b"\0" * 76, "v2bin", 400, "binary_data_size"),
]


@pytest.mark.parametrize("case", REST_ERRORS, ids=[c[0] for c in REST_ERRORS])
def test_client_errors_over_rest_are_4xx_and_the_connection_stays_usable(door, case):
    what, make, headers, status, words = case
    f, m = two(1, seed=12)
    body = make(f, m)
    body = body.encode() if isinstance(body, str) else body
    if headers == "v2bin":
        head = body[: body.index(b"}]}") + 3]
        headers = {"Inference-Header-Content-Length": str(len(head))}
    conn = http.client.HTTPConnection("127.0.0.1", door["container"].http, timeout=60)
    conn.request("POST", "/v2/models/two/infer", body=body, headers=headers)
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == status, (what, r.status, text)
    err = json.loads(text)
    assert words in (err.get("message") or err.get("error") or ""), (what, text)
    # the same keep-alive connection answers the next request
    conn.request("POST", "/v2/models/two/infer", body=json.dumps(v2_body(f, m)), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    check(json.loads(r.read())["outputs"], f, m)
    conn.close()


def test_the_handlers_413_reaches_the_client_with_its_own_reason(door):
    """A request of 1,025 rows (the model takes 1,024 per request) is far under nginx's body limit:
    the 413 is the handler's, and the client must read the handler's words (which limit), over
    REST and gRPC, not nginx's body-size text."""
    rows = 1025
    f, m = two(rows, seed=21)
    r = requests.post(f"{door['base']}/v2/models/two/infer", json=v2_body(f, m), timeout=60)
    assert r.status_code == 413, r.text
    assert "request carries 1025 rows; this model accepts at most 1024" in r.json()["message"], r.text
    assert "larger than" not in r.text
    req = grpc_infer_request("two", [("features", "FP32", [rows, 16], None), ("mask", "BOOL", [rows, 16], None)],
                             [f.numpy().tobytes(), m.numpy().astype("uint8").tobytes()])
    with grpc.insecure_channel(door["grpc"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(OIP + "ModelInfer")(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    assert "request carries 1025 rows" in e.value.details(), e.value.details()


# names a client might send to reach something else through TorchServe's request line
FORGED_NAMES = ["nope", "two%3Fx=1", "two%20x", "two%0d%0aX-Evil:%201", "..%2Ftwo", "two%2F..", "TWO"]


@pytest.mark.parametrize("name", FORGED_NAMES)
def test_inference_names_are_checked_against_the_pods_models_before_forwarding(door, name):
    f, m = two(1, seed=22)
    conn = http.client.HTTPConnection("127.0.0.1", door["container"].http, timeout=30)
    for path in (f"/v2/models/{name}/infer", f"/v1/models/{name}:predict", f"/v2/models/{name}/versions/1.0/infer"):
        conn.request("POST", path, body=json.dumps(v2_body(f, m)), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode()
        # no such model (named); a path of dots resolves to another route: no such route, or a
        # status route that takes GET only (405); never forwarded, always JSON
        assert r.status in (404, 405), (path, r.status, text)
        error = json.loads(text)["error"]
        assert error.startswith("no such model") and "it serves two" in error or r.status == 405 \
            or error.startswith("no such route"), text
    conn.close()


def test_a_version_the_pod_does_not_serve_is_404_and_its_own_is_answered(door):
    f, m = two(1, seed=23)
    wrong = requests.post(f"{door['base']}/v2/models/two/versions/7/infer", json=v2_body(f, m), timeout=30)
    assert wrong.status_code == 404 and "no such model and version" in wrong.json()["error"], wrong.text
    right = requests.post(f"{door['base']}/v2/models/two/versions/1.0/infer", json=v2_body(f, m), timeout=60)
    assert right.status_code == 200, right.text
    check(right.json()["outputs"], f, m)


def test_client_errors_over_grpc_are_invalid_argument(door):
    f, m = two(1, seed=13)
    fp32 = protowire.Writer()
    fp32.packed_varints(3, [1] * 16)  # int64_contents for an FP32 input
    cases = {
        "int64_contents for an FP32 input": grpc_infer_request("two", [("features", "FP32", [1, 16], fp32.bytes()),
                                                                       ("mask", "BOOL", [1, 16], None)]),
        "raw size": grpc_infer_request("two", [("features", "FP32", [1, 16], None), ("mask", "BOOL", [1, 16], None)],
                                       [b"\0" * 60, b"\0" * 16]),
        "truncated message": raw_two(f, m)[:-7],
        "shape and raw disagree": grpc_infer_request("two", [("features", "FP32", [2, 16], None),
                                                             ("mask", "BOOL", [1, 16], None)],
                                                     [f.numpy().tobytes(), b"\1" * 16]),
    }
    with grpc.insecure_channel(door["grpc"]) as ch:
        call = ch.unary_unary(OIP + "ModelInfer")
        for what, req in cases.items():
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details(), (what, e.value)
        # a valid request naming a model this pod does not serve is never answered by the one it does
        f2, m2 = two(1, seed=16)
        other = grpc_infer_request("nope", [("features", "FP32", [1, 16], None), ("mask", "BOOL", [1, 16], None)],
                                   [f2.numpy().tobytes(), m2.numpy().astype("uint8").tobytes()])
        with pytest.raises(grpc.RpcError) as e:
            call(other, timeout=60)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details(), e.value
        raw = [f2.numpy().tobytes(), m2.numpy().astype("uint8").tobytes()]
        ins = [("features", "FP32", [1, 16], None), ("mask", "BOOL", [1, 16], None)]
        with pytest.raises(grpc.RpcError) as e:  # no name: as the bridge answers it
            call(grpc_infer_request("", ins, raw), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_name is empty" in e.value.details()
        versioned = protowire.Writer()
        versioned.string(2, "7")  # model_version 7: the pod serves 1.0
        with pytest.raises(grpc.RpcError) as e:
            call(grpc_infer_request("two", ins, raw) + versioned.bytes(), timeout=60)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "version '7'" in e.value.details(), e.value
        out = call(raw_two(f, m), timeout=60)  # the channel still serves
        assert protowire.first_string(out, 1) == "two"


def test_a_model_stream_outlives_the_body_limit_and_a_malformed_tensor_is_an_error_message(door):
    """One ModelStreamInfer call (tritonclient's start_stream) carrying requests that add up to
    more than the pod's body limit (twelve of 1 MiB against LIMIT, 8.5 MiB), with an INT64 raw
    content of 7 bytes among them: every request is answered on the stream with its own
    error_message (the pod's model is no decoder, so no request here generates), and the call
    stays open to the last. Before, nginx counted the call's whole body against
    client_max_body_size and reset it past LIMIT, and the 7-byte raw content ended the call with
    the bridge's struct.error."""
    import queue

    pad = grpc_infer_request("two", [("padding", "FP32", [1 << 18], None)], [b"\0" * (1 << 20)])
    bad = grpc_infer_request("two", [("input_ids", "INT64", [1], None)], [b"\1" * 7])
    sends = [pad] * 6 + [bad] + [pad] * 6 + [bad]
    assert sum(map(len, sends)) > LIMIT
    outbox = queue.Queue()

    def requests_():
        while (item := outbox.get(timeout=60)) is not None:
            yield item
    errors = []
    with grpc.insecure_channel(door["grpc"]) as ch:
        replies = ch.stream_stream(OIP + "ModelStreamInfer")(requests_(), timeout=120)
        for req in sends:  # one at a time: each answered before the next goes
            outbox.put(req)
            errors.append(protowire.first_string(next(replies), 1))
        outbox.put(None)
        assert list(replies) == []  # the call ended as the client ended it, not reset
    assert all("unknown input 'padding'" in e for e in errors[:6] + errors[7:13]), errors
    for e in (errors[6], errors[13]):
        assert "raw INT64 content of 7 bytes" in e, errors


def nginx_connections(container) -> int:
    """Every connection nginx can hold: worker_processes x worker_connections of its rendered conf."""
    conf = (container.root / "run" / "nginx.conf").read_text()
    workers = int(re.search(r"(?m)^worker_processes (\d+);", conf).group(1))
    return workers * int(re.search(r"worker_connections (\d+);", conf).group(1))


def test_the_probes_pass_while_one_client_holds_every_connection_of_nginx_with_half_sent_headers(door):
    """A bounded slowloris on loopback: one client opens 300 more connections to the REST port than
    nginx can hold, each with a request's headers half sent and a header line more a moment later
    (so nginx is reading them: no idle connection it could reuse), re-opens any nginx closes, and
    lets go after 15 s. The kubelet's probes, as the runtime declares them (pod.status's own
    PROBE_PORT), pass every second throughout, while the public port itself fails; nginx closes
    the half-sent requests after client_header_timeout (10 s) and serves again once the client lets
    go. The probe port serves the probes alone. Before, the probes named 8080 and failed with it."""
    c = door["container"]
    flood, public_failed, probes, closed = [], 0, [], 0
    n = nginx_connections(c) + 300
    t0 = time.monotonic()
    try:
        flood = [_half_request(c.http) for _ in range(n)]
        for s in flood:
            _trickle(s)
        while time.monotonic() - t0 < 15:
            probes.append((c.probe("live").returncode, c.probe("ready").returncode))
            try:
                requests.get(f"{door['base']}/v2/health/live", timeout=1)
            except requests.RequestException:
                public_failed += 1
            for i, s in enumerate(flood):  # the attacker's refill: bounded by n
                if _closed_by_peer(s):
                    s.close()
                    closed += 1
                    flood[i] = _half_request(c.http)
            time.sleep(0.5)
    finally:
        for s in flood:
            s.close()
    print(f"{n} half-sent requests held 15 s: {len(probes)} probe rounds, the public port failed "
          f"{public_failed} times, nginx closed {closed}")
    assert public_failed > 0, "the flood never held nginx: the test proves nothing"
    assert probes and all(p == (0, 0) for p in probes), probes
    assert closed > nginx_connections(c) // 2, closed  # client_header_timeout closed the half-sent ones
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if requests.get(f"{door['base']}/v2/health/live", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            time.sleep(0.5)
    f, m = two(1, seed=24)
    assert requests.post(f"{door['base']}/v2/models/two/infer", json=v2_body(f, m), timeout=60).status_code == 200
    other = requests.get(f"http://127.0.0.1:{c.probe_port}/v2/models/two", timeout=5)
    assert other.status_code == 404 and "probes only" in other.json()["error"], other.text


def _half_request(port: int):
    import socket

    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    except OSError:
        pass  # nginx's backlog full: the flood holds it
    return s


def _trickle(s) -> None:
    try:
        s.sendall(b"X-a: b\r\n")
    except OSError:
        pass


def _closed_by_peer(s) -> bool:
    try:
        s.settimeout(0.0)
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset (reset_timedout_connection) or never connected


def rss_mib(pids) -> float:
    return sum(psutil.Process(p).memory_info().rss for p in pids) / 2**20


def pod_pids(container) -> list:
    """Every process of the pod: nginx, the bridge, the status process, TorchServe's JVM, workers."""
    return [p.pid for p in container.processes()]


def test_bodies_over_the_limit_are_refused_at_the_door_and_the_pods_memory_stays_bounded(door):
    """Four 100 MB bodies at once on each route (REST v2 with a Content-Length, chunked REST v2,
    REST v1, gRPC ModelInfer) against the limit cs-kserve derived from the model: every one refused
    (413 naming the limit, RESOURCE_EXHAUSTED), the whole pod's RSS within 64 MiB of before, and
    the model still answering."""
    c = door["container"]
    pids = pod_pids(c)
    before = rss_mib(pids)
    big = b"\0" * (100 * 2**20)
    base, json_type = door["base"], {"Content-Type": "application/json"}

    def rest(path, chunked=False):
        data = (big[i:i + 2**20] for i in range(0, len(big), 2**20)) if chunked else big
        r = requests.post(f"{base}{path}", data=data, headers=json_type, timeout=120)
        return r.status_code, r.text

    def grpc_call():
        with grpc.insecure_channel(door["grpc"], options=[("grpc.max_send_message_length", -1)]) as ch:
            try:
                ch.unary_unary(OIP + "ModelInfer")(grpc_infer_request("two", [], [big]), timeout=120)
                return "answered", ""
            except grpc.RpcError as e:
                return e.code(), e.details()
    calls = [lambda: rest("/v2/models/two/infer"), lambda: rest("/v2/models/two/infer", True),
             lambda: rest("/v1/models/two:predict"), grpc_call]
    with ThreadPoolExecutor(16) as pool:
        answers = [f.result() for f in [pool.submit(call) for call in calls for _ in range(4)]]
    for status, text in answers[:12]:
        assert status == 413, text
    for status, text in answers[:4] + answers[8:12]:
        assert str(LIMIT) in json.loads(text)["error"], text  # nginx's own limit, with its number
    for code, _ in answers[12:]:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    time.sleep(1.0)
    grew = rss_mib(pids) - before
    print(f"the pod's RSS {before:.0f} MiB, grew {grew:.0f} MiB over sixteen 100 MB bodies")
    assert grew < 64, grew
    f, m = two(1, seed=14)
    assert requests.post(f"{door['base']}/v2/models/two/infer", json=v2_body(f, m), timeout=60).status_code == 200


# each client sends its body again as soon as it is answered, for this long. On the 2-core CI
# host the flood's refused bodies (each read whole by nginx before the gate answers it) leave the
# admitted ones about 0.35 a second: 12 s let 4 to 5 through (two fresh-clone runs), under the 6
# the test asks of both routes together; 24 s lets about twice that through.
FLOOD_S = 24.0


@pytest.mark.parametrize("rest_clients, grpc_clients, size", [
    (32, 16, int(LIMIT * 0.98)),  # issue 63: sixteen of these took the model down for minutes
    (96, 32, 999_999)])  # the largest of the pool's tiers: 128 at once ran the frontend out as well
def test_a_flood_of_bodies_under_the_limit_never_takes_the_model_down(door, rest_clients, grpc_clients, size):
    """Clients over REST and gRPC, each sending a body of `size` bytes (0.98 of the pod's limit; or
    999,999) and again as soon as it is answered, for 12 s, against the shipped settings
    (max_request_size 8,912,896, the frontend's direct memory as cs-kserve sized it): every answer
    the handler's (400, 413 / RESOURCE_EXHAUSTED), or a truthful 503 with Retry-After / UNAVAILABLE
    naming the pod's limit, never "the worker died"; bodies keep reaching the handler; a one-row
    client answered within 3 s throughout (2.06 s seen once on the loaded 2-core CI host); no OutOfMemoryError in the frontend's log. Before, Netty
    ran out of direct memory at once, the clients read 503 "worker died" and the model hung for
    its 120 s responseTimeout."""
    c = door["container"]
    small, done = [], threading.Event()
    watcher = threading.Thread(target=_small_client, args=(door, small, done))
    watcher.start()
    t0 = time.monotonic()
    try:
        answers = _flood(door, size, rest_clients, grpc_clients)
    finally:
        time.sleep(2.0)  # the small client goes on a moment after the flood
        done.set()
        watcher.join()
    counts = {}
    for status, _, _ in answers:
        counts[str(status)] = counts.get(str(status), 0) + 1
    slow = [s for s in small if s[0] != 200 or s[1] > 3.0]
    print(f"{rest_clients} REST and {grpc_clients} gRPC clients of {size}-byte bodies for {time.monotonic() - t0:.1f} s: "
          f"{counts}; the small client {len(small)} requests, {len(slow)} failed or over 3 s: {slow[:5]}")
    for status, retry_after, text in answers:
        if isinstance(status, int):
            assert status in (400, 413) or (status == 503 and retry_after == "1"), (status, text)
            assert status != 503 or ("died" not in text and str(LIMIT) in json.loads(text)["error"]), text
        else:
            assert status in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE), (status, text)
            assert "died" not in text and ("rows" in text or str(LIMIT) in text), text
    # bodies keep reaching the handler, by both routes: the gate admits two near-limit bodies at once,
    # so how the 48 clients share them is the scheduler's (a loaded CI host gave gRPC 1 of 7)
    rest_in = counts.get("400", 0) + counts.get("413", 0)
    grpc_in = counts.get(str(grpc.StatusCode.RESOURCE_EXHAUSTED), 0)
    assert rest_in + grpc_in >= 6 and rest_in >= 1 and grpc_in >= 1, counts
    assert len(small) > 10 and not slow, slow
    for name in ("ts_log.log", "stdout.log"):
        assert "OutOfMemoryError" not in c.log(name), c.log(name)[-3000:]


def test_the_bridge_gives_back_the_memory_of_large_calls(door):
    """Three rounds of sixteen ModelInfer calls of 8.7 MB at once, straight to the gRPC bridge's
    loopback port (where a several-model pod's calls go): each answered RESOURCE_EXHAUSTED (the
    handler's row limit) or UNAVAILABLE (the gate), and 5 s later the bridge's RSS within 100 MiB of
    before. Before, it kept 530 MiB (failed calls' requests held in reference cycles, freed
    memory in malloc's arenas)."""
    c = door["container"]
    bridge = next(p for p in c.processes() if "pod.grpc_bridge" in " ".join(p.cmdline()))
    rows = (int(LIMIT * 0.98) - 200) // 80
    message = grpc_infer_request("two", [("features", "FP32", [rows, 16], None), ("mask", "BOOL", [rows, 16], None)],
                                 [b"\0" * (rows * 64), b"\0" * (rows * 16)])
    before = bridge.memory_info().rss / 2**20

    def call(_):
        with grpc.insecure_channel(f"127.0.0.1:{c.bridge}", options=[("grpc.max_send_message_length", -1)]) as ch:
            try:
                ch.unary_unary(OIP + "ModelInfer")(message, timeout=60)
                return "answered"
            except grpc.RpcError as e:
                return e.code()
    for _ in range(3):
        with ThreadPoolExecutor(16) as pool:
            codes = set(pool.map(call, range(16)))
        assert codes <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}, codes
    time.sleep(5.0)
    after = bridge.memory_info().rss / 2**20
    print(f"the bridge's RSS {before:.0f} MiB before, {after:.0f} MiB 5 s after 48 calls of 8.7 MB")
    assert after - before < 100, (before, after)


def _flood(door, size: int, rest_clients: int, grpc_clients: int) -> list:
    """(status or gRPC code, Retry-After, text) of every answer to the flood's clients."""
    head, tail = b'{"inputs": [], "pad": "', b'"}'
    body = head + b"x" * (size - len(head) - len(tail)) + tail
    rows = (size - 200) // 80  # FP32 features and BOOL mask, 16 each: 80 bytes a row
    message = grpc_infer_request("two", [("features", "FP32", [rows, 16], None), ("mask", "BOOL", [rows, 16], None)],
                                 [b"\0" * (rows * 64), b"\0" * (rows * 16)])
    barrier = threading.Barrier(rest_clients + grpc_clients)

    def rest():
        out, session = [], requests.Session()
        barrier.wait()
        until = time.monotonic() + FLOOD_S
        while time.monotonic() < until:
            r = session.post(f"{door['base']}/v2/models/two/infer", data=body,
                             headers={"Content-Type": "application/json"}, timeout=180)
            out.append((r.status_code, r.headers.get("Retry-After"), r.text))
        return out

    def grpc_client():
        out = []
        with grpc.insecure_channel(door["grpc"], options=[("grpc.max_send_message_length", -1)]) as ch:
            call = ch.unary_unary(OIP + "ModelInfer")
            barrier.wait()
            until = time.monotonic() + FLOOD_S
            while time.monotonic() < until:
                try:
                    call(message, timeout=180)
                    out.append(("answered", None, ""))
                except grpc.RpcError as e:
                    out.append((e.code(), None, e.details()))
        return out
    with ThreadPoolExecutor(rest_clients + grpc_clients) as pool:
        futures = [pool.submit(rest) for _ in range(rest_clients)] + [pool.submit(grpc_client) for _ in range(grpc_clients)]
        return [a for f in futures for a in f.result()]


def _small_client(door, out: list, done) -> None:
    """One-row requests, one every 0.2 s until `done`: (status, seconds) of each."""
    f, m = two(1, seed=25)
    while not done.is_set():
        t0 = time.monotonic()
        try:
            status = requests.post(f"{door['base']}/v2/models/two/infer", json=v2_body(f, m), timeout=5).status_code
        except requests.RequestException as e:
            status = type(e).__name__
        out.append((status, time.monotonic() - t0))
        time.sleep(0.2)


def test_a_worker_killed_mid_request_is_a_retryable_503_and_unavailable(door):
    """Every worker of the model stopped, one REST and one gRPC request sent to them, then the
    workers killed: the requests in flight get 503 / UNAVAILABLE (retry), not 500 or
    INVALID_ARGUMENT; the pod is ready again once TorchServe has restarted them. Runs after the
    others but the stop: the workers are new afterwards."""
    c = door["container"]
    workers = [p for p in c.processes() if "model_service_worker" in " ".join(p.cmdline())]
    assert workers
    for w in workers:
        w.send_signal(signal.SIGSTOP)
    f, m = two(1, seed=15)
    with ThreadPoolExecutor(2) as pool:
        rest = pool.submit(requests.post, f"{door['base']}/v2/models/two/infer", json=v2_body(f, m), timeout=120)

        def grpc_call():
            with grpc.insecure_channel(door["grpc"]) as ch:
                try:
                    ch.unary_unary(OIP + "ModelInfer")(raw_two(f, m), timeout=120)
                    return "answered"
                except grpc.RpcError as e:
                    return e.code()
        g = pool.submit(grpc_call)
        time.sleep(2.0)  # both are in a batch sent to a stopped worker
        for w in workers:
            w.send_signal(signal.SIGKILL)
        r = rest.result()
        assert r.status_code == 503 and "retry" in r.json()["error"], r.text
        assert g.result() == grpc.StatusCode.UNAVAILABLE
    c.wait("ready", timeout=240)
    assert requests.post(f"{door['base']}/v2/models/two/infer", json=v2_body(f, m), timeout=60).status_code == 200


def test_the_pods_ports_answer_on_ipv6_where_the_host_has_it(door):
    """On an IPv6-only cluster the probes and the Service's traffic reach the pod's IPv6 address:
    nginx listens there too where the host can (pod/nginx.py), and not at all where it cannot
    (an IPv6 listener would stop nginx from starting)."""
    from pod import nginx
    if not nginx.ipv6_available():
        pytest.skip("this host cannot listen on IPv6")
    c = door["container"]
    r = requests.get(f"http://[::1]:{c.http}/v2/health/live", timeout=5)
    assert r.status_code == 200 and r.json() == {"live": True}, r.text
    f, m = two(1, seed=19)
    r = requests.post(f"http://[::1]:{c.http}/v2/models/two/infer", json=v2_body(f, m), timeout=60)
    assert r.status_code == 200, r.text
    check(r.json()["outputs"], f, m)
    with grpc.insecure_channel(f"[::1]:{c.grpc}") as ch:
        ch.unary_unary(OIP + "ModelInfer")(raw_two(f, m), timeout=30)
    off = nginx.ipv6_listens(SimpleNamespace(http_port=1, grpc_port=2, metrics_port=3), False)
    assert all(v.startswith("#") for v in off.values())


def test_sigterm_fails_readiness_and_the_pod_serves_on_while_the_cluster_stops_sending(door):
    """As the kubelet stops a container: SIGTERM to its first process (the entrypoint, which execs
    pod.start). Kubernetes removes the pod from the endpoints while it sends SIGTERM, so requests
    keep arriving for a few seconds: readiness fails while the pod serves on, REST and gRPC
    requests sent in the next 3 s (and after readiness failed) are answered right (STOP_DRAIN_S
    is 5), then the pod exits 0. Runs last:
    it stops the module's pod."""
    c = door["container"]
    # the frontend's temp files (each archive unpacked, the workers' sockets) under RUNTIME_DIR,
    # not in /tmp, which a read-only root filesystem refuses
    assert any((c.root / "run" / "tmp" / "models").iterdir())
    f, m = two(2, seed=17)
    c.proc.send_signal(signal.SIGTERM)
    t0, answered, not_ready_after, last_sent = time.monotonic(), 0, None, 0.0
    with grpc.insecure_channel(door["grpc"]) as ch:
        # for 3 s, and on until readiness has failed (a loaded host's probe may take longer), but
        # no later than a second before the drain ends (pod/config.py STOP_DRAIN_S, 5 s)
        while time.monotonic() - t0 < 3.0 or not_ready_after is None and time.monotonic() - t0 < 4.0:
            last_sent = time.monotonic() - t0
            r = requests.post(f"{door['base']}/v2/models/two/infer", json=v2_body(f, m), timeout=30)
            assert r.status_code == 200, r.text
            check(r.json()["outputs"], f, m)
            ch.unary_unary(OIP + "ModelInfer")(raw_two(f, m), timeout=30)
            answered += 1
            if not_ready_after is None and c.probe("ready").returncode != 0:
                not_ready_after = answered
                assert "stopping" in c.probe("ready").stdout
            time.sleep(0.1)
    # what Kubernetes needs: readiness failed while the pod still answered, and it answered after
    assert not_ready_after is not None, f"readiness still passed {time.monotonic() - t0:.1f} s after SIGTERM"
    assert answered > not_ready_after, f"no request answered after readiness failed ({answered} in all)"
    assert c.probe("live").returncode == 0, "liveness must hold while the pod drains (else the kubelet kills it)"
    assert c.proc.wait(timeout=90) == 0
    # every request of the whole window (at least 3 s after SIGTERM) was answered right (above); how
    # many fit in it depends on the host's load (each turn runs a probe process: 4 on a loaded CI
    # host), so only that the window was served through is asserted, not a count
    assert answered >= 2 and last_sent >= 1.5, (answered, last_sent)
