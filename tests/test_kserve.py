"""Deploy on KServe: the storage layout and manifests `python -m compiled_serving.kserve` writes, served
by a real TorchServe started the way KServe's TorchServe runtime starts it
(`torchserve --start --model-store=<storage>/model-store --ts-config=<storage>/config/config.properties`,
with TS_SERVICE_ENVELOPE and PROTOCOL_VERSION set per protocol), called with real clients.

Only the listener ports of the generated config are rewritten (to free loopback ports); the test
asserts that nothing else changed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
import yaml
from conftest import PY, ROOT, build_mar, close, eager, image, two, cs_command
from kserve_kit import STORAGE_URI, crd_schema, unknown_fields

from compiled_serving.local_server import free_port, next_worker_port, server_env, tool
from compiled_serving.server_logs import read_log

# model name -> (artifact, archive.py arguments); "two" batches up to 4 requests.
MODELS = {
    "two": ("two_export", ["--batch-size", "4", "--max-batch-delay", "400"]),
    "cls": ("cls_export", []),
}
# protocolVersion -> what the runtime sets (kserve/pkg/apis/serving/v1beta1/inference_service_defaults.go:
# label serviceEnvelope -> TS_SERVICE_ENVELOPE in the runtime's container, PROTOCOL_VERSION env)
KSERVE_ENV = {
    "v1": {"TS_SERVICE_ENVELOPE": "kserve", "PROTOCOL_VERSION": "v1"},
    "v2": {"TS_SERVICE_ENVELOPE": "kservev2", "PROTOCOL_VERSION": "v2"},
    "grpc-v2": {"TS_SERVICE_ENVELOPE": "kservev2", "PROTOCOL_VERSION": "grpc-v2"},
}
PORT_KEYS = {"inference_address", "management_address", "metrics_address", "grpc_inference_port",
             "grpc_management_port"}
RESTART_MARKERS = ("process died", "Retry worker", "Auto recovery", "Worker disconnected")


def properties(text: str) -> dict:
    """key=value lines the way KServe's wrapper and TorchServe read them (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


# ---------------------------------------------------------------------------------------------
# The layout


@pytest.fixture(scope="session")
def layout(artifacts, tmp_path_factory):
    store = tmp_path_factory.mktemp("kserve_store")
    mars = [build_mar(artifacts.get(art), name, store, *extra) for name, (art, extra) in MODELS.items()]
    out = tmp_path_factory.mktemp("kserve_out")
    cmd = [*cs_command("kserve"), "--storage-uri", STORAGE_URI, "--out", str(out),
           "--name", "compiled", "--namespace", "ml",
           # the built-in runtime's layout, GPU manifests included and one CPU (the default runtime
           # and sizing are tests/test_cluster_runtime.py's)
           "--builtin-runtime", "--force-gpu", "--cpu", "1"]
    for m in mars:
        cmd += ["--mar", str(m)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=server_env())
    assert r.returncode == 0, r.stdout + r.stderr
    return {"out": out, "storage": out / "storage", "manifests": out / "manifests", "mars": mars,
            "stdout": r.stdout, "stderr": r.stderr}


@pytest.mark.server
def test_storage_layout_holds_the_archives_and_the_snapshot(layout):
    storage = layout["storage"]
    assert sorted(p.name for p in storage.iterdir()) == ["config", "model-store"]
    for mar in layout["mars"]:
        assert (storage / "model-store" / mar.name).read_bytes() == mar.read_bytes()
    cfg = properties((storage / "config" / "config.properties").read_text())
    snap = json.loads(cfg["model_snapshot"])
    assert snap["modelCount"] == 2 and set(snap["models"]) == set(MODELS)
    for mar in layout["mars"]:
        with zipfile.ZipFile(mar) as z:
            model_cfg = yaml.safe_load(z.read("model-config.yaml"))
            version = json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]["modelVersion"]
        entry = snap["models"][mar.stem][version]
        assert entry["marName"] == mar.name and entry["defaultVersion"] is True
        for key in ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout"):
            assert entry[key] == model_cfg[key], key
    # the frontend's logging, where config.properties' vmargs names it once mounted at /mnt/models
    assert (storage / "config" / "log4j2.xml").read_bytes() == (ROOT / "log4j2.xml").read_bytes()
    # and the JVM's caps after it (compiled_serving/kserve.py: heap, and direct memory for 4 bodies)
    from compiled_serving import kserve as kserve_script

    limit = kserve_script.body_limit([kserve_script.read_mar(str(m)) for m in layout["mars"]])
    assert cfg["vmargs"] == (f"-Dlog4j.configurationFile=/mnt/models/config/log4j2.xml -Xmx{kserve_script.JVM_HEAP_MIB}m "
                             f"-XX:MaxDirectMemorySize={kserve_script.direct_mib(limit)}m")
    assert cfg["max_request_size"] == str(limit) and limit < 128 << 20
    assert snap["models"]["two"]["1.0"]["batchSize"] == 4
    assert snap["models"]["two"]["1.0"]["maxBatchDelay"] == 400


@pytest.mark.server
def test_config_keeps_the_protections_and_documents_each_difference(layout):
    text = (layout["storage"] / "config" / "config.properties").read_text()
    kcfg = properties(text)
    local = properties((ROOT / "config.properties").read_text())
    # Listeners: all loopback (the wrapper and Knative's queue-proxy are in the pod).
    for key in ("inference_address", "management_address", "metrics_address"):
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", kcfg[key]), key
    assert kcfg["grpc_inference_address"] == kcfg["grpc_management_address"] == "127.0.0.1"
    # The wrapper owns 8080 (REST) and 8081 (gRPC): TorchServe must not take them.
    ports = {kcfg[k].rsplit(":", 1)[-1] for k in PORT_KEYS}
    assert not ports & {"8080", "8081"} and len(ports) == len(PORT_KEYS)
    assert kcfg["grpc_inference_port"] == "7070"  # the h2c containerPort of the grpc-v2 manifests
    for key in ("enable_model_api", "install_py_dep_per_model", "enable_envvars_config"):
        assert kcfg[key] == "false", key
    for key in ("max_response_size", "job_queue_size", "default_response_timeout"):
        assert kcfg[key] == local[key], key
    assert int(kcfg["max_request_size"]) < int(local["max_request_size"])  # the models' own, derived
    assert kcfg["ts_open_inference_protocol"] == "true"
    assert kcfg["disable_token_authorization"] == "true"
    allowed = re.compile(kcfg["allowed_urls"].replace("\\\\", "\\"))
    assert allowed.fullmatch("file:///mnt/models/model-store/two.mar")
    for url in ("file:///mnt/models/model-store/../x.mar", "file:///tmp/two.mar", "https://evil.example/two.mar",
                "file:///mnt/models/model-store/sub/two.mar"):
        assert not allowed.fullmatch(url), url
    # Every local setting is kept or deliberately dropped; every changed or new one says why.
    dropped = {"token_expiration_min"}  # tokens are off
    assert set(local) - set(kcfg) == dropped
    blocks = re.split(r"\n\s*\n", text)
    for key, value in kcfg.items():
        if key == "model_snapshot" or local.get(key) == value:
            continue
        block = next(b for b in blocks if re.search(rf"(?m)^{key}=", b))
        assert "DIFFERS" in block, f"{key} differs from config.properties without a DIFFERS note"
    # enable_envvars_config keeps its value but is documented against KServe's advice
    assert "DIFFERS" in next(b for b in blocks if "enable_envvars_config=" in b)


@pytest.mark.server
def test_kserve_wrapper_reads_the_config(layout):
    """What TorchServe's KServe wrapper (kubernetes/kserve/kserve_wrapper/__main__.py) derives."""
    cfg = properties((layout["storage"] / "config" / "config.properties").read_text())
    names = list(json.loads(cfg["model_snapshot"])["models"])
    assert sorted(names) == sorted(MODELS)
    predictor_host = cfg["inference_address"].split("//")[1]
    assert predictor_host == "127.0.0.1:8085"
    grpc_address = (cfg["inference_address"].split(":")[1] + ":" + cfg["grpc_inference_port"]).replace("/", "")
    assert grpc_address == "127.0.0.1:7070"
    assert cfg["model_store"] == "/mnt/models/model-store"


@pytest.mark.server
def test_manifests_are_valid_inference_services_naming_the_layout(layout):
    import jsonschema

    schema = crd_schema()
    files = sorted(layout["manifests"].glob("*.yaml"))
    assert [f.name for f in files] == sorted(
        f"compiled-{p}{d}.yaml" for p in ("v1", "v2", "grpc-v2") for d in ("", "-gpu"))
    # the example archives are CPU builds: the GPU manifests come with a warning
    assert "has no cuda variant" in layout["stderr"]
    for f in files:
        doc = yaml.safe_load(f.read_text())
        assert doc["apiVersion"] == "serving.kserve.io/v1beta1" and doc["kind"] == "InferenceService"
        jsonschema.Draft7Validator(schema).validate(doc)
        assert unknown_fields(doc, schema) == [], f.name
        assert doc["metadata"] == {"name": f.stem, "namespace": "ml"}
        model = doc["spec"]["predictor"]["model"]
        protocol = re.match(r"compiled-(v1|v2|grpc-v2)", f.stem).group(1)
        assert model["protocolVersion"] == protocol
        assert model["runtime"] == "kserve-torchserve" and model["modelFormat"] == {"name": "pytorch"}
        assert model["storageUri"] == STORAGE_URI
        res = model["resources"]
        assert res["requests"]["cpu"] == res["limits"]["cpu"] == "1"
        assert ("nvidia.com/gpu" in res["limits"]) == f.stem.endswith("-gpu")
        if f.stem.endswith("-gpu"):
            assert res["limits"]["nvidia.com/gpu"] == "1"
        if protocol == "grpc-v2":
            assert model["ports"] == [{"name": "h2c", "containerPort": 7070, "protocol": "TCP"}]
        else:
            assert "ports" not in model  # REST goes through the wrapper on the default 8080
    # the validation above can fail: a misspelt field and a wrong type are caught
    bad = yaml.safe_load(files[0].read_text())
    bad["spec"]["predictor"]["model"]["protocolversion"] = "v2"
    assert unknown_fields(bad, schema) == [".spec.predictor.model.protocolversion"]
    bad = yaml.safe_load(files[0].read_text())
    bad["spec"]["predictor"]["model"]["ports"] = [{"containerPort": "7070"}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)


@pytest.mark.server
def test_command_refuses_bad_input(layout, tmp_path):
    def run(*args):
        return subprocess.run([*cs_command("kserve"), *args], cwd=ROOT, capture_output=True, text=True)

    mar = str(layout["mars"][0])
    r = run("--mar", mar, "--storage-uri", STORAGE_URI, "--out", str(layout["out"]))
    assert r.returncode != 0 and "exists; pass --force" in r.stderr
    r = run("--mar", mar, "--mar", mar, "--storage-uri", STORAGE_URI, "--out", str(tmp_path / "a"))
    assert r.returncode != 0 and "same model name 'two'" in r.stderr
    r = run("--mar", mar, "--storage-uri", "bucket/path", "--out", str(tmp_path / "b"))
    assert r.returncode != 0 and "expected a URI" in r.stderr
    r = run("--mar", mar, "--storage-uri", STORAGE_URI, "--out", str(tmp_path / "c"), "--name", "Bad_Name")
    assert r.returncode != 0 and "DNS label" in r.stderr
    (tmp_path / "x.mar").write_bytes(b"not a zip")
    r = run("--mar", str(tmp_path / "x.mar"), "--storage-uri", STORAGE_URI, "--out", str(tmp_path / "d"))
    assert r.returncode != 0 and "not a readable .mar" in r.stderr


# ---------------------------------------------------------------------------------------------
# Units: the v2 binary extension, FP32 for half inputs, OIP gRPC replies, the envelope check

from worker_kit import admit  # noqa: E402

from handlers.admission import Limits  # noqa: E402
from handlers.artifact.metadata import ArtifactSpec, TensorSpec  # noqa: E402
from handlers.errors import ConfigError, RequestError  # noqa: E402
from handlers.wire import v2_binary  # noqa: E402

SPEC = ArtifactSpec(backend="export", artifact="m.pt2", sha256="", device="cpu",
                    inputs=(TensorSpec("x", "float32", (None, 4)), TensorSpec("m", "bool", (None, 4)),
                            TensorSpec("h", "float16", (None, 2))),
                    outputs=(TensorSpec("y", "float32", (None, 4)), TensorSpec("b", "bfloat16", (None, 2))),
                    output_structure="dict", batch_min=1, batch_max=8, torch_version=torch.__version__)
LIMITS = Limits(1 << 20, 64, 8, True)


def sample(rows=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, 4, generator=g), "m": torch.rand(rows, 4, generator=g) > 0.5,
            "h": torch.randn(rows, 2, generator=g).half()}


def triton_body(tensors, binary=True, outputs=None, request_id="u1"):
    """The exact bytes and header tritonclient sends (its own request builder)."""
    import tritonclient.http as httpclient
    from tritonclient.http._utils import _get_inference_request

    inputs = []
    for name, t in tensors.items():
        a = httpclient.InferInput(name, list(t.shape), {"x": "FP32", "m": "BOOL", "h": "FP16"}[name])
        a.set_data_from_numpy(t.numpy(), binary_data=binary and name != "m")  # mixed: m as JSON
        inputs.append(a)
    body, json_size = _get_inference_request(inputs, request_id, outputs, 0, False, False, 0, None, None)
    return body, (str(json_size) if json_size is not None else None)


def v2_admit(body, length, rid=None):
    return admit({"body": body}, SPEC, LIMITS, None, None, length)


def test_v2_binary_request_decodes_exactly_and_answers_in_binary():
    from tritonclient.http import InferResult

    t = sample()
    body, length = triton_body(t)
    assert length is not None and isinstance(body, bytes)
    req = v2_admit(body, length)
    for n in t:
        assert torch.equal(req.tensors[n], t[n]), n
    assert req.request_id == "u1"
    outs = {"y": t["x"] * 2, "b": t["h"].to(torch.bfloat16)}
    # no outputs named: tritonclient sets binary_data_output, so every output comes back binary
    reply, ctype, headers = req.encode(outs, "mod")
    head = int(headers[v2_binary.HEADER])
    assert ctype == "application/octet-stream" and isinstance(reply, bytes)
    res = InferResult.from_response_body(reply, header_length=head)
    assert np.array_equal(res.as_numpy("y"), outs["y"].numpy())
    meta = res.get_response()
    assert meta["id"] == "u1" and meta["model_name"] == "mod"
    assert all("data" not in o and o["parameters"]["binary_data_size"] for o in meta["outputs"])
    raw_b = reply[head + 3 * 4 * 4:]
    assert torch.equal(torch.frombuffer(bytearray(raw_b), dtype=torch.bfloat16).reshape(3, 2), outs["b"])


def test_v2_output_selection_and_binary_flags():
    import tritonclient.http as httpclient
    from tritonclient.http import InferResult

    t = sample(2)
    body, length = triton_body(t, outputs=[httpclient.InferRequestedOutput("y", binary_data=False)])
    req = v2_admit(body, length)
    reply, ctype, headers = req.encode({"y": t["x"], "b": t["h"].bfloat16()}, "mod")
    assert ctype == "application/json" and headers == {}
    got = json.loads(reply)
    assert [o["name"] for o in got["outputs"]] == ["y"]  # only what was asked for
    body, length = triton_body(t, outputs=[httpclient.InferRequestedOutput("b", binary_data=True)])
    req = v2_admit(body, length)
    reply, _, headers = req.encode({"y": t["x"], "b": t["h"].bfloat16()}, "mod")
    res = InferResult.from_response_body(reply, header_length=int(headers[v2_binary.HEADER]))
    assert [o["name"] for o in res.get_response()["outputs"]] == ["b"]
    with pytest.raises(RequestError, match="unknown output"):
        v2_admit(*triton_body(t, outputs=[httpclient.InferRequestedOutput("nope")]))
    # a JSON request (no binary inputs) asking for binary outputs gets them too
    body, length = triton_body(t, binary=False)
    assert length is None
    req = admit({"body": json.loads(body)}, SPEC, LIMITS)
    reply, ctype, headers = req.encode({"y": t["x"], "b": t["h"].bfloat16()}, "mod")
    assert ctype == "application/octet-stream" and v2_binary.HEADER in headers


def _frame(header: dict, raw: bytes) -> tuple:
    head = json.dumps(header).encode()
    return head + raw, str(len(head))


def _item(name, datatype, shape, size=None, **extra):
    item = {"name": name, "datatype": datatype, "shape": shape, **extra}
    if size is not None:
        item["parameters"] = {"binary_data_size": size}
    return item


GOOD = [_item("x", "FP32", [1, 4], 16), _item("m", "BOOL", [1, 4], 4), _item("h", "FP16", [1, 2], 4)]
GOOD_RAW = torch.zeros(4).numpy().tobytes() + bytes([1, 0, 1, 0]) + torch.zeros(2).half().numpy().tobytes()


def test_v2_binary_good_frame_parses():
    body, n = _frame({"inputs": GOOD}, GOOD_RAW)
    req = v2_admit(body, n)
    assert req.tensors["m"].tolist() == [[True, False, True, False]]


@pytest.mark.parametrize("mutate, header, message", [
    (lambda h, r: (h, r), "abc", "expected the JSON part's length"),
    (lambda h, r: (h, r), "0", "expected the JSON part's length"),
    (lambda h, r: (h, r), "-5", "expected the JSON part's length"),
    (lambda h, r: (h, r), "99999", "expected the JSON part's length"),
    (lambda h, r: (h, r), "9" * 5000, "expected the JSON part's length"),  # past int()'s digit limit
    (lambda h, r: (h, r), "\u0661\u0662", "expected the JSON part's length"),  # non-ASCII digits
    (lambda h, r: (h, r[:-1]), None, "bytes after the JSON header|left"),
    (lambda h, r: (h, r + b"\0"), None, "after the last binary input"),
    (lambda h, r: ([_item("x", "FP32", [1, 4], 12)] + h[1:], r), None, "needs 16 bytes"),
    (lambda h, r: ([_item("x", "FP32", [1, 4], -16)] + h[1:], r), None, "needs 16 bytes"),
    (lambda h, r: ([_item("x", "FP32", [1, 4], "16")] + h[1:], r), None, "needs 16 bytes"),
    (lambda h, r: ([_item("x", "FP32", [1, 4], 16, data=[0] * 4)] + h[1:], r), None, "both data"),
    (lambda h, r: ([_item("x", "FP32", [1, -4], 16)] + h[1:], r), None, "non-negative"),
    (lambda h, r: ([_item("x", "FP32", [1 << 40, 4], 16)] + h[1:], r), None, "needs"),
    (lambda h, r: ([_item("x", "INT32", [1, 4], 16)] + h[1:], r), None, "does not match"),
    (lambda h, r: ([_item("x", "BYTES", [1, 4], 16)] + h[1:], r), None, "unknown v2 datatype"),
    (lambda h, r: (h, r[:16] + bytes([1, 2, 0, 0]) + r[20:]), None, "BOOL bytes must be 0 or 1"),
    (lambda h, r: (h[:2], r), None, "missing input|after the last"),
])
def test_v2_binary_malformed_requests_are_400(mutate, header, message):
    items, raw = mutate(list(GOOD), GOOD_RAW)
    body, n = _frame({"inputs": items}, raw)
    with pytest.raises(RequestError, match=message) as e:
        v2_admit(body, header if header is not None else n)
    assert e.value.status == 400


def test_v2_binary_header_that_is_not_json_is_400():
    for body, n in ((b"\xff\xfe{}", "4"), (b"[1, 2]", "6"), (b"{\"inputs\": 3}xx", "13")):
        with pytest.raises(RequestError) as e:
            v2_admit(body, n)
        assert e.value.status == 400


def test_fp32_values_for_a_half_input_only_when_exact():
    body = {"inputs": [_item("x", "FP32", [1, 4], data=[0.0] * 4), _item("m", "BOOL", [1, 4], data=[True] * 4),
                       _item("h", "FP32", [1, 2], data=[0.5, -2.0])]}
    req = admit({"body": body}, SPEC, LIMITS)
    assert req.tensors["h"].dtype == torch.float16 and req.tensors["h"].tolist() == [[0.5, -2.0]]
    from handlers.wire import kserve_v2

    tensors = kserve_v2.FORMAT.decode(kserve_v2.FORMAT.parse(body), SPEC)  # the format alone, stateless
    assert torch.equal(tensors["h"], req.tensors["h"])
    body["inputs"][2]["data"] = [0.1, 1.0]
    with pytest.raises(RequestError, match="not exactly representable as float16"):
        admit({"body": body}, SPEC, LIMITS)
    del body["inputs"][2]["data"]  # what TorchServe's gRPC frontend makes of FP16 contents
    with pytest.raises(RequestError, match="TorchServe 0.12's OIP gRPC frontend drops FP16"):
        admit({"body": body}, SPEC, LIMITS)


class FakeContext:
    def __init__(self, headers):
        self.headers = headers

    def get_all_request_header(self, idx):
        return self.headers[idx]


def test_oip_replies_are_complete():
    from handlers.errors import PayloadTooLarge, ServingError
    from handlers.torchserve import headers
    from handlers.torchserve.oip import batch_failure
    from handlers.wire import oip_grpc as oip

    def is_grpc(ctx, idx, request):  # as the pipeline asks: the format's own transport test
        return oip.FORMAT.arrival(request, headers.read(ctx, idx), None) is not None

    grpc_req = {"body": {"id": "", "model_name": "two", "inputs": []}}
    ctx = FakeContext([{"body": {"content-type": "application/json"}},
                       {"body": {"content-type": "application/json"}, "Host": "x"}])
    assert is_grpc(ctx, 0, grpc_req) and not is_grpc(ctx, 1, grpc_req)
    assert not is_grpc(ctx, 0, {"body": {"inputs": []}})
    # header-less bodies as bytes: the JSON one is parsed (handed on, the request unchanged), a
    # binary one is left alone unparsed
    raw = {"body": bytearray(b' {"id": "q", "model_name": "two", "inputs": []}')}
    arrived = oip.FORMAT.arrival(raw, headers.read(ctx, 0), None)
    assert arrived.body["model_name"] == "two" and arrived.request_id == "q" and isinstance(raw["body"], bytearray)
    from handlers.wire import safetensors_io

    binary = {"body": safetensors_io.dumps({"x": torch.zeros(4, 3)})}
    calls = []
    real_loads = oip.strict_json.loads
    oip.strict_json.loads = lambda b: calls.append(len(b)) or real_loads(b)
    try:
        assert not is_grpc(ctx, 0, binary) and isinstance(binary["body"], bytearray)
    finally:
        oip.strict_json.loads = real_loads
    assert calls == []  # never parsed: JSON-parsing a large binary body cost 14 ms (bench, H100)
    r = json.loads(oip.reply({"y": torch.ones(1, 2).half(), "i": torch.ones(1, dtype=torch.int64)}, "", "two", "1.0"))
    assert r["id"] == "" and r["model_name"] == "two" and r["model_version"] == "1.0"
    assert r["outputs"][0] == {"name": "y", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 1.0]}
    assert r["outputs"][1]["datatype"] == "INT64"
    e = json.loads(oip.error_reply(RequestError("bad"), "g1", "two", "1.0"))
    assert e["id"] == "g1" and e["model_version"] == "1.0"
    assert e["outputs"] == [{"name": "error", "datatype": "BYTES", "shape": [1],
                             "data": [{"code": 400, "type": "InvalidInput", "message": "bad"}]}]
    assert batch_failure([RequestError("a")]).error_code == 400
    assert batch_failure([RequestError("a"), PayloadTooLarge("b")]).error_code == 400
    assert batch_failure([PayloadTooLarge("a"), PayloadTooLarge("b")]).error_code == 413
    assert batch_failure([RequestError("a"), ServingError("b")]).error_code == 500


def test_envelope_is_detected_from_the_loader_frame():
    from ts.torch_handler.request_envelope.kservev2 import KServev2Envelope

    from handlers.torchserve.envelope import refuse_envelope

    def initialize():
        refuse_envelope()

    def load(envelope, wrap):  # the shape of ts.model_loader.TsModelLoader.load
        entry_point = (lambda data, ctx: data)
        if wrap:
            entry_point = KServev2Envelope(entry_point).handle
        initialize()
        return entry_point

    load(None, False)
    with pytest.raises(ConfigError, match="TS_SERVICE_ENVELOPE=kservev2.*enable_envvars_config=false"):
        load("kservev2", True)


# ---------------------------------------------------------------------------------------------
# TorchServe as KServe's runtime starts it


class KServeTorchServe:
    """`torchserve --start` (no --foreground, no --models: the runtime's exact arguments) on a
    copy of the layout whose listener ports alone are moved to free loopback ports."""

    def __init__(self, storage: Path, workdir: Path, protocol: str, overrides=None):
        self.workdir = workdir
        mnt = workdir / "mnt" / "models"
        shutil.copytree(storage, mnt)
        cfg_path = mnt / "config" / "config.properties"
        original = cfg_path.read_text()
        self.ports = {}
        lines = []
        for line in original.splitlines():
            key = line.split("=", 1)[0] if "=" in line and not line.startswith("#") else None
            if key in PORT_KEYS:
                self.ports[key] = free_port()
                line = re.sub(r"\d+$", str(self.ports[key]), line)
            elif key in (overrides or {}):
                line = f"{key}={overrides[key]}"
            elif key == "vmargs":  # the log configuration, where the runtime mounts the storage
                line = line.replace("/mnt/models/", f"{mnt}/")
            lines.append(line)
        # worker ports apart from the other servers of this run (compiled_serving/local_server.next_worker_port)
        lines.append(f"initial_worker_port={next_worker_port()}")
        text = "\n".join(lines) + "\n"
        changed = {k for k, v in properties(text).items() if properties(original).get(k) != v}
        assert changed == PORT_KEYS | {"initial_worker_port", "vmargs"} | set(overrides or {}), changed
        cfg_path.write_text(text)
        self.cfg = properties(text)
        self.base = self.cfg["inference_address"]
        self.mgmt = self.cfg["management_address"]
        self.grpc = f"127.0.0.1:{self.ports['grpc_inference_port']}"
        self.env = server_env()
        self.env.update(KSERVE_ENV[protocol])
        self.env["TMPDIR"] = str(workdir / "tmp")  # the pod's own /tmp: pid file, worker sockets
        (workdir / "tmp").mkdir()
        cmd = [tool("torchserve"), "--start", f"--model-store={mnt}/model-store",
               f"--ts-config={cfg_path}"]
        # The launcher exits once the frontend runs; the frontend keeps its stdout: a file, not a pipe.
        with open(workdir / "stdout.log", "w") as out:
            r = subprocess.run(cmd, cwd=workdir, env=self.env, stdout=out, stderr=subprocess.STDOUT, timeout=120)
        assert r.returncode == 0, (workdir / "stdout.log").read_text()
        self.models = list(json.loads(self.cfg["model_snapshot"])["models"])

    def ready(self, name) -> bool:
        """The readiness call KServe's wrapper makes (TorchserveModel.load): no token."""
        try:
            r = requests.get(f"{self.mgmt}/models/{name}?customized=false", timeout=5)
            return any(w["status"] == "READY" for w in r.json()[0]["workers"])
        except (requests.RequestException, ValueError, KeyError, IndexError):
            return False

    def wait_ready(self, timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if all(self.ready(n) for n in self.models):
                return
            time.sleep(1)
        raise TimeoutError(f"not ready: {self.log('ts_log.log')[-3000:]}\n{self.log()[-3000:]}")

    def log(self, name="model_log.log") -> str:
        return read_log(self.workdir / "logs" / name)

    def assert_no_worker_restarts(self):
        text = self.log("ts_log.log")
        found = [m for m in RESTART_MARKERS if m in text]
        assert not found, f"worker restarts ({found}): {text[-3000:]}"

    def stop(self):
        subprocess.run([tool("torchserve"), "--stop"], cwd=self.workdir, env=self.env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


@pytest.fixture(scope="module")
def kserve_ts(layout, tmp_path_factory):
    servers = {}
    lock = threading.Lock()

    def get(protocol: str) -> KServeTorchServe:
        with lock:
            if protocol not in servers:
                ts = KServeTorchServe(layout["storage"], tmp_path_factory.mktemp(f"kserve_{protocol}"), protocol)
                servers[protocol] = ts
                ts.wait_ready()
            return servers[protocol]

    yield get
    for ts in servers.values():
        ts.stop()


def v2_inputs(f, m, binary=False):
    import tritonclient.http as httpclient

    a = httpclient.InferInput("features", list(f.shape), "FP32")
    a.set_data_from_numpy(f.numpy(), binary_data=binary)
    b = httpclient.InferInput("mask", list(m.shape), "BOOL")
    b.set_data_from_numpy(m.numpy(), binary_data=binary)
    return [a, b]


def v2_outputs(binary=False):
    import tritonclient.http as httpclient

    return [httpclient.InferRequestedOutput(n, binary_data=binary) for n in eager("two_input", *two(1))]


def triton(ts):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(url=ts.base.split("//")[1], network_timeout=120,
                                            connection_timeout=120)


def check_v2(result, f, m, request_id):
    ref = eager("two_input", f, m)
    got = {n: torch.from_numpy(np.array(result.as_numpy(n))) for n in ref}
    close(got, ref)
    resp = result.get_response()
    assert resp["model_name"] == "two" and resp["id"] == request_id
    assert {o["name"] for o in resp["outputs"]} == set(ref)


@pytest.mark.server
def test_v2_rest_json_with_tritonclient(kserve_ts):
    ts = kserve_ts("v2")
    client = triton(ts)
    f, m = two(3, seed=31)
    result = client.infer("two", v2_inputs(f, m), outputs=v2_outputs(), request_id="r-31")
    check_v2(result, f, m, "r-31")
    # without requested outputs tritonclient asks for binary outputs; the JSON answer still parses
    result = client.infer("two", v2_inputs(f, m), request_id="r-32")
    check_v2(result, f, m, "r-32")
    import tritonclient.http as httpclient

    x = image(2, seed=33)
    inp = httpclient.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x.numpy(), binary_data=False)
    out = client.infer("cls", [inp], outputs=[httpclient.InferRequestedOutput("output", binary_data=False)])
    close({"output": torch.from_numpy(out.as_numpy("output"))}, eager("classifier", x))


@pytest.mark.server
def test_v2_concurrent_batch_and_a_bad_request_failing_alone(kserve_ts):
    from tritonclient.utils import InferenceServerException

    ts = kserve_ts("v2")
    inputs = [two(n, seed=40 + i) for i, n in enumerate([1, 2, 3, 1, 2, 1, 3, 2])]
    bad_at = 5
    barrier = threading.Barrier(len(inputs))

    def one(i):
        f, m = inputs[i]
        reqs = v2_inputs(f, m)
        if i == bad_at:  # features with 15 columns instead of 16
            import tritonclient.http as httpclient

            reqs[0] = httpclient.InferInput("features", [f.shape[0], 15], "FP32")
            reqs[0].set_data_from_numpy(f[:, :15].contiguous().numpy(), binary_data=False)
        client = triton(ts)
        barrier.wait()
        try:
            return client.infer("two", reqs, outputs=v2_outputs(), request_id=f"b{i}")
        except InferenceServerException as e:
            return e
        finally:
            client.close()

    with ThreadPoolExecutor(len(inputs)) as pool:
        results = list(pool.map(one, range(len(inputs))))
    for i, (res, (f, m)) in enumerate(zip(results, inputs)):
        if i == bad_at:
            assert isinstance(res, InferenceServerException), res
            assert res.status() == "400" and "dimension 1" in res.message(), (res.status(), res.message())
        else:
            assert not isinstance(res, Exception), res
            check_v2(res, f, m, f"b{i}")
    # the bad request was refused inside a batch of several (the handler's own log line), so
    # batches really formed with the runtime's TS_SERVICE_ENVELOPE set
    sizes = [int(n) for n in re.findall(r"batch of (\d+): 1 of \d+ request\(s\) rejected", ts.log())]
    assert sizes and max(sizes) > 1, ts.log()[-3000:]
    ts.assert_no_worker_restarts()


@pytest.mark.server
def test_v2_rest_binary_tensors_with_tritonclient(kserve_ts):
    ts = kserve_ts("v2")
    f, m = two(4, seed=51)
    result = triton(ts).infer("two", v2_inputs(f, m, binary=True), outputs=v2_outputs(binary=True),
                              request_id="bin-51")
    check_v2(result, f, m, "bin-51")
    assert result.get_response().get("outputs") and all(
        o.get("parameters", {}).get("binary_data_size") for o in result.get_response()["outputs"])
    # binary inputs, JSON outputs; and a truncated body is the request's own 400
    result = triton(ts).infer("two", v2_inputs(f, m, binary=True), outputs=v2_outputs(), request_id="bin-52")
    check_v2(result, f, m, "bin-52")
    head = json.dumps({"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 64}}]}).encode()
    r = requests.post(f"{ts.base}/v2/models/two/infer", data=head + b"\0" * 10, timeout=60,
                      headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 400 and "needs 64 bytes after the JSON header" in r.text, r.text
    ts.assert_no_worker_restarts()


@pytest.mark.server
def test_v2_metadata_and_ready_routes_are_absent_in_torchserve_0_12(kserve_ts):
    """Documented limit: TorchServe 0.12 answers no v2 model metadata/ready route."""
    ts = kserve_ts("v2")
    for path in ("/v2/models/two", "/v2/models/two/ready"):
        assert requests.get(ts.base + path, timeout=10).status_code == 404, path


@pytest.mark.server
def test_v1_predict_matches_eager_in_a_concurrent_batch(kserve_ts):
    ts = kserve_ts("v1")
    url = f"{ts.base}/v1/models/two:predict"
    inputs = [two(n, seed=60 + i) for i, n in enumerate([2, 1, 3, 1, 2, 2])]
    bad_at = 2
    barrier = threading.Barrier(len(inputs))

    def one(i):
        f, m = inputs[i]
        inst = [{"features": f[j].tolist(), "mask": m[j].tolist()} for j in range(f.shape[0])]
        if i == bad_at:
            inst[0]["mask"] = [0.5] * 16  # floats for a bool input
        barrier.wait()
        return requests.post(url, json={"instances": inst}, timeout=120)

    with ThreadPoolExecutor(len(inputs)) as pool:
        responses = list(pool.map(one, range(len(inputs))))
    for i, (r, (f, m)) in enumerate(zip(responses, inputs)):
        if i == bad_at:
            assert r.status_code == 400, r.text
            assert "input 'mask'" in r.json()["message"]
            continue
        assert r.status_code == 200, r.text
        preds = r.json()["predictions"]
        ref = eager("two_input", f, m)
        assert len(preds) == f.shape[0]
        for j, p in enumerate(preds):
            close({k: torch.tensor(v) for k, v in p.items()}, {k: v[j] for k, v in ref.items()})
    x = image(2, seed=66)  # a single-input model takes bare instances
    r = requests.post(f"{ts.base}/v1/models/cls:predict", json={"instances": x.tolist()}, timeout=120)
    assert r.status_code == 200, r.text
    close({"output": r.json()["predictions"]}, eager("classifier", x))
    sizes = [int(n) for n in re.findall(r"batch of (\d+): 1 of \d+ request\(s\) rejected", ts.log())]
    assert sizes and max(sizes) > 1, ts.log()[-3000:]
    ts.assert_no_worker_restarts()


@pytest.mark.server
def test_management_and_model_api_stay_closed(kserve_ts):
    ts = kserve_ts("v1")
    # registration over the network stays off even without tokens
    r = requests.post(f"{ts.mgmt}/models?url=https://example.invalid/x.mar", timeout=10)
    assert r.status_code == 405, r.text
    # the inference listener does not serve the management API
    assert requests.get(f"{ts.base}/models", timeout=10).status_code in (404, 405)


# ---------------------------------------------------------------------------------------------
# grpc-v2: the Open Inference Protocol's gRPC service on TorchServe's gRPC port


@pytest.fixture(scope="module")
def oip(tmp_path_factory):
    import grpc_tools
    import ts as ts_pkg
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("oip")
    jar = os.path.join(os.path.dirname(ts_pkg.__file__), "frontend", "model-server.jar")
    with zipfile.ZipFile(jar) as z:
        (out / "open_inference_grpc.proto").write_bytes(z.read("proto/open_inference_grpc.proto"))
    includes = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    assert protoc.main(["protoc", f"-I{out}", f"-I{includes}", f"--python_out={out}",
                        f"--grpc_python_out={out}", str(out / "open_inference_grpc.proto")]) == 0
    sys.path.insert(0, str(out))
    import open_inference_grpc_pb2
    import open_inference_grpc_pb2_grpc

    return open_inference_grpc_pb2, open_inference_grpc_pb2_grpc


@pytest.mark.server
def test_grpc_v2_model_ready(kserve_ts, oip):
    import grpc

    pb2, pb2_grpc = oip
    ts = kserve_ts("grpc-v2")
    with grpc.insecure_channel(ts.grpc) as channel:
        stub = pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb2.ServerLiveRequest(), timeout=30).live
        assert stub.ModelReady(pb2.ModelReadyRequest(name="two"), timeout=30).ready


def grpc_request(pb2, f, m, request_id, features=None):
    features = f if features is None else features
    return pb2.ModelInferRequest(model_name="two", id=request_id, inputs=[
        pb2.ModelInferRequest.InferInputTensor(
            name="features", datatype="FP32", shape=list(features.shape),
            contents=pb2.InferTensorContents(fp32_contents=features.reshape(-1).tolist())),
        pb2.ModelInferRequest.InferInputTensor(
            name="mask", datatype="BOOL", shape=list(m.shape),
            contents=pb2.InferTensorContents(bool_contents=m.reshape(-1).tolist())),
    ])


def check_grpc(resp, f, m, request_id):
    assert resp.model_name == "two" and resp.id == request_id and resp.model_version == "1.0"
    ref = eager("two_input", f, m)
    got = {o.name: torch.tensor(list(o.contents.fp32_contents)).reshape(list(o.shape)) for o in resp.outputs}
    assert all(o.datatype == "FP32" for o in resp.outputs)
    close(got, ref)


@pytest.mark.server
def test_grpc_v2_model_infer(kserve_ts, oip):
    import grpc

    pb2, pb2_grpc = oip
    ts = kserve_ts("grpc-v2")
    f, m = two(3, seed=71)
    req = pb2.ModelInferRequest(model_name="two", id="g-71", inputs=[
        pb2.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(f.shape),
                                               contents=pb2.InferTensorContents(fp32_contents=f.reshape(-1).tolist())),
        pb2.ModelInferRequest.InferInputTensor(name="mask", datatype="BOOL", shape=list(m.shape),
                                               contents=pb2.InferTensorContents(bool_contents=m.reshape(-1).tolist())),
    ])
    with grpc.insecure_channel(ts.grpc) as channel:
        resp = pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=60)
    check_grpc(resp, f, m, "g-71")
    ts.assert_no_worker_restarts()


@pytest.mark.server
def test_grpc_v2_bad_requests_get_a_status_and_the_worker_lives(kserve_ts, oip):
    import grpc

    pb2, pb2_grpc = oip
    ts = kserve_ts("grpc-v2")
    f, m = two(2, seed=72)
    with grpc.insecure_channel(ts.grpc) as channel:
        stub = pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:  # 15 columns instead of 16, alone in its batch
            stub.ModelInfer(grpc_request(pb2, f, m, "g-bad", features=f[:, :15].contiguous()), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "dimension 1" in e.value.details(), e.value.details()
        # FP16 contents: the frontend drops them (no typed field), the reply says so and how to fix
        req = grpc_request(pb2, f, m, "g-half")
        req.inputs[0].datatype = "FP16"
        req.inputs[0].ClearField("contents")
        req.raw_input_contents.append(f.half().numpy().tobytes())
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "drops FP16/BF16 contents and raw_input_contents" in e.value.details(), e.value.details()
        check_grpc(stub.ModelInfer(grpc_request(pb2, f, m, "g-after"), timeout=60), f, m, "g-after")
    ts.assert_no_worker_restarts()


@pytest.mark.server
def test_grpc_v2_concurrent_batch_with_a_bad_request(kserve_ts, oip):
    import grpc

    pb2, pb2_grpc = oip
    ts = kserve_ts("grpc-v2")
    inputs = [two(n, seed=90 + i) for i, n in enumerate([1, 2, 3, 1, 2, 1, 3, 2])]
    bad_at = 3
    barrier = threading.Barrier(len(inputs))

    def one(i):
        f, m = inputs[i]
        req = grpc_request(pb2, f, m, f"gb{i}", features=f[:, :15].contiguous() if i == bad_at else None)
        with grpc.insecure_channel(ts.grpc) as channel:
            stub = pb2_grpc.GRPCInferenceServiceStub(channel)
            barrier.wait()
            try:
                return stub.ModelInfer(req, timeout=120)
            except grpc.RpcError as e:
                return e

    with ThreadPoolExecutor(len(inputs)) as pool:
        results = list(pool.map(one, range(len(inputs))))
    for i, (res, (f, m)) in enumerate(zip(results, inputs)):
        if i != bad_at:
            assert not isinstance(res, Exception), res
            check_grpc(res, f, m, f"gb{i}")
        elif isinstance(res, grpc.RpcError):  # alone in its batch: a real status
            assert res.code() == grpc.StatusCode.INVALID_ARGUMENT and "dimension 1" in res.details()
        else:  # inside a batch with good requests: a complete reply whose output `error` says why
            assert res.id == f"gb{i}" and [o.name for o in res.outputs] == ["error"]
            err = json.loads(res.outputs[0].contents.bytes_contents[0])
            assert err["code"] == 400 and "dimension 1" in err["message"], err
    sizes = [int(n) for n in re.findall(r"batch of (\d+)", ts.log())]
    assert sizes and max(sizes) > 1, ts.log()[-3000:]
    ts.assert_no_worker_restarts()


@pytest.mark.server
def test_envelope_from_kserve_docs_fails_the_load_naming_the_setting(layout, tmp_path_factory):
    """KServe's docs set enable_envvars_config=true, which makes TS_SERVICE_ENVELOPE=kservev2 wrap
    the handler: only the first request of a batch would be passed on. The handler refuses to
    load instead, naming the setting and the fix; the model never becomes READY."""
    ts = KServeTorchServe(layout["storage"], tmp_path_factory.mktemp("kserve_envelope"), "v2",
                          overrides={"enable_envvars_config": "true"})
    try:
        deadline = time.time() + 240
        while time.time() < deadline and "enable_envvars_config=false" not in ts.log():
            assert not any(ts.ready(n) for n in ts.models), ts.log()[-3000:]
            time.sleep(1)
        log = ts.log()
        assert "TS_SERVICE_ENVELOPE=kservev2" in log and "enable_envvars_config=false" in log, log[-3000:]
        time.sleep(3)
        assert not any(ts.ready(n) for n in ts.models)
    finally:
        ts.stop()


def test_the_probes_name_the_port_pod_status_serves_them_on(tmp_path):
    """The kubelet's probes go to pod.status's own listener (PROBE_PORT), not to nginx's public
    port, whose connections one client's flood can hold (issue 63): the runtime template, the
    runtime cs-kserve writes, the image's PROBE_PORT and the pod's default all name one port."""
    import re as _re

    import yaml as _yaml

    from compiled_serving import kserve
    from pod import config as pod_config

    template = _yaml.safe_load(open(kserve.RUNTIME_TEMPLATE))
    written = kserve.runtime_docs("repo", "2.11", ["cpu", "gpu"])
    for doc in [template, *written]:
        for probe in kserve.PROBES:
            assert doc["spec"]["containers"][0][probe]["httpGet"]["port"] == kserve.PROBE_PORT, (probe, doc)
    dockerfile = open(Path(kserve.ROOT) / "kserve" / "Dockerfile").read()
    assert f"PROBE_PORT={kserve.PROBE_PORT}" in dockerfile and _re.search(rf"EXPOSE .*\b{kserve.PROBE_PORT}\b", dockerfile)
    store = Path(kserve.ROOT) / "kserve" / "config.properties"
    props = store.read_text() + '\nmodel_snapshot={"models": {"m": {"1": {}}}}\n'
    props = props.replace("\nvmargs=", "\nvmargs=-XX:MaxDirectMemorySize=400m ")  # a cap for its 128 MiB bodies
    (tmp_path / "config.properties").write_text(props)
    assert pod_config.load(str(tmp_path / "config.properties"), env={}).probe_port == kserve.PROBE_PORT
