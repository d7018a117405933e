"""TorchServe's gRPC inference API with a real grpcio client; stubs generated from the .proto
files shipped inside the TorchServe frontend jar."""
import json

import grpc
import pytest
import torch
from conftest import close, eager, two

from handlers.wire import safetensors_io

pytestmark = pytest.mark.server


@pytest.fixture(scope="session")
def grpc_client(main_server, stubs):
    pb2, pb2_grpc = stubs
    limit = 134217728  # max_request_size in config.properties
    channel = grpc.insecure_channel(f"127.0.0.1:{main_server.ports['grpc']}", options=[
        ("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)])
    stub = pb2_grpc.InferenceAPIsServiceStub(channel)
    meta = [("authorization", f"Bearer {main_server.keys['inference']['key']}")]

    def predict(model, payload: bytes, metadata=meta):
        return stub.Predictions(pb2.PredictionsRequest(model_name=model, input={"data": bytes(payload)}),
                                metadata=metadata, timeout=60)

    yield predict
    channel.close()


def test_grpc_json(grpc_client):
    f, m = two(3, seed=21)
    resp = grpc_client("two_aoti", json.dumps({"inputs": {"features": f.tolist(), "mask": m.tolist()}}).encode())
    close(json.loads(resp.prediction)["outputs"], eager("two_input", f, m))


def test_grpc_safetensors(grpc_client):
    f, m = two(6, seed=22)
    resp = grpc_client("two_export", safetensors_io.dumps({"features": f, "mask": m}))
    close(safetensors_io.loads(resp.prediction), eager("two_input", f, m))


def test_grpc_requires_token(grpc_client):
    f, m = two(1)
    with pytest.raises(grpc.RpcError) as e:
        grpc_client("two_export", safetensors_io.dumps({"features": f, "mask": m}), metadata=[])
    assert e.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                              grpc.StatusCode.INVALID_ARGUMENT)


def test_grpc_bad_request_carries_the_error_object(grpc_client):
    # TorchServe 0.12's GRPCJob.response() drops per-request status codes, so a request that
    # fails alone inside a batch arrives as a PredictionResponse holding our JSON error object.
    f, m = two(2)
    resp = grpc_client("two_export", safetensors_io.dumps({"features": f, "mask": torch.zeros(2, 16)}))
    err = json.loads(resp.prediction)
    assert err["code"] == 400 and err["type"] == "InvalidInput"
    assert "input 'mask'" in err["message"] and "float32 does not match" in err["message"]
    ok = grpc_client("two_export", safetensors_io.dumps({"features": f, "mask": m}))
    close(safetensors_io.loads(ok.prediction), eager("two_input", f, m))


def test_grpc_hostile_kinds_answer_each_with_its_error_object(grpc_client):
    """These bodies used to fail their whole batch, which gRPC reported as UNAVAILABLE.
    Each now arrives as its own error object (TorchServe 0.12's gRPC drops the status code)."""
    from hostile import KINDS

    for name in ("deep_array_50k", "int_5000_digits", "v2_datatype_list", "scalar_null", "nan_token",
                 "st_deep_header", "st_dtype_dict"):
        ct, body, status, needle = KINDS[name]
        err = json.loads(grpc_client("two_aoti", body).prediction)
        assert err["code"] == status and needle in err["message"], (name, err)
    f, m = two(2, seed=23)
    ok = grpc_client("two_aoti", json.dumps({"inputs": {"features": f.tolist(), "mask": m.tolist()}}).encode())
    close(json.loads(ok.prediction)["outputs"], eager("two_input", f, m))
