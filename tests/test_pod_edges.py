"""The KServe pod's edges (issue 63 item 7), on a pod serving a slot-form decoder (continuous
batching, queue_size 0), started by the image's entrypoint: headers only the pod may set
(`describe`, X-Generate-Route) never reach the handler from a client; nginx's own refusals are
JSON; every retryable 503 carries Retry-After; gRPC clients read the pod's words, never
TorchServe's Java text; a decoder asked on a tensor route says where it generates; TorchServe's
management API requires its key inside the pod; ModelStreamInfer's bodies pass through nginx's
gate; the async worker's log holds no `_entry_point` line a second."""
from __future__ import annotations

import json
import socket
import subprocess
import time

import grpc
import pytest
import requests
import torch

from conftest import ROOT, cs_command, server_env
from handlers import protowire
from kserve_kit import Container, grpc_infer_request, lay_out

pytestmark = pytest.mark.server
OIP = "/inference.GRPCInferenceService/"
DESCRIBE = '"load_error"'  # a word of the handler's describe answer (ts_entry.describe_handle)


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    from examples import slot_decoder
    from examples.tiny_decoder import Config

    d = tmp_path_factory.mktemp("edges")
    torch.export.save(slot_decoder.export(slot_decoder.build(Config(max_seq_length=128), slots=4)), d / "slots.pt2")
    r = subprocess.run([*cs_command("archive"), "--artifact", str(d / "slots.pt2"), "--name", "lm", "--out", str(d / "store"),
                        "--handler-option", "queue_size=0"], cwd=ROOT, capture_output=True, text=True, env=server_env())
    assert r.returncode == 0, r.stdout + r.stderr
    laid = lay_out([d / "store" / "lm.mar"], d / "out")
    assert laid.returncode == 0, laid.stdout + laid.stderr
    c = Container(d / "out" / "storage", d / "pod")
    try:
        c.wait("ready")
        yield c
    finally:
        c.stop()


def ids_request(n_tokens: int = 3) -> bytes:
    return grpc_infer_request("lm", [("input_ids", "INT64", [2], None)], [b"\1" + b"\0" * 7 + b"\2" + b"\0" * 7],
                              params=[("max_tokens", n_tokens)])


def stream_errors(target: str, requests_: list) -> list:
    """Each request on one ModelStreamInfer call, one at a time: its error_message, or '' for an
    answer that generated."""
    out = []
    with grpc.insecure_channel(target) as ch:
        for req in requests_:
            replies = list(ch.stream_stream(OIP + "ModelStreamInfer")(iter([req]), timeout=120))
            out.append((protowire.first_string(replies[-1], 1) or "") if replies else "no reply")
    return out


def management(pod, method: str, path: str, key: bool):
    keys = json.loads((pod.root / "run" / "key_file.json").read_text())
    headers = {"Authorization": f"Bearer {keys['management']['key']}"} if key else {}
    return requests.request(method, f"http://127.0.0.1:{pod.ports['management']}{path}", headers=headers, timeout=120)


def test_describe_and_the_route_header_from_a_client_never_reach_the_handler(pod):
    """`describe: True` made the handler answer its management describe instead of the request,
    on every route nginx did not clear it on; X-Generate-Route switched a decoder's format."""
    body = {"input_ids": [1, 2], "parameters": {"max_tokens": 3}}
    for path in ("/v2/models/lm/infer", "/v1/models/lm:predict", "/v2/models/lm/versions/1.0/infer"):
        for header in ({"describe": "True"}, {"Describe": "True"}, {"X-Generate-Route": "generate_stream"}):
            r = requests.post(pod.base + path, json=body, headers=header, timeout=60)
            assert DESCRIBE not in r.text and "data: " not in r.text, (path, header, r.status_code, r.text)
            assert r.status_code == 400 and "generate_stream" in r.json()["message"], (path, header, r.text)
    with grpc.insecure_channel(pod.grpc_target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(OIP + "ModelInfer")(ids_request(), metadata=[("describe", "True")], timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert DESCRIBE not in e.value.details() and "ModelStreamInfer" in e.value.details(), e.value.details()


def test_a_decoder_on_the_tensor_routes_names_the_generate_routes_and_generates_on_them(pod):
    r = requests.post(f"{pod.base}/v2/models/lm/infer", json={"input_ids": [1, 2]}, timeout=60)
    assert r.status_code == 400 and r.headers["Content-Type"].startswith("application/json"), r.text
    assert "/v2/models/NAME/generate" in r.json()["message"] and "ModelStreamInfer" in r.json()["message"], r.text
    one = requests.post(f"{pod.base}/v2/models/lm/generate", json={"input_ids": [1, 2], "parameters": {"max_tokens": 3}},
                        timeout=60)
    assert one.status_code == 200 and len(one.json()["output_ids"]) == 3, one.text
    assert stream_errors(pod.grpc_target, [ids_request()]) == [""]


RAW = [  # (what, bytes sent, status nginx answers)
    ("a request line of garbage", b"GARBAGE\r\n\r\n", 400),
    ("no Host", b"GET /v2 HTTP/1.1\r\n\r\n", 400),
    ("a header with a space in its name", b"GET /v2 HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n", 400),
    ("a header over 8 KiB", b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 400),
    ("Content-Length and chunked", b"POST /v2/models/lm/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("a chunk size that is no number", b"POST /v2/models/lm/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n", 400),
    ("a Content-Length that is no number", b"POST /v2/models/lm/infer HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    ("a URI over 8 KiB", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    ("Transfer-Encoding gzip", b"POST /v2/models/lm/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    ("HTTP/2.0 in plain text", b"GET /v2 HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    ("TRACE", b"TRACE / HTTP/1.1\r\nHost: x\r\n\r\n", 405),
]


def raw_answer(port: int, data: bytes) -> tuple:
    """(status, Content-Type, body) of what nginx answers to `data` on a new connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        got = b""
        while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < _length(got):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), fields.get("content-type", ""), body.decode("utf-8", "replace")


def _length(got: bytes) -> int:
    for line in got.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


@pytest.mark.parametrize("what, data, status", RAW, ids=[c[0] for c in RAW])
def test_nginx_s_own_refusals_are_json_saying_what_was_wrong(pod, what, data, status):
    got, content_type, body = raw_answer(pod.http, data)
    assert got == status and content_type == "application/json", (what, got, content_type, body)
    assert json.loads(body)["error"], body
    got, content_type, body = raw_answer(pod.public_metrics, data)  # the metrics port too
    assert content_type == "application/json" and "<html>" not in body, (what, got, body)


def test_a_handlers_400_still_reaches_the_client_in_its_own_words(pod):
    """error_page 400 in the public server intercepts TorchServe's 400s too: the handler's own
    JSON must come back, not nginx's words for a request it could not read."""
    r = requests.post(f"{pod.base}/v2/models/lm/generate", json={"input_ids": [1, 999]}, timeout=60)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["message"], r.text


def test_the_management_api_requires_its_key_inside_the_pod_and_pod_status_has_it(pod):
    denied = management(pod, "PUT", "/models/lm?min_worker=2", key=False)
    assert denied.status_code in (400, 401, 403) and "Token" in denied.text, (denied.status_code, denied.text)
    assert management(pod, "GET", "/models/lm", key=False).status_code != 200
    assert management(pod, "GET", "/models/lm", key=True).status_code == 200
    ready = pod.probe("ready")  # pod.status reads the model's state with the key
    assert ready.returncode == 0 and json.loads(ready.stdout)["ready"] is True, ready.stdout
    body = {"input_ids": [1, 2], "parameters": {"max_tokens": 2}}  # TorchServe's own inference API, as bench_pod calls it
    assert requests.post(f"{pod.direct}/predictions/lm", json=body, timeout=60).status_code != 200
    keyed = requests.post(f"{pod.direct}/predictions/lm", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {pod.inference_key()}"})
    assert keyed.status_code == 200, keyed.text
    conf = pod.root / "run" / "nginx.conf"  # it holds the inference key
    assert conf.stat().st_mode & 0o077 == 0, oct(conf.stat().st_mode)


def test_torchserve_s_own_503_carries_retry_after_and_grpc_clients_read_the_pods_words(pod):
    """With no worker (scaled to 0 through the management API, with its key), TorchServe answers
    503 "... Please use scale workers API to add workers" itself: the REST client gets Retry-After,
    the gRPC clients (ModelInfer through nginx, ModelStreamInfer through the bridge) the pod's
    words, never TorchServe's Java text."""
    assert management(pod, "PUT", "/models/lm?min_worker=0&synchronous=true", key=True).status_code == 200
    try:
        r = requests.post(f"{pod.base}/v2/models/lm/generate", json={"input_ids": [1, 2]}, timeout=60)
        assert r.status_code == 503 and r.headers.get("Retry-After") == "1", (r.status_code, r.headers, r.text)
        with grpc.insecure_channel(pod.grpc_target) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(OIP + "ModelInfer")(ids_request(), timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in e.value.details(), e.value
        [stream] = stream_errors(pod.grpc_target, [ids_request()])
        for message in (e.value.details(), stream):
            assert "scale workers API" not in message and "Exception" not in message, message
        assert "503" in stream and "no worker of this model can take the request now" in stream, stream
    finally:
        assert management(pod, "PUT", "/models/lm?min_worker=1&synchronous=true", key=True).status_code == 200
    pod.wait("ready", timeout=120)


def test_a_busy_slot_engines_503_keeps_its_retry_after_through_the_pod(pod):
    """queue_size 0 and 4 slots: 24 generations of 100 tokens at once; every refusal is the
    engine's 503 with Retry-After: 1."""
    from concurrent.futures import ThreadPoolExecutor

    long = {"input_ids": [1, 2, 3], "parameters": {"max_tokens": 100, "ignore_eos": True}}
    for _ in range(3):
        with ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(lambda _: requests.post(f"{pod.base}/v2/models/lm/generate", json=long, timeout=120),
                                    range(24)))
        busy = [a for a in answers if a.status_code == 503]
        assert all(a.headers.get("Retry-After") == "1" and "slots are busy" in a.text for a in busy), busy[0].text
        if busy:
            return
    pytest.fail("24 generations at once on 4 slots were never refused in three rounds")


def hold_gate(pod, n: int) -> list:
    """n connections to nginx's gate, each a request announcing a 5,000,000-byte body and sending
    none: each holds one of the gate's places for bodies of 1,000,000 bytes or more."""
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(pod.root / "run" / "gate.sock"))
        s.sendall(b"POST /predictions/lm HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000000\r\n\r\n")
        held.append(s)
    return held


def test_model_stream_infer_s_large_messages_are_bounded_by_the_gate(pod):
    """The gate admits at most large_bodies bodies of 1,000,000 bytes or more at once (TorchServe's
    direct memory, pod/config.py): with its places held, a ModelStreamInfer message of 1.1 MB is
    refused with the gate's words and a retry; with them free it reaches the handler (which
    refuses a text too long for its cache). The stream serves on between them."""
    conf = (pod.root / "run" / "nginx.conf").read_text()
    places = int(conf.split("limit_conn bodies_7_digits ")[1].split(";")[0])
    big = grpc_infer_request("lm", [("text_input", "BYTES", [1], None)], [len(b"a" * 1_100_000).to_bytes(4, "little") + b"a" * 1_100_000])
    held = hold_gate(pod, places)
    try:
        time.sleep(0.5)  # each held request has reached the gate's location
        refused, small = stream_errors(pod.grpc_target, [big, ids_request()])
    finally:
        for s in held:
            s.close()
    assert "503" in refused and "at once" in refused and "retry" in refused, refused
    assert small == "", small  # small messages pass uncounted
    [answered] = stream_errors(pod.grpc_target, [big])
    assert "503" not in answered and answered.startswith("400"), answered


def test_the_async_worker_logs_no_entry_point_line(pod):
    """TorchServe 0.12's ts/async_service.py prints `self._entry_point=<bound method ...>` for every
    call, pod.status's describe poll included: a line a second in model_log.log."""
    time.sleep(3)  # three polls at least
    log = pod.log()
    assert "ArtifactLoadTime" in log or "load" in log  # the worker's log is read
    assert "self._entry_point=" not in log, [ln for ln in log.splitlines() if "_entry_point" in ln][:2]
