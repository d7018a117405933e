"""The request pipeline in process: one request at a time after a failed batch, device faults."""
import torch

from handlers.errors import ServingError
from handlers.pipeline import infer
from worker_kit import make_spec, make_worker


class ReusingRunner:
    """Returns views of one reused output buffer, as the CUDA runner's pinned host outputs are;
    fails on batches of several requests, so the handler retries them one by one."""

    def __init__(self):
        self.out = torch.zeros(1, 4)

    def run(self, requests):
        if len(requests) > 1:
            raise RuntimeError("simulated batch failure")
        self.out.copy_(requests[0]["x"] * 10)
        return [{"y": self.out[:1]}]


def test_one_by_one_retry_keeps_each_requests_own_answer():
    worker = make_worker(make_spec(), ReusingRunner())
    batch = [{"x": torch.full((1, 4), float(i))} for i in range(3)]
    outs = infer(worker, batch)
    assert [o["y"][0, 0].item() for o in outs] == [0.0, 10.0, 20.0]  # not [20, 20, 20]


def test_retry_stops_running_after_a_device_fault():
    calls = []

    class Sticky:  # the batch fails for an ordinary reason, its first request with a device fault
        def run(self, requests):
            calls.append(len(requests))
            raise RuntimeError("CUDA error: device-side assert triggered" if len(requests) == 1
                               else "simulated batch failure")

    worker = make_worker(make_spec(), Sticky())
    from handlers.torchserve import restart

    real = restart.exit_soon
    restart.exit_soon = lambda reason, delay_s=0: None
    try:
        outs = infer(worker, [{"x": torch.zeros(1, 4)}] * 3)
    finally:
        restart.exit_soon = real
    assert calls == [3, 1] and all(isinstance(o, ServingError) for o in outs)
    assert [o.error_type for o in outs[1:]] == ["WorkerRestarting"] * 2 and worker.health.state == "broken"


def test_an_index_error_of_the_model_is_the_clients_400_without_native_paths():
    """With handler.check_values off, a bad id reaches the model: the error it raises is the
    client's 400, carrying the error's own first line only (AOTInductor kernels name their
    generated source and C++ frames; TORCH_SHOW_CPP_STACKTRACES adds torch's; fbgemm's
    embedding_bag and one_hot word it their own way)."""
    from dataclasses import replace

    from handlers.artifact.metadata import TensorSpec
    from handlers.faults import client_fault

    spec = replace(make_spec(), inputs=(TensorSpec("sparse", "int64", (None, 3)),))
    cases = {
        RuntimeError("index out of bounds: 0 <= tmp2 < 20L\nException raised from cpp_fused_embedding_sum_0 at "
                     "/tmp/torchinductor_root/cq/cff4.kernel.cpp:24 (most recent call first):\nframe #0: "
                     "c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f66 in /x/torch/lib/libc10.so)"):
            "index out of bounds: 0 <= tmp2 < 20L",
        RuntimeError("Expected i < index_size to be true, but got false.  (Could this error message be improved?  "
                     "If so, please report an enhancement request to PyTorch.)\nException raised from "
                     "fbgemm_spmdm_report_error_ at /__w/pytorch/aten/src/ATen/native/EmbeddingBag.cpp:169"):
            "Expected i < index_size to be true, but got false.",
        RuntimeError("Index 1 of input takes value 25 which is not in the valid range [0, 20)"):
            "Index 1 of input takes value 25 which is not in the valid range [0, 20)",
        IndexError("index out of range in self"): "index out of range in self",
        RuntimeError("Class values must be smaller than num_classes."):
            "Class values must be smaller than num_classes.",
    }
    for e, said in cases.items():
        answer = client_fault(e, spec)
        assert answer is not None and answer.status == 400, e
        assert answer.message == (f"the model cannot index with this request's values ({type(e).__name__}: {said}); "
                                  "check the values of sparse against the model's tables")
    assert client_fault(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), spec) is None
    assert client_fault(IndexError("index out of range in self"), make_spec()) is None  # no integer input


class Doubling:
    def run(self, requests):
        return [{"y": r["x"] * 2} for r in requests]


def test_the_pipeline_answers_each_request_without_a_server_and_replies_set_them():
    """pipeline.serve knows no TorchServe context: headers in, one Encoded or Failed per request
    out; torchserve/replies.write sets them on the context, and raises only for a batch of OIP
    gRPC calls that all failed."""
    import json

    import pytest
    from ts.utils.util import PredictionException

    from handlers import pipeline
    from handlers.torchserve import replies
    from handlers.torchserve.headers import RequestHeaders
    from handlers.wire.base import Encoded, Failed

    worker = make_worker(make_spec(), Doubling(), name="m", version="1")
    rest, grpc = RequestHeaders("application/json"), RequestHeaders(rest=False)
    oip_ok = {"body": b'{"id": "a", "model_name": "m", "inputs": [{"name": "x", "shape": [1, 4], '
                      b'"datatype": "FP32", "data": [1, 2, 3, 4]}]}'}
    oip_bad = {"body": b'{"id": "b", "model_name": "m", "inputs": [{"name": "x", "shape": [1, 3], '
                       b'"datatype": "FP32", "data": [1, 2, 3]}]}'}
    answers = pipeline.serve(worker, [{"body": b'{"inputs": {"x": [[1, 2, 3, 4]]}}'}, {"body": b"{"},
                                      dict(oip_ok), dict(oip_bad)], [rest, rest, grpc, grpc])
    assert [type(a) for a in answers] == [Encoded, Failed, Encoded, Failed]
    assert json.loads(answers[0].body) == {"outputs": {"y": [[2.0, 4.0, 6.0, 8.0]]}}
    assert answers[1].error.status == 400 and answers[1].transport is None
    assert json.loads(answers[2].body)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    assert answers[3].transport == "torchserve-oip-grpc"
    assert json.loads(answers[3].encoded.body)["outputs"][0]["name"] == "error"  # a complete OIP reply

    class Context:
        def __init__(self):
            self.status, self.types, self.headers = {}, {}, {}

        def set_response_status(self, code, phrase, idx):
            self.status[idx] = code

        def set_response_content_type(self, idx, value):
            self.types[idx] = value

        def set_response_header(self, idx, key, value):
            self.headers[idx, key] = value

    ctx = Context()
    bodies = replies.write(ctx, answers)
    assert bodies == [a.body if type(a) is Encoded else a.encoded.body for a in answers]
    assert ctx.status == {1: 400, 3: 400} and ctx.types[0] == "application/json"
    # every request of the batch an OIP gRPC call, every one failed: one exception, its status
    answers = pipeline.serve(worker, [dict(oip_bad), dict(oip_bad)], [grpc, grpc])
    with pytest.raises(PredictionException) as e:
        replies.write(Context(), answers)
    assert e.value.error_code == 400 and "BatchFailed" in e.value.message
