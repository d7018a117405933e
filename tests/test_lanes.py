"""A one-sequence decoder as the engine's lanes (handlers/run/lanes.py; issue 64 item 3): copies of
its KV cache on one copy of the weights, generating several sequences at once.

In process, on the CPU (examples/tiny_decoder.py, the TorchChat form, imported as a user does):
load_lanes gives each lane a cache of its own on the shared weights (a lifted tensor constant
cache included, which the program's read-only tensors would otherwise have shared), the
continuous batch over the lanes answers every sequence as the eager model alone, and two lanes on
one cache fail the load's check instead of answering from each other's state.

Through real TorchServe (cs-archive --handler-option engine=on, two workers): the program and its
AOTInductor package, 12 concurrent streams each equal to the eager model, one engine per model,
the archive's async frontend and its load line naming the lanes; a kill -9 of the engines ends
every open stream (none hangs) and their successors answer again.
"""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from test_continuous import archive
from test_engine_generation import engine_pids, streams
from test_generation import ask, eager_greedy

from compiled_serving.import_artifact import import_artifact
from examples import tiny_decoder
from handlers.artifact.decoder import of as decoder_of
from handlers.artifact.variants import choose_variant
from handlers.config import parse_config
from handlers.errors import LoadError
from handlers.generation import engine as batching
from handlers.generation import loop
from handlers.generation.request import GenerateRequest, Params
from handlers.run.decoder import DecoderRunner
from handlers.run.lanes import LaneRunner, check_independent, load_lanes


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("lanes")
    torch.export.save(tiny_decoder.export(tiny_decoder.build(), "torchchat"), d / "decoder.pt2")
    return d


@pytest.fixture(scope="module")
def imported(saved):
    return import_artifact(str(saved / "decoder.pt2"), str(saved / "art"))


def lanes_of(art: str, copies: int) -> tuple:
    cfg = parse_config({"handler": {"cache_copies": copies}})
    spec, placement, _ = choose_variant(art, None, cfg, None)
    return load_lanes(spec, decoder_of(spec), placement, cfg), cfg


def test_each_lane_has_a_cache_of_its_own_on_one_copy_of_the_weights(imported):
    (lanes, note), _ = lanes_of(imported, 3)
    assert len(lanes) == 3 and note.startswith("3 lanes (handler.cache_copies 3)"), note
    mods = [lane.model._fn for lane in lanes]
    caches = [{n: t.data_ptr() for n, t in m.named_buffers() if "kv_cache" in n} for m in mods]
    weights = [{n: t.data_ptr() for n, t in m.named_parameters()} for m in mods]
    assert len(caches[0]) == 4 and all(c.keys() == caches[0].keys() for c in caches)
    assert len({c[n] for c in caches for n in c}) == 12, "a cache tensor shared between lanes"
    assert weights[0] and all(w == weights[0] for w in weights), "the lanes read different copies of the weights"


def test_the_batch_over_lanes_answers_every_sequence_as_the_model_alone(imported):
    (lanes, _), cfg = lanes_of(imported, 3)
    runner, done, cond = LaneRunner(lanes, cfg), {}, threading.Condition()

    def deliver(updates):
        with cond:
            for job, events, err in updates:
                for e in events:
                    if isinstance(e, loop.Finished):
                        done[job.tag] = e.ids
                if err is not None:
                    done[job.tag] = err
            cond.notify_all()
    eng = batching.Engine(runner, deliver, 64, batching.Budget(3, 8)).start()
    g = torch.Generator().manual_seed(5)
    prompts = {i: torch.randint(0, 256, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
               for i in range(10)}
    for i, pr in prompts.items():
        req = GenerateRequest(None, pr, Params(max_tokens=4 + i % 7, ignore_eos=True))
        plan = loop.plan(req, None, 256, 64, dataclasses.replace(cfg, max_new_tokens=12))
        eng.submit(batching.Job(loop.Sequence(req, plan, None), i))
    with cond:
        assert cond.wait_for(lambda: len(done) == len(prompts), timeout=120), sorted(done)
    for i, pr in prompts.items():
        assert done[i] == eager_greedy(pr, 4 + i % 7, "torchchat"), i
    assert sorted(eng.free) == [0, 1, 2]


def test_two_lanes_on_one_cache_fail_the_loads_check(imported):
    (lanes, _), cfg = lanes_of(imported, 1)
    same = DecoderRunner(lanes[0].model, lanes[0].dec, torch.device("cpu"), cfg)
    with pytest.raises(LoadError, match="share the state they write"):
        check_independent(lanes[0], same)


def test_the_shared_weights_leave_the_cache_out_and_a_failed_share_serves_one_plain_lane(imported, monkeypatch):
    """The packed weights hold no state the decoder writes (TorchChat's cache is lifted tensor
    constants: "constant:NAME"), which each lane gets as zeros of its own; where reading the weights
    for sharing fails, the load serves one plain lane and says why."""
    from handlers.artifact.kinds import kind_of
    from handlers.run import lanes as lanes_mod

    cfg = parse_config({"handler": {"cache_copies": 2}})
    spec, placement, _ = choose_variant(imported, None, cfg, None)
    dec = decoder_of(spec)
    shared, written = lanes_mod._shared(kind_of(spec), spec, placement, dec)
    assert written and all(k.split(":", 1)[-1] in dec.mutated for k in written), written
    assert not set(written) & set(shared.tensors) and shared.tensors
    kind = kind_of(spec)

    def refuse(*a, **k):
        raise LoadError("the package keeps its weights outside its library (data/weights/)")
    monkeypatch.setattr(type(kind), "held_weights", refuse)
    lanes, note = load_lanes(spec, dec, placement, cfg)
    assert len(lanes) == 1 and note.startswith("1 lane (its weights could not be read for sharing"), note


def test_cs_archive_batches_a_one_sequence_decoder_only_where_the_engine_serves_every_worker(monkeypatch):
    from types import SimpleNamespace

    from compiled_serving import archive
    from handlers.artifact import decoder as decoder_mod

    monkeypatch.setattr(decoder_mod, "of", lambda spec: SimpleNamespace(slotted=False, name="one"))
    cuda, cpu = SimpleNamespace(device="cuda"), SimpleNamespace(device="cpu")
    assert archive.batched_decoder([cuda], {}) is not None  # auto, a CUDA variant
    assert archive.batched_decoder([cuda], {}, "cpu") is None  # deviceType cpu: its workers run it
    assert archive.batched_decoder([cuda, cpu], {}) is None  # a worker may load the CPU variant itself
    assert archive.batched_decoder([cpu], {"engine": "on"}) is not None
    program = SimpleNamespace(device="cpu", backend="export")  # exported on the CPU: a GPU worker relocates it
    assert archive.batched_decoder([program], {}) is None  # it may be served on a CPU host
    assert archive.batched_decoder([program], {}, "gpu") is not None  # deviceType gpu: the engine's lanes
    assert archive.batched_decoder([SimpleNamespace(device="cpu", backend="aoti")], {}, "gpu") is None


# --- through real TorchServe ---


@pytest.fixture(scope="module")
def lanes_server(saved, serve):
    from torch._inductor import aoti_compile_and_package

    store = saved / "store"
    pkg = aoti_compile_and_package(torch.export.load(saved / "decoder.pt2"), package_path=str(saved / "pkg.pt2"))
    opts = ("--handler-option", "engine=on", "--handler-option", "cache_copies=4", "--workers", "2")
    made = {"lanes_ep": archive(saved / "decoder.pt2", "lanes_ep", store, *opts),
            "lanes_aoti": archive(pkg, "lanes_aoti", store, "--program", str(saved / "decoder.pt2"), *opts)}
    ts = serve({name: store / f"{name}.mar" for name in made})
    return ts, made


@pytest.mark.server
@pytest.mark.parametrize("model", ["lanes_ep", "lanes_aoti"])
def test_concurrent_streams_through_the_engines_lanes_each_as_alone(lanes_server, model):
    ts, made = lanes_server
    assert "by continuous batching" in made[model].stdout and "lanes" in made[model].stdout, made[model].stdout
    prompts = {i: [(3 * i + k) % 256 for k in range(2 + i % 5)] for i in range(12)}
    got, errors = streams(ts, prompts, 8, model)
    assert not errors, errors[:3]
    for i, (status, lines) in got.items():
        assert status == 200, lines
        assert lines[-1]["token_ids"] == eager_greedy(prompts[i], 8, "torchchat"), i
    log = ts.log()
    assert "one-sequence decoder" in log and "4 lanes (handler.cache_copies 4)" in log
    assert len(engine_pids(ts)) == 2  # one per model


@pytest.mark.server
def test_killed_engines_end_every_stream_and_their_successors_serve(lanes_server):
    """kill -9 of every engine of the server while 6 streams run on lanes_ep: each stream ends (a
    result, a 503, or an error as its last line), none hangs, and each model answers again."""
    import os
    import signal
    import time

    ts, _ = lanes_server
    old = engine_pids(ts)
    result = {}
    prompts = {i: [1 + i, 2, 3] for i in range(6)}
    runner = threading.Thread(
        target=lambda: result.update(zip(("got", "errors"), streams(ts, prompts, 60, "lanes_ep"))))
    runner.start()
    time.sleep(0.3)
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    runner.join(150)
    assert not runner.is_alive(), "a stream hung after the engines were killed"
    got, errors = result["got"], result["errors"]
    assert not errors, errors[:3]
    for status, lines in got.values():
        assert status in (200, 503), status
        if status == 200:
            assert len(lines[-1].get("token_ids", [])) == 60 or "error" in lines[-1], lines[-1]
    for model in ("lanes_ep", "lanes_aoti"):
        deadline = time.monotonic() + 90
        while True:
            r, lines = ask(ts, model, {"input_ids": [5, 6, 7], "parameters": {"max_tokens": 4, "ignore_eos": True}})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200 and lines[-1]["token_ids"] == eager_greedy([5, 6, 7], 4, "torchchat"), model
    assert not set(old) & set(engine_pids(ts)) and len(engine_pids(ts)) == 2
