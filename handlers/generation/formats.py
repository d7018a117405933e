"""A generation's answers on each route, one place per route's shape:

- `predictions` (TorchServe's /predictions/NAME over HTTP, chunked, and its gRPC
  StreamPredictions): one JSON object per line per token, `{"token_ids": [...], "text": "..."}`,
  then a last line `{"finish_reason", "prompt_tokens", "completion_tokens", "token_ids",
  "text_output"}`; with parameters.stream false, only that last object.
- `generate` (the Open Inference Protocol's POST /v2/models/NAME/generate, through the pod):
  one answer, `{"model_name", "model_version", "text_output", "output_ids", "details":
  {"finish_reason", "prompt_tokens", "completion_tokens"}}`.
- `generate_stream` (its /generate_stream): server-sent events, `data: {...}\n\n` per token
  (`text_output` holds the token's text) and a last event with `details`.
An error after the first token ends the stream with an object holding `error` (and
finish_reason "error"): the status line has gone out already.

The pod's nginx names the route in the request header ROUTE_HEADER; without it a request is
a /predictions one. On its tensor routes (v2 infer, v1 predict, gRPC ModelInfer) nginx and the
gRPC bridge send TENSOR_ROUTE there, and a decoder refuses the request (400, naming the generate
routes) rather than answer its token stream in a format the client did not ask for. nginx sets the
header on every route, so a client's own value never reaches the handler.
"""
from __future__ import annotations

import json

from handlers import wire
from handlers.errors import RequestError
from handlers.generation.request import parse
from handlers.wire.base import Encoded

ROUTE_HEADER = "X-Generate-Route"
ROUTES = ("predictions", "generate", "generate_stream")
GENERATE_ROUTES = ROUTES[1:]
TENSOR_ROUTE = "infer"
ON_A_TENSOR_ROUTE = ("this model is a language model: it generates on POST /v2/models/NAME/generate and "
                     "/v2/models/NAME/generate_stream (REST) and ModelStreamInfer (gRPC), not on the tensor routes "
                     "(v2 infer, v1 predict, ModelInfer); docs/generation.md")
NDJSON, SSE, JSON = "application/x-ndjson", "text/event-stream", "application/json"


class Route:
    def __init__(self, name: str, model: str, version: str):
        self.name = name if name in ROUTES else "predictions"
        self.model, self.version = model, version
        self.tensor = name == TENSOR_ROUTE

    def check(self) -> None:
        """RequestError (400) on a tensor route: a decoder generates on the generate routes."""
        if self.tensor:
            raise RequestError(ON_A_TENSOR_ROUTE)

    def parse(self, request, content_type, max_bytes: int, text):
        """The request as a GenerateRequest (request.py); RequestError naming what is wrong."""
        return parse(request, content_type, max_bytes)

    def direct(self):
        """An answer that needs no generation (OpenAI's /v1/models, handlers/generation/openai.py), or None."""
        return None

    def error(self, err) -> Encoded:
        """A request's whole answer when it fails before any token: the JSON error object."""
        return wire.ERRORS.error(err, None, "")

    def streams(self, stream_param: bool) -> bool:
        return self.name == "generate_stream" or (self.name == "predictions" and stream_param)

    def media_type(self, streamed: bool = True) -> str:
        """The answer's Content-Type: JSON lines, server-sent events, or one JSON object (generate,
        and /predictions with stream false)."""
        if self.name == "generate_stream":
            return SSE
        return NDJSON if self.name == "predictions" and streamed else JSON

    def _head(self) -> dict:
        return {"model_name": self.model, "model_version": self.version}

    def token(self, ev, index: int = 0) -> str:
        """A streamed token's chunk (`ev` a loop.Token of choice `index`: always 0 here, where a
        request makes one sequence)."""
        ids = [ev.id] if ev.id is not None else []
        if self.name == "generate_stream":
            return _sse({**self._head(), "text_output": ev.text, "token_ids": ids})
        return json.dumps({"token_ids": ids, "text": ev.text}) + "\n"

    def choice_end(self, done, index: int) -> str:
        """The chunk that ends choice `index` of a stream while others go on (OpenAI's n; none here)."""
        return ""

    def final(self, dones: list, streamed: bool) -> str:
        """The last answer, or the stream's last chunk, from each choice's loop.Finished."""
        done = dones[0]
        counts = {"finish_reason": done.reason, "prompt_tokens": done.prompt_tokens,
                  "completion_tokens": len(done.ids)}
        if self.name == "predictions":
            body = {**counts, "token_ids": done.ids, "text_output": done.text}
            return json.dumps(body) + ("\n" if streamed else "")
        if self.name == "generate_stream":
            return _sse({**self._head(), "text_output": "", "details": counts})
        return json.dumps({**self._head(), "text_output": done.text, "output_ids": done.ids, "details": counts})

    def error_event(self, err) -> str:
        """The last chunk of a stream that failed after its first token."""
        body = {**err.to_dict(), "finish_reason": "error"}
        if self.name == "generate_stream":
            return _sse({**self._head(), "error": err.message, **body})
        return json.dumps({"error": err.message, **body}) + "\n"


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"
