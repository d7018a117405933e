"""OpenAI's API in the pod at KServe's paths, /openai/v1/completions, /openai/v1/chat/completions
and /openai/v1/models, with the model named in the JSON body (handlers/generation/openai.py serves
the API on TorchServe at /predictions/NAME/VERSION/v1/...).

nginx cannot read a body (no njs in the image), so for the two POST routes it sends the request to
pod.status on loopback, and this module reads `model` from the body and answers with
`X-Accel-Redirect: /_openai/predictions/NAME/VERSION/v1/...`. nginx then sends the same request,
its body kept in nginx's buffer or temporary file, to TorchServe from the internal location
/_openai/predictions/ (kserve/nginx.conf) through the gate's /generate/ location (its bound on
large bodies, TorchServe's inference key), and the answer back unbuffered: the stream never passes through
Python, only the body's lookup does (the body crosses loopback once more). Facts of nginx this
relies on: an X-Accel-Redirect turns the method into GET (ngx_http_upstream_process_headers), so
that location sets `proxy_method POST`; the request body read for the first upstream is reused
for the second (checked on nginx 1.24 with bodies in memory and in a temporary file).

Only models whose archive is a decoder (artifact.json's extra.state.decoder) are routed and listed.
A body with no usable `model`, or a model that is not one of them, is answered here in OpenAI's
error shape; everything else (parameters, the prompt) is the handler's to check.
"""
from __future__ import annotations

import json
import re
import time
from urllib.parse import quote

from pod.state import read_artifact

PREFIX = "/openai/v1/"
ROUTES = ("completions", "chat/completions")
INTERNAL = "/_openai"  # kserve/nginx.conf's internal location /_openai/predictions/ (to the gate)
MODEL_ROUTE = re.compile(r"^/openai/v1/models/([^/]+)$")
CREATED = int(time.time())


def decoders(models) -> dict:
    """{name: version} of the pod's models (pod.config.Model) whose archive is a decoder; an archive
    that cannot be read is left out (pod.status reports it as it reports any)."""
    found = {}
    for m in models:
        try:
            state = (read_artifact(m.mar).get("extra") or {}).get("state") or {}
        except ValueError:
            continue
        if isinstance(state, dict) and state.get("decoder"):
            found[m.name] = m.version
    return found


def error(status: int, message: str, param=None, code=None) -> tuple:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {}, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _card(name: str) -> dict:
    return {"id": name, "object": "model", "created": CREATED, "owned_by": "compiled-serving"}


def get(path: str, models: dict):
    """(status, body) for GET /openai/v1/models[/NAME], or None for another path."""
    if path == PREFIX + "models":
        return 200, {"object": "list", "data": [_card(n) for n in models]}
    m = MODEL_ROUTE.match(path)
    if m is None:
        return None
    if m.group(1) in models:
        return 200, _card(m.group(1))
    return error(404, f"The model `{m.group(1)}` does not exist; this pod serves {', '.join(models) or 'none'}",
                 "model", "model_not_found")[::2]


def post(path: str, body: bytes, models: dict) -> tuple:
    """(status, headers, JSON body) for a POST: the redirect to the model's versioned route, or
    OpenAI's error object."""
    route = path[len(PREFIX):] if path.startswith(PREFIX) else ""
    if route not in ROUTES:
        return error(404, f"no route {path}; this pod serves POST {PREFIX}completions, POST "
                          f"{PREFIX}chat/completions and GET {PREFIX}models")
    try:
        name = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return error(400, "the body is not a JSON object; send {\"model\": NAME, ...} with Content-Type "
                          "application/json")
    if not isinstance(name, str) or not name:
        return error(400, "model is required: the name of the model to use (GET /openai/v1/models lists them)",
                     "model")
    if name not in models:
        return error(404, f"The model `{name}` does not exist; this pod serves {', '.join(models) or 'none'}",
                     "model", "model_not_found")
    target = f"{INTERNAL}/predictions/{quote(name, safe='')}/{quote(models[name], safe='')}/v1/{route}"
    return 200, {"X-Accel-Redirect": target}, None
