"""OpenAI's API on decoder archives (handlers/generation/openai.py, chat.py): the chat template
rendered as transformers renders it, the wire's refusals in OpenAI's error shape, and through real
TorchServe with the official `openai` client, on both decoder forms (a transformers Llama exported
with its static cache, one sequence per worker; and the slot form, continuous batching): greedy
completions and chats, streamed and not, equal to the /predictions answer for the same prompt
ids; usage, finish reasons, stop strings, seeds, v1/models, and errors with their status."""
import json
from types import SimpleNamespace

import pytest
import requests
import torch
from conftest import build_mar
from test_continuous import archive

from examples import slot_decoder, transformers_decoder
from examples.tiny_decoder import Config
from handlers.errors import ModelNotFound, RequestError
from handlers.generation.chat import ChatTemplate
from handlers.generation.openai import OpenAIRoute, error_body
from handlers.generation.request import choices
from handlers.generation.text import Text

# Qwen2-Instruct's own chat template (its tokenizer_config.json): ChatML with a default system turn
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 2's (bos_token, raise_exception, a system turn folded into the first user turn)
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
          "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
# Zephyr's (HuggingFaceH4/zephyr-7b-beta): one tag a line, which only trim_blocks renders without blank lines
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}"
          "\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
SPECIAL = ("</s>", "<|im_start|>", "<|im_end|>")
CHAT = [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps"},
        {"role": "user", "content": [{"type": "text", "text": "over the "}, {"type": "text", "text": "lazy dog"}]}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    transformers_decoder.tiny_tokenizer(special_tokens=SPECIAL).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>",
                                                         "bos_token": None}))
    return d


def test_chat_templates_render_as_transformers_renders_them(tok_dir):
    from transformers import PreTrainedTokenizerFast

    text = Text.in_dir(str(tok_dir))
    system = [{"role": "system", "content": "be brief"}, *CHAT]
    for template in (CHATML, LLAMA2, ZEPHYR):
        ours = ChatTemplate(template, {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}})
        hf = PreTrainedTokenizerFast(tokenizer_object=text.tokenizer, bos_token="<s>", eos_token="</s>",
                                     chat_template=template)
        for messages in (CHAT, system):
            plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else "over the lazy dog"}
                     for m in messages]
            want = hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
            assert ours.render(plain) == want, template[:30]
    with pytest.raises(RequestError) as e:  # the template's own raise_exception: the client's 400
        ChatTemplate(LLAMA2, {}).render([{"role": "assistant", "content": "x"}])
    assert "roles must alternate" in e.value.message and e.value.status == 400
    assert text.chat is not None and text.chat.render(CHAT[:1]).endswith("<|im_start|>assistant\n")


def parsed(path, body, text=None):
    route = OpenAIRoute(path, "lm", "1.0")
    return route, route.parse({"body": json.dumps(body).encode()}, "application/json", 1 << 20, text)


@pytest.mark.parametrize("path, body, param, words", [
    ("v1/completions", {"model": "lm", "prompt": "x", "n": 0}, "n", "n is 0: expected an integer from 1 to 8"),
    ("v1/chat/completions", {"model": "lm", "messages": CHAT, "n": 9}, "n", "n is 9: expected an integer from 1 to 8"),
    ("v1/completions", {"model": "lm", "prompt": "x", "n": True}, "n", "n is true: expected an integer"),
    ("v1/completions", {"model": "lm", "prompt": "x", "logprobs": True}, "logprobs",
     "logprobs is true: expected an integer from 0 to 20"),
    ("v1/completions", {"model": "lm", "prompt": "x", "logprobs": 21}, "logprobs", "logprobs is 21: expected an "
     "integer from 0 to 20"),
    ("v1/completions", {"model": "lm", "prompt": "x", "echo": True, "logprobs": 0}, "echo",
     "echo with logprobs asks for the prompt tokens' log probabilities"),
    ("v1/completions", {"model": "lm", "prompt": [5, 6], "echo": True}, "echo", "needs the archive's tokenizer"),
    ("v1/completions", {"model": "lm", "prompt": "x", "echo": 1}, "echo", "echo is 1: expected true or false"),
    ("v1/completions", {"model": "lm", "prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens is 0"),
    ("v1/completions", {"model": "lm", "prompt": "x", "top_logprobs": 2}, "top_logprobs", "Unrecognized request"),
    ("v1/completions", {"model": "lm", "prompt": "x", "best_of": 2}, "best_of", "best_of 2 is not supported"),
    ("v1/chat/completions", {"model": "lm", "messages": CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs",
     "top_logprobs is 21: expected an integer from 0 to 20"),
    ("v1/chat/completions", {"model": "lm", "messages": CHAT, "top_logprobs": 2}, "top_logprobs",
     "top_logprobs 2 needs logprobs true"),
    ("v1/chat/completions", {"model": "lm", "messages": CHAT, "logprobs": 3}, "logprobs",
     "logprobs is 3: expected true or false"),
    ("v1/chat/completions", {"model": "lm", "messages": CHAT, "echo": True}, "echo", "Unrecognized request"),
    ("v1/completions", {"model": "lm", "prompt": "x", "bogus": 1}, "bogus", "Unrecognized request argument"),
    ("v1/completions", {"model": "lm", "prompt": ["a", "b"]}, "prompt", "prompt holds 2 prompts"),
    ("v1/completions", {"model": "lm", "prompt": ""}, "prompt", "expected a non-empty string"),
    ("v1/completions", {"prompt": "x"}, "model", "model is required"),
    ("v1/completions", {"model": "lm", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "only taken with stream true"),
    ("v1/completions", {"model": "lm", "prompt": "x", "temperature": -1}, "temperature", "temperature is -1.0"),
    ("v1/completions", {"model": "lm", "prompt": "x", "stop": 5}, "stop", "stop is 5"),
    ("v1/chat/completions", {"model": "lm", "messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens is 0"),
    ("v1/chat/completions", {"model": "lm", "messages": []}, "messages", "non-empty list"),
    ("v1/chat/completions", {"model": "lm", "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages", "messages[0].tool_calls is not supported"),
    ("v1/chat/completions", {"model": "lm", "messages": CHAT}, "messages", "has no chat template"),
])
def test_bad_openai_requests_are_400s_naming_the_parameter_in_openais_error_shape(path, body, param, words):
    with pytest.raises(RequestError) as e:
        parsed(path, body, SimpleNamespace(chat=None) if path == "v1/chat/completions" else None)
    err = error_body(e.value)["error"]
    assert e.value.status == 400 and words in err["message"] and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}


def test_the_openai_body_maps_onto_the_generation_request():
    route, req = parsed("v1/completions", {"model": "lm", "prompt": [[5, 6, 7]], "stop": "ab", "seed": 3,
                                           "stream": True, "stream_options": {"include_usage": True},
                                           "n": 1, "presence_penalty": 0.0, "logprobs": None, "echo": False})
    assert req.ids == [5, 6, 7] and req.params.stop == ("ab",) and req.params.seed == 3 and req.n == 1
    assert req.params.logprobs is None and route.echo is None
    assert req.params.temperature == 1.0 and req.params.max_tokens == 16 and route.stream and route.usage
    _, req = parsed("v1/chat/completions", {"model": "lm", "messages": CHAT[:1], "max_tokens": 9,
                                            "max_completion_tokens": 4, "temperature": 0},
                    SimpleNamespace(chat=ChatTemplate(CHATML, {})))
    assert req.params.max_tokens == 4 and req.params.temperature == 0 and not req.special_tokens
    assert req.text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" \
                       "the quick brown fox<|im_end|>\n<|im_start|>assistant\n"
    route, req = parsed("v1/completions", {"model": "lm", "prompt": "x y", "n": 3, "logprobs": 0, "seed": 2**63 - 2})
    assert req.n == 3 and req.params.logprobs == 0 and route.top == 0
    assert [c.params.seed for c in choices(req)] == [2**63 - 2, 2**63 - 1, 0]  # choice i: seed + i (mod 2**63)
    assert all(c.params.seed is None for c in choices(parsed("v1/completions", {"model": "lm", "prompt": "x",
                                                                                "n": 2})[1]))
    route, req = parsed("v1/completions", {"model": "lm", "prompt": "x y", "echo": True, "max_tokens": 0})
    assert route.echo == "x y" and req.params.max_tokens == 0
    for chat_asks, top in (({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 4}, 4),
                           ({"logprobs": False, "top_logprobs": 0}, None), ({}, None)):
        _, req = parsed("v1/chat/completions", {"model": "lm", "messages": CHAT[:1], **chat_asks},
                        SimpleNamespace(chat=ChatTemplate(CHATML, {})))
        assert req.params.logprobs == top, chat_asks
    with pytest.raises(ModelNotFound) as e:
        parsed("v1/completions", {"model": "other", "prompt": "x"})
    assert error_body(e.value)["error"]["code"] == "model_not_found" and e.value.status == 404


def test_the_pods_lookup_of_the_model_named_in_the_body(tmp_path):
    """pod/openai_route.py: the redirect to the model's versioned TorchServe route, only for the
    pod's decoders (an archive whose artifact.json records one), and OpenAI's errors otherwise."""
    import zipfile

    from pod.config import Model
    from pod.openai_route import decoders, get, post

    mars = {}
    for name, extra in (("lm", {"state": {"decoder": {"vocab": 300}}}), ("cls", {})):
        mars[name] = tmp_path / f"{name}.mar"
        with zipfile.ZipFile(mars[name], "w") as z:
            z.writestr("variants/00/artifact.json", json.dumps({"inputs": [], "outputs": [], "extra": extra}))
    models = decoders([Model("lm", "2.0", str(mars["lm"])), Model("cls", "1.0", str(mars["cls"])),
                       Model("gone", "1.0", str(tmp_path / "missing.mar"))])
    assert models == {"lm": "2.0"}
    assert post("/openai/v1/chat/completions", b'{"model": "lm", "messages": []}', models) == (
        200, {"X-Accel-Redirect": "/_openai/predictions/lm/2.0/v1/chat/completions"}, None)
    for body, status, param in ((b'{"model": "cls"}', 404, "model"), (b"[1]", 400, None), (b"{}", 400, "model"),
                                (b'{"model": 5}', 400, "model"), (b"{", 400, None)):
        code, headers, answer = post("/openai/v1/completions", body, models)
        assert (code, answer["error"]["param"], headers) == (status, param, {}), answer
    assert post("/openai/v1/embeddings", b'{"model": "lm"}', models)[0] == 404
    assert get("/openai/v1/models", models)[1]["data"][0]["id"] == "lm"
    assert get("/openai/v1/models/cls", models)[0] == 404 and get("/v1/models", models) is None


# --- through real TorchServe -------------------------------------------------------------------

@pytest.fixture(scope="module")
def oa_server(tok_dir, serve, tmp_path_factory):
    """One server: `lm_one`, a transformers Llama (one sequence per worker), and `lm_slots`, the
    slot form (continuous batching), both with the ChatML tokenizer and template."""
    d = tmp_path_factory.mktemp("oa")
    store = d / "store"
    one, slots = d / "one.pt2", d / "slots.pt2"
    torch.export.save(transformers_decoder.export(transformers_decoder.tiny_llama(), max_cache=128), one)
    torch.export.save(slot_decoder.export(slot_decoder.build(Config(vocab_size=300, max_seq_length=128), slots=8)),
                      slots)
    tok = str(tok_dir / "tokenizer.json")
    build_mar(one, "lm_one", store, "--tokenizer", tok)
    r = archive(slots, "lm_slots", store, "--tokenizer", tok)
    assert "chat template: from" in r.stdout, r.stdout
    ts = serve({"lm_one": store / "lm_one.mar", "lm_slots": store / "lm_slots.mar"})
    return SimpleNamespace(ts=ts, text=Text.in_dir(str(tok_dir)), store=store)


def client(oa, model):
    from openai import OpenAI

    return OpenAI(base_url=f"{oa.ts.base}/predictions/{model}/1.0/v1", api_key=oa.ts.keys["inference"]["key"],
                  max_retries=0, timeout=120)


def predictions(oa, model, ids, n):
    """The /predictions answer (its last line) for prompt ids, greedy, n tokens."""
    r = requests.post(f"{oa.ts.base}/predictions/{model}", json={"input_ids": ids, "parameters": {
        "max_tokens": n, "ignore_eos": True, "stream": False}}, headers=oa.ts.auth(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


MODELS = ("lm_one", "lm_slots")
PROMPT = "the quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
def test_completions_streamed_and_not_equal_the_predictions_answer(oa_server, model):
    c = client(oa_server, model)
    want = predictions(oa_server, model, oa_server.text.encode(PROMPT), 12)
    got = c.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert got.object == "text_completion" and got.id.startswith("cmpl-") and got.model == model and got.created > 0
    assert got.choices[0].text == want["text_output"] and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        want["prompt_tokens"], 12, want["prompt_tokens"] + 12)
    chunks = list(c.completions.create(model=model, prompt=PROMPT, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY))
    *tokens, last, usage = chunks
    assert len(tokens) == 12 and all(ch.id == chunks[0].id and ch.choices[0].finish_reason is None for ch in tokens)
    assert "".join(ch.choices[0].text for ch in tokens) == want["text_output"]
    assert last.choices[0].finish_reason == "length" and usage.choices == [] and usage.usage.completion_tokens == 12
    ids = c.completions.create(model=model, prompt=[5, 17, 33], **GREEDY)  # a prompt of token ids
    assert ids.choices[0].text == predictions(oa_server, model, [5, 17, 33], 12)["text_output"]


@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
def test_chat_streamed_and_not_equals_the_predictions_answer_for_the_templates_ids(oa_server, model):
    c = client(oa_server, model)
    ids = oa_server.text.encode(oa_server.text.chat.render(
        [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "over the lazy dog"}
         for m in CHAT]), add_special_tokens=False)
    want = predictions(oa_server, model, ids, 10)
    args = dict(model=model, messages=CHAT, temperature=0, max_completion_tokens=10, extra_body={"ignore_eos": True})
    got = c.chat.completions.create(**args)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want["text_output"]
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 10
    chunks = list(c.chat.completions.create(stream=True, **args))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want["text_output"]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
def test_stop_seed_models_and_errors_through_the_client(oa_server, model):
    import openai

    c = client(oa_server, model)
    whole = c.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = c.completions.create(model=model, prompt=PROMPT, stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[:whole.index(stop)], (whole, stop)
    seeded = [c.completions.create(model=model, prompt=PROMPT, temperature=1.0, seed=7, max_tokens=12).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert [m.id for m in c.models.list()] == [model]
    for call, status, param in ((lambda: c.completions.create(model=model, prompt=PROMPT, n=9), 400, "n"),
                                (lambda: c.completions.create(model=model, prompt=PROMPT, max_tokens=500), 400,
                                 "max_tokens"),
                                (lambda: c.completions.create(model="nope", prompt=PROMPT), 404, None)):
        with pytest.raises(openai.APIStatusError) as e:
            call()
        assert e.value.status_code == status and e.value.body["param"] == param, e.value.body
        assert set(e.value.body) == {"message", "type", "param", "code"}
    # serves on (ignore_eos: sampled at the default temperature, the tiny model's second token was
    # once its end-of-sequence token, a right answer of 1 token)
    again = c.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert again.usage.completion_tokens == 2 and again.choices[0].finish_reason == "length"


@pytest.mark.server
def test_the_wire_server_sent_events_end_with_done_and_errors_keep_openais_shape(oa_server):
    """What the client library reads leniently, checked on the raw HTTP: the stream's
    Content-Type, `data: {...}` events, `data: [DONE]` last; a route the model does not serve,
    a form body (400 today; issue 65 item 6 makes it 415) and a body that is no JSON each in OpenAI's error shape."""
    ts, base = oa_server.ts, f"{oa_server.ts.base}/predictions/lm_slots/1.0/"
    r = requests.post(base + "v1/chat/completions", json={"model": "lm_slots", "messages": CHAT[:1], "stream": True,
                                                          "max_tokens": 4, "temperature": 0}, headers=ts.auth(),
                      stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream"), r.text
    events = [line for line in r.iter_lines() if line]
    assert all(e.startswith(b"data: ") for e in events) and events[-1] == b"data: [DONE]", events
    assert [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * 4 + ["length"]
    for path, kwargs, status in (("v1/embeddings", {"json": {"model": "lm_slots"}}, (404,)),
                                 ("v1/completions", {"data": {"model": "lm_slots", "prompt": "x"}}, (400, 415)),
                                 ("v1/completions", {"data": b"{", "headers": {"Content-Type": "application/json"}},
                                  (400,))):
        bad = requests.post(base + path, headers={**ts.auth(), **kwargs.pop("headers", {})}, timeout=60, **kwargs)
        assert bad.status_code in status and set(bad.json()["error"]) == {"message", "type", "param", "code"}, bad.text
    models = requests.get(base + "v1/models", headers=ts.auth(), timeout=60)
    assert models.json() == {"object": "list", "data": [{"id": "lm_slots", "object": "model", "created": ANY_INT,
                                                         "owned_by": "compiled-serving"}]}, models.text


@pytest.mark.server
def test_the_pods_openai_routes_take_the_model_from_the_body(oa_server, tmp_path):
    """The KServe pod with both archives: /openai/v1/... routed by the body's `model` (pod.status
    looks it up, nginx sends the request on to TorchServe's versioned route): the same greedy
    answers as /predictions, streamed and not; v1/models lists the decoders; a model the pod
    lacks, a body without one, and the handler's own 400 each in OpenAI's error shape."""
    import openai
    from kserve_kit import Container, lay_out

    laid = lay_out([oa_server.store / "lm_one.mar", oa_server.store / "lm_slots.mar"], tmp_path / "out")
    assert laid.returncode == 0, laid.stdout + laid.stderr
    pod = Container(tmp_path / "out" / "storage", tmp_path / "pod")
    try:
        pod.wait("ready")
        c = openai.OpenAI(base_url=f"{pod.base}/openai/v1", api_key="unused", max_retries=0, timeout=120)
        assert sorted(m.id for m in c.models.list()) == list(MODELS)
        ids = oa_server.text.encode(oa_server.text.chat.render(CHAT[:1]), add_special_tokens=False)
        for model in MODELS:
            want = predictions(oa_server, model, oa_server.text.encode(PROMPT), 12)["text_output"]
            assert c.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text == want
            chunks = list(c.chat.completions.create(model=model, messages=CHAT[:1], stream=True, **GREEDY))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == \
                predictions(oa_server, model, ids, 12)["text_output"]
        r = requests.post(f"{pod.base}/openai/v1/completions", json={"model": "lm_slots", "prompt": PROMPT,
                          "stream": True, "max_tokens": 3}, stream=True, timeout=60)
        assert r.headers["Content-Type"].startswith("text/event-stream") and "Content-Length" not in r.headers
        assert [line for line in r.iter_lines() if line][-1] == b"data: [DONE]"
        for body, status, param in (({"model": "nope", "prompt": "x"}, 404, "model"), ({"prompt": "x"}, 400, "model"),
                                    ({"model": "lm_one", "prompt": "x", "n": 9}, 400, "n")):
            bad = requests.post(f"{pod.base}/openai/v1/completions", json=body, timeout=60)
            assert bad.status_code == status and bad.json()["error"]["param"] == param, bad.text
        assert requests.get(f"{pod.base}/openai/v1/models/nope", timeout=60).status_code == 404
        # the internal location is no route from outside (nginx's 404 there becomes the server's 503 page)
        hidden = requests.get(f"{pod.base}/_openai/predictions/lm_one/1.0/v1/models", timeout=60)
        assert hidden.status_code in (404, 503) and "lm_one" not in hidden.text, hidden.text
    finally:
        pod.stop()


class _AnyInt:
    def __eq__(self, other):
        return isinstance(other, int) and other > 0


ANY_INT = _AnyInt()


# --- n, logprobs, echo through real TorchServe ---------------------------------------------------

def eager_logprobs(model: str, ids: list) -> torch.Tensor:
    """log_softmax (float32) of the eager model's logits at every position of `ids`: the models
    the archives were exported from (lm_one: transformers' Llama; lm_slots: the slot decoder)."""
    with torch.no_grad():
        if model == "lm_one":
            logits = transformers_decoder.tiny_llama()(torch.tensor([ids])).logits[0]
        else:
            m = slot_decoder.build(Config(vocab_size=300, max_seq_length=128), slots=8)
            logits = m(torch.tensor([ids]), torch.arange(len(ids)).view(1, -1), torch.tensor([0]))[0]
    return torch.log_softmax(logits.float(), -1)


def whole_text_tokens(entries) -> list:
    """The indices of the entries whose token, and the one before it, are whole UTF-8 characters
    (the piece the stream sends for such a token is its text), special tokens left out."""
    def whole(e):
        try:
            return e.token not in SPECIAL and bool(bytes(e.bytes).decode("utf-8"))
        except UnicodeDecodeError:
            return False
    return [i for i, e in enumerate(entries) if whole(e) and (i == 0 or whole(entries[i - 1]))]


@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
def test_chat_logprobs_are_the_models_own_streamed_and_not(oa_server, model):
    """Greedy chat with logprobs and top_logprobs 3: an entry per generated token whose token is
    the text the stream sends for it (its bytes adding up to the message), its logprob the top-1's,
    every value <= 0 and sorted, and equal to log_softmax of the eager model's logits for the same
    prefix to 1e-4; streamed, each chunk carries its token's entry, the same as unstreamed."""
    c, text = client(oa_server, model), oa_server.text
    ids = text.encode(text.chat.render(CHAT[:1]), add_special_tokens=False)
    want = predictions(oa_server, model, ids, 10)["token_ids"]
    ref = eager_logprobs(model, ids + want)[len(ids) - 1:-1]
    args = dict(model=model, messages=CHAT[:1], temperature=0, max_tokens=10, logprobs=True, top_logprobs=3,
                extra_body={"ignore_eos": True})
    got = c.chat.completions.create(**args)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == 10
    for i, e in enumerate(content):
        assert [t.token for t in e.top_logprobs][0] == e.token and e.top_logprobs[0].logprob == e.logprob
        values = [t.logprob for t in e.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True) and values[0] <= 0
        assert abs(e.logprob - ref[i, want[i]].item()) < 1e-4, (i, e.logprob, ref[i, want[i]].item())
        assert max(abs(v - w) for v, w in zip(values, torch.topk(ref[i], 3).values.tolist())) < 1e-4
        assert bytes(e.bytes) == text.tokenizer.decode([want[i]], skip_special_tokens=False).encode() or \
            "\ufffd" in text.tokenizer.decode([want[i]])
    # the bytes add up to the message (a character left unfinished at the end is never sent)
    full = b"".join(bytes(e.bytes) for e in content if e.token not in SPECIAL).decode("utf-8", "replace")
    message = got.choices[0].message.content
    assert full.startswith(message) and set(full[len(message):]) <= {"\ufffd"}, (full, message)
    chunks = [ch for ch in c.chat.completions.create(stream=True, **args) if ch.choices[0].logprobs]
    streamed = [e for ch in chunks for e in ch.choices[0].logprobs.content]
    assert all(len(ch.choices[0].logprobs.content) == 1 for ch in chunks) and len(chunks) == 10
    assert [(e.token, e.logprob, e.bytes, e.top_logprobs) for e in streamed] == \
        [(e.token, e.logprob, e.bytes, e.top_logprobs) for e in content]
    # each chunk's text is what its token's bytes complete: the token itself where it and the one
    # before are whole characters; at every chunk the text so far is the bytes so far, a character
    # still unfinished held back
    pieces = [ch.choices[0].delta.content for ch in chunks]
    assert all(pieces[i] == streamed[i].token for i in whole_text_tokens(streamed))
    for i in range(len(chunks)):
        so_far = b"".join(bytes(e.bytes) for e in streamed[:i + 1] if e.token not in SPECIAL).decode("utf-8", "replace")
        sent = "".join(pieces[:i + 1])
        assert so_far.startswith(sent) and set(so_far[len(sent):]) <= {"\ufffd"}, (i, so_far, sent)


@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
def test_completions_with_n_3_and_logprobs_2_streamed_and_not(oa_server, model):
    """n 3 sampled at temperature 0.7 with a seed: choices 0, 1, 2 are the single answers for seeds
    11, 12, 13; logprobs 2 gives the untempered log_softmax of each chosen token (to 1e-4 of the
    eager model's) with up to 3 alternatives (the 2 most likely and the chosen one); usage counts
    the prompt once and every choice's tokens; streamed, the chunks of the choices (interleaved on
    the slot form) add up, per index, to the same choices."""
    c, text = client(oa_server, model), oa_server.text
    ids = text.encode(PROMPT)
    args = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0.7, seed=11, extra_body={"ignore_eos": True})
    got = c.completions.create(n=3, logprobs=2, **args)
    assert [ch.index for ch in got.choices] == [0, 1, 2] and len({ch.text for ch in got.choices}) > 1
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 24)
    for i, ch in enumerate(got.choices):
        alone = c.completions.create(**{**args, "seed": 11 + i}).choices[0]
        assert ch.text == alone.text and ch.finish_reason == "length"
        made = requests.post(f"{oa_server.ts.base}/predictions/{model}", headers=oa_server.ts.auth(), timeout=120,
                             json={"input_ids": ids, "parameters": {"max_tokens": 8, "temperature": 0.7, "seed": 11 + i,
                                                                    "ignore_eos": True, "stream": False}}).json()
        ref = eager_logprobs(model, ids + made["token_ids"])[len(ids) - 1:-1]
        lp = ch.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
        for j, (token, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
            assert abs(value - ref[j, made["token_ids"][j]].item()) < 1e-4, (i, j)
            assert top[token] == value and 2 <= len(top) <= 3 and all(v <= 0 for v in top.values())
            best = torch.topk(ref[j], 2).values.tolist()
            assert sorted(top.values(), reverse=True)[:2] == pytest.approx(best, abs=1e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(c.completions.create(n=3, logprobs=2, stream=True, stream_options={"include_usage": True}, **args))
    *chunks, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 24
    order = [ch.choices[0].index for ch in chunks]
    for i, whole in enumerate(got.choices):
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == i]
        assert "".join(x.text for x in mine) == whole.text and [x.finish_reason for x in mine][-1] == "length"
        assert [t for x in mine if x.logprobs for t in x.logprobs.token_logprobs] == whole.logprobs.token_logprobs
        assert [t for x in mine if x.logprobs for t in x.logprobs.text_offset] == whole.logprobs.text_offset
    changes = sum(a != b for a, b in zip(order, order[1:]))
    assert changes > 2 if model == "lm_slots" else changes == 2, order  # one sequence at a time: in order


@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
def test_echo_puts_the_prompt_before_the_text(oa_server, model):
    c = client(oa_server, model)
    plain = c.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    got = c.completions.create(model=model, prompt=PROMPT, echo=True, n=2, **GREEDY)
    assert [ch.text for ch in got.choices] == [PROMPT + plain] * 2 and got.usage.completion_tokens == 24
    chunks = list(c.completions.create(model=model, prompt=PROMPT, echo=True, stream=True, **GREEDY))
    assert chunks[0].choices[0].text.startswith(PROMPT) and "".join(ch.choices[0].text for ch in chunks) == \
        PROMPT + plain
    alone = c.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=0)
    assert alone.choices[0].text == PROMPT and alone.choices[0].finish_reason == "length"
    assert (alone.usage.prompt_tokens, alone.usage.completion_tokens) == (len(oa_server.text.encode(PROMPT)), 0)
    chunks = list(c.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=0, stream=True))
    assert [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in chunks] == [(PROMPT, "length")]
    ids = c.completions.create(model=model, prompt=[5, 17, 33], echo=True, **GREEDY).choices[0].text
    assert ids == oa_server.text.decode([5, 17, 33]) + c.completions.create(model=model, prompt=[5, 17, 33],
                                                                           **GREEDY).choices[0].text


@pytest.mark.server
def test_n_logprobs_and_echo_refusals_through_the_client_and_their_raw_shapes(oa_server):
    import openai

    model = "lm_slots"
    c = client(oa_server, model)
    for call, param, words in (
            (lambda: c.chat.completions.create(model=model, messages=CHAT[:1], logprobs=True, top_logprobs=21),
             "top_logprobs", "top_logprobs is 21: expected an integer from 0 to 20"),
            (lambda: c.completions.create(model=model, prompt=PROMPT, logprobs=True), "logprobs",
             "logprobs is true: expected an integer from 0 to 20"),
            (lambda: c.completions.create(model=model, prompt=PROMPT, n=0), "n", "n is 0: expected an integer from 1 "
             "to 8"),
            (lambda: c.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1), "echo",
             "keeps the logits of the prompt's last position only")):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.status_code == 400 and e.value.body["param"] == param and words in e.value.body["message"], \
            e.value.body
    base, auth = f"{oa_server.ts.base}/predictions/{model}/1.0/", oa_server.ts.auth()
    chat = requests.post(base + "v1/chat/completions", headers=auth, timeout=60, json={
        "model": model, "messages": CHAT[:1], "max_tokens": 2, "logprobs": True, "top_logprobs": 1}).json()
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert set(chat["choices"][0]["logprobs"]) == {"content"} and set(entry) == {"token", "logprob", "bytes",
                                                                                 "top_logprobs"}
    assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    done = requests.post(base + "v1/completions", headers=auth, timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 2, "logprobs": 0}).json()
    lp = done["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, lp
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]  # logprobs 0: the chosen
