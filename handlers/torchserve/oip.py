"""The status of a batch of TorchServe 0.12 Open Inference Protocol gRPC calls that all failed
(the format itself, requests and replies: handlers/wire/oip_grpc.py).

Facts this relies on (TorchServe 0.12, OpenInferenceProtocolImpl / GRPCJob in model-server.jar):
the frontend ignores per-request status codes; a gRPC status comes only from a failed batch
(PredictionException(message, code) -> GRPCUtils.getGRPCStatusCode: 400 INVALID_ARGUMENT,
413 RESOURCE_EXHAUSTED, 404 NOT_FOUND, 503 UNAVAILABLE, other codes INTERNAL).
"""
from __future__ import annotations

import json

from ts.utils.util import PredictionException


def batch_failure(errors: list) -> PredictionException:
    """Every request of a gRPC batch failed: one exception, so each call gets a real status.
    The status is theirs if they agree, else 400 when all are the clients' fault, else 500."""
    codes = {e.status for e in errors}
    code = codes.pop() if len(codes) == 1 else (400 if all(e.status < 500 for e in errors) else 500)
    if len(errors) == 1:
        return PredictionException(json.dumps(errors[0].to_dict()), code)
    # One description reaches every call of the batch: it lists the errors, yours among them.
    return PredictionException(json.dumps({
        "code": code, "type": "BatchFailed", "message": f"all {len(errors)} requests of this batch "
        "failed; yours is one of `errors`", "errors": [e.to_dict() for e in errors]}), code)
