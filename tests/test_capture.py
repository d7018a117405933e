"""Capture-and-verify (handlers/run/capture.py) and the worker's stream (handlers/run/stream.py) on
the CPU: torch.cuda's graph, stream and allocator calls stand in, logged in order, as
tests/test_continuous.py's RecordedGraph stands in for a captured graph. The real captures run on
the GPU machine (tests/test_graphs_gpu.py, tests/test_continuous.py's `gpu` test)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from handlers.run import capture
from handlers.run.capture import GraphMismatch, capture_graph, check_equal, mismatch
from handlers.run.stream import worker_stream


def test_equal_outputs_pass_and_a_difference_names_the_graph_the_output_and_max_d():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert mismatch(a, a.clone(), "g") is None
    check_equal({"y": a, "z": a.int()}, {"y": a.clone(), "z": a.int()}, "g")  # no raise
    with pytest.raises(GraphMismatch, match=r"^the 2-row step graph replays logits differing from the plain "
                                            r"call's \(max \|d\| 0\.5\)$"):
        check_equal(a, a + torch.tensor([0.0, 0.5, -0.25]), "the 2-row step graph", "logits")
    got = mismatch({"y": a, "z": a}, {"y": a.clone(), "z": a * 2}, "the graph at batch 4")
    assert isinstance(got, RuntimeError) and str(got) == (
        "the graph at batch 4 replays output 'z' differing from the plain call's (max |d| 3)")
    got = mismatch({"y": a}, {"y": a[:2]}, "the graph at batch 4")
    assert str(got) == "the graph at batch 4 replays output 'y' differing from the plain call's (shape (2,), " \
                       "the plain call's (3,))"
    # bit for bit: a difference in the last place is a difference
    b = a.clone()
    b[0] = torch.nextafter(b[0], torch.tensor(2.0))
    assert "max |d| 1.19e-07" in str(mismatch(a, b, "g"))


class _Graph:
    """A torch.cuda.CUDAGraph stand-in: nothing to replay, only its identity."""


def fake_cuda(monkeypatch, log: list, end_raises: bool = False):
    """torch.cuda's capture machinery on the CPU, each call appended to `log`: the worker's
    stream, a pool handle, the capture (`graph` context), the current stream and its restoring,
    the allocator's routing ended."""
    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        log.append(("capture", pool, stream))
        yield
        log.append(("captured",))

    @contextlib.contextmanager
    def on_stream(s):
        log.append(("on", s))
        yield

    def end_routing(index, pool):
        log.append(("endAllocateToPool", index, pool))
        if end_raises:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "fresh pool")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the current stream")
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: log.append(("set_stream", s)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_routing, raising=False)
    return SimpleNamespace(synchronize=lambda: log.append(("synchronize",)))


def test_the_call_is_warmed_up_on_the_stream_and_waited_for_before_its_capture(monkeypatch):
    log = []
    stream = fake_cuda(monkeypatch, log)

    def call():
        log.append(("call",))
        return torch.ones(2)

    graph, out = capture_graph(call, stream, "pool", warmup=2)
    assert isinstance(graph, _Graph) and torch.equal(out, torch.ones(2))
    assert log == [("on", stream), ("call",), ("call",), ("synchronize",),
                   ("capture", "pool", stream), ("call",), ("captured",)]
    log.clear()
    capture_graph(call, stream)  # one warm-up by default; a graph alone gets a pool of its own
    assert log == [("on", stream), ("call",), ("synchronize",), ("capture", "fresh pool", stream), ("call",),
                   ("captured",)]


@pytest.mark.parametrize("end_raises", [False, True])
def test_a_capture_that_raises_is_undone_and_re_raised(monkeypatch, end_raises):
    """The stream current before the capture is current again and the allocator's routing into the
    pool ended (on the device's own index) before the error goes on; where ending the capture got
    that far itself, the allocator's own complaint is not what is raised."""
    log = []
    stream = fake_cuda(monkeypatch, log, end_raises)
    calls = []

    def call():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        capture_graph(call, stream, "pool", warmup=1, device=torch.device("cuda", 3))
    assert log[-3:] == [("capture", "pool", stream), ("set_stream", "the current stream"),
                        ("endAllocateToPool", 3, "pool")]
    log.clear()
    capture.after_failed_capture(None, "pool", "before")  # no index: the current device's
    assert log == [("set_stream", "before"), ("endAllocateToPool", 0, "pool")]


def test_the_workers_stream_is_made_on_cuda_only(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: made.append((device, priority)) or "s")
    assert worker_stream(torch.device("cpu"), -1) is None and made == []
    assert worker_stream(torch.device("cuda", 1), -1) == "s" and made == [(torch.device("cuda", 1), -1)]


@pytest.fixture(scope="module")
def tiny():
    from examples import tiny_decoder
    from handlers.artifact.decoder import recognise
    from handlers.artifact.state import program_state

    ep = tiny_decoder.export(tiny_decoder.build(), "torchchat")
    return ep, recognise(ep, program_state(ep).mutated)


@pytest.mark.parametrize("skew", [0.0, 1e-3])
def test_the_decoders_step_graph_is_captured_and_verified_through_the_module(tiny, monkeypatch, skew):
    """DecoderRunner.capture over tests/test_continuous.py's RecordedGraph: the step graph kept
    where its replay equals the plain call, and where it does not, "on" raises the GraphMismatch
    and "auto" keeps the plain call, naming it."""
    from test_continuous import RecordedGraph, on_recorded_graphs

    from handlers.run.decoder import DecoderRunner

    ep, dec = tiny
    module = ep.module()
    runner = DecoderRunner(lambda t, p: {"logits": module(t, p)}, dec, torch.device("cpu"),
                           SimpleNamespace(stream_priority=0))
    on_recorded_graphs(monkeypatch, runner)
    monkeypatch.setattr(RecordedGraph, "skew", skew)
    if not skew:
        assert runner.capture("on") == "decode steps as a CUDA graph (verified equal to the plain call)"
        assert runner.graph is not None
        return
    with pytest.raises(GraphMismatch, match=r"the step graph replays logits differing from the plain call's "
                                            r"\(max \|d\| "):
        runner.capture("on")
    note = runner.capture("auto")
    assert runner.graph is None and note.startswith(
        "plain step calls: the step's CUDA graph was not kept (GraphMismatch: the step graph replays logits"), note
