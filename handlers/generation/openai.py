"""OpenAI's completions and chat completions API (the OpenAI API reference, /v1/completions,
/v1/chat/completions, /v1/models) on a decoder archive: the body mapped onto the generation
request (request.py: the one place parameters are checked) and the answers written in OpenAI's
shapes; the generation itself is the decoder's own (generating.py, continuous.py).

Where TorchServe 0.12 routes it: its frontend hands `/predictions/{model}/{version}/{rest}` to the
model's worker with the request header `url_path` holding `rest` (InferenceRequestHandler.
handlePredictions joins the path segments past the version with "/", "" without any, and checks no
HTTP method), as TorchServe's own vLLM handler reads it. So the routes are /predictions/NAME/
VERSION/v1/completions, .../v1/chat/completions and .../v1/models (GET); the version is the
archive's (cs-archive --version, 1.0 by default): the frontend looks the model up by name and
version and has no name for "the default version" in this path.

OpenAI's defaults are kept where they differ from /predictions': `temperature` 1 (sampling),
`max_tokens` 16 on completions (the legacy endpoint's documented default; chat: up to the cache or
handler.max_new_tokens), `stream` false. Parameters this server cannot honour (best_of, suffix,
penalties, logit_bias, tools) are a 400 naming the parameter rather than ignored; an unknown field
is a 400 too, as OpenAI answers one.

Taken as OpenAI defines them: `n` (1..MAX_N independent sequences of the prompt, choice i seeded
with seed + i: request.choices), chat's `logprobs` and `top_logprobs` (0..20), completions'
`logprobs` (0..20: OpenAI caps it at 5, this server at chat's bound) and `echo` (the prompt before
the text; with max_tokens 0 the prompt alone). The log probabilities are the model's own
(handlers/generation/logprobs.py), each token named by text.Text.token_texts. `echo` with
`logprobs` would need the prompt tokens' log probabilities, which the prefill does not keep (the
runners keep the logits of the prompt's last position: run/slots.py reads that row inside its prompt
graphs, run/decoder.py takes it from the call, an export may return no other): a 400 that says so.
"""
from __future__ import annotations

import codecs
import json
import time
import uuid
from dataclasses import replace

from handlers.errors import ModelNotFound, RequestError
from handlers.generation.formats import JSON, SSE, Route
from handlers.generation.logprobs import MAX_TOP
from handlers.generation.request import GenerateRequest, json_body, parameters, unicode
from handlers.wire.base import Encoded

COMPLETIONS, CHAT, MODELS = "v1/completions", "v1/chat/completions", "v1/models"
PATHS = (COMPLETIONS, CHAT, MODELS)
# parameters taken as the generation's own (request.PARAMETERS); top_k, ignore_eos and
# stop_token_ids are vLLM's extras, which clients send through the openai client's extra_body
SAMPLING = ("temperature", "top_p", "seed", "stop", "top_k", "ignore_eos", "stop_token_ids")
TAKEN = {COMPLETIONS: {"model", "prompt", "max_tokens", "stream", "stream_options", "user", "n", "logprobs", "echo",
                       *SAMPLING},
         CHAT: {"model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "user",
                "response_format", "n", "logprobs", "top_logprobs", *SAMPLING}}
MAX_N = 8  # the most choices (`n`) one request makes: n sequences take n of the engine's slots
# name -> the values that ask for nothing this server lacks (any other value is a 400 naming it)
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "parallel_tool_calls": (None, False, True)}
NAMES = set().union(*TAKEN.values(), UNSUPPORTED)  # every parameter an error may name
FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
UNLIKELY = -9999.0  # OpenAI's logprob for a token of no probability (a -inf logit)
ECHO_WITH_LOGPROBS = ("echo with logprobs asks for the prompt tokens' log probabilities, which this server does not "
                      "compute: its prefill keeps the logits of the prompt's last position only (its compiled prompt "
                      "graphs read that row alone). Send echo without logprobs (the prompt text before the "
                      "completion), or logprobs without echo (the generated tokens' log probabilities)")
CREATED = int(time.time())  # /v1/models' `created`: when this worker started
EXAMPLE = "{\"model\": NAME, \"prompt\": \"...\"} or {\"model\": NAME, \"messages\": [...]}"


class BadParameter(RequestError):
    """A 400 naming the OpenAI parameter at fault (the error object's `param`)."""

    def __init__(self, message: str, param, code=None):
        super().__init__(message)
        self.param, self.code = param, code


def route_for(headers, model: str, version: str) -> Route:
    """The route a request's answers take: OpenAI's where TorchServe's url_path names one (any
    url_path at all is no route of the /predictions protocol), else the generate routes'."""
    if headers.url_path:
        return OpenAIRoute(headers.url_path.strip("/"), model, version)
    return Route(headers.generate_route or "predictions", model, version)


class OpenAIRoute(Route):
    """One request's OpenAI answer: its id and time, whether it streams and how, and each choice's
    state while it streams (role sent, echo sent, finish sent, text offset)."""

    def __init__(self, path: str, model: str, version: str):
        super().__init__("predictions", model, version)
        self.path, self.chat = path, path == CHAT
        self.stream = self.usage = False
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.top = self.echo = self.text = None  # logprobs asked (k), the prompt to echo, the tokenizer
        self.began, self.ended, self.offsets = set(), set(), {}

    def direct(self):
        if self.path == MODELS:
            return Encoded(json.dumps({"object": "list", "data": [self._model_card()]}), JSON, {})
        if self.path == f"{MODELS}/{self.model}":
            return Encoded(json.dumps(self._model_card()), JSON, {})
        if self.path.startswith(MODELS + "/"):
            raise ModelNotFound(f"The model `{self.path[len(MODELS) + 1:]}` does not exist; this route serves "
                                f"`{self.model}`")
        if self.path not in PATHS:
            raise ModelNotFound(f"no route {self.path}: this model serves {', '.join(PATHS)} (OpenAI's API) under "
                                f"/predictions/{self.model}/{self.version}/")
        return None

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": CREATED, "owned_by": "compiled-serving"}

    def parse(self, request, content_type, max_bytes: int, text) -> GenerateRequest:
        body = json_body(request, content_type, max_bytes, EXAMPLE)
        _check_fields(body, self.path)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadParameter("model is required: the name of the model to use (GET v1/models lists it)", "model")
        if model != self.model:
            raise ModelNotFound(f"The model `{model}` does not exist; this route serves `{self.model}`")
        self.stream = _stream(body)
        self.usage = self.stream and bool((body.get("stream_options") or {}).get("include_usage"))
        n, self.top, self.text = _n(body.get("n")), _top(body, self.chat), text
        params = replace(_params(body, self.chat, self.stream), logprobs=self.top)
        if self.chat:
            messages = _messages(body.get("messages"))
            if text is None or text.chat is None:
                raise BadParameter("this model's archive has no chat template (tokenizer_config.json's "
                                   "chat_template): use v1/completions with a prompt, or archive the model with "
                                   "cs-archive --tokenizer-config", "messages", "no_chat_template")
            return GenerateRequest(text.chat.render(messages), None, params, special_tokens=False, n=n)
        prompt, ids = _prompt(body.get("prompt"))
        self.echo = _echo(body.get("echo"), prompt, ids, text, self.top)
        return GenerateRequest(prompt, ids, params, n=n)

    def streams(self, stream_param: bool) -> bool:
        return self.stream

    def media_type(self, streamed: bool = True) -> str:
        return SSE if self.stream and streamed else JSON

    def error(self, err) -> Encoded:
        return Encoded(json.dumps(error_body(err)), JSON, {})

    def _chunk(self, choice: dict, usage=None) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice] if choice is not None else []}
        if self.usage:
            obj["usage"] = usage
        return "data: " + json.dumps(obj) + "\n\n"

    def _delta(self, text: str, index: int, finish=None, lps=None) -> dict:
        """A streamed chunk's choice: a token's text (the prompt first where echoed) and its log
        probabilities (`lps`), or the finish; chat's first delta of a choice names the role."""
        if not self.chat:
            if self.echo and index not in self.began:
                text = self.echo + text
            self.began.add(index)
            return {"index": index, "text": text, "logprobs": self._completion_logprobs(lps, index),
                    "finish_reason": finish}
        delta = {} if finish is not None and index in self.began else {"content": text}
        if index not in self.began:
            delta = {"role": "assistant", **delta}
            self.began.add(index)
        return {"index": index, "delta": delta, "logprobs": self._chat_logprobs(lps), "finish_reason": finish}

    def token(self, ev, index: int = 0) -> str:
        return self._chunk(self._delta(ev.text, index, lps=[ev.logprob] if ev.logprob is not None else None))

    def choice_end(self, done, index: int) -> str:
        self.ended.add(index)
        return self._chunk(self._delta("", index, FINISH.get(done.reason, done.reason)))

    def final(self, dones: list, streamed: bool) -> str:
        completion = sum(len(d.ids) for d in dones)
        usage = {"prompt_tokens": dones[0].prompt_tokens, "completion_tokens": completion,
                 "total_tokens": dones[0].prompt_tokens + completion}
        if streamed:
            last = "".join(self.choice_end(d, i) for i, d in enumerate(dones) if i not in self.ended)
            if self.usage:
                last += self._chunk(None, usage)
            return last + "data: [DONE]\n\n"
        return json.dumps({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                           "created": self.created, "model": self.model,
                           "choices": [self._choice(d, i) for i, d in enumerate(dones)], "usage": usage})

    def _choice(self, done, index: int) -> dict:
        """A choice of the answer without streaming."""
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": done.text},
                      "logprobs": self._chat_logprobs(done.logprobs)}
        else:
            choice = {"index": index, "text": (self.echo or "") + done.text,
                      "logprobs": self._completion_logprobs(done.logprobs, index)}
        return {**choice, "finish_reason": FINISH.get(done.reason, done.reason)}

    def _named(self, lp) -> list:
        """[(text, bytes or None, logprob)]: the chosen token, then its step's most likely."""
        ids = [lp.id] + [t for t, _ in lp.top]
        names = (self.text.token_texts(ids, lp.prev) if self.text is not None
                 else [(f"token_id:{i}", None) for i in ids])  # vLLM's name where there is no tokenizer
        values = [lp.logprob] + [v for _, v in lp.top]
        return [(t, b, v if v > UNLIKELY else UNLIKELY) for (t, b), v in zip(names, values)]

    def _chat_logprobs(self, lps):
        """Chat's choice logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        if lps is None:
            return None
        out = []
        for lp in lps:
            (token, raw, value), *top = self._named(lp)
            out.append({**_entry(token, raw, value), "top_logprobs": [_entry(*t) for t in top]})
        return {"content": out}

    def _completion_logprobs(self, lps, index: int):
        """Completions' choice logprobs: {tokens, token_logprobs, top_logprobs: [{token: logprob}]
        (the k most likely and the chosen token: up to k + 1, as OpenAI documents), text_offset:
        where in the choice's text each token begins, counted from the tokens' bytes}."""
        if lps is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        decoder, at = self.offsets.get(index) or (codecs.getincrementaldecoder("utf-8")("replace"), 0)
        for lp in lps:
            (token, raw, value), *top = self._named(lp)
            out["tokens"].append(token)
            out["token_logprobs"].append(value)
            tops = {t: v for t, _, v in top}
            tops.setdefault(token, value)
            out["top_logprobs"].append(tops)
            out["text_offset"].append(at)
            at += len(decoder.decode(raw if raw is not None else token.encode("utf-8")))
        self.offsets[index] = (decoder, at)
        return out

    def error_event(self, err) -> str:
        return "data: " + json.dumps(error_body(err)) + "\n\ndata: [DONE]\n\n"


def _entry(token: str, raw, value: float) -> dict:
    return {"token": token, "logprob": value, "bytes": list(raw) if raw is not None else None}


def error_body(err) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}. The parameter a
    message of request.py or loop.py begins with ("parameters.stop ...", "text_input ...") is
    named in OpenAI's words and is its `param`, as is max_tokens where the message names it
    (the prompt plus max_tokens past the cache)."""
    message = getattr(err, "message", str(err))
    for ours, theirs in (("parameters.", ""), ("text_input", "prompt"), ("input_ids", "prompt")):
        if message.startswith(ours):
            message = theirs + message[len(ours):]
    param = getattr(err, "param", None)
    if param is None:
        first = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":,")
        param = first if first in NAMES else "max_tokens" if "max_tokens" in message else None
    kind = ("invalid_request_error" if err.status < 500 else
            "server_error" if err.status != 503 else "service_unavailable")
    code = getattr(err, "code", None) or ("model_not_found" if isinstance(err, ModelNotFound) else None)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _check_fields(body: dict, path: str) -> None:
    for name, fine in UNSUPPORTED.items():
        if name in body and not any(_same(body[name], v) for v in fine):
            raise BadParameter(f"{name} {json.dumps(body[name])} is not supported by this server (it takes "
                               f"{' or '.join(json.dumps(v) for v in fine if v is not None)})", name,
                               "unsupported_parameter")
    unknown = sorted(set(body) - TAKEN[path] - set(UNSUPPORTED))
    if unknown:
        raise BadParameter(f"Unrecognized request argument supplied: {', '.join(unknown)}; {path} takes "
                           f"{', '.join(sorted(TAKEN[path]))}", unknown[0], "unknown_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadParameter(f"response_format {json.dumps(fmt)} is not supported: only {{\"type\": \"text\"}}",
                           "response_format", "unsupported_parameter")


def _same(value, default) -> bool:
    """`value` is `default`, a bool only a bool (0 == False in Python, but best_of true is no count
    and parallel_tool_calls 1 no flag)."""
    return value is default if default is None or isinstance(default, bool) or isinstance(value, bool) \
        else value == default


def _int_in(name: str, value, low: int, high: int, what: str):
    """`value` where it is an integer in [low, high] (None stays None); else a 400 naming `name`."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        return value
    raise BadParameter(f"{name} is {json.dumps(value)}: expected an integer from {low} to {high} ({what})", name)


def _n(value) -> int:
    n = _int_in("n", value, 1, MAX_N, "the number of choices; this server makes at most "
                f"{MAX_N} per request")
    return 1 if n is None else n


def _top(body: dict, chat: bool):
    """The number of most likely tokens to report beside each token's log probability, or None
    where none are asked for: chat's logprobs (true or false) and top_logprobs, completions'
    logprobs (an integer)."""
    if not chat:
        return _int_in("logprobs", body.get("logprobs"), 0, MAX_TOP, "on completions, the number of most likely "
                       "tokens to list beside each token's log probability; OpenAI caps it at 5, this server at "
                       f"{MAX_TOP}")
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise BadParameter(f"logprobs is {json.dumps(asked)}: expected true or false (on chat completions; "
                           "top_logprobs takes the number of most likely tokens)", "logprobs")
    top = _int_in("top_logprobs", top, 0, MAX_TOP, "the number of most likely tokens at each position")
    if top and not asked:
        raise BadParameter(f"top_logprobs {top} needs logprobs true", "top_logprobs")
    return (top or 0) if asked else None


def _echo(echo, prompt, ids, text, top):
    """The prompt's text to put before each choice's text, or None: `echo` true on completions."""
    if echo is None or echo is False:
        return None
    if echo is not True:
        raise BadParameter(f"echo is {json.dumps(echo)}: expected true or false", "echo")
    if top is not None:
        raise BadParameter(ECHO_WITH_LOGPROBS, "echo", "unsupported_parameter")
    if prompt is not None:
        return prompt
    if text is None:
        raise BadParameter("echo of a prompt of token ids needs the archive's tokenizer (tokenizer.json) to write "
                           "it as text: send the prompt as text, or leave echo out", "echo")
    return text.decode(ids)


def _stream(body: dict) -> bool:
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise BadParameter(f"stream is {json.dumps(stream)}: expected true or false", "stream")
    if options is not None:
        if not stream:
            raise BadParameter("stream_options is only taken with stream true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise BadParameter(f"stream_options is {json.dumps(options)}: it takes {{\"include_usage\": true or "
                               "false}", "stream_options")
    return bool(stream)


def _params(body: dict, chat: bool, stream: bool):
    """The generation's parameters (request.parameters checks them); max_completion_tokens is
    chat's newer name for max_tokens and wins where both are sent."""
    raw = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    if isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]
    most = body.get("max_completion_tokens") if chat else None
    raw["max_tokens"] = most if most is not None else body.get("max_tokens", None if chat else 16)
    raw.setdefault("temperature", 1.0)  # OpenAI's default: sampling
    raw["stream"] = stream
    if not chat and body.get("echo") is True and raw["max_tokens"] == 0 and type(raw["max_tokens"]) is int:
        return replace(parameters({**raw, "max_tokens": None}), max_tokens=0)  # the prompt alone: no generation
    if chat and most is not None:
        try:
            return parameters(raw)
        except RequestError as e:
            raise BadParameter(e.message.replace("parameters.max_tokens", "max_completion_tokens", 1),
                               "max_completion_tokens") from None
    return parameters(raw)


def _prompt(prompt) -> tuple:
    """(text, ids): a string, or token ids (a list of integers); a list of one of them is that one."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        unicode("prompt", prompt)
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return None, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadParameter(f"prompt holds {len(prompt)} prompts; this server answers one prompt per request: send "
                           "each in a request of its own", "prompt", "unsupported_parameter")
    raise BadParameter(f"prompt is {json.dumps(prompt)[:80]}: expected a non-empty string or a list of token ids",
                       "prompt")


def _messages(messages) -> list:
    """The conversation as the template takes it: [{role, content: str}] (a content of text parts
    joined; other part types are a 400)."""
    if not isinstance(messages, list) or not messages:
        raise BadParameter("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadParameter(f"messages[{i}] must be an object with a string role", "messages")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise BadParameter(f"messages[{i}].{extra[0]} is not supported by this server (it takes role, content, "
                               "name)", "messages", "unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadParameter(f"messages[{i}].content: only parts of type text are taken", "messages",
                                   "unsupported_parameter")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadParameter(f"messages[{i}].content must be a string or a list of text parts", "messages")
        unicode(f"messages[{i}].content", content)
        out.append({**{k: m[k] for k in ("role", "name") if k in m}, "content": content})
    return out
