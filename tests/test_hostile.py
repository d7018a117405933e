"""Hostile input, in process (no TorchServe): every wire format's decoder and whole mixed
batches through the entry class's handle(), with the catalogue of tests/hostile.py and with
hypothesis-generated bodies. The invariant: whatever one request holds, it is answered with its
own 4xx (or its own 500 for a bug of ours), handle() never raises, and the good requests of the
same batch get correct answers. Every JSON answer parses with a strict parser.

Bounded in time: hypothesis runs a fixed number of examples without a deadline per example
(the CI machine has 2 shared cores), derandomized so CI is reproducible."""
from __future__ import annotations

import json
import math
import os
import subprocess
import time

import pytest
import torch
from hostile import JSON, JSON_CAP_MB, KINDS, ST, good_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from worker_kit import admit

from handlers.admission import Limits
from handlers.artifact.metadata import ArtifactSpec, TensorSpec
from handlers.config import parse_config
from handlers.errors import RequestError
from handlers.run.cpu import CpuRunner
from handlers.wire import safetensors_io, strict_json

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SPEC = ArtifactSpec(backend="export", artifact="m.pt2", sha256="", device="cpu",
                    inputs=(TensorSpec("features", "float32", (None, 16)), TensorSpec("mask", "bool", (None, 16))),
                    outputs=(TensorSpec("score", "float32", (None, 1)), TensorSpec("probs", "float32", (None, 16))),
                    output_structure="dict", batch_min=1, batch_max=32, torch_version=torch.__version__)
LIMITS = Limits(128 << 20, 1024, 32, True, JSON_CAP_MB << 20)


def model(features, mask):
    """Stands in for the artifact: exact and cheap. A row whose first feature is 1234.5 yields
    non-finite outputs (NaN, +inf, -inf), to test how they are written."""
    score = (features * mask).sum(1, keepdim=True)
    probs = features * 2
    bad = features[:, :1] == 1234.5
    probs = torch.where(bad, torch.tensor([float("nan")] + [float("inf"), -float("inf")] * 7 + [0.0]), probs)
    return {"score": score, "probs": probs}


def reference(f, m):
    return model(f, m)


def strict_loads(text):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def handler():
    from worker_kit import make_worker, serving_handler

    return serving_handler(make_worker(SPEC, CpuRunner(model, SPEC), LIMITS, parse_config({}), name="hostile"))


def context(content_types):
    from ts.context import Context, RequestProcessor

    ctx = Context("hostile", "/nonexistent", {"model": {"modelName": "hostile"}}, len(content_types), None, "0.12.0")
    ctx.request_processor = [RequestProcessor({"Content-Type": ct}) for ct in content_types]
    return ctx


def answer(ctx, idx, out):
    """(status, parsed body) of one answer, the JSON parsed strictly."""
    status = ctx.get_response_status(idx)[0] if ctx.request_processor[idx].get_response_status_code() else 200
    ct = ctx.get_response_content_type(idx) or ""
    if ct.startswith(ST):
        return status, safetensors_io.loads(out)
    return status, strict_loads(out if isinstance(out, str) else bytes(out).decode())


def run_batch(items):
    """items: [("good", seed) | ("bad", kind name)] -> checks every answer of one handle() call."""
    reqs, cts, expect = [], [], []
    for what, key in items:
        if what == "good":
            ct, body, f, m = good_request(key)
            expect.append((200, (f, m), ct))
        else:
            ct, body, status, needle = KINDS[key]
            expect.append((status, needle, ct))
        reqs.append({"body": bytearray(body)})
        cts.append(ct)
    ctx = context(cts)
    outs = handler().handle(reqs, ctx)
    assert len(outs) == len(items)
    for idx, (out, (status, want, ct)) in enumerate(zip(outs, expect)):
        got_status, body = answer(ctx, idx, out)
        assert got_status == status, (items[idx], body)
        if status == 200:
            ref = reference(*want)
            got = body if ct == ST else {k: torch.tensor(v) for k, v in body["outputs"].items()}
            for k in ref:
                assert torch.equal(got[k].to(ref[k].dtype), ref[k]), (items[idx], k)
        else:
            assert body["code"] == status and want in body["message"], (items[idx], body)


# ---------------------------------------------------------------- the catalogue, one by one


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_hostile_kind_is_its_own_4xx(name):
    run_batch([("good", 1), ("bad", name), ("good", 2)])


def test_catalogue_has_at_least_30_kinds():
    assert len(KINDS) >= 30


def test_every_kind_in_one_batch_with_good_neighbours():
    items = [("good", i) for i in range(4)] + [("bad", k) for k in sorted(KINDS)] + [("good", 9)]
    run_batch(items)


@given(st.lists(st.one_of(st.tuples(st.just("good"), st.integers(0, 50)),
                          st.tuples(st.just("bad"), st.sampled_from(sorted(KINDS)))), min_size=1, max_size=8))
@FUZZ
def test_mixed_batches(items):
    run_batch(items)


# ---------------------------------------------------------------- decoders under generated input

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=40)
envelopes = st.one_of(
    json_values,
    st.builds(lambda v: {"inputs": v}, json_values),
    st.builds(lambda f, m: {"inputs": {"features": f, "mask": m}}, json_values, json_values),
    st.builds(lambda v: {"instances": v}, json_values),
    st.builds(lambda items: {"inputs": items}, st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from(["features", "mask"]) | json_values, "shape": json_values | st.lists(st.integers(-3, 40), max_size=3),
         "datatype": st.sampled_from(["FP32", "BOOL", "FP64"]) | json_values, "data": json_values}), max_size=3)))


def admit_or_4xx(body: bytes, ct: str):
    try:
        a = admit({"body": bytearray(body)}, SPEC, LIMITS, ct, None)
    except RequestError as e:
        assert 400 <= e.status < 500
        strict_loads(json.dumps(e.to_dict(), allow_nan=False))
        return None
    assert list(a.tensors) == ["features", "mask"]
    assert a.tensors["features"].dtype == torch.float32 and a.tensors["mask"].dtype == torch.bool
    assert bool(torch.isfinite(a.tensors["features"]).all()) or ct == ST
    return a


@given(envelopes)
@FUZZ
def test_json_decoders_never_raise_anything_but_4xx(value):
    admit_or_4xx(json.dumps(value).encode(), JSON)  # json.dumps writes NaN/Infinity tokens too


@given(st.binary(max_size=300))
@FUZZ
def test_arbitrary_bytes_as_json_or_safetensors(blob):
    admit_or_4xx(blob, JSON)
    admit_or_4xx(blob, ST)


@given(st.dictionaries(st.sampled_from(["features", "mask", "__metadata__", "x"]), json_values, max_size=3),
       st.binary(max_size=200))
@FUZZ
def test_safetensors_headers_of_any_json(header, data):
    h = json.dumps(header).encode()
    admit_or_4xx(len(h).to_bytes(8, "little") + h + data, ST)


@given(st.integers(0, 10**6), st.integers(0, 255))
@FUZZ
def test_mutated_valid_safetensors(position, byte):
    f, m = torch.randn(2, 16), torch.ones(2, 16, dtype=torch.bool)
    blob = bytearray(safetensors_io.dumps({"features": f, "mask": m}))
    blob[position % len(blob)] = byte
    admit_or_4xx(bytes(blob), ST)


# ---------------------------------------------------------------- strict JSON out


@pytest.mark.parametrize("fmt", ["ours", "v1", "v2", "st_accept_json"])
def test_non_finite_outputs_are_written_as_strings_on_every_json_path(fmt):
    f = torch.zeros(2, 16)
    f[1, 0] = 1234.5  # the stub model's non-finite row
    m = torch.ones(2, 16, dtype=torch.bool)
    if fmt == "ours":
        body, ct, hdr = strict_json.dumps({"inputs": {"features": f.tolist(), "mask": m.tolist()}}), JSON, None
    elif fmt == "v1":
        body, ct, hdr = json.dumps({"instances": [{"features": f[i].tolist(), "mask": m[i].tolist()} for i in range(2)]}), JSON, None
    elif fmt == "v2":
        body, ct, hdr = json.dumps({"inputs": [
            {"name": "features", "shape": [2, 16], "datatype": "FP32", "data": f.reshape(-1).tolist()},
            {"name": "mask", "shape": [2, 16], "datatype": "BOOL", "data": m.reshape(-1).tolist()}]}), JSON, None
    else:
        body, ct, hdr = bytes(safetensors_io.dumps({"features": f, "mask": m})), ST, "application/json"
    from ts.context import Context, RequestProcessor

    ctx = Context("hostile", "/x", {"model": {"modelName": "hostile"}}, 1, None, "0.12.0")
    ctx.request_processor = [RequestProcessor({"Content-Type": ct, **({"Accept": hdr} if hdr else {})})]
    out = handler().handle([{"body": bytearray(body.encode() if isinstance(body, str) else body)}], ctx)[0]
    text = out if isinstance(out, str) else bytes(out).decode()
    parsed = strict_loads(text)  # no bare NaN / Infinity token anywhere
    assert '"NaN"' in text and '"Infinity"' in text and '"-Infinity"' in text, text[:300]
    import numpy as np

    probs = {"ours": lambda: parsed["outputs"]["probs"], "st_accept_json": lambda: parsed["outputs"]["probs"],
             "v1": lambda: [p["probs"] for p in parsed["predictions"]],
             "v2": lambda: np.reshape(next(o["data"] for o in parsed["outputs"] if o["name"] == "probs"), (2, 16)).tolist()}[fmt]()
    back = np.array(probs, dtype=np.float32)  # numpy reads the strings back as the values
    assert math.isnan(back[1, 0]) and back[1, 1] == np.inf and back[1, 2] == -np.inf and back[0, 0] == 0.0


def test_error_answers_are_strict_json():
    run_batch([("bad", "nan_token"), ("bad", "not_utf8"), ("bad", "st_shape_nan")])


def test_handle_never_raises_even_when_our_code_fails(monkeypatch):
    """A bug in admission or encoding fails its own request with 500; a bug outside any request
    answers every request 500; nothing escapes handle()."""
    from handlers import pipeline

    h = handler()
    calls = {"n": 0}
    real = pipeline.admit

    def flaky(request, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("bug")
        return real(request, *a, **kw)

    monkeypatch.setattr(pipeline, "admit", flaky)
    goods = [good_request(i) for i in range(3)]
    ctx = context([g[0] for g in goods])
    outs = h.handle([{"body": bytearray(g[1])} for g in goods], ctx)
    assert answer(ctx, 1, outs[1])[0] == 500 and answer(ctx, 0, outs[0])[0] == 200 and answer(ctx, 2, outs[2])[0] == 200
    monkeypatch.setattr(pipeline, "_run", lambda *a: 1 / 0)
    ctx = context([g[0] for g in goods])
    outs = h.handle([{"body": bytearray(g[1])} for g in goods], ctx)
    assert all(answer(ctx, i, o)[0] == 500 for i, o in enumerate(outs))


def test_load_failure_answers_every_request_with_the_reason(tmp_path):
    """A LoadError at initialize: the worker answers 503 ModelLoadFailed naming the cause and
    describes itself not ready (in process; tests/test_faults.py does it through TorchServe)."""
    from ts.context import Context

    from handlers.ts_entry import CompiledModelHandler

    h = CompiledModelHandler()
    ctx = Context("broken", str(tmp_path), {"model": {"modelName": "broken"}}, 1, None, "0.12.0",
                  model_yaml_config={"handler": {"crash_safe_load": False}})
    h.initialize(ctx)  # tmp_path holds no artifact.json: a LoadError
    assert h.initialized and h.worker.health.state == "load_failed" and h.worker.health.reason
    ctx = context([JSON, JSON])
    outs = h.handle([{"body": bytearray(good_request(0)[1])}] * 2, ctx)
    for i, o in enumerate(outs):
        status, body = answer(ctx, i, o)
        assert status == 503 and body["type"] == "ModelLoadFailed" and "no artifact.json" in body["message"]
    assert json.loads(h.describe_handle())["ready"] is False


@pytest.mark.server
def test_scratch_sweep_removes_only_directories_of_gone_processes(tmp_path):
    from handlers.torchserve import scratch

    root = tmp_path / scratch.ROOT_NAME
    gone = subprocess.Popen(["true"])
    gone.wait()
    for pid in (os.getpid(), gone.pid):
        (root / f"worker-{pid}" / "aotinductor_x").mkdir(parents=True)
    (root / "other").mkdir()
    assert scratch.sweep(str(root)) == [f"worker-{gone.pid}"]
    assert sorted(p.name for p in root.iterdir()) == ["other", f"worker-{os.getpid()}"]


@pytest.mark.server
def test_scratch_reaper_removes_the_directory_when_its_process_is_killed(tmp_path):
    from handlers.torchserve import scratch

    victim = subprocess.Popen(["sleep", "60"])
    d = tmp_path / f"worker-{victim.pid}"
    (d / "aotinductor_y").mkdir(parents=True)
    scratch._start_reaper(victim.pid, str(d))
    victim.kill()
    victim.wait()
    deadline = time.time() + 10
    while d.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert not d.exists()


# ---------------------------------------------------------------- device faults, simulated on CPU


def test_out_of_memory_fails_only_its_request(monkeypatch):
    """torch.OutOfMemoryError for a call of more than 2 rows: the batch is retried request by
    request, the 3-row request gets 507 OutOfMemory, the others their answers (the real CUDA
    case: tests/test_faults_gpu.py)."""
    h = handler()

    def picky(features, mask):
        if features.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 GiB")
        return model(features, mask)

    h.worker.loaded.runner = CpuRunner(picky, SPEC)
    goods = [good_request(0), good_request(3), good_request(2)]  # 1, 1 and 3 rows
    ctx = context([g[0] for g in goods])
    outs = h.handle([{"body": bytearray(g[1])} for g in goods], ctx)
    got = [answer(ctx, i, o) for i, o in enumerate(outs)]
    assert [s for s, _ in got] == [200, 200, 507]
    assert got[2][1]["type"] == "OutOfMemory" and "out of device memory" in got[2][1]["message"]


def test_sticky_device_error_answers_then_exits(monkeypatch):
    from handlers.torchserve import restart

    exits = []
    monkeypatch.setattr(restart, "exit_soon", lambda reason, delay_s=0: exits.append(reason))
    h = handler()

    def broken(features, mask):
        raise RuntimeError("CUDA error: device-side assert triggered")

    h.worker.loaded.runner = CpuRunner(broken, SPEC)
    goods = [good_request(0), good_request(2)]
    ctx = context([g[0] for g in goods])
    outs = h.handle([{"body": bytearray(g[1])} for g in goods], ctx)
    assert [answer(ctx, i, o)[0] for i, o in enumerate(outs)] == [500, 500] and len(exits) == 1
    ctx = context([goods[0][0]])
    later = h.handle([{"body": bytearray(goods[0][1])}], ctx)
    status, body = answer(ctx, 0, later[0])
    assert status == 503 and body["type"] == "WorkerRestarting"
    assert json.loads(h.describe_handle())["ready"] is False


@pytest.mark.server
def test_torchserve_profiler_switch_writes_a_trace_per_batch(monkeypatch, tmp_path):
    """ENABLE_TORCH_PROFILER, read as TorchServe's BaseHandler reads it: each batch is profiled
    and its trace written under PROFILE_ROOT/MODEL; the answers stay the same."""
    from handlers.torchserve import stage_timings

    monkeypatch.setenv("ENABLE_TORCH_PROFILER", "true")
    monkeypatch.setattr(stage_timings, "PROFILE_ROOT", str(tmp_path))
    h = handler()
    h.worker.profile = stage_timings.batch_profiler(h.worker.name)
    goods = [good_request(i) for i in range(2)]
    ctx = context([g[0] for g in goods])
    outs = h.handle([{"body": bytearray(g[1])} for g in goods], ctx)
    assert all(answer(ctx, i, o)[0] == 200 for i, o in enumerate(outs))
    traces = list((tmp_path / "hostile").glob("*.pt.trace.json"))
    assert len(traces) == 1 and "handler.run" in traces[0].read_text()
    monkeypatch.delenv("ENABLE_TORCH_PROFILER")
    assert stage_timings.batch_profiler("hostile") is None
