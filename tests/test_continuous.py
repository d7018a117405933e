"""Continuous batching of a slot-form decoder (examples/slot_decoder.py, handlers/continuous.py,
handlers/generation/engine.py): the form recognised and its contract read from the artifact; a
sequence's tokens the same alone and among 32 others that join and leave around it, equal to the
one-sequence model's with the same weights; seeded sampling the same alone and in a crowd; a full
queue refused at once with 503 and a retry hint; and through real TorchServe (an archive built by
cs-archive with no options: asyncCommunication, one worker, batchSize 1): many concurrent streams
each answered as alone, one line per token, the answer without streaming, a bad request's 400, a
full queue's 503 with Retry-After, and the worker serving on after all of them."""
import dataclasses
import json
import subprocess
import threading
from types import SimpleNamespace

import pytest
import requests
import torch
import yaml
from conftest import ROOT, cs_command, server_env
from test_frontend_death import workers_left_after_the_frontend_dies
from test_generation import STREAM_CLIENT

from compiled_serving import contract
from examples import slot_decoder, tiny_decoder
from examples.tiny_decoder import Config
from handlers.artifact.decoder import recognise
from handlers.artifact.state import program_state
from handlers.config import parse_config
from handlers.errors import ServingError
from handlers.generation.abandon import ClientGone, Marks, mark
from handlers.generation import engine as engines
from handlers.generation import loop
from handlers.generation.request import GenerateRequest, Params
from handlers.run.capture import GraphMismatch
from handlers.run.slots import SlotRunner, sizes

SLOTS = 32


@pytest.fixture(scope="module")
def program():
    return slot_decoder.export(slot_decoder.build(Config(max_seq_length=128), slots=SLOTS))


def test_the_slot_form_is_recognised_with_its_slots_and_contract(program):
    dec = recognise(program, program_state(program).mutated)
    assert dec.slotted and dec.slots == SLOTS and dec.slot_input == "slots"
    assert dec.cache_length == 128 and dec.vocab == 256 and dec.chunk_max == 128
    c = contract.read(program, ["logits"])
    assert c.batch == (1, SLOTS) and c.values["slots"]["max"] == SLOTS - 1
    assert [i[0] for i in c.inputs] == ["tokens", "input_pos", "slots"]
    assert sizes(SLOTS) == [1, 2, 4, 8, 16, 32] and sizes(6) == [1, 2, 4, 6]


class _Module:
    loader = "torch.export"

    def __init__(self, ep):
        self.mod = ep.module()

    def __call__(self, tokens, positions, slots):
        return {"logits": self.mod(tokens, positions, slots)}


class Harness:
    """The engine on the CPU over the exported program, its answers collected."""

    def __init__(self, program, queue_size=256, budget=engines.Budget(4, 16), runner=None, start=True,
                 queue_timeout_s=0.0, marks=None):
        """`runner`: one made (and its graphs captured) by the caller; else the CPU's. `start`
        False: the engine's thread is not started, the test runs its turns (`turn`)."""
        dec = recognise(program, program_state(program).mutated)
        self.runner = runner or SlotRunner(_Module(program), dec, torch.device("cpu"),
                                           SimpleNamespace(stream_priority=0))
        self.done, self.cond = {}, threading.Condition()
        self.engine = engines.Engine(self.runner, self._deliver, queue_size, budget, queue_timeout_s=queue_timeout_s,
                                     marks=marks)
        if start:
            self.engine.start()

    def turn(self):
        """One turn of the engine on the test's thread, as its loop runs it (engine._run)."""
        with torch.inference_mode():
            expired = self.engine._begin()
            try:
                self.engine.deliver(expired + (self.engine._turn() if self.engine._busy() else []))
            except Exception as e:  # noqa: BLE001  (as engine._run: the sequences in the cache fail)
                self.engine._fail_all(e)

    def _deliver(self, updates):
        with self.cond:
            for job, events, err in updates:
                for e in events:
                    if isinstance(e, loop.Finished):
                        self.done[job.tag] = e.ids
                if err is not None:
                    self.done[job.tag] = err
            self.cond.notify_all()

    def submit(self, tag, prompt, n, key=None, **params):
        dec = self.runner.dec
        req = GenerateRequest(None, prompt, Params(max_tokens=n, ignore_eos=True, **params))
        cfg = dataclasses.replace(parse_config(None), max_new_tokens=n)
        self.engine.submit(engines.Job(loop.Sequence(req, loop.plan(req, None, dec.vocab, dec.cache_length, cfg), None), tag,
                                       key=key))

    def wait(self, tags):
        with self.cond:
            assert self.cond.wait_for(lambda: all(t in self.done for t in tags), timeout=120), "sequences unfinished"
        return {t: self.done[t] for t in tags}


def one_sequence_greedy(program, prompt, n):
    """Greedy tokens of the one-sequence model (examples/tiny_decoder.py) with the same weights."""
    model = tiny_decoder.build(Config(max_seq_length=128))
    model.load_state_dict({k: v for k, v in program.state_dict.items()}, strict=False)
    ids = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)))
        for i in range(n):
            ids.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[ids[-1]]]), torch.tensor([len(prompt) + i]))
    return ids


def test_tokens_are_the_same_alone_and_among_32_that_join_and_leave(program):
    h = Harness(program)
    prompt = [5, 9, 13, 2, 7, 7, 1]
    h.submit("alone", prompt, 24)
    alone = h.wait(["alone"])["alone"]
    assert alone == one_sequence_greedy(program, prompt, 24)
    g = torch.Generator().manual_seed(1)
    others = {}
    for i in range(48):  # more than the slots: the rest wait and join as slots free up
        p = prompt if i % 3 == 0 else torch.randint(0, 256, (int(torch.randint(1, 40, (1,), generator=g)),),
                                                    generator=g).tolist()
        n = 24 if i % 3 == 0 else 4 + i % 29  # sequences of different lengths leave at different steps
        others[i] = (p, n)
        h.submit(i, p, n)
    others[1000] = ([(3 * k) % 256 for k in range(100)], 28)  # prompt and tokens fill the cache exactly
    h.submit(1000, *others[1000])
    got = h.wait(list(others))
    assert got[1000] == one_sequence_greedy(program, *others[1000])
    assert all(got[i] == alone for i in others if i % 3 == 0)
    for i in (1, 2, 4, 5, 47):
        assert got[i] == one_sequence_greedy(program, *others[i]), i


class _Replay:
    """Stands in for a captured torch.cuda.CUDAGraph on the CPU: replay() runs the model on the
    graph's static buffers, as the captured graph does, so the runner's padded step path (rows
    padded to a graph's size) runs here exactly as it does on a GPU."""

    def __init__(self, runner, tok, pos, rows, logits):
        self.run = lambda: logits.copy_(runner._run(tok, pos, rows))

    def replay(self):
        self.run()


def with_step_graphs(h):
    """Every step size of the runner 'captured' (_Replay), as SlotRunner.capture leaves it on CUDA."""
    r = h.runner
    for n in sizes(r.dec.slots):
        tok, pos = torch.zeros(n, 1, dtype=torch.int64), torch.zeros(n, 1, dtype=torch.int64)
        rows, logits = torch.arange(n), torch.empty(n, r.dec.vocab)
        r.graphs[n] = (_Replay(r, tok, pos, rows, logits), tok, pos, rows, logits)
    return h


class _PromptReplay:
    """A captured prompt graph on the CPU (as _Replay): each row's logits at its `last` position."""

    def __init__(self, runner, tok, pos, rows, last, logits):
        each = torch.arange(len(rows))
        self.run = lambda: logits.copy_(runner.model(tok, pos, rows)["logits"][each, last])

    def replay(self):
        self.run()


def with_prompt_graphs(h, rows=(1, 2, 4, 8), lengths=(4, 8, 16)):
    """Prompt graphs 'captured' (_PromptReplay) for each rows x length, as SlotRunner.capture
    leaves them on CUDA: chunks padded to a graph's length and rows padded to its rows."""
    r = h.runner
    for n in rows:
        for c in lengths:
            tok, pos = torch.zeros(n, c, dtype=torch.int64), torch.zeros(n, c, dtype=torch.int64)
            slots, last, logits = torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.empty(n, r.dec.vocab)
            r.prompt_graphs[(n, c)] = (_PromptReplay(r, tok, pos, slots, last, logits), tok, pos, slots, last, logits,
                                       torch.arange(n))
    return h


@pytest.mark.parametrize("budget", [engines.Budget(1, 4), engines.Budget(4, 8)])
def test_padded_steps_and_prompt_calls_never_touch_a_prompt_being_filled(program, budget):
    """Steps and prompt calls replayed at a graph's size pad their rows onto places outside the
    call, and chunks onto the slot's own later positions: prompts filled over several turns
    (prompts up to 40 tokens, chunks of 4 or 8 of up to 4 sequences per turn) hold slots outside
    the step, decoding sequences hold slots outside the prompt call, and every sequence's tokens
    must still be the one-sequence model's."""
    h = with_prompt_graphs(with_step_graphs(Harness(program, budget=budget)))
    g = torch.Generator().manual_seed(3)
    cases = {}
    for i in range(40):
        p = torch.randint(0, 256, (int(torch.randint(9, 40, (1,), generator=g)),), generator=g).tolist()
        cases[i] = (p, 6 + i % 11)
        h.submit(i, *cases[i])
    got = h.wait(list(cases))
    wrong = [i for i in cases if got[i] != one_sequence_greedy(program, *cases[i])]
    assert not wrong, f"sequences {wrong} answered other tokens than the one-sequence model's"


def test_padding_lands_on_decoding_sequences_and_a_prompt_being_filled_and_changes_no_token(program):
    """The layouts the padding rules are for, built turn by turn on the test's thread: 31
    sequences decode while a 32nd fills its 30-token prompt 4 tokens a turn, so no slot is free:
    each prompt call (one row on the 4-row graph) pads 3 rows onto decoding sequences, from the
    position their next step writes, and each step (31 rows on the 32-row graph) pads its row
    onto the prompt being filled, at its next prompt position. Every sequence's tokens are the
    one-sequence model's."""
    h = with_prompt_graphs(with_step_graphs(Harness(program, budget=engines.Budget(1, 4), start=False)),
                           rows=(4,), lengths=(4, 16))
    r, prompt_pads, step_pads = h.runner, [], []
    real_call, real_step = r._prompt_call, r.step
    r._prompt_call = lambda key, slots, chunks, starts, pad: (
        prompt_pads.append((list(slots), list(pad))) or real_call(key, slots, chunks, starts, pad))
    r.step = lambda slots, tokens, positions, spare=(): (
        step_pads.append(list(spare[:32 - len(slots)])) or real_step(slots, tokens, positions, spare))
    g = torch.Generator().manual_seed(5)
    cases = {i: (torch.randint(0, 256, (5 + i % 12,), generator=g).tolist(), 10 + i % 7) for i in range(SLOTS - 1)}
    for i, (p, n) in cases.items():
        h.submit(i, p, n)
    h.turn()  # no sequence decodes yet: every prompt whole, 4 per call
    assert len(h.engine.ready) == SLOTS - 1
    cases["late"] = (torch.randint(0, 256, (30,), generator=g).tolist(), 6)
    h.submit("late", *cases["late"])
    prompt_pads.clear()
    for _ in range(200):
        if not h.engine._busy():
            break
        h.turn()
    wrong = [i for i in cases if h.done.get(i) != one_sequence_greedy(program, *cases[i])]
    assert not wrong, f"sequences {wrong} answered other tokens than the one-sequence model's"
    late = 31  # the one slot left: the layouts above occurred
    over_decoding = [pad for slots, pad in prompt_pads if slots == [late]]
    assert len(over_decoding) == 8 and all(len(p) == 3 and late not in dict(p) for p in over_decoding)
    assert any(pad == [(late, f)] for pad in step_pads for f in range(4, 30, 4)), "no step padded onto the prompt"


def test_a_padded_step_writes_its_padding_rows_only_at_the_spare_places(program):
    """The rows a graph's size adds go to the (slot, position) places the caller names, in order;
    too few places is an error, not a guess."""
    h = with_step_graphs(Harness(program))
    del h.runner.graphs[1], h.runner.graphs[2]  # a 1-row step now replays the 4-row graph
    _, tok, pos, rows, _ = h.runner.graphs[4]
    h.runner.step([7], torch.tensor([3]), [5], [(2, 0), (9, 11), (4, 0), (30, 0)])
    assert rows.tolist() == [7, 2, 9, 4] and pos.view(-1).tolist() == [5, 0, 11, 0] and tok[0, 0] == 3
    with pytest.raises(RuntimeError, match="needs 3 spare places, got 1"):
        h.runner.step([7], torch.tensor([3]), [5], [(2, 0)])


def test_a_prompt_call_pads_rows_at_the_spare_places_and_splits_where_it_must(program):
    """Three chunks on the 4-row graph of length 8: the fourth row at the first spare place with
    room for 8 positions; with no such place, a 2-row call then a 1-row call; a chunk whose
    padded run would pass the cache's end goes alone, at its own length. Every row's logits equal
    its sequence's own plain call."""
    h = with_prompt_graphs(Harness(program), rows=(1, 2, 4), lengths=(8,))
    r, cap = h.runner, h.runner.dec.cache_length
    chunks, starts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 7], [0, 0, 0]
    assert r._prompt_plan(chunks, starts, [(20, cap - 3), (21, 40), (22, 0)]) == (3, (4, 8), [(21, 40)])
    assert r._prompt_plan(chunks, starts, [(20, cap - 3)]) == (2, (2, 8), [])
    assert r._prompt_plan([[1, 2], [3, 4]], [cap - 2, 0], []) == (1, (None, 2), [])
    calls = []
    real = r._prompt_call
    r._prompt_call = lambda key, *a: calls.append(key) or real(key, *a)
    want = [r._prompt_call((None, len(c)), [s], [c], [0], [])[0].clone() for s, c in zip((3, 4, 5), chunks)]
    calls.clear()
    got = r.prefill_rows([3, 4, 5], chunks, starts, [(20, cap - 3)])
    assert calls == [(2, 8), (1, 8)]
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    _, tok, pos, rows, last, _, _ = r.prompt_graphs[(1, 8)]
    assert rows.tolist() == [5] and last.tolist() == [6] and pos[0].tolist() == list(range(8))


def test_the_budget_is_the_biggest_prompt_call_no_longer_than_a_full_step():
    """measure_budget on a runner whose calls take a known time (a clock the calls advance): the
    longest chunk first, then the most sequences of such chunks, each within one full step."""
    clock = [0.0]

    class Timed:
        dec = SimpleNamespace(slots=16, cache_length=256)
        device, cuda, chunk_limit, prompt_rows = torch.device("cpu"), False, 128, 16

        def stream_context(self):
            import contextlib
            return contextlib.nullcontext()

        def step(self, *a):
            clock[0] += 5.0

        def prefill_rows(self, slots, chunks, starts):
            clock[0] += 1.0 + len(slots) * len(chunks[0]) / 128  # 1 + a unit per 128 tokens

    import unittest.mock
    with unittest.mock.patch.object(engines.time, "perf_counter", lambda: clock[0]):
        budget, note = engines.measure_budget(Timed())
    assert budget == engines.Budget(4, 128) and "up to 128 tokens of up to 4 sequences" in note
    Timed.chunk_limit = 64  # 64-token chunks fit; 2 rows of them too (2.0), 4 (3.0), 8 (5.0), not 16
    with unittest.mock.patch.object(engines.time, "perf_counter", lambda: clock[0]):
        assert engines.measure_budget(Timed())[0] == engines.Budget(8, 64)


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd(program):
    h = Harness(program)
    prompt = [3, 1, 4, 1, 5]
    h.submit("alone", prompt, 16, temperature=0.9, top_k=20, seed=7)
    alone = h.wait(["alone"])["alone"]
    for i in range(20):
        h.submit(i, prompt, 16, temperature=0.9, top_k=20, seed=7 if i % 2 else 8)
    got = h.wait(list(range(20)))
    assert all(got[i] == alone for i in range(1, 20, 2))
    assert any(got[i] != alone for i in range(0, 20, 2))


@pytest.mark.parametrize("failing_call", [1, 3])
def test_a_failed_turn_fails_the_sequences_in_the_cache_and_the_engine_serves_on(program, failing_call):
    """The step fails on its first call (the sequence's first step: it has just left the prompt)
    or a later one: either way the sequence is told, and the next is answered as if alone."""
    h = Harness(program)
    real, calls = h.runner.step, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("device said no")
        return real(*args)
    h.runner.step = flaky
    h.submit("a", [1, 2, 3], 10)
    err = h.wait(["a"])["a"]
    assert isinstance(err, ServingError) and "device said no" in err.message
    h.submit("b", [1, 2, 3], 10)
    assert h.wait(["b"])["b"] == one_sequence_greedy(program, [1, 2, 3], 10)


def test_a_failed_turn_frees_every_slot_it_held(program):
    """All 32 slots in the cache when a step fails: each sequence is told, every slot is free again
    once the failure is delivered, and a next crowd of 32 is answered (a slot kept by a failed
    turn would leave the worker admitting nothing after 32 failures)."""
    h = Harness(program)
    real, calls = h.runner.step, []

    def fails_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device said no")
        return real(*args)
    h.runner.step = fails_once
    with h.engine.cond:  # every sequence admitted in one turn: all 32 fill their prompts before the first step
        for i in range(SLOTS):
            h.submit(("failed", i), [1, 2, 3 + i], 6)
    got = h.wait([("failed", i) for i in range(SLOTS)])
    assert all(isinstance(e, ServingError) and "device said no" in e.message for e in got.values())
    with h.engine.cond:  # _fail_all frees the slots before it delivers the errors
        assert sorted(h.engine.free) == list(range(SLOTS)), f"{SLOTS - len(h.engine.free)} slots still held"
    for i in range(SLOTS):
        h.submit(("next", i), [1, 2, 3 + i], 6)
    again = h.wait([("next", i) for i in range(SLOTS)])
    assert again[("next", 5)] == one_sequence_greedy(program, [1, 2, 8], 6)


def continuous_worker(program, step, monkeypatch):
    """A worker serving the program by continuous batching (handlers/continuous.py) in process, its
    runner's step replaced by `step(real_step, *args)`, a frontend that takes the streams' chunks;
    (worker, the chunks sent: (request id, Encoded))."""
    from handlers import continuous
    from handlers.config import parse_config
    from worker_kit import make_spec, make_worker

    dec = recognise(program, program_state(program).mutated)
    runner = SlotRunner(_Module(program), dec, torch.device("cpu"), SimpleNamespace(stream_priority=0))
    real = runner.step
    runner.step = lambda *a: step(real, *a)
    config = parse_config({})
    worker = make_worker(make_spec(1, 1), runner, config=config)
    cont = continuous.Continuous(runner, None, config, 1 << 20)
    worker.loaded.generation = cont
    cont.start(engines.Budget(4, 16), "", worker.broken)
    chunks = []
    cont.sock = object()  # what handle_async sets from the context: chunks go out to it
    monkeypatch.setattr(continuous.replies, "send_chunks", lambda sock, lock, sent: chunks.extend(sent))
    return worker, chunks


def test_a_stream_that_fails_after_its_first_token_ends_with_the_error_object(program, monkeypatch):
    """The continuous worker's failure path of a running stream: tokens went out as chunks, so the
    last frame is the route's error object (finish_reason error, the reason), not a final
    answer and not an empty one; the worker serves on."""
    from handlers.torchserve.headers import RequestHeaders

    calls = []

    def third_call_fails(real, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the model's kernel failed")
        return real(*args)
    worker, frames = continuous_worker(program, third_call_fails, monkeypatch)
    body = json.dumps({"input_ids": [5, 17, 33], "parameters": {"max_tokens": 8}}).encode()
    last = worker.serve([{"body": body}], [RequestHeaders("application/json")])[0]
    streamed = [json.loads(e.body) for _, e in frames]
    assert 1 <= len(streamed) <= 3 and all("token_ids" in t for t in streamed), streamed
    answer = json.loads(last.body)
    assert answer["finish_reason"] == "error" and "the model's kernel failed" in answer["error"], answer
    assert worker.health.refusal() is None
    again = json.loads(worker.serve([{"body": body}], [RequestHeaders("application/json")])[0].body)
    assert again["token_ids"] == one_sequence_greedy(program, [5, 17, 33], 8)


def test_a_sync_batch_tells_the_guardian_its_streams_ended(program, monkeypatch):
    """TorchServe's sync worker through handlers/continuous.py (handle_sync: a decoder the engine
    serves, its archive without asyncCommunication): the guardian is told a stream began before its
    first chunk and that the batch ended before TorchServe writes its last frames. A request left
    held would have the guardian write frames for a request the sync frontend no longer holds
    when the worker dies (BatchAggregator.sendResponse's IllegalStateException), and the stream
    then under way would be cut instead of ended with its error event."""
    import os

    from handlers import continuous
    from handlers.torchserve import guardian, replies

    worker, frames = continuous_worker(program, lambda real, *a: real(*a), monkeypatch)
    read_end, write_end = os.pipe()
    monkeypatch.setattr(guardian, "_pipe", write_end)
    context = replies._Chunks(set())
    context.request_ids, context.cl_socket = {0: "rid-1"}, object()
    context.get_all_request_header = lambda idx: {"Content-Type": "application/json"}
    body = json.dumps({"input_ids": [5, 17, 33], "parameters": {"max_tokens": 4}}).encode()
    try:
        (last,) = continuous.handle_sync(worker, [{"body": body}], context)
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        told = [json.loads(line) for line in pipe.read().splitlines()]
    assert len(frames) == 4 and json.loads(last)["completion_tokens"] == 4, (frames, last)
    assert [t[:2] for t in told] == [["S", "rid-1"], ["E", "rid-1"]], told
    assert context.get_response_headers(0)[replies.STREAM_NEXT] == "false"


class _Event:
    """torch.cuda.Event on the CPU: its record() and synchronize() logged with its buffer's index."""

    def __init__(self, log, k):
        self.log, self.k = log, k

    def record(self):
        self.log.append(("record", self.k))

    def synchronize(self):
        self.log.append(("wait", self.k))


def test_the_engines_device_path_reads_each_step_after_its_wait_through_two_buffers(program):
    """The engine's CUDA path (runner.cuda): each step's tokens copied into one of two host
    buffers taken in turn and an event recorded; the next turn waits on that event before reading
    them, and a buffer is written again only after the step that last wrote it was waited on.
    Turns run on the test's thread with sequences joining and leaving; every sequence's tokens are
    the one-sequence model's; a failed turn synchronizes the stream before the errors go out."""
    h = Harness(program, budget=engines.Budget(2, 8), start=False)
    log = []
    h.engine.events = [_Event(log, 0), _Event(log, 1)]
    h.runner.cuda = True
    h.runner.stream = SimpleNamespace(synchronize=lambda: log.append(("stream", None)))
    cases = {i: ([(5 * i + k) % 256 for k in range(3 + 4 * i)], 5 + 3 * i) for i in range(6)}
    for turn in range(200):
        if turn % 3 == 0 and turn // 3 in cases:  # one joins every third turn
            h.submit(turn // 3, *cases[turn // 3])
        elif not h.engine._busy():
            break
        h.turn()
    assert {i: h.done[i] for i in cases} == {i: one_sequence_greedy(program, *c) for i, c in cases.items()}
    records = [k for what, k in log if what == "record"]
    assert records == [i % 2 for i in range(len(records))] and len(records) > 20
    for i, (what, k) in enumerate(log):
        if what == "record":  # the buffer's last step (if any) was waited on since its record
            before = [e for e in log[:i] if e[1] == k]
            assert not before or before[-1] == ("wait", k), (i, log[max(0, i - 6):i + 1])
    real = h.runner.step

    def fails_with_a_step_in_flight(*args):
        if h.engine.inflight is not None:
            raise RuntimeError("device said no")
        return real(*args)
    h.runner.step = fails_with_a_step_in_flight
    h.submit("failed", [1, 2, 3], 6)
    log.clear()
    while h.engine._busy():
        h.turn()
    assert isinstance(h.done["failed"], ServingError) and ("stream", None) in log


def test_a_full_queue_is_refused_at_once_with_a_retry_hint(program):
    h = Harness(program, queue_size=2)
    with h.engine.cond:  # the engine cannot admit while the test holds its lock: the slots stay free
        h.engine.waiting.extend(engines.Job(None, i) for i in range(SLOTS + 1))  # every slot's worth, and one
        h.submit("last", [1, 2], 4)  # the queue's second place
        with pytest.raises(engines.Busy) as e:
            h.submit("over", [1, 2], 4)
        assert e.value.status == 503 and "retry after 1 s" in e.value.message
        h.engine.waiting.clear()


def test_a_sequence_that_waited_past_the_queue_timeout_is_dropped_before_it_starts(program):
    """Issue 63: TorchServe never tells the worker that a client went, so 8 abandoned requests
    held every slot and the queue behind them. A waiting sequence older than
    handler.queue_timeout_s is answered 503 (Busy) and never takes a slot; the running go on."""
    h = Harness(program, start=False, queue_timeout_s=0.2)
    for i in range(SLOTS):
        h.submit(i, [1, 2, 3], 8)
    h.turn()  # every slot taken
    h.submit("late", [1, 2], 4)
    h.turn()
    assert "late" not in h.done and list(h.engine.waiting)[0].tag == "late"  # not yet past its deadline
    h.engine.waiting[0].queued -= 1.0
    h.turn()
    err = h.done["late"]
    assert isinstance(err, engines.Busy) and err.status == 503 and "handler.queue_timeout_s 0.2" in err.message
    assert not h.engine.waiting and not h.engine.free
    for _ in range(20):
        h.turn()
    assert all(h.done[i] and len(h.done[i]) == 8 for i in range(SLOTS))  # the running sequences finished


def test_sequences_whose_clients_went_free_their_slots_at_the_next_turn(program, tmp_path):
    """Issue 63: 8 abandoned requests held every slot to their end. The pod marks a request whose
    client went (pod/aborts.py); at its next turn the engine ends each marked sequence wherever it
    is (decoding, filling its prompt, waiting), answers it ClientGone (499), frees its slot for
    the next in line, and the others' tokens are what they are alone."""
    keys = [f"{i:032x}" for i in range(SLOTS + 2)]
    h = Harness(program, start=False, budget=engines.Budget(1, 2), marks=Marks(str(tmp_path)))
    prompt = [5, 17, 33, 2, 9, 44, 120, 3]
    for i, key in enumerate(keys):
        h.submit(i, prompt, 12, key=key)
    h.turn()
    h.turn()  # every slot decoding, two waiting
    assert len(h.engine.waiting) == 2 and not h.engine.free
    slot = next(j.slot for j in h.engine.inflight.rows if j.tag == 0)
    mark(str(tmp_path), keys[0])
    h.turn()
    assert isinstance(h.done[0], ClientGone) and h.done[0].status == 499
    assert [(j.tag, j.slot) for j in h.engine.filling] == [(SLOTS, slot)]  # the next in line, in its slot
    mark(str(tmp_path), keys[SLOTS])  # filling its prompt
    mark(str(tmp_path), keys[SLOTS + 1])  # waiting
    h.turn()
    assert all(isinstance(h.done[t], ClientGone) for t in (SLOTS, SLOTS + 1))
    assert h.engine.free == [slot] and not h.engine.filling and not h.engine.waiting
    for _ in range(20):
        h.turn()
    want = one_sequence_greedy(program, prompt, 12)
    assert all(h.done[i] == want for i in range(1, SLOTS)), "a sequence beside the abandoned ones changed"
    assert sorted(h.engine.free) == list(range(SLOTS))


# --- through real TorchServe -------------------------------------------------------------------

def archive(path, name: str, store, *extra):
    """cs-archive with no options but `extra`, as a user runs it; its run (output printed)."""
    r = subprocess.run([*cs_command("archive"), "--artifact", str(path), "--name", name, "--out", str(store), *extra],
                       cwd=ROOT, capture_output=True, text=True, env=server_env())
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def saved_program(program, tmp_path_factory, name: str) -> tuple:
    """(the program saved as a .pt2 file, a model store beside it) in a new directory `name`."""
    d = tmp_path_factory.mktemp(name)
    torch.export.save(program, d / "slots.pt2")
    return d / "slots.pt2", d / "store"


@pytest.fixture(scope="module")
def slot_server(program, serve, tmp_path_factory):
    path, store = saved_program(program, tmp_path_factory, "slots")
    r = archive(path, "lm", store)
    archive(path, "lm_q0", store, "--handler-option", "queue_size=0")
    ts = serve({"lm": store / "lm.mar", "lm_q0": store / "lm_q0.mar"})
    return SimpleNamespace(ts=ts, archive_out=r.stdout + r.stderr, store=store)


def ask(ts, model, body, stream=True):
    r = requests.post(f"{ts.base}/predictions/{model}", json=body, headers=ts.auth(), stream=stream, timeout=120)
    lines = [json.loads(x) for x in r.iter_lines() if x] if r.status_code == 200 else []
    return r, lines


@pytest.mark.server
def test_the_archive_serves_it_with_async_communication_one_worker_and_no_options(slot_server):
    import zipfile

    with zipfile.ZipFile(slot_server.store / "lm.mar") as z:
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    assert cfg["asyncCommunication"] is True and cfg["batchSize"] == 1 and cfg["minWorkers"] == 1, cfg
    assert "continuous batching" in slot_server.archive_out


@pytest.mark.server
def test_concurrent_streams_are_each_answered_as_alone(program, slot_server):
    ts = slot_server.ts
    prompts = {i: [(7 * i + k) % 256 for k in range(3 + i % 9)] for i in range(40)}
    want = {i: one_sequence_greedy(program, p, 12) for i, p in prompts.items()}
    got, errors = {}, []

    def client(i):
        try:
            r, lines = ask(ts, "lm", {"input_ids": prompts[i], "parameters": {"max_tokens": 12, "ignore_eos": True}})
            assert r.status_code == 200 and r.headers["Transfer-Encoding"] == "chunked", r.text
            *tokens, last = lines
            assert [t["token_ids"][0] for t in tokens] == last["token_ids"]
            got[i] = last["token_ids"]
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=client, args=(i,)) for i in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert got == want


@pytest.mark.server
def test_an_answer_without_streaming_and_a_bad_request(program, slot_server):
    ts = slot_server.ts
    r = requests.post(f"{ts.base}/predictions/lm", json={"input_ids": [5, 6, 7], "parameters": {
        "max_tokens": 5, "stream": False}}, headers=ts.auth(), timeout=60)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json"), r.text
    assert r.json()["token_ids"] == one_sequence_greedy(program, [5, 6, 7], 5)
    bad = requests.post(f"{ts.base}/predictions/lm", json={"input_ids": [1, 999]}, headers=ts.auth(), timeout=60)
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["message"], bad.text
    over = requests.post(f"{ts.base}/predictions/lm", json={"input_ids": [1] * 100, "parameters": {"max_tokens": 40}},
                         headers=ts.auth(), timeout=60)
    assert over.status_code == 400 and "ask for at most 28" in over.json()["message"], over.text
    r, lines = ask(ts, "lm", {"input_ids": [5, 6, 7], "parameters": {"max_tokens": 5}})
    assert lines[-1]["token_ids"] == one_sequence_greedy(program, [5, 6, 7], 5)


def crowd_on_a_queue_of_none(ts) -> list:
    """(status, Retry-After, body) of 96 requests of 120 tokens sent at once to lm_q0 (no queue);
    a request not answered within 60 s (a sequence takes well under 2 s here) as ("timeout", ...)."""
    long = {"input_ids": [1, 2, 3], "parameters": {"max_tokens": 120, "ignore_eos": True}}
    statuses, lock = [], threading.Lock()

    def client():
        try:
            r = requests.post(f"{ts.base}/predictions/lm_q0", json=long, headers=ts.auth(), timeout=60)
            got = (r.status_code, r.headers.get("Retry-After"), r.text)
        except requests.exceptions.Timeout as e:
            got = ("timeout", None, repr(e))
        with lock:
            statuses.append(got)
    threads = [threading.Thread(target=client) for _ in range(SLOTS * 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


@pytest.mark.server
def test_a_full_queue_is_503_with_retry_after_and_the_worker_serves_on(slot_server):
    """No condition says when every slot is busy from outside the worker (a sequence's 120
    tokens take a fraction of a second), so the crowd is sent up to three times until some of it
    is refused; every round's refusals carry the retry hint, at least a slot's worth is served,
    and every request is answered: one of the 96 was once left unanswered after 60 s in 2 of 3
    full runs (the generation metrics' first emission of a name changed TorchServe's context while
    its async predict deep-copied it for that request: stage_timings.generation_sink)."""
    ts = slot_server.ts
    for _ in range(3):
        statuses = crowd_on_a_queue_of_none(ts)
        unanswered = [s for s in statuses if s[0] == "timeout"]
        assert not unanswered, f"{len(unanswered)} request(s) of the burst unanswered after 60 s"
        busy = [s for s in statuses if s[0] == 503]
        assert all(s[1] == "1" and "slots are busy" in s[2] for s in busy), busy[:3]
        assert sum(s[0] == 200 for s in statuses) >= SLOTS and len(statuses) == SLOTS * 3
        assert {s[0] for s in statuses} <= {200, 503}, {s[0] for s in statuses}
        if busy:
            break
    assert busy, "96 requests at once were never refused in three rounds"
    r, lines = ask(ts, "lm_q0", {"input_ids": [1, 2, 3], "parameters": {"max_tokens": 3}})
    assert r.status_code == 200 and len(lines) == 4


@pytest.mark.server
def test_grpc_stream_predictions_and_a_unary_call_on_the_slot_model(program, slot_server, stubs):
    """TorchServe's gRPC routes through the async frontend: StreamPredictions sends each token
    and ends; a unary Predictions call gets the whole answer once; the worker serves on."""
    import grpc

    pb2, pb2_grpc = stubs
    ts = slot_server.ts
    want = one_sequence_greedy(program, [5, 17, 33, 2, 9], 6)
    with grpc.insecure_channel(f"127.0.0.1:{ts.ports['grpc']}") as channel:
        stub = pb2_grpc.InferenceAPIsServiceStub(channel)
        meta = [("authorization", f"Bearer {ts.keys['inference']['key']}")]
        body = json.dumps({"input_ids": [5, 17, 33, 2, 9], "parameters": {"max_tokens": 6}}).encode()
        replies = [json.loads(m.prediction) for m in stub.StreamPredictions(
            pb2.PredictionsRequest(model_name="lm", input={"body": body}), metadata=meta, timeout=60)]
        assert len(replies) == 7 and replies[-1]["token_ids"] == [r["token_ids"][0] for r in replies[:-1]] == want
        once = json.dumps({"input_ids": [5, 17, 33, 2, 9], "parameters": {"max_tokens": 6, "stream": False}}).encode()
        one = stub.Predictions(pb2.PredictionsRequest(model_name="lm", input={"body": once}), metadata=meta, timeout=60)
        assert json.loads(one.prediction)["token_ids"] == want
    r, lines = ask(ts, "lm", {"input_ids": [5, 17, 33, 2, 9], "parameters": {"max_tokens": 6}})
    assert lines[-1]["token_ids"] == want


@pytest.mark.server
def test_an_async_worker_whose_frontend_dies_exits(slot_server):
    """TorchServe's async worker (ts/async_service.py) reads, batches and writes on threads that
    are not daemons and that nothing stops: when its frontend is killed (kill -9, the OOM killer)
    the reader ends and the process would wait for the others for ever, holding the GPU memory
    of its model (seen on the GPU machine: a 6 GiB continuous-batching worker outlived its
    server). The worker must notice and exit. Last test of this module's server: it kills it."""
    left = workers_left_after_the_frontend_dies(slot_server.ts, "lm")
    assert not left, f"workers {left} outlived their frontend by 15 s"


@pytest.mark.server
def test_the_pods_generate_routes_on_the_slot_model(program, kserve_env, tmp_path):
    """The Open Inference Protocol's generate and generate_stream through the KServe pod (nginx in
    front of TorchServe's async frontend): one answer with details, server-sent events token by
    token, and a 400 with the handler's reason before any event; and tritonclient's start_stream
    (ModelStreamInfer through the pod's gRPC bridge): the same tokens, the last response flagged,
    a bad request's error and the stream serving on."""
    from kserve_kit import Container, lay_out

    path = tmp_path / "slots.pt2"
    torch.export.save(program, path)
    store = tmp_path / "store"
    archive(path, "lm", store)
    laid = lay_out([store / "lm.mar"], tmp_path / "out")
    assert laid.returncode == 0, laid.stdout + laid.stderr
    pod = Container(tmp_path / "out" / "storage", tmp_path / "pod")
    try:
        pod.wait("ready")
        prompt = [5, 17, 33, 2, 9]
        want = one_sequence_greedy(program, prompt, 8)
        one = requests.post(f"{pod.base}/v2/models/lm/generate", json={"input_ids": prompt, "parameters": {
            "max_tokens": 8}}, timeout=60)
        assert one.status_code == 200, one.text
        assert one.json()["output_ids"] == want and one.json()["details"]["finish_reason"] == "length"
        s = requests.post(f"{pod.base}/v2/models/lm/generate_stream", json={"input_ids": prompt, "parameters": {
            "max_tokens": 8}}, stream=True, timeout=60)
        assert s.status_code == 200 and s.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[len(b"data: "):]) for line in s.iter_lines() if line.startswith(b"data: ")]
        assert [e["token_ids"][0] for e in events[:-1]] == want
        bad = requests.post(f"{pod.base}/v2/models/lm/generate_stream", json={"input_ids": [1, 999]}, timeout=60)
        assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["message"], bad.text
        r = subprocess.run([str(kserve_env), "-c", STREAM_CLIENT, pod.grpc_target], capture_output=True, text=True,
                           timeout=180)  # tritonclient's start_stream: ModelStreamInfer through the gRPC bridge
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["good"]["tokens"] == want and out["good"]["reason"] == "length", out
        assert "outside the vocabulary" in out["bad"]["error"], out
        assert out["again"]["tokens"] == want[:3], out
    finally:
        pod.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU machine)")
def test_on_cuda_every_graph_is_captured_and_verified_and_a_crowd_answers_as_alone():
    """On a GPU: capture "on" raises unless every step and prompt graph (rows x length) equals the
    plain call; then the engine, its budget measured on the device, gives the same greedy tokens
    to a sequence alone and among 20 that join in one burst (batched prompt calls, padded steps)."""
    program = slot_decoder.export(slot_decoder.build(Config(max_seq_length=128), slots=8, device="cuda"))
    dec = recognise(program, program_state(program).mutated)
    runner = SlotRunner(_Module(program), dec, torch.device("cuda"), SimpleNamespace(stream_priority=0))
    note = runner.capture("on")
    assert set(runner.graphs) == {1, 2, 4, 8}, note
    assert set(runner.prompt_graphs) == {(r, c) for r in (1, 2, 4, 8) for c in (16, 32, 64, 128)}, note
    h = Harness(program, queue_size=64, budget=engines.measure_budget(runner)[0], runner=runner)
    prompt = [5, 9, 13, 2, 7, 7, 1] * 5
    h.submit("alone", prompt, 24)
    alone = h.wait(["alone"])["alone"]
    for i in range(20):
        h.submit(i, prompt if i % 2 else [(11 * i + k) % 256 for k in range(3 + 5 * i)], 24)
    got = h.wait(list(range(20)))
    assert all(got[i] == alone for i in range(1, 20, 2))


class RecordedGraph:
    """A torch.cuda.CUDAGraph on the CPU: its capture records every aten op run inside it (with
    the tensors it read and wrote), and replay() runs them again over the same tensors, writing
    each result into the tensor the capture produced, as a graph's kernels rerun over the memory
    they were captured with. A `skew` added to every floating result of a replay stands for a
    graph that computes otherwise than the plain call."""

    skew = 0.0

    def __init__(self):
        self.ops = []

    def replay(self):
        for func, args, kwargs, out in self.ops:
            again = func(*args, **kwargs)
            for o, a in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (out, again))):
                if isinstance(o, torch.Tensor) and o is not a:
                    o.copy_(a + self.skew if a.is_floating_point() else a)


class _Recording(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.graph.ops.append((func, args, kwargs or {}, out))
        return out


def on_recorded_graphs(monkeypatch, runner):
    """`runner` as on a CUDA device whose graphs are RecordedGraphs: SlotRunner.capture's own code
    captures, verifies and keeps them."""
    import contextlib

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        with _Recording(g):
            yield
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)  # run/capture.py reads it
    runner.cuda, runner.stream = True, SimpleNamespace(synchronize=lambda: None)
    runner.stream_context = contextlib.nullcontext
    return runner


@pytest.fixture(scope="module")
def program8():
    return slot_decoder.export(slot_decoder.build(Config(max_seq_length=128), slots=8))


def test_capture_verifies_and_keeps_every_graph_and_their_replays_answer_as_alone(program8, monkeypatch):
    """The CPU's run of the GPU test below: SlotRunner.capture("on") over RecordedGraphs captures
    and verifies a step graph of each size and a prompt graph of each rows x length, and the
    engine over them gives a sequence the same tokens alone and in a crowd of 20."""
    dec = recognise(program8, program_state(program8).mutated)
    runner = on_recorded_graphs(monkeypatch, SlotRunner(_Module(program8), dec, torch.device("cpu"),
                                                        SimpleNamespace(stream_priority=0)))
    note = runner.capture("on")
    assert set(runner.graphs) == {1, 2, 4, 8}, note
    assert set(runner.prompt_graphs) == {(r, c) for r in (1, 2, 4, 8) for c in (16, 32, 64, 128)}, note
    assert "each verified equal to the plain call" in note
    runner.cuda, runner.stream_context = False, SlotRunner.stream_context.__get__(runner)  # the engine's CPU path
    h = Harness(program8, queue_size=64, budget=engines.Budget(2, 16), runner=runner)
    prompt = [5, 9, 13, 2, 7, 7, 1] * 5
    h.submit("alone", prompt, 12)
    alone = h.wait(["alone"])["alone"]
    assert alone == one_sequence_greedy(program8, prompt, 12)
    for i in range(20):
        h.submit(i, prompt if i % 2 else [(11 * i + k) % 256 for k in range(3 + 5 * i)], 12)
    got = h.wait(list(range(20)))
    assert all(got[i] == alone for i in range(1, 20, 2))


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_a_graph_that_computes_otherwise_is_refused(program8, monkeypatch, mode):
    """Replays that add 1e-3 to every floating result: "on" raises naming the difference; any
    other mode keeps no graph and says the steps run as plain calls."""
    dec = recognise(program8, program_state(program8).mutated)
    runner = on_recorded_graphs(monkeypatch, SlotRunner(_Module(program8), dec, torch.device("cpu"),
                                                        SimpleNamespace(stream_priority=0)))
    monkeypatch.setattr(RecordedGraph, "skew", 1e-3)
    if mode == "on":
        with pytest.raises(GraphMismatch, match=r"the 1-row step graph replays logits differing from the plain call's \(max \|d\| \d"):
            runner.capture(mode)
        return
    note = runner.capture(mode)
    assert runner.graphs == {} and runner.prompt_graphs == {}
    assert note.startswith("plain step calls: the steps' CUDA graphs were not kept") and "differ" in note, note


@pytest.mark.server
def test_an_aotinductor_package_answers_as_alone_with_prompts_of_several_sequences_per_call(program, tmp_path):
    """The runner over the program packaged by AOTInductor (CPU), steps and prompt calls padded as
    graph replays pad them, prompts of up to 4 sequences filled 4 tokens a turn: 40 sequences on
    32 slots (so padding rows also land on prompts being filled), each equal to the one-sequence
    model."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    model = aoti_load_package(aoti_compile_and_package(program, package_path=str(tmp_path / "p.pt2")))

    class Packaged:
        loader = "aoti"

        def __call__(self, tokens, positions, slots):
            return {"logits": model(tokens, positions, slots)}

    h = Harness(program, budget=engines.Budget(4, 4))
    h.runner.model = Packaged()
    h = with_step_graphs(with_prompt_graphs(h))
    g = torch.Generator().manual_seed(3)
    cases = {}
    for i in range(40):
        n = int(torch.randint(9, 40, (1,), generator=g))
        cases[i] = (torch.randint(0, 256, (n,), generator=g).tolist(), 6 + i % 11)
    for i, (p, n) in cases.items():
        h.submit(i, p, n)
    got = h.wait(list(cases))
    wrong = [i for i in cases if got[i] != one_sequence_greedy(program, *cases[i])]
    assert not wrong, f"sequences {wrong} answered other tokens than the one-sequence model's"
