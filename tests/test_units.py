"""Unit tests of single functions (no TorchServe): device resolution, relocation check,
staging buffers, batch planning, configuration, wire formats."""
import json

import pytest
import torch

from handlers import safetensors_io
from handlers.admission import Limits, admit
from handlers.batch import plan_chunks, warmup_sizes
from handlers.config import parse_config
from handlers.device import resolve_placement
from handlers.errors import (ConfigError, IncompatibleArtifact, LoadError, PayloadTooLarge, RequestError,
                             UnsupportedMediaType)
from handlers.kinds import KINDS
from handlers.metadata import ArtifactSpec, TensorSpec
from handlers.relocate import leftovers, relocate
from handlers.run.cuda import upload
from handlers.stage import StagingBuffers
from handlers.wire import WireName

# ---------------------------------------------------------------- device resolution


def place(**kw):
    base = dict(gpu_id=None, device_type=None, artifact_device="cpu", backend="aoti",
                cuda_available=False, device_count=0, visible_devices=None)
    base.update(kw)
    return resolve_placement(relocatable=KINDS[base["backend"]].relocatable, **base)


GPU = dict(cuda_available=True, device_count=2)


# Workers as TorchServe and the machine present them.
WORKERS = {
    "gpu1": dict(gpu_id=1, cuda_available=True, device_count=2),  # TorchServe assigned GPU 1
    "cpu": dict(gpu_id=None, cuda_available=False, device_count=0),  # CPU-only host
    "no_gpu_id": dict(gpu_id=None, cuda_available=True, device_count=2),  # GPUs, none assigned
    "id_no_cuda": dict(gpu_id=0, cuda_available=False, device_count=0),  # gpu_id, CPU build of torch
}
NATIVE = ("aoti", "aoti_so", "tensorrt")
ALL = NATIVE + ("export",)
CUDA1 = ("cuda", 1)
# Refusals: the phrase that says why.
NO_CUDA = "demands deviceType: gpu, but CUDA is not available"
NONE_ASSIGNED = "demands deviceType: gpu, but TorchServe assigned no GPU"
SAYS_CPU = "compiled for CUDA and cannot run on the CPU, but model-config.yaml says deviceType: cpu"
HAS_NO_GPU = "compiled for CUDA and cannot run on the CPU, but this worker has no GPU"
CPU_KERNELS = "compiled for the CPU and holds only CPU kernels"

# (worker, artifact device, deviceType, backends) -> expected: "cpu", ("cuda", index) or a
# refusal phrase. Written out case by case from the README's placement rules, not computed.
PLACEMENT_TABLE = [
    ("gpu1", "cuda", None, ALL, CUDA1),
    ("gpu1", "cuda", "gpu", ALL, CUDA1),
    ("gpu1", "cuda", "cpu", ALL, SAYS_CPU),
    ("gpu1", "cpu", None, NATIVE, "cpu"),  # native CPU kernels stay on the CPU
    ("gpu1", "cpu", None, ("export",), CUDA1),  # a CPU-exported program is relocated
    ("gpu1", "cpu", "cpu", ALL, "cpu"),
    ("gpu1", "cpu", "gpu", NATIVE, CPU_KERNELS),
    ("gpu1", "cpu", "gpu", ("export",), CUDA1),
    ("cpu", "cuda", None, ALL, HAS_NO_GPU),
    ("cpu", "cuda", "cpu", ALL, SAYS_CPU),
    ("cpu", "cuda", "gpu", ALL, NO_CUDA),
    ("cpu", "cpu", None, ALL, "cpu"),
    ("cpu", "cpu", "cpu", ALL, "cpu"),
    ("cpu", "cpu", "gpu", ALL, NO_CUDA),
    ("no_gpu_id", "cuda", None, ALL, HAS_NO_GPU),
    ("no_gpu_id", "cuda", "cpu", ALL, SAYS_CPU),
    ("no_gpu_id", "cuda", "gpu", ALL, NONE_ASSIGNED),
    ("no_gpu_id", "cpu", None, ALL, "cpu"),
    ("no_gpu_id", "cpu", "cpu", ALL, "cpu"),
    ("no_gpu_id", "cpu", "gpu", ALL, NONE_ASSIGNED),
    ("id_no_cuda", "cuda", None, ALL, HAS_NO_GPU),
    ("id_no_cuda", "cuda", "cpu", ALL, SAYS_CPU),
    ("id_no_cuda", "cuda", "gpu", ALL, NO_CUDA),
    ("id_no_cuda", "cpu", None, ALL, "cpu"),
    ("id_no_cuda", "cpu", "cpu", ALL, "cpu"),
    ("id_no_cuda", "cpu", "gpu", ALL, NO_CUDA),
]
PLACEMENT_CASES = [(w, a, d, b, want) for w, a, d, backends, want in PLACEMENT_TABLE for b in backends]


def test_placement_table_covers_every_combination():
    keys = [(w, a, d, b) for w, a, d, b, _ in PLACEMENT_CASES]
    assert len(keys) == len(set(keys)) == len(WORKERS) * 2 * 3 * len(ALL)


@pytest.mark.parametrize("worker,artifact_device,device_type,backend,want", PLACEMENT_CASES,
                         ids=lambda v: str(v))
def test_placement(worker, artifact_device, device_type, backend, want):
    """Every combination has one required outcome: a placement, or a refusal naming why and
    the fix. A refusal where a placement is expected fails, and the other way round."""
    kw = dict(device_type=device_type, artifact_device=artifact_device, backend=backend, **WORKERS[worker])
    if isinstance(want, str) and want != "cpu":
        with pytest.raises(IncompatibleArtifact) as e:
            place(**kw)
        assert want in str(e.value) and "Fix:" in str(e.value), str(e.value)
        return
    p = place(**kw)
    assert (p.kind, p.index) == (("cpu", None) if want == "cpu" else want), p


def test_cuda_artifact_on_cpu_worker_names_the_fix():
    with pytest.raises(IncompatibleArtifact, match="compiled for CUDA.*--device cpu"):
        place(artifact_device="cuda")


def test_cpu_native_artifact_when_gpu_demanded():
    with pytest.raises(IncompatibleArtifact, match="holds only CPU kernels"):
        place(device_type="gpu", gpu_id=0, **GPU)


def test_cpu_artifact_on_gpu_worker_without_demand_runs_on_cpu():
    p = place(gpu_id=1, **GPU)
    assert p.kind == "cpu" and "left unused" in p.note


def test_cuda_visible_devices_remaps_physical_ids():
    p = place(gpu_id=3, artifact_device="cuda", cuda_available=True, device_count=2, visible_devices="2,3")
    assert (p.kind, p.index) == ("cuda", 1)
    with pytest.raises(IncompatibleArtifact, match="sees 2 CUDA device"):
        place(gpu_id=5, artifact_device="cuda", cuda_available=True, device_count=2, visible_devices="2,3")


# ---------------------------------------------------------------- relocation


class DeviceArgs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("shift", torch.ones(4))
        self.const = torch.tensor(2.0)

    def forward(self, x):
        return self.lin(x) + torch.arange(4, device=x.device) + torch.ones(4, device=x.device) * self.const + self.shift


def exported():
    return torch.export.export(DeviceArgs().eval(), (torch.randn(2, 4),))


def test_graph_has_device_arguments_to_relocate():
    ep = exported()
    left = leftovers(ep, torch.device("meta"))
    kinds = " ".join(left)
    assert "state_dict['lin.weight']" in kinds and "state_dict['shift']" in kinds
    assert "constant" in kinds and "argument device=cpu" in kinds


def test_relocation_moves_everything():
    moved = relocate(exported(), torch.device("meta"))
    assert leftovers(moved, torch.device("meta")) == []
    devs = {torch.device(n.kwargs["device"]) for n in moved.graph.nodes if "device" in n.kwargs}
    assert devs == {torch.device("meta")}


def test_relocation_check_names_what_stayed_behind(monkeypatch):
    import torch.export.passes as passes

    def partial(ep, device):  # moves parameters only: graph kwargs and constants stay behind
        for k, v in list(ep.state_dict.items()):
            ep.state_dict[k] = v.to(device)
        return ep

    monkeypatch.setattr(passes, "move_to_device_pass", partial)
    with pytest.raises(LoadError, match=r"left \d+ item\(s\) behind:.*argument device=cpu"):
        relocate(exported(), torch.device("meta"))


def test_string_device_kwargs_are_checked():
    ep = relocate(exported(), torch.device("meta"))
    node = next(n for n in ep.graph.nodes if "device" in n.kwargs)
    node.kwargs = {**node.kwargs, "device": "cpu"}  # a string left behind
    assert any("argument device=cpu" in x for x in leftovers(ep, torch.device("meta")))


# ---------------------------------------------------------------- staging


def test_staging_reuses_and_grows():
    s = StagingBuffers(pinned=False)
    a = s.stage("x", [torch.ones(2, 3), torch.full((1, 3), 2.0)], run_rows=4)
    assert a.shape == (4, 3) and a[3].abs().sum() == 0 and a[2, 0] == 2.0
    ptr, grows = a.data_ptr(), s.grows
    b = s.stage("x", [torch.ones(3, 3)], run_rows=3)
    assert b.data_ptr() == ptr and s.grows == grows  # reused: no new allocation
    c = s.stage("x", [torch.ones(10, 3)], run_rows=10)
    assert s.grows == grows + 1 and c.shape == (10, 3)
    d = s.stage("x", [torch.ones(9, 3)], run_rows=9)
    assert d.data_ptr() == c.data_ptr() and s.grows == grows + 1
    s.stage("x", [torch.ones(2, 3, dtype=torch.float16)], run_rows=2)
    assert s.grows == grows + 2  # a dtype change reallocates


@pytest.mark.parametrize("piece_bytes", [0, 1, 3 * 4 * 4, 5 * 4 * 4, 1 << 20])
def test_piecewise_upload_assembles_every_row(piece_bytes, monkeypatch):
    """The pipelined upload (CUDA path) is pure copy logic: run it against a CPU 'device' and
    check every row lands in place, whatever the piece size against the request sizes."""
    sent = []
    real_copy = torch.Tensor.copy_

    def spy(self, src, non_blocking=False):
        if non_blocking:
            sent.append(src.shape[0])
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    s = StagingBuffers(pinned=False)
    parts = [torch.arange(i * 40, i * 40 + n * 4, dtype=torch.float32).reshape(n, 4)
             for i, n in enumerate([1, 7, 2, 5])]
    dev = torch.empty(18, 4)
    upload(s, "x", parts, dev, piece_bytes=piece_bytes)
    assert torch.equal(dev[:15], torch.cat(parts)) and not dev[15:].any()
    assert sum(sent) == 15
    step = max(1, piece_bytes // 16) if piece_bytes else 18
    assert all(n == step for n in sent[:-1]) and 0 < sent[-1] <= step
    # the next request reuses the pinned buffer and sees none of the old rows
    again = torch.empty(2, 4)
    upload(s, "x", [torch.ones(2, 4)], again, piece_bytes=piece_bytes)
    assert torch.equal(again, torch.ones(2, 4)) and s.grows == 1


def test_rows_of_cuts_across_requests_without_copying():
    from handlers.batch import rows_of

    reqs = [{"x": torch.arange(n * 2).reshape(n, 2) + 100 * i} for i, n in enumerate([3, 1, 4])]
    parts = rows_of(reqs, ["x"], 2, 4)["x"]
    assert [p.shape[0] for p in parts] == [1, 1, 2]
    assert parts[0].data_ptr() == reqs[0]["x"][2].data_ptr()  # a view, not a copy
    assert torch.equal(torch.cat(parts), torch.cat([r["x"] for r in reqs])[2:6])


def test_cpu_runner_touches_no_cuda(monkeypatch):
    from handlers.run import runner_for

    def boom(*a, **k):
        raise AssertionError("CUDA API used on the CPU path")

    monkeypatch.setattr(torch.cuda, "Stream", boom)
    monkeypatch.setattr(torch.cuda, "Event", boom)
    monkeypatch.setattr(torch.cuda, "current_stream", boom)
    spec = make_spec(batch_min=1, batch_max=3)
    model = lambda x: {"y": x * 2}  # noqa: E731
    ex = runner_for(model, spec, torch.device("cpu"))
    out = ex.run([{"x": torch.ones(2, 4)}, {"x": torch.full((2, 4), 3.0)}])
    assert out[0]["y"].tolist() == [[2.0] * 4] * 2 and out[1]["y"].tolist() == [[6.0] * 4] * 2
    assert not ex.inputs.pinned
    # 7 rows over a max of 3: three calls, every request still gets exactly its rows
    reqs = [{"x": torch.full((n, 4), float(i))} for i, n in enumerate([2, 4, 1])]
    out = ex.run(reqs)
    assert [o["y"].shape[0] for o in out] == [2, 4, 1]
    assert all(torch.equal(o["y"], r["x"] * 2) for o, r in zip(out, reqs))


# ---------------------------------------------------------------- batching


def test_plan_chunks():
    assert [(c.start, c.rows, c.run_rows) for c in plan_chunks(10, 2, 4)] == [(0, 4, 4), (4, 4, 4), (8, 2, 2)]
    assert [(c.rows, c.run_rows) for c in plan_chunks(1, 2, 4)] == [(1, 2)]
    assert [(c.rows, c.run_rows) for c in plan_chunks(6, 4, 4)] == [(4, 4), (2, 4)]


def test_warmup_sizes():
    assert warmup_sizes(1, 16) == [1, 2, 4, 8, 16]
    assert warmup_sizes(4, 4) == [4]
    assert len(warmup_sizes(1, 1024)) <= 5 and warmup_sizes(1, 1024)[-1] == 1024
    with pytest.raises(ValueError, match="outside"):
        warmup_sizes(1, 8, (16,))


# ---------------------------------------------------------------- config


def test_config_parses_and_rejects_with_fix():
    c = parse_config({"deviceType": "gpu", "handler": {"stream_priority": -1, "warmup": "false"}})
    assert c.device_type == "gpu" and c.stream_priority == -1 and c.warmup is False
    with pytest.raises(ConfigError, match="unknown handler option.*strem_priority.*valid options"):
        parse_config({"handler": {"strem_priority": 1}})
    with pytest.raises(ConfigError, match="max_rows_per_request.*integer"):
        parse_config({"handler": {"max_rows_per_request": "lots"}})
    with pytest.raises(ConfigError, match="deviceType"):
        parse_config({"deviceType": "neuron"})
    assert parse_config({"handler": {"staging_piece_mb": 0}}).staging_piece_mb == 0.0
    assert parse_config({}).float32_matmul_precision == "highest"
    with pytest.raises(ConfigError, match="float32_matmul_precision.*highest.*high.*medium"):
        parse_config({"handler": {"float32_matmul_precision": "tf32"}})
    with pytest.raises(ConfigError, match="staging_piece_mb must be 0"):
        parse_config({"handler": {"staging_piece_mb": -2}})
    assert parse_config({}).stage_metrics_s == 1.0 and parse_config({"handler": {"stage_metrics_s": 0}}).stage_metrics_s == 0
    with pytest.raises(ConfigError, match="stage_metrics_s must be 0 .*or a positive number of seconds"):
        parse_config({"handler": {"stage_metrics_s": -1}})


def test_shipped_log4j2_xml_is_well_formed_and_named_by_both_configs():
    """log4j falls back to logging nothing useful when its file does not parse (and says so only
    on the frontend's stdout), so the file must parse; both configs must name it."""
    import xml.etree.ElementTree as ET
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    loggers = {e.get("name"): e for e in ET.parse(root / "log4j2.xml").getroot().iter("Logger")}
    assert loggers["org.pytorch.serve"].get("level") == "info"
    assert loggers["ACCESS_LOG"].get("level") == "info"
    assert all(e.get("additivity") == "false" for e in loggers.values() if e.find("AppenderRef") is not None)
    assert "vmargs=-Dlog4j.configurationFile=log4j2.xml\n" in (root / "config.properties").read_text()


# ---------------------------------------------------------------- stage timings


def test_stage_times_emit_means_at_most_once_per_interval():
    from handlers.stage_timings import StageTimes

    now, got = [100.0], []
    st = StageTimes(lambda name, ms: got.append((name, ms)), 1.0, clock=lambda: now[0])
    st.record(decode=1.0, run=10.0, encode=2.0)  # the first batch emits
    assert got == [("HandlerDecodeTime", 1.0), ("HandlerRunTime", 10.0), ("HandlerEncodeTime", 2.0)]
    got.clear()
    now[0] += 0.4
    st.record(decode=2.0, run=20.0, encode=4.0)
    now[0] += 0.4
    st.record(decode=4.0)  # a batch refused in admission: decode only
    assert got == []  # 0.8 s since the last emission
    now[0] += 0.2
    st.record(decode=6.0, run=30.0, encode=8.0)
    # means over the batches since the last emission, each stage over the batches that had it
    assert got == [("HandlerDecodeTime", 4.0), ("HandlerRunTime", 25.0), ("HandlerEncodeTime", 6.0)]
    got.clear()
    st.record(decode=1.0)
    st.reset()  # forgotten, never emitted
    now[0] += 5
    st.record(run=3.0)
    assert got == [("HandlerRunTime", 3.0)]


def test_stage_times_every_batch_with_zero_interval():
    from handlers.stage_timings import StageTimes

    got = []
    st = StageTimes(lambda name, ms: got.append(name), 0.0, clock=lambda: 5.0)
    for _ in range(3):
        st.record(decode=1.0, run=1.0, encode=1.0)
    assert got == ["HandlerDecodeTime", "HandlerRunTime", "HandlerEncodeTime"] * 3


def test_stage_labels_only_while_a_profiler_records():
    from torch.profiler import profile

    from handlers.stage_timings import label

    with label("run"):  # no profiler: a plain no-op context
        torch.ones(2).add_(1)
    with profile() as prof:
        with label("run"):
            torch.ones(2).add_(1)
        with label("encode"):
            pass
    names = {e.name for e in prof.events()}
    assert {"handler.run", "handler.encode"} <= names, sorted(names)[:20]


# ---------------------------------------------------------------- wire formats


def make_spec(batch_min=1, batch_max=8):
    return ArtifactSpec(backend="export", artifact="model.pt2", sha256="", device="cpu",
                        inputs=(TensorSpec("x", "float32", (None, 4)),),
                        outputs=(TensorSpec("y", "float32", (None, 4)),), output_structure="dict",
                        batch_min=batch_min, batch_max=batch_max, torch_version=torch.__version__)


def test_safetensors_roundtrip_all_dtypes():
    ts = {f"t{i}": (torch.arange(6) % 2).to(dt).reshape(2, 3) for i, dt in enumerate(
        [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool])}
    back = safetensors_io.loads(safetensors_io.dumps(ts))
    for k, v in ts.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def test_safetensors_dumps_strided_and_empty_tensors_and_reads_both_buffer_kinds():
    # Outputs may be views (transposed, sliced rows): their bytes must be written in logical
    # order from memory that is still alive when copied.
    g = torch.Generator().manual_seed(1)
    ts = {"t": torch.randn(3, 4, generator=g).t(), "s": torch.randn(5, 6, generator=g).half()[:, ::2],
          "e": torch.zeros(0, 3), "z": torch.tensor(2.5)}
    blob = safetensors_io.dumps(ts)
    assert isinstance(blob, bytearray)  # TorchServe sends bytearray responses without a copy
    for payload in (blob, bytes(blob)):  # TorchServe hands bodies as bytearray; clients as bytes
        back = safetensors_io.loads(payload)
        for k, v in ts.items():
            assert back[k].shape == v.shape and torch.equal(back[k], v), k


def test_safetensors_rejects_lying_offsets():
    blob = bytearray(safetensors_io.dumps({"x": torch.ones(2, 4)}))
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header["x"]["data_offsets"] = [0, 10_000]
    h = json.dumps(header).encode()
    bad = len(h).to_bytes(8, "little") + h + bytes(blob[8 + n:])
    with pytest.raises(RequestError, match="data_offsets"):
        safetensors_io.loads(bad)
    with pytest.raises(RequestError, match="header length"):
        safetensors_io.loads((10**9).to_bytes(8, "little") + b"{}")


def limits(max_body_bytes=1 << 30, max_rows=1024, batch_max=8, split_oversized=True):
    return Limits(max_body_bytes, max_rows, batch_max, split_oversized)


def decode(request, spec, content_type=None, max_rows=1024, accept=None):
    return admit(request, spec, limits(max_rows=max_rows, batch_max=spec.batch_max), content_type, accept)


@pytest.mark.parametrize("body", [3, True, None], ids=repr)
def test_decode_json_scalar_body_is_a_400_naming_the_object_rule(body):
    with pytest.raises(RequestError, match="JSON body must be an object"):
        decode({"body": body}, make_spec(), content_type="application/json")


def test_decode_json_int_values_are_accepted_as_floats():
    d = decode({"body": {"inputs": {"x": [[1, 2, 3, 4]]}}}, make_spec())
    assert d.tensors["x"].dtype == torch.float32 and d.rows == 1


def test_decode_limits_rows_per_request():
    with pytest.raises(PayloadTooLarge, match="at most 2 per request"):
        decode({"body": {"inputs": {"x": [[0.0] * 4] * 3}}}, make_spec(), max_rows=2)


def test_admission_limits_body_size_and_unsplit_rows():
    body = safetensors_io.dumps({"x": torch.ones(3, 4)})
    with pytest.raises(PayloadTooLarge, match="handler.max_body_mb") as e:
        admit({"body": body}, make_spec(), limits(max_body_bytes=len(body) - 1))
    assert e.value.status == 413
    with pytest.raises(PayloadTooLarge, match="at most 2 per call"):
        admit({"body": body}, make_spec(batch_max=2), limits(batch_max=2, split_oversized=False))
    assert admit({"body": body}, make_spec(batch_max=2), limits(batch_max=2)).rows == 3


def test_decode_media_type():
    with pytest.raises(UnsupportedMediaType) as e:
        decode({"body": b"abc"}, make_spec(), content_type="image/jpeg")
    assert e.value.status == 415
    d = decode({"body": safetensors_io.dumps({"x": torch.ones(1, 4)})}, make_spec(),
               content_type="application/octet-stream")
    assert d.wire.name == WireName.SAFETENSORS


def test_response_format_follows_accept():
    st = safetensors_io.dumps({"x": torch.ones(1, 4)})
    ours = {"body": {"inputs": {"x": [[1.0] * 4]}}}
    v1 = {"body": {"instances": [[1.0] * 4]}}
    assert decode({"body": st}, make_spec(), accept="application/json").respond_as.name == WireName.OURS_JSON
    assert decode({"body": st}, make_spec(), accept="*/*").respond_as.name == WireName.SAFETENSORS
    assert decode(v1, make_spec(), accept="application/json").respond_as.name == WireName.KSERVE_V1
    assert decode(ours, make_spec(), accept=safetensors_io.CONTENT_TYPE).respond_as.name == WireName.SAFETENSORS
    body, ct, _ = decode(v1, make_spec()).encode({"y": torch.ones(1, 4)}, "m")
    assert ct == "application/json" and json.loads(body) == {"predictions": [[1.0] * 4]}


@pytest.mark.parametrize("option,expected", [(None, "highest"), ("high", "high")])
def test_load_restores_fp32_matmul_precision(artifacts, option, expected):
    """TorchServe's base_handler sets TF32 ("high") on import when it sees an Ampere+ GPU; the
    handler puts back what the archive asks for (torch's default unless configured). Uses
    TorchServe's own Context class."""
    from ts.context import Context

    from handlers.ts_entry import CompiledModelHandler

    opts = {"crash_safe_load": False, "warmup": False}
    if option:
        opts["float32_matmul_precision"] = option
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # stands in for what base_handler did
    try:
        ctx = Context("p", str(artifacts.get("cls_export")), {"model": {"modelName": "p"}}, 1, None, "0.12.0",
                      model_yaml_config={"handler": opts})
        CompiledModelHandler().initialize(ctx)
        assert torch.get_float32_matmul_precision() == expected
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("buckets,batches,json_mb,cap", [
    ([1, 2, 4], [4, 2], 8.0, None),
    ([], [16, 8, 4, 2], 8.0, None),
    ([], [2], 0.001, 30_000),  # 12.4 KB bodies: no JSON under 1 KB, batches up to 30 KB
])
def test_warm_up_request_path_covers_graph_buckets_and_ends_on_the_binary_path(artifacts, monkeypatch,
                                                                               buckets, batches, json_mb, cap):
    """The request-path warm-up sends one JSON request, then a binary batch at every bucket the
    runner reports (CUDA graph buckets; stood in for here, a CPU runner has none) or, without
    buckets, at the warm-up sizes (1..16 for this artifact), largest first, up to a byte cap,
    and ends with the smallest binary batch, 8 times (JSON only where max_json_mb admits it), so the fast path is what the caches hold and what the
    interpreter has specialized. Uses TorchServe's own Context class and a real exported
    artifact."""
    from ts.context import Context

    from handlers import safetensors_io
    from handlers.run.cpu import CpuRunner
    from handlers.pipeline import request_headers as _headers
    from handlers.ts_entry import CompiledModelHandler

    monkeypatch.setattr(CpuRunner, "bucket_sizes", lambda self: buckets)
    if cap:
        monkeypatch.setattr("handlers.startup.WARMUP_BATCH_BYTES", cap)
    seen = []
    real_handle = CompiledModelHandler.handle

    def handle(self, data, context):
        cts = {_headers(context, i, "content-type")[0] for i in range(len(data))}
        out = real_handle(self, data, context)
        seen.append((len(data), cts.pop(), [context.get_response_status(i)[0] for i in range(len(data))]))
        return out

    monkeypatch.setattr(CompiledModelHandler, "handle", handle)
    ctx = Context("p", str(artifacts.get("cls_export")), {"model": {"modelName": "p"}}, 1, None, "0.12.0",
                  model_yaml_config={"handler": {"crash_safe_load": False, "max_json_mb": json_mb}})
    h = CompiledModelHandler()
    h.initialize(ctx)
    assert h.load_error is None and (h.spec.batch_min, h.spec.batch_max) == (1, 16)
    st = safetensors_io.CONTENT_TYPE
    json_case = [(1, "application/json")] if json_mb >= 1 else []
    assert [(n, ct) for n, ct, _ in seen] == json_case + [(n, st) for n in batches] + [(1, st)] * 8
    assert all(s in (None, 200) for _, _, statuses in seen for s in statuses)
    assert ctx.request_ids is None  # the batch state TorchServe set (none before a request) is back


def test_load_lists_every_process_wide_change_it_made(artifacts, caplog):
    """handlers/process.py: the load logs one line naming each change to the process (the
    environment, torch's global state, signal handlers), recorded where it is made."""
    import logging
    import os

    from ts.context import Context

    from handlers import process
    from handlers.ts_entry import CompiledModelHandler

    ctx = Context("p", str(artifacts.get("cls_export")), {"model": {"modelName": "p"}}, 1, None, "0.12.0",
                  model_yaml_config={"handler": {"crash_safe_load": False, "warmup": False}})
    with caplog.at_level(logging.INFO, logger="handlers.startup"):
        CompiledModelHandler().initialize(ctx)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("process-wide changes: ")]
    assert len(lines) == 1 and lines[0] == "process-wide changes: " + process.describe()
    for what in ("TS_DECODE_INPUT_REQUEST: false", "TMPDIR and tempfile.tempdir: ", "torch thread pools: intra-op ",
                 f"torch fp32 matmul precision: {torch.get_float32_matmul_precision()}"):
        assert what in lines[0], (what, lines[0])
    assert os.environ["TMPDIR"] in lines[0]
