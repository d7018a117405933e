"""Generation through the engine (issue 64; handlers/engine/generation.py on the engine's side,
handlers/engine/sequences.py on the worker's): a slot-form decoder's one continuous batch in the
engine, fed by workers that send token ids and make text.

In process (the engine's core and an InProcessEngine client over the CPU's slot runner): 40
sequences (more than the 32 slots) answered as the one-sequence model answers each alone, and
seeded sampling as the in-process batch samples it; a sequence the worker ends (a stop string)
aborted so its slot frees; a full queue's Busy with its class; a worker that goes frees its
slots; an engine that dies fails every sequence in flight with a retryable 503.

Through real TorchServe (cs-archive --handler-option engine=on): the worker's load line names
the engine, 24 concurrent streams each equal to the model alone, and a kill -9 of the engine
ends every open stream (none hangs) and a successor serves the next request.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch
from test_continuous import (SLOTS, Harness, archive, ask, one_sequence_greedy, program,  # noqa: F401 (fixture)
                             saved_program)

from handlers.config import parse_config
from handlers.engine import protocol as p
from handlers.engine.client import InProcessEngine
from handlers.engine.core import Engine
from handlers.engine.generation import Generation
from handlers.engine.sequences import RemoteBatch
from handlers.errors import EngineDead
from handlers.generation import engine as batching
from handlers.generation import loop
from handlers.generation.request import GenerateRequest, Params


class Side:
    """One engine (core + Generation, its batch on its own thread) and a worker's RemoteBatch
    over an InProcessEngine client, the worker's answers collected by job tag."""

    def __init__(self, program, queue_size=256):
        h = Harness(program, start=False)  # its CPU slot runner
        self.runner = h.runner
        cfg = dataclasses.replace(parse_config(None), queue_size=queue_size)
        self.gen = Generation(self.runner, cfg, batching.Budget(4, 16), "test budget")
        self.engine = Engine(self.runner, 1, "test-engine", generation=self.gen)
        self.gen.start()
        self.client = InProcessEngine(self.engine, "gen-w1", 1 << 20, 1 << 20)
        self.connects = 0
        self.remote = RemoteBatch(self._no_successor, self._deliver)
        self.remote.attach(self.client)
        self.done, self.tokens, self.cond = {}, {}, threading.Condition()
        self.closed = False

    def close(self):
        """The client's arena and the engine's mapping of it closed (a later test counts the
        process's arena mappings: tests/test_engine_device.py)."""
        if not self.closed:
            self.closed = True
            self.client.close()

    def _no_successor(self):
        self.connects += 1
        raise OSError("no successor in this test")

    def _deliver(self, updates):
        with self.cond:
            for job, events, err in updates:
                for e in events:
                    if isinstance(e, loop.Token) and e.id is not None:
                        self.tokens.setdefault(job.tag, []).append(e.id)
                    if isinstance(e, loop.Finished):
                        self.done[job.tag] = e
                if err is not None:
                    self.done[job.tag] = err
            self.cond.notify_all()

    def job(self, tag, prompt, n, seq_class=loop.Sequence, **params):
        dec = self.runner.dec
        req = GenerateRequest(None, prompt, Params(max_tokens=n, ignore_eos=True, **params))
        cfg = dataclasses.replace(parse_config(None), max_new_tokens=n)
        return batching.Job(seq_class(req, loop.plan(req, None, dec.vocab, dec.cache_length, cfg), None), tag)

    def submit(self, tag, prompt, n, **params):
        job = self.job(tag, prompt, n, **params)
        self.remote.submit(job)
        return job

    def wait(self, tags, timeout=120):
        with self.cond:
            assert self.cond.wait_for(lambda: all(t in self.done for t in tags), timeout=timeout), \
                f"unfinished: {[t for t in tags if t not in self.done]}"
        return {t: self.done[t] for t in tags}

    def all_free(self, timeout=30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.gen.batch.free) == SLOTS and not self.gen.jobs:
                return True
            time.sleep(0.01)
        return False


@pytest.fixture
def make_side(program):
    made = []

    def make(**kw):
        made.append(Side(program, **kw))
        return made[-1]
    yield make
    for side in made:
        side.close()


def test_sequences_through_the_engine_equal_the_model_alone(program, make_side):
    side = make_side()
    g = torch.Generator().manual_seed(3)
    prompts = {i: torch.randint(0, 256, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for i in range(40)}
    for i, pr in prompts.items():
        side.submit(i, pr, 6 + i % 11)
    got = side.wait(list(prompts))
    for i in (0, 1, 7, 31, 39):
        assert got[i].ids == one_sequence_greedy(program, prompts[i], 6 + i % 11), i
    assert all(got[i].reason == "length" and side.tokens[i] == got[i].ids for i in prompts)
    assert side.all_free(), "slots left held after every sequence ended"


def test_seeded_sampling_and_logprobs_as_the_batch_in_process(program, make_side):
    side, h = make_side(), Harness(program)
    params = dict(temperature=0.8, top_k=20, seed=11, logprobs=2)
    side.submit("s", [4, 8, 15], 10, **params)
    h.submit("s", [4, 8, 15], 10, **params)
    remote, local = side.wait(["s"])["s"], h.wait(["s"])["s"]
    assert remote.ids == local
    assert len(remote.logprobs) == 10 and all(len(lp.top) == 2 and lp.logprob <= 0 for lp in remote.logprobs)
    assert remote.logprobs[0].prev == 15 and remote.logprobs[1].prev == remote.ids[0]


class StopsAtThird(loop.Sequence):
    """A worker-side end the engine does not know (as a stop string is): the third token."""

    def take(self, tid, lp=None):
        ev = super().take(tid, lp)
        if len(self.ids) == 3 and self.reason is None:
            self.reason = "stop_sequence"
        return ev


def test_a_sequence_the_worker_ends_is_aborted_and_its_slot_freed(program, make_side):
    side = make_side()
    jobs = [side.job(i, [1 + i, 2, 3], 100, seq_class=StopsAtThird) for i in range(SLOTS)]
    side.remote.submit(*jobs)
    got = side.wait(list(range(SLOTS)))
    assert all(f.reason == "stop_sequence" and len(f.ids) == 3 for f in got.values())
    assert side.all_free(), "the aborted sequences kept their slots"
    time.sleep(0.2)  # nothing more arrives for them
    assert all(len(side.tokens[i]) == 3 for i in range(SLOTS))


def test_a_full_queue_is_busy_with_its_class_and_the_rest_run(program, make_side):
    side = make_side(queue_size=0)
    for i in range(SLOTS + 6):
        side.submit(i, [3, 4, 5 + i], 40)
    got = side.wait(list(range(SLOTS + 6)))
    busy = [i for i, v in got.items() if isinstance(v, batching.Busy)]
    assert len(busy) == 6 and all(got[i].status == 503 for i in busy)
    assert sum(isinstance(v, loop.Finished) for v in got.values()) == SLOTS


def test_the_engines_state_carries_its_batchs_gauges_to_the_workers_metrics(program, make_side):
    """A worker's generation gauges are the engine's batch (State at each flush of its metrics):
    slots held while 8 long sequences run, none after; a non-generating answer leaves them."""
    from handlers.generation.metrics import GenerationMetrics

    side, emitted = make_side(), []
    metrics = GenerationMetrics(lambda *m: emitted.append(m), 0)
    metrics.poll = side.remote.gauges
    assert metrics.flush() == 3 and emitted == [("generation_running_sequences", "gauge", 0),
                                               ("generation_waiting_sequences", "gauge", 0),
                                               ("generation_slots_in_use", "gauge", 0)]
    for i in range(8):
        side.submit(i, [9, 8, i], 120)
    deadline, seen = time.monotonic() + 30, None
    while time.monotonic() < deadline and (seen is None or seen[2] < 8):
        seen = side.remote.gauges()
    assert seen is not None and seen[2] == 8 and seen[0] <= 8 and seen[1] == 0, seen
    side.wait(list(range(8)))
    deadline = time.monotonic() + 10
    while side.remote.gauges() != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert side.remote.gauges() == (0, 0, 0)
    side.engine.die("a test fault")  # no answer: the gauges keep their last values
    assert side.remote.gauges() is None
    emitted.clear()
    assert metrics.flush() == 0 and emitted == []


def test_a_worker_that_goes_frees_its_slots(program, make_side):
    side = make_side()
    for i in range(8):
        side.submit(i, [9, 9, i], 120)
    deadline = time.monotonic() + 30
    while len(side.gen.batch.free) > SLOTS - 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    side.close()
    assert side.all_free(), "a gone worker's sequences kept their slots"


def test_an_engine_that_dies_fails_every_sequence_with_a_retryable_503(program, make_side):
    side = make_side()
    for i in range(4):
        side.submit(i, [2, 3, i], 120)
    side.engine.die("a test fault")
    got = side.wait(list(range(4)))
    assert all(isinstance(v, EngineDead) and v.status == 503 for v in got.values()), got
    with pytest.raises(EngineDead):
        side.client.send_stream(p.Generate(99, (1,), 1, ()))
    with pytest.raises(EngineDead):  # at once, on the request's thread: the successor is reached on another
        side.submit("late", [1, 2], 3)
    assert not side.remote.engine_state()["connected"]
    deadline = time.monotonic() + 10
    while side.connects == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert side.connects >= 1, "nobody tried to reach the engine's successor"


def test_an_engine_that_dies_while_a_request_is_sent_fails_each_choice_once(make_side, monkeypatch):
    """The send fails (the engine's socket closed under it): every choice of the request is
    answered EngineDead exactly once through the updates, and submit itself raises nothing (a
    raise there would answer the request a second time: handlers/continuous.py)."""
    side = make_side()
    delivered = []
    inner = side.remote.deliver
    side.remote.deliver = lambda updates: (delivered.extend(j.tag for j, _e, _err in updates), inner(updates))

    def broken(msg):
        raise OSError("the engine's socket closed")
    monkeypatch.setattr(side.client, "_send", broken)
    side.remote.submit(side.job("a", [1, 2], 5), side.job("b", [3, 4], 5))
    got = side.wait(["a", "b"])
    assert all(isinstance(v, EngineDead) for v in got.values()) and sorted(delivered) == ["a", "b"], delivered
    with pytest.raises(EngineDead):  # found dead before anything is sent: the caller answers it
        side.remote.submit(side.job("c", [5], 2))
    assert "c" not in delivered


def test_no_arena_of_these_tests_stays_mapped():
    """Every Side closed its client: no arena of theirs left in this process's mappings."""
    with open("/proc/self/maps") as f:
        left = [line for line in f if "/memfd:cs-arena-gen-" in line]
    assert not left, left[:3]


# --- through real TorchServe ---


def engine_pids(ts) -> list:
    import subprocess

    out = subprocess.run(["pgrep", "-af", "handlers.engine.serve"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if str(ts.workdir) in line]


@pytest.fixture(scope="module")
def engine_slots(program, serve, tmp_path_factory):
    path, store = saved_program(program, tmp_path_factory, "engine_slots")
    archive(path, "lm_engine", store, "--handler-option", "engine=on", "--workers", "2")
    return serve({"lm_engine": store / "lm_engine.mar"})


def streams(ts, prompts: dict, n: int, model: str = "lm_engine") -> tuple:
    """({i: (status, lines)}, errors) of one streaming client per prompt at once, none left hanging."""
    got, errors = {}, []

    def client(i):
        try:
            r, lines = ask(ts, model, {"input_ids": prompts[i], "parameters": {"max_tokens": n, "ignore_eos": True}})
            got[i] = (r.status_code, lines)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=client, args=(i,)) for i in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    return got, errors


@pytest.mark.server
def test_the_engines_batch_serves_every_worker_and_each_stream_as_alone(program, engine_slots):
    ts = engine_slots
    assert "served by the engine: engine pid" in ts.log() and "slot-form decoder" in ts.log()
    prompts = {i: [(5 * i + k) % 256 for k in range(2 + i % 7)] for i in range(24)}
    got, errors = streams(ts, prompts, 10)
    assert not errors, errors[:3]
    for i, (status, lines) in got.items():
        assert status == 200
        *tokens, last = lines
        assert [t["token_ids"][0] for t in tokens] == last["token_ids"] == one_sequence_greedy(program, prompts[i], 10)
    assert len(engine_pids(ts)) == 1


def settled_tokens(ts, scrape) -> float:
    """The frontend's token counter once no earlier stream's count is still on its way: each
    worker flushes every generation_metrics_s (1 s), so a count unchanged over 3 s is complete."""
    last, since = None, time.monotonic()
    deadline = since + 30
    while time.monotonic() < deadline:
        now = scrape(ts).get(("generation_tokens_total", "lm_engine"), 0)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 3:
            return now
        time.sleep(0.5)
    raise AssertionError(f"the token counter kept moving for 30 s with no stream running (last {last})")


@pytest.mark.server
def test_engine_served_workers_emit_the_engines_gauges_and_their_own_tokens(engine_slots):
    """Each worker counts its own tokens and times; the gauges are the one batch's, asked of
    the engine: 0 slots in use once every stream ended."""
    from test_generation_metrics import scrape

    ts = engine_slots
    before = settled_tokens(ts, scrape)
    got, errors = streams(ts, {i: [3, 4, 5 + i] for i in range(6)}, 7)
    assert not errors and all(status == 200 for status, _ in got.values()), (errors, got)
    deadline, seen = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        seen = scrape(ts)
        if seen.get(("generation_tokens_total", "lm_engine"), 0) - before == 42 and \
                seen.get(("generation_slots_in_use", "lm_engine")) == 0:
            break
        time.sleep(0.5)
    mine = {k: v for k, v in seen.items() if k[1] == "lm_engine"}
    assert seen.get(("generation_tokens_total", "lm_engine"), 0) - before == 42, mine
    assert seen.get(("generation_slots_in_use", "lm_engine")) == 0, mine
    assert seen.get(("generation_running_sequences", "lm_engine")) == 0, mine
    assert seen.get(("generation_waiting_sequences", "lm_engine")) == 0, mine


@pytest.mark.server
def test_a_killed_engine_ends_every_stream_and_a_successor_serves(program, engine_slots):
    ts = engine_slots
    (old,) = engine_pids(ts)
    prompts = {i: [1 + i, 2, 3] for i in range(8)}
    result = {}
    runner = threading.Thread(target=lambda: result.update(zip(("got", "errors"), streams(ts, prompts, 110))))
    runner.start()
    time.sleep(0.3)
    os.kill(old, signal.SIGKILL)
    runner.join(150)
    assert not runner.is_alive(), "a stream hung after the engine was killed"
    for status, lines in result["got"].values():  # each ended: a result, a 503, or an error as its last line
        assert status in (200, 503), status
        if status == 200:
            assert "token_ids" in lines[-1] and len(lines[-1]["token_ids"]) == 110 or "error" in lines[-1], lines[-1]
    deadline = time.monotonic() + 60
    while True:
        r, lines = ask(ts, "lm_engine", {"input_ids": [5, 6, 7], "parameters": {"max_tokens": 4, "ignore_eos": True}})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200 and lines[-1]["token_ids"] == one_sequence_greedy(program, [5, 6, 7], 4)
    assert old not in engine_pids(ts) and len(engine_pids(ts)) == 1
