"""A generation request, parsed and checked before any native call: the prompt (text through the
archive's tokenizer, or token ids) and its parameters. Every fault is a RequestError (400) that
names the field, what it holds and what it takes; a body over the JSON limit is 413.

The body is a JSON object, the Open Inference Protocol's generate request
(kserve/open-inference-protocol, generate_rest.yaml) with token ids as an alternative prompt:

    {"text_input": "...", "parameters": {"max_tokens": 32, "temperature": 0.7, ...}}
    {"input_ids": [1, 15, 27], "parameters": {...}}
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Optional

from handlers.errors import PayloadTooLarge, RequestError, UnsupportedMediaType
from handlers.wire import strict_json
from handlers.wire.request import payload_of

# Below it sampling is greedy (as vLLM's _SAMPLING_EPS): logits divided by 1e-300 overflow to inf
# and softmax turns them into NaN, which torch.multinomial refuses (on a GPU, a device-side assert).
MIN_TEMPERATURE = 1e-5
# name -> (type, meaning); the only parameters taken (an unknown one is a 400, never ignored)
PARAMETERS = {
    "max_tokens": (int, "the most tokens to generate"),
    "temperature": (float, f"0 picks the most likely token (greedy), as does any value below {MIN_TEMPERATURE:g}; "
                           "above it samples"),
    "top_k": (int, "sample among the k most likely tokens; 0: all"),
    "top_p": (float, "sample among the most likely tokens whose probabilities add up to p; 1: all"),
    "seed": (int, "the sampling's random seed: the same seed, prompt and parameters give the same tokens"),
    "stop": (list, "strings that end the generation (not included in the text)"),
    "stop_token_ids": (list, "token ids that end the generation, besides the end-of-sequence ids"),
    "ignore_eos": (bool, "go on past end-of-sequence tokens"),
    "details": (bool, "add the finish reason and counts to a generate answer"),
    "stream": (bool, "/predictions: one JSON line per token (true) or one answer (false)"),
}
TOP_LEVEL = ("text_input", "input_ids", "parameters", "id")


@dataclass(frozen=True)
class Params:
    max_tokens: Optional[int] = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    details: bool = False
    stream: bool = True
    # not a /predictions parameter: OpenAI's logprobs (handlers/generation/openai.py), the number of
    # most likely tokens to report beside each generated token's log probability; None: none
    logprobs: Optional[int] = None


@dataclass(frozen=True)
class GenerateRequest:
    text: Optional[str]
    ids: Optional[list]
    params: Params = field(default_factory=Params)
    id: Optional[str] = None
    # False: `text` already holds the model's special tokens (a rendered chat template, as
    # transformers' apply_chat_template tokenizes it), so the tokenizer adds none
    special_tokens: bool = True
    n: int = 1  # independent sequences for the prompt (OpenAI's n; `choices`)


def choices(req: GenerateRequest) -> list:
    """The request of each of `req.n` sequences: with a seed, choice i draws from seed + i (mod
    2**63), so choice 0 is the request's own and the same seed gives the same n sequences."""
    seed = req.params.seed
    return [req if i == 0 or seed is None else replace(req, params=replace(req.params, seed=(seed + i) % 2**63))
            for i in range(req.n)]


def _typed(name: str, value, kind):
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise RequestError(f"parameters.{name} is {json.dumps(value)}: expected "
                           f"{ {int: 'an integer', float: 'a number', bool: 'true or false', list: 'a list'}[kind]} "
                           f"({PARAMETERS[name][1]})")
    return value


def parameters(raw) -> Params:
    """`parameters` of a request checked (types, ranges, stop lists): the one place they are."""
    if raw is None:
        return Params()
    if not isinstance(raw, dict):
        raise RequestError("parameters must be a JSON object, e.g. {\"max_tokens\": 32}")
    unknown = sorted(set(raw) - set(PARAMETERS))
    if unknown:
        raise RequestError(f"unknown parameter(s) {', '.join(unknown)}; this model takes "
                           f"{', '.join(PARAMETERS)}")
    v = {k: _typed(k, x, PARAMETERS[k][0]) for k, x in raw.items() if x is not None}
    if "stop" in v:
        if not all(isinstance(s, str) and s for s in v["stop"]):
            raise RequestError("parameters.stop must be a list of non-empty strings")
        for i, s in enumerate(v["stop"]):
            unicode(f"parameters.stop[{i}]", s)
        v["stop"] = tuple(v["stop"])
    if "stop_token_ids" in v:
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in v["stop_token_ids"]):
            raise RequestError("parameters.stop_token_ids must be a list of integers")
        v["stop_token_ids"] = tuple(v["stop_token_ids"])
    _ranges(v)
    if 0 < v.get("temperature", 0) < MIN_TEMPERATURE:
        v["temperature"] = 0.0
    return Params(**v)


def unicode(name: str, text: str) -> None:
    """RequestError where `text` is no Unicode text: JSON's \\ud800 escapes reach Python as lone
    surrogates, which UTF-8 (and the tokenizer: a TypeError) cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{name} holds a lone surrogate ({text[e.start]!a}) at character {e.start}: "
                           "it is not Unicode text; send each character as itself or as a surrogate pair") from None


def _ranges(v: dict) -> None:
    checks = (("max_tokens", lambda x: x >= 1, "at least 1"), ("temperature", lambda x: 0 <= x <= 100, "in [0, 100]"),
              ("top_k", lambda x: x >= 0, "at least 0"), ("top_p", lambda x: 0 < x <= 1, "in (0, 1]"),
              ("seed", lambda x: 0 <= x < 2**63, "in [0, 2**63)"))
    for name, ok, words in checks:
        if name in v and not ok(v[name]):
            raise RequestError(f"parameters.{name} is {v[name]}: expected a value {words} ({PARAMETERS[name][1]})")


OIP_EXAMPLE = "{\"text_input\": \"...\"} or {\"input_ids\": [1, 2, 3]}"


def json_body(data, content_type: Optional[str], max_bytes: int, example: str = OIP_EXAMPLE) -> dict:
    """The JSON object of the request TorchServe handed over (a dict with the body under "body" or
    "data"): 413 past `max_bytes`, 415 for a Content-Type that is no JSON, 400 for no JSON object;
    `example` is the body the messages show."""
    body = payload_of(data)
    if isinstance(body, (bytes, bytearray)):
        if len(body) > max_bytes:
            raise PayloadTooLarge(f"the request body is {len(body)} bytes; a generation request may be at most "
                                  f"{max_bytes} bytes (handler.max_json_mb)")
        if content_type and "json" not in content_type.lower() and not content_type.startswith("text/plain"):
            raise UnsupportedMediaType(f"Content-Type {content_type} is not taken by a language model: send "
                                       f"application/json, {example}")
        try:
            body = strict_json.loads(body)
        except RequestError as e:
            raise RequestError(f"the body is not JSON ({e.message}); send {example}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object: {example}")
    return body


def parse(data, content_type: Optional[str], max_bytes: int) -> GenerateRequest:
    """The request TorchServe handed over (a dict with the body under "body" or "data")."""
    body = json_body(data, content_type, max_bytes)
    unknown = sorted(set(body) - set(TOP_LEVEL))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}; a generation request takes "
                           f"{', '.join(TOP_LEVEL)}")
    text, ids = body.get("text_input"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("send exactly one prompt: \"text_input\" (a string) or \"input_ids\" (a list of token ids)")
    if text is not None and (not isinstance(text, str) or not text):
        raise RequestError("text_input must be a non-empty string")
    if text is not None:
        unicode("text_input", text)
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise RequestError("input_ids must be a non-empty list of integer token ids")
    rid = body.get("id")
    return GenerateRequest(text, ids, parameters(body.get("parameters")), str(rid) if rid is not None else None)
