"""CUDA graphs per batch bucket (handlers/run/graphs.py): the bucket and padding arithmetic and
the auto/on/off decision, on CPU. The capture and replay themselves run on the GPU machine
(tests/test_graphs_gpu.py)."""
from __future__ import annotations

import types

import pytest
import torch

from handlers.artifact.kinds import kind_of
from handlers.artifact.metadata import TensorSpec
from handlers.config import parse_config
from handlers.errors import ConfigError, LoadError
from handlers.run import cuda as cuda_runner
from handlers.run import graphs


@pytest.mark.parametrize("lo,hi,largest,expected", [
    (1, 64, 64, [1, 2, 4, 8, 16, 32, 64]),
    (1, 16, 64, [1, 2, 4, 8, 16]),
    (1, 24, 64, [1, 2, 4, 8, 16, 24]),     # the range's end is a bucket: every batch has one
    (1, 256, 64, [1, 2, 4, 8, 16, 32, 64]),  # larger batches run without a graph
    (3, 20, 64, [3, 4, 8, 16, 20]),
    (4, 4, 64, [4]),                        # fixed batch
    (1, 64, 8, [1, 2, 4, 8]),
    (16, 64, 8, [16]),                      # the smallest accepted batch always gets a bucket
])
def test_buckets(lo, hi, largest, expected):
    assert graphs.graph_buckets(lo, hi, (), largest) == expected


def test_configured_buckets_are_checked_against_the_range():
    assert graphs.graph_buckets(1, 64, (8, 1, 8)) == [1, 8]
    with pytest.raises(LoadError, match=r"\[128\] lie outside the artifact's batch range \[1, 64\]"):
        graphs.graph_buckets(1, 64, (1, 128))


@pytest.mark.parametrize("rows,expected", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, None)])
def test_bucket_for_pads_to_the_smallest_that_holds(rows, expected):
    assert graphs.bucket_for(rows, [1, 2, 4, 8, 16]) == expected


def spec_of(shape, backend="aoti"):
    return types.SimpleNamespace(backend=backend, batch_min=1, batch_max=16,
                                 inputs=[TensorSpec("x", "float32", shape)])


def test_which_kinds_are_captured():
    assert graphs.why_not_capturable(kind_of("aoti"), spec_of((None, 3, 8, 8))) is None
    assert graphs.why_not_capturable(kind_of("export"), spec_of((None, 3, 8, 8), "export")) is None
    assert "keep their own runtime" in graphs.why_not_capturable(kind_of("tensorrt"), spec_of((None, 3), "tensorrt"))
    assert "x have dynamic non-batch" in graphs.why_not_capturable(kind_of("aoti"), spec_of((None, None)))
    named = spec_of((None, "S"))
    named.dims = {"S": (8, 128)}
    assert "no declared padding (handler.pad)" in graphs.why_not_capturable(kind_of("aoti"), named)
    # with padding declared every call carries a length bucket: capturable
    assert graphs.why_not_capturable(kind_of("aoti"), named, pad=object()) is None
    # an unnamed dynamic dimension never is, padding or not
    assert "dynamic non-batch" in graphs.why_not_capturable(kind_of("aoti"), spec_of((None, None)), pad=object())


def test_graphs_per_length_bucket_are_found_by_the_call_shape():
    """With named dimensions (padding declared) a call finds the graph of its own length bucket
    and the smallest batch bucket holding its rows; a length or batch without one runs plainly."""
    spec = types.SimpleNamespace(dims={"S": (8, 64)}, inputs=[TensorSpec("ids", "int64", (None, "S")),
                                                               TensorSpec("mask", "int64", (None, "S"))])
    pad = types.SimpleNamespace(buckets={"S": [16, 64]})
    assert graphs.length_buckets(spec, pad) == [{"S": 16}, {"S": 64}]
    assert graphs.length_buckets(types.SimpleNamespace(dims={}), None) == [{}]
    assert graphs.length_buckets(spec, None) == [{}]  # named dimensions but no pad plan: one plain shape
    two = types.SimpleNamespace(buckets={"S": [16, 64], "T": [4]})
    assert graphs.length_buckets(spec, two) == [{"S": 16, "T": 4}, {"S": 64, "T": 4}]
    buckets = {(rows, ((n,), (n,))): graphs.GraphBucket(rows, None, [], {}, (("S", n),), rows * n / 100)
               for rows in (1, 2, 4) for n in (16, 64) if (rows, n) != (4, 64)}
    gs = graphs.GraphSet(buckets, 1 << 20, dynamic=True)

    def parts(rows, n):
        return {"ids": [torch.zeros(rows, n)], "mask": [torch.zeros(rows, n)]}

    def found(rows, n):
        b = gs.for_call(rows, parts(rows, n), ["ids", "mask"])
        return b and (b.rows, b.sizes)

    assert found(3, 16) == (4, (("S", 16),))
    assert found(2, 64) == (2, (("S", 64),))
    assert found(3, 64) is None  # batch 4 at 64 was not kept
    assert found(1, 32) is None  # no such length bucket
    assert gs.describe() == "CUDA graphs for batch [1, 2, 4] x 2 input shapes (5 graphs, 1 MiB)"
    # what a call would cost: the replay time of the graph it would use (None without one)
    assert gs.replay_ms(3, {"S": 16}) == 4 * 16 / 100 and gs.replay_ms(1, {"S": 64}) == 64 / 100
    assert gs.replay_ms(3, {"S": 64}) is None and gs.replay_ms(1, {"S": 32}) is None


def test_config_options():
    assert parse_config({}).cuda_graphs == "auto"  # on by default where graphs verify
    assert parse_config({"handler": {"cuda_graphs": "off"}}).cuda_graphs == "off"
    # what yaml.safe_load makes of `cuda_graphs: off` / `on` in model-config.yaml
    assert parse_config({"handler": {"cuda_graphs": False}}).cuda_graphs == "off"
    assert parse_config({"handler": {"cuda_graphs": True}}).cuda_graphs == "on"
    with pytest.raises(ConfigError, match="cuda_graphs = 'yes' is invalid: expected auto"):
        parse_config({"handler": {"cuda_graphs": "yes"}})
    with pytest.raises(ConfigError, match="cuda_graph_max_batch = 0 is invalid: expected an integer of at least 1"):
        parse_config({"handler": {"cuda_graph_max_batch": 0}})


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: replay recomputes into the static outputs."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def test_first_difference_finds_a_stale_output():
    model = lambda x: {"y": x * 2}  # noqa: E731
    x = torch.zeros(4, 3)
    out = {"y": torch.zeros(4, 3)}
    good = graphs.GraphBucket(4, FakeGraph(lambda: out["y"].copy_(x * 2)), [x], out)
    assert graphs.first_difference(model, good, None, seed=0) is None
    stale = graphs.GraphBucket(4, FakeGraph(lambda: None), [x], out)  # replay that writes nothing
    assert graphs.first_difference(model, stale, None, seed=1).startswith(
        "the graph at batch 4 replays output 'y' differing from the plain call's (max |d| ")


def bare_runner(monkeypatch, build):
    """A CudaRunner without CUDA: only what prepare() touches."""
    r = cuda_runner.CudaRunner.__new__(cuda_runner.CudaRunner)
    r.model, r.spec, r.device, r.graphs, r.pad = None, spec_of((None, 3)), None, None, None
    r.spec.dims = {}
    r.stream = types.SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(cuda_runner.graphs, "build", build)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return r


def test_auto_keeps_verified_graphs(monkeypatch):
    seen = {}

    def build(target, sizes, cap, verify, lengths):
        seen.update(sizes=sizes, cap=cap, verify=verify, lengths=lengths)
        return graphs.GraphSet({(s, ((3,),)): graphs.GraphBucket(s, None, [], {}) for s in sizes}, 5 << 20)

    r = bare_runner(monkeypatch, build)
    note = r.prepare(parse_config({"handler": {"cuda_graph_max_batch": 8}}), kind_of("aoti"))
    assert seen == {"sizes": [1, 2, 4, 8], "cap": 2048 << 20, "verify": True, "lengths": [{}]}
    assert note == "CUDA graphs for batch [1, 2, 4, 8] (4 graphs, 5 MiB)" and r.graphs.sizes == [1, 2, 4, 8]


@pytest.mark.parametrize("failure", [RuntimeError("output 'y' at batch 4 differs from the plain call"),
                                     RuntimeError("operation not permitted when stream is capturing")])
def test_auto_falls_back_and_on_fails_the_load(monkeypatch, failure):
    def build(*a, **k):
        raise failure

    r = bare_runner(monkeypatch, build)
    note = r.prepare(parse_config({}), kind_of("aoti"))
    assert note == f"no CUDA graphs (RuntimeError: {failure})" and r.graphs is None
    with pytest.raises(LoadError, match="cuda_graphs is on but this model cannot use them: RuntimeError"):
        r.prepare(parse_config({"handler": {"cuda_graphs": "on"}}), kind_of("aoti"))


def test_off_and_uncapturable_kinds_never_capture(monkeypatch):
    def build(*a, **k):
        raise AssertionError("must not capture")

    r = bare_runner(monkeypatch, build)
    assert r.prepare(parse_config({"handler": {"cuda_graphs": "off"}}), kind_of("aoti")) == "CUDA graphs off"
    assert "keep their own runtime" in r.prepare(parse_config({}), kind_of("tensorrt"))
    with pytest.raises(LoadError, match="keep their own runtime"):
        r.prepare(parse_config({"handler": {"cuda_graphs": "on"}}), kind_of("tensorrt"))


def test_fixed_shape_graphs_are_found_by_rows_alone():
    """Without named dimensions (every call has the one admitted row shape) the lookup takes the
    smallest batch bucket holding the rows, never looking at the parts; rows past the largest
    bucket run plainly."""
    buckets = {(rows, ((3, 8, 8),)): graphs.GraphBucket(rows, None, [], {}) for rows in (1, 2, 4, 8)}
    gs = graphs.GraphSet(buckets, 0, dynamic=False)
    assert [getattr(gs.for_call(n, None, ["x"]), "rows", None) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert gs.sizes == [1, 2, 4, 8] and gs.describe() == "CUDA graphs for batch [1, 2, 4, 8] (4 graphs, 0 MiB)"


def fake_cuda(monkeypatch, fail: dict):
    """graphs.build without a GPU: a capture stands in that raises `fail[(rows, sizes)]` for those
    shapes and otherwise 'captures' a replay that recomputes the model into static outputs."""
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    seen = []

    def capture(target, rows, pool, sizes=None):
        model, spec, device, _stream = target
        seen.append((rows, sizes))
        if (rows, tuple(sorted((sizes or {}).items()))) in fail:
            raise fail[(rows, tuple(sorted((sizes or {}).items())))]
        inputs = graphs._static_inputs(spec, rows, device, sizes)
        outputs = {k: v.clone() for k, v in model(*inputs).items()}

        def replay():
            for k, v in model(*inputs).items():
                outputs[k].copy_(v)

        return graphs.GraphBucket(rows, FakeGraph(replay), inputs, outputs, tuple(sorted((sizes or {}).items())))

    monkeypatch.setattr(graphs, "capture", capture)
    return seen


def test_a_shape_whose_capture_fails_runs_plain_calls_and_the_others_keep_their_graphs(monkeypatch):
    """A capture that raises for one shape (cuDNN attention refusing one size, say) leaves that
    shape to the artifact's own call, named in the load line; the other shapes keep verified
    graphs. A sticky CUDA error is never swallowed (nothing can run after it), and where every
    capture failed the runner falls back to plain calls for all (auto) or fails the load (on)."""
    from handlers.artifact.metadata import ArtifactSpec

    spec = ArtifactSpec("aoti", "m", "", "cuda", (TensorSpec("x", "float32", (None, 3)),),
                        (TensorSpec("y", "float32", (None, 3)),), "dict", 1, 8, torch.__version__)
    model = lambda x: {"y": x * 2}  # noqa: E731
    fake_cuda(monkeypatch, {(4, ()): RuntimeError("cuDNN Frontend error: mha_graph.execute(...).is_good()")})
    gs = graphs.build(graphs.Target(model, spec, None, None), [1, 2, 4, 8], 1 << 30, verify=True)
    assert gs.sizes == [1, 2, 8]
    assert gs.describe() == ("CUDA graphs for batch [1, 2, 8] (3 graphs, 0 MiB); capture failed, plain calls for "
                             "batch 4 (RuntimeError: cuDNN Frontend error: mha_graph.execute(...).is_good())")
    assert [getattr(gs.for_call(n, None, ["x"]), "rows", None) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, None, None, 8, 8]
    # the capture's own exit error carries the model's as its context: both are named. torch
    # ends every CUDA error with a hint naming device-side assertions: not a sticky error
    dsa = "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing" + dsa)
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture" + dsa)
    except RuntimeError as chained:
        fake_cuda(monkeypatch, {(1, ()): chained})
    gs = graphs.build(graphs.Target(model, spec, None, None), [1, 2], 1 << 30, verify=True)
    assert gs.sizes == [2] and gs.describe().endswith(
        "batch 1 (RuntimeError: CUDA error: operation failed due to a previous error during capture (after "
        "RuntimeError: CUDA error: operation not permitted when stream is capturing))")
    fake_cuda(monkeypatch, {(2, ()): RuntimeError("CUDA error: device-side assert triggered")})
    with pytest.raises(RuntimeError, match="device-side assert"):
        graphs.build(graphs.Target(model, spec, None, None), [1, 2, 4], 1 << 30, verify=True)
    r = bare_runner(monkeypatch, graphs.build)
    r.model, r.spec = model, spec
    fake_cuda(monkeypatch, {(2, ()): RuntimeError("no capture at 2")})
    note = r.prepare(parse_config({"handler": {"cuda_graph_max_batch": 4}}), kind_of("aoti"))
    assert note.endswith("plain calls for batch 2 (RuntimeError: no capture at 2)") and r.graphs.sizes == [1, 4]
    with pytest.raises(LoadError, match="cuda_graphs is on but .*plain calls for batch 2"):  # on: all or nothing
        r.prepare(parse_config({"handler": {"cuda_graphs": "on", "cuda_graph_max_batch": 4}}), kind_of("aoti"))
    fake_cuda(monkeypatch, {(n, ()): RuntimeError(f"no capture at {n}") for n in (1, 2)})
    note = r.prepare(parse_config({"handler": {"cuda_graph_max_batch": 2}}), kind_of("aoti"))
    assert note == "no CUDA graphs (RuntimeError: every capture failed, the first: RuntimeError: no capture at 1)"
    with pytest.raises(RuntimeError, match="device-side assert"):  # the load fails with it: a restart
        fake_cuda(monkeypatch, {(1, ()): RuntimeError("CUDA error: device-side assert triggered")})
        r.prepare(parse_config({}), kind_of("aoti"))


def test_graph_verification_replays_a_valid_request():
    """The replay-against-plain check feeds a request a client could send: ids inside their
    range (per column), masks all ones, floats random (it was 0/1 everywhere: ids outside the
    range and fully masked rows, the inputs kernels fail on)."""
    from handlers.artifact.metadata import ArtifactSpec

    spec = ArtifactSpec("aoti", "m", "", "cuda",
                        (TensorSpec("ids", "int64", (None, 6), {"min": 3, "max": 9, "source": "t"}),
                         TensorSpec("attention_mask", "int64", (None, 6)), TensorSpec("x", "float32", (None, 6))),
                        (TensorSpec("y", "float32", (None, 6)),), "dict", 1, 8, torch.__version__)
    seen = {}

    def model(ids, mask, x):
        seen.update(ids=ids.clone(), mask=mask.clone(), x=x.clone())
        return {"y": ids * mask + x}

    inputs = graphs._static_inputs(spec, 4, None)
    out = {"y": torch.zeros(4, 6)}
    bucket = graphs.GraphBucket(4, FakeGraph(lambda: out["y"].copy_(model(*inputs)["y"])), inputs, out)
    assert graphs.first_difference(model, bucket, None, seed=3, spec=spec) is None
    assert 3 <= seen["ids"].min() and seen["ids"].max() <= 9 and bool((seen["mask"] == 1).all())
    assert seen["x"].std() > 0.1


# --- the capture at load, shape by shape (graphs.build over GraphBuilder) ---

def prepared_runner(monkeypatch, fail=None, max_batch=8, mode="auto"):
    """A bare CudaRunner (no CUDA) prepared at load, captures standing in as in fake_cuda; the
    spec's model doubles its input. (runner, load-line note, shapes captured)."""
    from handlers.artifact.metadata import ArtifactSpec

    spec = ArtifactSpec("aoti", "m", "", "cuda", (TensorSpec("x", "float32", (None, 3)),),
                        (TensorSpec("y", "float32", (None, 3)),), "dict", 1, 8, torch.__version__)
    r = bare_runner(monkeypatch, graphs.build)
    r.model, r.spec = (lambda x: {"y": x * 2}), spec
    seen = fake_cuda(monkeypatch, fail or {})
    note = r.prepare(parse_config({"handler": {"cuda_graph_max_batch": max_batch, "cuda_graphs": mode}}),
                     kind_of("aoti"))
    return r, note, seen


def rows_with_graph(r, upto=9):
    return [n for n in range(1, upto) if r.graphs is not None and r.graphs.for_call(n, None, ["x"]) is not None]


def test_a_capture_out_of_memory_at_load_falls_back_and_stops(monkeypatch):
    """Out of device memory while capturing: that shape and every larger one run plainly, the
    smaller ones keep their graphs, and the load goes on."""
    r, note, seen = prepared_runner(monkeypatch, fail={(4, ()): torch.OutOfMemoryError("CUDA out of memory")})
    assert "plain calls for batch 4 (OutOfMemoryError: CUDA out of memory)" in note, note
    assert [s for s, _ in seen] == [1, 2, 4] and rows_with_graph(r) == [1, 2]


def test_on_captures_every_shape_at_load(monkeypatch):
    r, note, _ = prepared_runner(monkeypatch, max_batch=2, mode="on")
    assert note == "CUDA graphs for batch [1, 2] (2 graphs, 0 MiB)" and rows_with_graph(r, 3) == [1, 2]
