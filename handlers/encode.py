"""Encode one request's outputs in the format it came in (or the one its Accept header asks).

Binary (safetensors) responses are written straight from tensor memory; JSON responses use
tensor.tolist(), which is what JSON needs anyway.
"""
from __future__ import annotations

import json

from . import safetensors_io
from .decode import TORCH_TO_V2, Decoded

JSON = "application/json"


def _wants(accept, media: str) -> bool:
    return bool(accept) and media in accept.lower()


def encode(outputs: dict, req: Decoded, model_name: str):
    """Returns (body, content type)."""
    fmt = req.fmt
    if fmt == "safetensors" and _wants(req.accept, JSON) and not _wants(req.accept, safetensors_io.CONTENT_TYPE):
        fmt = "json"
    elif fmt != "safetensors" and _wants(req.accept, safetensors_io.CONTENT_TYPE):
        fmt = "safetensors"
    if fmt == "safetensors":
        return safetensors_io.dumps(outputs), safetensors_io.CONTENT_TYPE
    if fmt == "v1":
        names = list(outputs)
        rows = range(next(iter(outputs.values())).shape[0])
        if len(names) == 1:
            preds = outputs[names[0]].tolist()
        else:
            lists = {n: outputs[n].tolist() for n in names}
            preds = [{n: lists[n][i] for n in names} for i in rows]
        body = {"predictions": preds}
    elif fmt == "v2":
        body = {"model_name": model_name, "outputs": [
            {"name": n, "shape": list(t.shape), "datatype": TORCH_TO_V2[t.dtype],
             "data": t.reshape(-1).tolist()} for n, t in outputs.items()]}
        if req.request_id:
            body["id"] = req.request_id
    else:
        body = {"outputs": {n: t.tolist() for n, t in outputs.items()}}
    return json.dumps(body, separators=(",", ":")), JSON


def encode_error(err) -> str:
    return json.dumps(err.to_dict())
