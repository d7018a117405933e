"""A decoder's generation when its model fails after the first token (handlers/generating.py): the
stream ends with an error object (its status line has gone out), the worker stays ready and the
next request is served. The model here is the tiny decoder's eager module behind a runner that
fails on a chosen step: the one fault a real decoder cannot be made to show on demand."""
import json

import torch

from examples import tiny_decoder
from handlers.artifact.decoder import recognise
from handlers.artifact.state import program_state
from handlers.config import parse_config
from handlers.generating import Generation
from handlers.run.decoder import DecoderRunner
from handlers.torchserve.headers import RequestHeaders
from worker_kit import make_spec, make_worker


class FailingStep(DecoderRunner):
    """The real runner over the exported program, raising `message` on step `fail_at` of each sequence."""

    def __init__(self, *args, fail_at: int, message: str = "the model's kernel failed"):
        super().__init__(*args)
        self.fail_at, self.steps, self.message = fail_at, 0, message

    def prefill(self, ids):
        self.steps = 0
        return super().prefill(ids)

    def step(self, token, position):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError(self.message)
        return super().step(token, position)


def test_an_error_after_the_first_token_ends_the_stream_and_the_worker_serves_on():
    ep = tiny_decoder.export(tiny_decoder.build(), "torchchat")
    dec = recognise(ep, program_state(ep).mutated)
    module = ep.module()
    config = parse_config({})
    runner = FailingStep(lambda t, p: {"logits": module(t, p)}, dec, torch.device("cpu"), config, fail_at=3)
    worker = make_worker(make_spec(1, 1), runner, config=config)
    worker.loaded.generation = Generation(runner, None, config, 1 << 20)
    sent = []
    body = json.dumps({"input_ids": [5, 17, 33], "parameters": {"max_tokens": 8}}).encode()
    answers = worker.serve([{"body": body}], [RequestHeaders("application/json")], lambda i, a, ending=None: sent.append(a))
    # the step queued ahead of the host's read fails: tokens before it went out, then the error
    assert 1 <= len(sent) <= 3 and all("token_ids" in json.loads(a.body) for a in sent)
    last = json.loads(answers[0].body)
    assert last["finish_reason"] == "error" and "the model's kernel failed" in last["error"]
    assert worker.health.refusal() is None  # not a device fault: the worker serves on
    runner.fail_at = 0
    answers = worker.serve([{"body": body}], [RequestHeaders("application/json")], lambda i, a, ending=None: None)
    assert json.loads(answers[0].body)["completion_tokens"] == 8


def test_a_sticky_fault_breaks_the_worker_and_its_exit_never_ends_the_test_process():
    """A device-side assert is sticky (handlers/faults.py): the stream ends with the error, every
    later request is refused, and the worker asks for its exit (restart.exit_soon), which in this
    process is recorded by tests/conftest.py instead of ending pytest (os._exit(70))."""
    import time

    import conftest
    from handlers.torchserve import restart

    ep = tiny_decoder.export(tiny_decoder.build(), "torchchat")
    dec = recognise(ep, program_state(ep).mutated)
    module = ep.module()
    config = parse_config({})
    runner = FailingStep(lambda t, p: {"logits": module(t, p)}, dec, torch.device("cpu"), config, fail_at=2,
                         message="CUDA error: device-side assert triggered")
    worker = make_worker(make_spec(1, 1), runner, config=config)
    worker.loaded.generation = Generation(runner, None, config, 1 << 20)
    body = json.dumps({"input_ids": [5, 17, 33], "parameters": {"max_tokens": 8}}).encode()
    asked = len(conftest.EXITS_ASKED)
    try:
        answers = worker.serve([{"body": body}], [RequestHeaders("application/json")], lambda i, a, ending=None: None)
        assert "device-side assert" in json.loads(answers[0].body)["error"]
        assert worker.health.refusal() is not None and restart.exiting()
        deadline = time.monotonic() + 30  # the exit's timer fires after restart.EXIT_DELAY_S
        while len(conftest.EXITS_ASKED) == asked and time.monotonic() < deadline:
            time.sleep(0.05)
        assert conftest.EXITS_ASKED[asked:] == [70]
    finally:
        restart._exit_reason = None  # expected here: the exit conftest.py fails every other test on


def test_text_held_for_a_stop_sequence_is_released_when_an_end_of_sequence_id_ends_it(tmp_path):
    """Text that could begin a stop sequence is held back; when an end-of-sequence id ends the
    generation instead, that text is still sent (never lost)."""
    from examples import transformers_decoder
    from handlers.generation import loop
    from handlers.generation.request import GenerateRequest, Params
    from handlers.generation.text import Text

    path = tmp_path / "tokenizer.json"
    transformers_decoder.tiny_tokenizer().save(str(path))
    text = Text(str(path))
    ep = transformers_decoder.export(transformers_decoder.tiny_llama())
    dec = recognise(ep, program_state(ep).mutated)
    module = ep.module()
    runner = DecoderRunner(lambda t, p: {"logits": module(input_ids=t, cache_position=p)}, dec,
                           torch.device("cpu"), parse_config({}))
    config = parse_config({})

    def run(**params):
        req = GenerateRequest("the quick brown", None, Params(max_tokens=12, ignore_eos=True, **params))
        events = list(loop.generate(runner, req, loop.plan(req, text, dec.vocab, dec.cache_length, config), text))
        return events[-1], "".join(e.text for e in events[:-1])
    free, _ = run()
    ids, full = free.ids, free.text
    k = next(i for i in range(2, len(ids)) if text.decode(ids[:i]) and ids[i] not in ids[:i])
    before = text.decode(ids[:k])  # the text of the tokens before the one that will end it
    done, streamed = run(stop_token_ids=[ids[k]], stop=[before[-1] + "\x00"])
    assert done.reason == "eos_token" and done.ids == ids[:k + 1]
    assert streamed == done.text and full.startswith(done.text) and done.text.endswith(before[-1])
