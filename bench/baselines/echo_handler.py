"""Transport limit of bench/bench_e2e.py: no model. Each request's body is read and a
response of the model's output size (the bytes in `echo.response` of model-config.yaml,
hex) comes back, so TorchServe's frontend, its worker protocol and the client move exactly
what they move for the real model, and nothing else runs."""

_RESPONSE = None


def handle(data, context):
    global _RESPONSE
    if _RESPONSE is None:
        _RESPONSE = bytes.fromhex((context.model_yaml_config or {})["echo"]["response"])
    if data is None:  # TorchServe's load-time call of a function handler
        return None
    return [_RESPONSE if (r.get("body") or r.get("data")) else b"" for r in data]
