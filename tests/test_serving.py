"""End to end through real TorchServe: compiled artifacts served over REST, equal to eager."""

import json

import pytest
import torch
from conftest import close, eager, image, two

from handlers.wire import safetensors_io

pytestmark = pytest.mark.server


@pytest.mark.parametrize("model", ["cls_aoti", "cls_so", "cls_export"])
def test_classifier_matches_eager(main_server, model):
    x = image(3, seed=11)
    r = main_server.predict(model, {"inputs": {"image": x.tolist()}})
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    close(r.json()["outputs"], eager("classifier", x))


@pytest.mark.parametrize("model", ["two_aoti", "two_export"])
def test_two_inputs_dict_outputs_match_eager(main_server, model):
    f, m = two(5, seed=3)
    r = main_server.predict(model, {"inputs": {"features": f.tolist(), "mask": m.tolist()}})
    assert r.status_code == 200, r.text
    close(r.json()["outputs"], eager("two_input", f, m))


def test_token_required(main_server):
    body = {"inputs": {"image": image(1).tolist()}}
    missing = main_server.predict("cls_export", body, auth=False)
    bad = main_server.predict("cls_export", body, auth=False, headers={"Authorization": "Bearer nope"})
    # TorchServe 0.12 answers a missing and a wrong token alike (observed: 400, not 401)
    want = {"code": 400, "type": "InvalidKeyException",
            "message": "Token Authorization failed. Token either incorrect, expired, or not provided correctly"}
    assert (missing.status_code, missing.json()) == (400, want), missing.text
    assert (bad.status_code, bad.json()) == (400, want), bad.text
    assert main_server.predict("cls_export", body).status_code == 200


def test_management_key_is_not_an_inference_key(main_server):
    r = main_server.predict("cls_export", {"inputs": {"image": image(1).tolist()}}, auth=False,
                            headers=main_server.auth("management"))
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "InvalidKeyException" and r.json()["message"].startswith("Token Authorization failed")


def test_model_registration_api_is_off(main_server):
    import requests

    r = requests.post(f"{main_server.mgmt}/models?url=http://example.invalid/x.mar",
                      headers=main_server.auth("management"), timeout=10)
    assert r.status_code == 405, r.text  # enable_model_api=false: registration is not a method here
    assert "not allowed" in r.json()["message"]


@pytest.mark.parametrize("model", ["two_aoti", "two_export"])
def test_bad_requests_get_4xx_and_worker_survives(main_server, model):
    f, m = two(2)
    good = {"inputs": {"features": f.tolist(), "mask": m.tolist()}}
    cases = [
        (b'{"inputs": {"features": [[1.0, 2.0]', "malformed JSON"),
        ({"inputs": {"features": f.tolist(), "mask": m.tolist(), "extra": [[1]]}}, "unknown input 'extra'"),
        ({"inputs": {"features": torch.randn(2, 15).tolist(), "mask": m.tolist()}}, "dimension 1"),
        ({"inputs": {"features": f.tolist(), "mask": torch.randn(2, 16).tolist()}}, "expected bool"),
        ({"inputs": {"features": f.tolist()}}, "missing input"),
        ({"inputs": {"features": [[1.0] * 16, [2.0] * 15], "mask": m.tolist()}},
         "input 'features': not a rectangular array: [1] has 15 entries where [0] has 16; every row must have "
         "the same length"),
        # KServe v1 instances of different lengths: which one, in words (not numpy's internals)
        ({"instances": [{"features": f[0].tolist(), "mask": m[0].tolist()},
                        {"features": f[1, :12].tolist(), "mask": m[1].tolist()}]},
         "input 'features': not a rectangular array: [1] has 12 entries where [0] has 16"),
        ({"inputs": {"features": [["a"] * 16] * 2, "mask": m.tolist()}}, "features"),
        ({"inputs": {"features": torch.randn(3, 16).tolist(), "mask": m.tolist()}}, "disagree"),
        ({"something": 1}, "neither `inputs` nor `instances`"),
        # rank: one dimension too many
        ({"inputs": {"features": torch.randn(2, 16, 1).tolist(), "mask": m.tolist()}},
         "input 'features': shape [2, 16, 1] has rank 3, expected rank 2"),
        # zero rows (expressible in v2: shape [0, 16])
        ({"inputs": [{"name": "features", "shape": [0, 16], "datatype": "FP32", "data": []},
                     {"name": "mask", "shape": [0, 16], "datatype": "BOOL", "data": []}]},
         "batch dimension is 0; send at least one row"),
        # KServe v1
        ({"instances": []}, "KServe v1 `instances` must be a non-empty list"),
        ({"instances": [{"features": f[0].tolist()}]}, "instances[0] lacks input 'mask'"),
        ({"instances": [{"features": f[0].tolist(), "mask": m[0].tolist(), "x": 1}]},
         "instances[0] has unknown input(s) x"),
        ({"instances": [f[0].tolist()]}, "instances[0] must be an object {name: value}"),
        # KServe v2
        ({"inputs": [{"name": "features", "shape": [2, 16], "datatype": "FP8", "data": [0.0] * 32}]},
         "input 'features': unknown v2 datatype 'FP8'; expected FP32"),
        ({"inputs": [{"name": "features", "shape": [2, 16]}]}, "v2 inputs[0] must have name, shape, datatype and data"),
        # JSON that is not an object
        ([[1.0] * 16], "JSON body must be an object"),
        # empty body, and a body that is not JSON at all: two different fixes, two messages
        (b"", "empty JSON body: send a JSON object"),
        (b"hello", "JSON body is not JSON at all (it starts with 'hello')"),
    ]
    for body, needle in cases:
        r = main_server.predict(model, body)
        assert r.status_code == 400, (needle, r.status_code, r.text)
        assert r.json()["code"] == 400 and r.json()["type"] == "InvalidInput", r.text
        assert needle in r.json()["message"], (needle, r.text)
        ok = main_server.predict(model, good)
        assert ok.status_code == 200, (needle, ok.text)
    close(ok.json()["outputs"], eager("two_input", f, m))


def test_unsupported_media_type(main_server):
    r = main_server.predict("cls_export", b"\x00\x01", content_type="image/png")
    assert r.status_code == 415
    assert r.json()["type"] == "UnsupportedMediaType"
    assert "application/x-safetensors" in r.json()["message"]
    # a JSON body sent as curl -d sends it (a form, which TorchServe's frontend decodes into no
    # parameter at all): the media type is named with the fix, not "empty request"
    body = json.dumps({"inputs": {"image": [[[[0.0] * 32] * 32] * 3]}}).encode()
    for form in (body, b"a=b"):
        r = main_server.predict("cls_export", form, content_type="application/x-www-form-urlencoded")
        assert r.status_code == 415 and "-H 'Content-Type: application/json'" in r.json()["message"], r.text


def test_oversize_body_and_too_many_rows_get_413(main_server):
    """cls_limits: handler.max_body_mb=0.02 (20971 bytes), max_rows_per_request=4."""
    big = safetensors_io.dumps({"image": image(4)})  # 49 KB
    r = main_server.predict("cls_limits", big, content_type=safetensors_io.CONTENT_TYPE)
    assert r.status_code == 413 and r.json()["type"] == "PayloadTooLarge", r.text
    assert "max_body_mb" in r.json()["message"]
    # JSON bodies reach the handler as bytes too (TS_DECODE_INPUT_REQUEST=false), so the body
    # limit applies to them before they are parsed; the row limit is covered by tests/test_wire.py
    # and, through TorchServe, by tests/test_faults.py (rows_1025)
    r = main_server.predict("cls_limits", {"inputs": {"image": image(5).tolist()}})
    assert r.status_code == 413 and "handler.max_body_mb" in r.json()["message"], r.text
    x = image(1)
    r = main_server.predict("cls_limits", safetensors_io.dumps({"image": x}),
                            content_type=safetensors_io.CONTENT_TYPE)
    assert r.status_code == 200, r.text
    close(safetensors_io.loads(r.content), eager("classifier", x))


def test_kserve_v1(main_server):
    f, m = two(3, seed=5)
    inst = [{"features": f[i].tolist(), "mask": m[i].tolist()} for i in range(3)]
    r = main_server.predict("two_aoti", {"instances": inst})
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    ref = eager("two_input", f, m)
    assert len(preds) == 3
    for i, p in enumerate(preds):
        close({k: torch.tensor(v) for k, v in p.items()}, {k: v[i] for k, v in ref.items()})
    x = image(2, seed=6)  # single-input model: instances are bare samples
    r = main_server.predict("cls_aoti", {"instances": x.tolist()})
    assert r.status_code == 200, r.text
    close({"output": r.json()["predictions"]}, eager("classifier", x))


def test_kserve_v2(main_server):
    f, m = two(2, seed=7)
    body = {"id": "req-7", "inputs": [
        {"name": "features", "shape": [2, 16], "datatype": "FP32", "data": f.reshape(-1).tolist()},
        {"name": "mask", "shape": [2, 16], "datatype": "BOOL", "data": m.reshape(-1).tolist()}]}
    r = main_server.predict("two_export", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "req-7" and out["model_name"] == "two_export"
    ref = eager("two_input", f, m)
    got = {o["name"]: torch.tensor(o["data"]).reshape(o["shape"]) for o in out["outputs"]}
    assert {o["datatype"] for o in out["outputs"]} == {"FP32"}
    close(got, ref)
    body["inputs"][0]["datatype"] = "FP64"
    bad = main_server.predict("two_export", body)
    assert bad.status_code == 400 and "FP64 does not match" in bad.json()["message"]
    body["inputs"][0]["datatype"], body["inputs"][0]["shape"] = "FP32", [2, 8]
    bad = main_server.predict("two_export", body)
    assert bad.status_code == 400 and "needs 16 values" in bad.json()["message"]


def test_safetensors_binary(main_server):
    f, m = two(4, seed=8)
    payload = safetensors_io.dumps({"features": f, "mask": m})
    r = main_server.predict("two_aoti", payload, content_type=safetensors_io.CONTENT_TYPE)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith(safetensors_io.CONTENT_TYPE)
    close(safetensors_io.loads(r.content), eager("two_input", f, m))
    # same payload, JSON answer on request
    r = main_server.predict("two_aoti", payload, content_type=safetensors_io.CONTENT_TYPE,
                            headers={"Accept": "application/json"})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    close(r.json()["outputs"], eager("two_input", f, m))
    # wrong dtype in binary: float64 features
    bad = main_server.predict("two_aoti", safetensors_io.dumps({"features": f.double(), "mask": m}),
                              content_type=safetensors_io.CONTENT_TYPE)
    assert bad.status_code == 400 and "float64 does not match" in bad.json()["message"]
    # truncated payload
    bad = main_server.predict("two_aoti", payload[:-10], content_type=safetensors_io.CONTENT_TYPE)
    assert bad.status_code == 400 and "data_offsets" in bad.json()["message"]


def test_json_request_binary_answer(main_server):
    x = image(2, seed=9)
    r = main_server.predict("cls_export", {"inputs": {"image": x.tolist()}},
                            headers={"Accept": safetensors_io.CONTENT_TYPE})
    assert r.status_code == 200
    close(safetensors_io.loads(r.content), eager("classifier", x))


def test_the_frontends_temp_files_stay_in_the_servers_own_directory(main_server):
    """TorchServe's frontend unpacks every archive into java.io.tmpdir/models/<uuid> (and never
    removes it) and puts the workers' sockets there: the launchers set TEMP, which TorchServe's
    launcher passes on as java.io.tmpdir (TMPDIR alone left them all in /tmp), to a directory of
    the server's own whose socket paths fit 107 bytes."""
    from pathlib import Path
    tmp = Path(main_server.java_tmp)
    assert len(str(tmp / ".ts.sock.65535")) <= 107
    unpacked = [d for d in (tmp / "models").iterdir() if (d / "MAR-INF" / "MANIFEST.json").is_file()]
    assert len(unpacked) >= len(main_server.models), sorted(p.name for p in (tmp / "models").iterdir())
    assert list(tmp.glob(".ts.sock.*")), sorted(p.name for p in tmp.iterdir())


def test_load_reports_in_log_and_metrics(main_server):
    log = main_server.log()
    assert "loaded aoti artifact model.pt2 (aoti_package) on cpu" in log
    assert "loaded aoti_so artifact model.so (aoti_so) on cpu" in log
    assert "loaded export artifact model.pt2 (exported_program) on cpu" in log
    # each worker's start, step by step, from the process's beginning (bench.bench_start reads it)
    from bench.bench_start import start_steps

    starts = start_steps(log)
    assert starts and all({"process and imports", "variant", "load", "total"} <= set(s) for s in starts), starts[:2]
    assert all(s["process and imports"] > 0.2 for s in starts)  # torch's import alone takes longer
    import requests

    metrics = requests.get(f"http://127.0.0.1:{main_server.ports['metrics']}/metrics", timeout=10).text
    assert 'ArtifactLoadTime{ModelName="cls_aoti"' in metrics, metrics[-2000:]
    assert 'ArtifactWarmupTime{ModelName="two_export"' in metrics
    assert 'WorkerStartTime{ModelName="cls_aoti"' in metrics


def test_stage_timings_on_the_metrics_endpoint(main_server):
    import requests

    f, m = two(2)
    assert main_server.predict("two_export", {"inputs": {"features": f.tolist(), "mask": m.tolist()}}).ok
    metrics = requests.get(f"http://127.0.0.1:{main_server.ports['metrics']}/metrics", timeout=10).text
    for name in ("HandlerDecodeTime", "HandlerRunTime", "HandlerEncodeTime", "HandlerTime"):
        assert f'{name}{{ModelName="two_export"' in metrics, (name, metrics[-2000:])


def test_shipped_log_configuration_drops_per_request_lines_only(main_server):
    """config.properties' vmargs loads log4j2.xml: start-up, worker output and the access log stay;
    TorchServe's per-request and per-batch lines (DEBUG, each line twice with its built-in file)
    are gone."""
    f, m = two(1)
    before = main_server.log("logs/access_log.log").count("POST /predictions/two_export")
    for _ in range(5):
        assert main_server.predict("two_export", {"inputs": {"features": f.tolist(), "mask": m.tolist()}}).ok
    access = main_server.log("logs/access_log.log")
    assert access.count("POST /predictions/two_export") - before == 5  # one line per request
    ts_log = main_server.log("logs/ts_log.log")
    assert "Initialize Inference server with" in ts_log  # start-up lines are kept
    for gone in ("[DEBUG]", "Sending response for jobId", "Backend response time", "result=[METRICS]",
                 "POST /predictions"):
        assert gone not in ts_log, gone
    model_log = main_server.log()
    assert "loaded export artifact" in model_log and "Backend received inference at" not in model_log
    lines = [ln for ln in ts_log.splitlines() if " - " in ln]
    assert len(lines) == len(set(lines)), "a line written twice"


def test_every_worker_reads_the_frontend_with_the_buffered_reader(main_server):
    """Each worker's load line says it put handlers/torchserve/frontend_frames.py in place of TorchServe's
    reader; the requests of this whole module (binary, JSON, multipart, gRPC, hostile bodies)
    then reach the handlers through it."""
    loaded = [ln for ln in main_server.log().splitlines() if "] loaded " in ln or " - loaded " in ln]
    assert loaded, "no load line in model_log.log"
    for line in loaded:
        assert line.rstrip().endswith("; buffered frame reader"), line


def test_multipart_body_is_refused(main_server):
    """A multipart form with two fields reaches the handler as two parts: 400 naming them."""
    import requests

    f, m = two(1)
    r = requests.post(f"{main_server.base}/predictions/two_export", headers=main_server.auth(), timeout=60,
                      files={"a": ("a.json", b'{"inputs": {}}', "application/json"),
                             "b": ("b.json", b"{}", "application/json")})
    assert r.status_code == 400, r.text
    assert r.json()["message"] == "request has several parts (a, b); send one body"
