"""Generation metrics (handlers/generation/metrics.py): what is counted, observed and gauged, and
when it is emitted; the slot engine's gauges and counts in process; TorchServe's lines; and through
real TorchServe (one server, a slot-form archive and a one-sequence archive): the names on the
metrics port, the token counter equal to the tokens generated."""
import logging
import os
import re
import time
from types import SimpleNamespace

import pytest
import requests
import torch
from conftest import build_mar
from test_continuous import Harness, archive, ask, program  # noqa: F401  (program: the slot form's fixture)

from examples import tiny_decoder
from handlers.generation import loop
from handlers.generation import engine as engines
from handlers.generation import metrics as gm
from handlers.generation.request import GenerateRequest, Params
from handlers.torchserve.stage_timings import generation_sink

NAMES = (gm.TOKENS, gm.TIME_TO_FIRST_TOKEN, gm.INTER_TOKEN, gm.RUNNING, gm.WAITING, gm.SLOTS_IN_USE)


def recorder(interval_s=1.0):
    now, got = [10.0], []
    m = gm.GenerationMetrics(lambda name, kind, value: got.append((name, kind, value)), interval_s,
                             clock=lambda: now[0])
    return m, now, got


def test_tokens_first_token_and_mean_gap_are_recorded_and_emitted_once_each():
    m, now, got = recorder()
    t = m.begin()  # the request reaches the worker at 10.0
    now[0] = 10.5
    m.token(t)  # first token after 0.5 s
    for _ in range(4):  # four more, 0.1 s apart
        now[0] += 0.1
        m.token(t)
    m.end(t)
    m.state(1, 3, 2)
    assert m.flush() == 6
    assert got[0] == (gm.TOKENS, "counter", 5)
    assert got[1] == (gm.TIME_TO_FIRST_TOKEN, "histogram", pytest.approx(0.5))
    assert got[2] == (gm.INTER_TOKEN, "histogram", pytest.approx(0.1))
    assert got[3:] == [(gm.RUNNING, "gauge", 1), (gm.WAITING, "gauge", 3), (gm.SLOTS_IN_USE, "gauge", 2)]
    got.clear()
    assert m.flush() == 0 and got == []  # nothing changed: nothing emitted
    t2 = m.begin(at=9.0)  # a clock started by the caller
    m.token(t2)
    m.end(t2)  # one token: no gap to observe
    m.state(0, 3, 2)
    m.flush()
    assert got == [(gm.TOKENS, "counter", 1), (gm.TIME_TO_FIRST_TOKEN, "histogram", pytest.approx(now[0] - 9.0)),
                   (gm.RUNNING, "gauge", 0)]  # the counter's increase; only the gauge that changed


def test_a_gauge_this_form_does_not_know_is_never_emitted():
    m, _, got = recorder()
    m.state(1, None, 1)
    m.flush()
    assert [name for name, _, _ in got] == [gm.RUNNING, gm.SLOTS_IN_USE]


def test_the_flusher_emits_on_its_own_thread_and_zero_means_none():
    got = []
    m = gm.for_worker(lambda *a: got.append(a), 0.05)
    m.token(m.begin())
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got[0][:2] == (gm.TOKENS, "counter") and got[0][2] == 1
    assert m._thread.name == "generation-metrics" and m._thread.daemon
    assert gm.for_worker(lambda *a: None, 0) is gm.OFF


def test_a_sequence_counts_each_token_and_is_timed_from_its_start():
    m, now, got = recorder()
    req = GenerateRequest(None, [1, 2], Params(max_tokens=3, ignore_eos=True))
    seq = loop.Sequence(req, loop.Plan([1, 2], 3, frozenset()), None, m, started=9.0)
    for tid in (5, 6, 7):
        now[0] += 1.0
        seq.take(tid)
    seq.finish()
    m.flush()
    assert got[:3] == [(gm.TOKENS, "counter", 3), (gm.TIME_TO_FIRST_TOKEN, "histogram", 2.0),
                       (gm.INTER_TOKEN, "histogram", 1.0)]


def _submit(h, m, tag, prompt, n):
    dec = h.runner.dec
    req = GenerateRequest(None, prompt, Params(max_tokens=n, ignore_eos=True))
    seq = loop.Sequence(req, loop.Plan(prompt, n, frozenset()), None, m)
    h.engine.submit(engines.Job(seq, tag))
    assert n + len(prompt) <= dec.cache_length


def test_the_engine_gauges_each_turn_and_counts_every_token(program):  # noqa: F811
    got = []
    m = gm.GenerationMetrics(lambda *a: got.append(a), 1.0)
    h = Harness(program, start=False)
    h.engine.metrics = m
    slots = h.engine.slots
    tags = list(range(slots + 5))
    for i in tags:
        _submit(h, m, i, [3 + i % 7, 9, 4], 4 + i % 3)
    with h.engine.cond:
        h.engine._begin()
        h.engine._gauges()
    assert m._state == (0, 5, slots)  # every slot filling a prompt, five waiting
    h.turn()  # prompts whole: their first tokens read
    with h.engine.cond:
        h.engine._gauges()
    assert m._state[0] > 0 and m._state[2] == slots
    h.engine.thread.start()
    done = h.wait(tags)
    deadline = time.monotonic() + 30
    while m._state != (0, 0, 0) and time.monotonic() < deadline:  # the engine's thread, idle again
        time.sleep(0.01)
    assert m._state == (0, 0, 0)
    m.flush()
    counted = {name: [v for n, _, v in got if n == name] for name in NAMES}
    assert counted[gm.TOKENS] == [sum(len(ids) for ids in done.values())]
    assert len(counted[gm.TIME_TO_FIRST_TOKEN]) == len(counted[gm.INTER_TOKEN]) == len(tags)


def test_the_sink_writes_torchserves_metric_lines_and_never_raises(caplog):
    import ts
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    cache = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    cache.initialize_cache()
    cache.model_name = "lm"
    caplog.set_level(logging.INFO, logger="ts.metrics.caching_metric")
    emit = generation_sink(SimpleNamespace(metrics=cache), "lm")
    # before any batch (no request ids: TorchServe's defaults would be Level "Error" alone), then
    # within one, through the metrics cached at the first: the same dimensions both times
    for ids in (None, {0: "r1"}):
        cache.request_ids = ids
        emit(gm.TOKENS, "counter", 3)
        emit(gm.TIME_TO_FIRST_TOKEN, "histogram", 0.25)
        emit(gm.RUNNING, "gauge", 2)
    lines = [x for x in caplog.messages if x.startswith("[METRICS]")]
    assert len(lines) == 6, caplog.messages
    assert all("|#ModelName:lm,Level:Model|" in x for x in lines), lines
    assert re.match(r"\[METRICS\]generation_tokens_total\.Count:3\|#ModelName:lm,Level:Model\|#type:COUNTER\|", lines[3])
    assert "generation_time_to_first_token_seconds.seconds:0.25|#ModelName:lm,Level:Model|#type:HISTOGRAM" in lines[4]
    assert "generation_running_sequences.Count:2|#ModelName:lm,Level:Model|#type:GAUGE" in lines[5]
    generation_sink(SimpleNamespace(), "lm")(gm.TOKENS, "counter", 1)  # no metrics object: nothing raised


def test_the_sink_adds_no_name_to_the_contexts_own_metrics_cache():
    """TorchServe 0.12's async worker deep-copies the service's context for every batch on its
    event loop (ts/async_service.py predict) while the flusher's thread emits: a name added to
    that context's cache during a copy raised there, outside predict's try, and the batch's
    request was never answered (one of 96 in tests/test_continuous.py's burst). The sink emits
    through a cache of its own, copied at load: the context's dicts never change after it."""
    import copy
    import threading

    import ts
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    cache = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    cache.initialize_cache()
    context = SimpleNamespace(metrics=cache, model_name="lm")
    names = lambda: {kind: sorted(metrics) for kind, metrics in cache.cache.items()}  # noqa: E731
    before = names()
    emit = generation_sink(context, "lm")
    failures, done = [], threading.Event()

    def copier():  # TorchServe's event loop, a batch after another
        while not done.is_set():
            try:
                copy.deepcopy(context)
            except RuntimeError as e:
                failures.append(e)
    t = threading.Thread(target=copier)
    t.start()
    try:
        for i in range(200):  # the flusher, each name new
            for name, kind in ((gm.TOKENS, "counter"), (gm.TIME_TO_FIRST_TOKEN, "histogram"), (gm.RUNNING, "gauge")):
                emit(f"{name}_{i}", kind, 1)
    finally:
        done.set()
        t.join()
    assert names() == before and not failures, (names(), failures[:1])


# --- through real TorchServe -------------------------------------------------------------------

@pytest.fixture(scope="module")
def metrics_server(program, serve, tmp_path_factory):  # noqa: F811
    """One TorchServe: the slot form (`slots`) and the one-sequence form (`one`), each archived once."""
    d = tmp_path_factory.mktemp("gen_metrics")
    store = d / "store"
    torch.export.save(program, d / "slots.pt2")
    archive(d / "slots.pt2", "slots", store)
    torch.export.save(tiny_decoder.export(tiny_decoder.build(), "torchchat"), d / "one.pt2")
    build_mar(d / "one.pt2", "one", store)
    ts = serve({"slots": store / "slots.mar", "one": store / "one.mar"})
    return ts


def scrape(ts) -> dict:
    """{(metric name, ModelName): value} of the metrics port's samples."""
    text = requests.get(f"http://127.0.0.1:{ts.ports['metrics']}/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r'(?m)^(\w+)\{([^}]*)\} (\S+)$', text):
        model = re.search(r'ModelName="([^"]*)"', m.group(2))
        out[(m.group(1), model.group(1) if model else None)] = float(m.group(3))
    return out


@pytest.mark.server
def test_generation_metrics_reach_the_metrics_port_for_both_forms(metrics_server):
    generated = {}
    for model in ("slots", "one"):
        n = 0
        for prompt, k in (([5, 17, 33], 5), ([7, 1, 200, 45], 3)):
            r, lines = ask(metrics_server, model, {"input_ids": prompt, "parameters": {"max_tokens": k,
                                                                                        "ignore_eos": True}})
            assert r.status_code == 200, r.text
            n += lines[-1]["completion_tokens"]
        generated[model] = n
    assert generated == {"slots": 8, "one": 8}
    deadline, seen = time.monotonic() + 30, {}
    while time.monotonic() < deadline:  # emitted within about a second, parsed by the frontend
        seen = scrape(metrics_server)
        # every sample, not the first: the frontend parses the worker's metric lines one by one
        if all(seen.get(("generation_tokens_total", m)) == n and seen.get(("generation_time_to_first_token_seconds_count", m))
               == 2 and seen.get(("generation_inter_token_seconds_count", m)) == 2 for m, n in generated.items()):
            break
        time.sleep(0.5)
    for model, n in generated.items():
        assert seen.get(("generation_tokens_total", model)) == n, {k: v for k, v in seen.items() if k[1] == model}
        assert seen[("generation_time_to_first_token_seconds_count", model)] == 2
        assert seen[("generation_inter_token_seconds_count", model)] == 2
        assert 0 < seen[("generation_time_to_first_token_seconds_sum", model)] < 60
        assert seen[("generation_running_sequences", model)] == 0
        assert seen[("generation_slots_in_use", model)] == 0
    assert seen[("generation_waiting_sequences", "slots")] == 0
    assert ("generation_waiting_sequences", "one") not in seen  # TorchServe's queue: the frontend's own metrics
