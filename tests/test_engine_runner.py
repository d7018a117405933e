"""handlers/engine/runner.py: a worker's batch through the engine. The requests of one shape go as
one job (one Infer, their rows one after the other), each request gets exactly its own rows,
padding is applied by the worker and cut back, a job that fails for a request's own fault is
sent again one request at a time so only that request fails, and a dead engine answers every
request 503 at once. The engine runs in process (InProcessEngine) on its own loop thread."""
import pytest
import torch

import engine_kit as kit
from handlers.batch import PadPlan
from handlers.engine.client import InProcessEngine
from handlers.engine.core import Engine, start
from handlers.engine.model import module_runner, module_spec
from handlers.engine.runner import EngineRunner
from handlers.errors import EngineDead, ServingError


@pytest.fixture
def served():
    model = kit.Recorder()
    engine = Engine(kit.runner(model))
    thread, stop = start(engine)
    client = InProcessEngine(engine, "w", 1 << 16, 1 << 16)
    runner = EngineRunner(client, kit.runner(model).spec, reconnect=lambda: client)
    yield model, runner, client
    stop.set()
    thread.join(5)
    client.close()


def check(model, req, outputs):
    for name, want in kit.expected(model, req).items():
        assert outputs[name].shape == want.shape and torch.allclose(outputs[name], want, atol=1e-5), name


def test_a_batch_of_one_shape_is_one_job_and_each_request_gets_its_rows(served):
    model, runner, client = served
    reqs = [kit.request(rows, seed) for rows, seed in ((1, 0), (3, 1), (2, 2))]
    outs = runner.run(reqs)
    assert model.calls == [6]  # one call of the three requests' rows
    for req, out in zip(reqs, outs):
        check(model, req, out)
    assert client.session.held  # the rows stay the engine's until the next run releases them
    runner.run([kit.request(1, 3)])
    assert len(client.session.held) == 1


def test_a_bad_request_fails_alone_and_the_others_are_answered(served):
    model, runner, _ = served
    reqs = [kit.request(2, 0), kit.request(1, 1, bad=True), kit.request(3, 2)]
    outs = runner.run(reqs)
    assert isinstance(outs[1], ServingError) and outs[1].status == 400, outs[1]
    check(model, reqs[0], outs[0])
    check(model, reqs[2], outs[2])


class Doubler(torch.nn.Module):
    """Each position of ids on its own (padding leaves the real positions unchanged); records the
    length of every call."""

    def __init__(self):
        super().__init__()
        self.lengths = []

    def forward(self, ids):
        self.lengths.append(ids.shape[1])
        return ids * 2


@pytest.fixture
def doubled():
    """A Doubler behind an in-process engine, and a worker's runner of it padding ids (named
    dimension S, 1..16) to their buckets: (model, client, runner(): made after a test sets
    client.ready, as a worker makes its runner once connected)."""
    model = Doubler()
    spec = module_spec({"ids": (torch.int64, ("S",))}, {"out": (torch.int64, ("S",))}, batch_max=64)
    spec = type(spec)(**{**spec.__dict__, "dims": {"S": (1, 16)}})
    engine = Engine(module_runner(model, {"ids": (torch.int64, (None,))}, {"out": (torch.int64, (None,))}, 64))
    thread, stop = start(engine)
    client = InProcessEngine(engine, "w", 1 << 16, 1 << 16)
    yield model, client, lambda: EngineRunner(client, spec, reconnect=lambda: client, pad=PadPlan.of(spec, {"ids": 0}, ()))
    stop.set()
    thread.join(5)
    client.close()


def test_the_worker_pads_to_buckets_sends_one_job_per_bucket_and_cuts_back(doubled):
    model, _, runner = doubled
    reqs = [{"ids": torch.arange(n).view(1, n) + 1} for n in (3, 4, 7, 16)]
    outs = runner().run(reqs)
    for req, out in zip(reqs, outs):
        assert torch.equal(out["out"], req["ids"] * 2)
    assert sorted(model.lengths) == [4, 8, 16]  # 3 and 4 share the bucket 4: one job


@pytest.mark.parametrize("two_rows_ms, lengths", [(0.06, [16]), (5.0, [4, 8, 16])])
def test_the_engines_replay_times_decide_which_buckets_the_worker_sends_as_one_job(doubled, two_rows_ms, lengths):
    """The engine's Ready carries its graphs' replay times (as a msgpack frame would): where one
    job at the longest bucket costs less than one per bucket (each job's fixed 0.2 ms), the worker
    pads the whole batch to it; where a replay of more rows is dear, the groups stay apart."""
    from handlers.engine import protocol as p
    from handlers.engine.serve import replay_costs
    from handlers.run.graphs import ReplayTable

    table = ReplayTable([((("S", s),), rows, 0.05 if rows == 1 else two_rows_ms) for s in (4, 8, 16)
                         for rows in (1, 2, 4)])
    graphs = type("Graphs", (), {"table": table})()
    ready = p.Ready("engine", 1, 64, costs=replay_costs(type("R", (), {"graphs": graphs})()))
    model, client, runner = doubled
    client.ready = p.Decoder().feed(p.Encoder().frame(ready))[0]  # over the wire
    reqs = [{"ids": torch.arange(n).view(1, n) + 1} for n in (3, 7, 16)]
    outs = runner().run(reqs)
    for req, out in zip(reqs, outs):
        assert torch.equal(out["out"], req["ids"] * 2)  # cut back to each request's length
    assert sorted(model.lengths) == lengths


def test_the_workers_description_shows_its_engine_and_is_not_ready_while_the_engine_is_gone(served):
    """handlers/worker.py describe (the management API's customized description, which the pod's
    readiness reads) from the runner's engine_state."""
    from types import SimpleNamespace
    from handlers.worker import Worker

    _, runner, client = served
    worker = Worker("m")
    worker.loaded = SimpleNamespace(runner=runner)
    worker.health.ready()
    info = worker.describe()
    assert info["ready"] and info["engine"]["connected"] and "engine_down" not in info
    client.engine_dead("killed")
    info = worker.describe()
    assert not info["ready"] and not info["engine"]["connected"] and "killed" in info["engine_down"]
    assert info["state"] == "ready"  # the worker itself is fine: no load error, no device fault


def test_a_dead_engine_answers_every_request_503_at_once(served):
    _, runner, client = served
    runner._reconnect = lambda: (_ for _ in ()).throw(OSError("no engine here"))
    client.engine_dead("killed")
    outs = runner.run([kit.request(1, 0), kit.request(2, 1)])
    assert all(isinstance(o, EngineDead) and o.status == 503 and o.retryable for o in outs), outs


@pytest.mark.parametrize("engine, gpu_id, device_type, devices, decoder, served", [
    (None, 0, None, ("cuda",), False, True),  # the default, auto: a GPU worker of a CUDA archive
    (None, None, None, ("cuda",), False, False),  # no GPU given (TorchServe on a CPU host)
    (None, 1, "cpu", ("cuda",), False, False),  # device_type: cpu
    (None, 0, None, ("cpu",), False, False),  # a CPU-compiled package runs in its workers
    (None, 0, None, ("cpu-export",), False, True),  # a program exported on the CPU: the GPU's engine
    (None, None, None, ("cpu-export",), False, False),  # ... and in its workers on a CPU host
    (None, 1, "cpu", ("cpu-export",), False, False),
    (None, 0, None, ("cpu", "cuda"), False, True),
    (None, 0, None, ("cuda",), "one", True),  # auto: a one-sequence decoder as the engine's lanes
    (None, 0, None, ("cpu",), "one", False),  # a CPU-compiled package runs in its workers, a decoder too
    (None, 0, None, ("cpu-export",), "one", True),  # an exported decoder: the engine's lanes
    (None, 0, None, ("cuda",), "slots", True),  # auto: a slot-form decoder's batch too
    ("on", None, None, ("cpu",), False, True),  # on: the CPU too
    ("on", 0, None, ("cuda",), "one", True),  # on: a one-sequence decoder's lanes
    ("on", 0, None, ("cuda",), "slots", True),  # on: a slot-form decoder's batch in the engine
    ("on", None, None, ("cpu",), "slots", True),
])
def test_which_workers_the_engine_serves(monkeypatch, tmp_path, engine, gpu_id, device_type, devices, decoder,
                                         served):
    """handlers/engine_worker.wanted, from the archive's settings, the worker's GPU and the variants'
    devices (read from their artifact.json: no CUDA call)."""
    from types import SimpleNamespace
    from handlers import engine_worker

    dirs = [str(tmp_path / d) for d in devices]
    monkeypatch.setattr(engine_worker, "find_variants", lambda model_dir: dirs)
    def spec(d):  # "device" or "device-backend" (default: an AOTInductor package, compiled for that device)
        device, _, backend = d.rsplit("/", 1)[1].partition("-")
        return SimpleNamespace(device=device, backend=backend or "aoti", decoder=decoder)

    monkeypatch.setattr(engine_worker, "read_spec", spec)
    monkeypatch.setattr(engine_worker, "host_has_gpu", lambda: gpu_id is not None)  # NVML sees the GPU given
    monkeypatch.setattr(engine_worker, "decoder_of",
                        lambda spec: SimpleNamespace(slotted=spec.decoder == "slots") if spec.decoder else None)
    raw = {"handler": {"engine": engine} if engine else {}}
    if device_type:
        raw["deviceType"] = device_type  # TorchServe's own key, at the top level
    context = SimpleNamespace(model_yaml_config=raw,
                              system_properties={"model_dir": str(tmp_path), "gpu_id": gpu_id})
    assert (engine_worker.wanted(context) is not None) == served


def test_a_gpu_id_without_a_gpu_keeps_a_cpu_exported_program_in_its_workers(monkeypatch, tmp_path):
    """TorchServe counts GPUs from CUDA_VISIBLE_DEVICES alone where it is set, and hands out gpu_id 0
    on a host with none: a program exported on the CPU then stays in its workers on the CPU (NVML,
    never CUDA, says whether a GPU is there); an archive built for CUDA still goes to the engine,
    whose load says what the machine lacks."""
    from types import SimpleNamespace
    from handlers import engine_worker

    def wanted(device, backend, nvml):
        monkeypatch.setattr(engine_worker, "find_variants", lambda model_dir: ["v"])
        monkeypatch.setattr(engine_worker, "read_spec", lambda d: SimpleNamespace(device=device, backend=backend))
        monkeypatch.setattr(engine_worker.torch.cuda, "_device_count_nvml", lambda: nvml)
        context = SimpleNamespace(model_yaml_config={}, system_properties={"model_dir": str(tmp_path), "gpu_id": 0})
        return engine_worker.wanted(context) is not None

    assert not wanted("cpu", "export", -1) and not wanted("cpu", "export", 0)  # no NVIDIA driver; no GPU
    assert wanted("cpu", "export", 1)
    assert wanted("cuda", "aoti", -1)


def test_where_nvml_cannot_tell_the_drivers_control_device_says_whether_a_gpu_is_here(monkeypatch):
    """host_has_gpu: NVML's count where it has one; -1 (no libnvidia-ml in a container given the
    driver's compute capability alone, MIG entries) falls back on /dev/nvidiactl."""
    from handlers import engine_worker

    for nvml, ctl, want in ((2, False, True), (0, True, False), (-1, True, True), (-1, False, False)):
        monkeypatch.setattr(engine_worker.torch.cuda, "_device_count_nvml", lambda n=nvml: n)
        monkeypatch.setattr(engine_worker.os.path, "exists", lambda p, c=ctl: c and p == "/dev/nvidiactl")
        assert engine_worker.host_has_gpu() is want, (nvml, ctl)


def test_a_gpu_prefers_a_variant_it_places_on_the_gpu_to_an_earlier_cpu_one(monkeypatch, tmp_path):
    """An archive of a package compiled for the CPU, listed first, and a program exported on the CPU:
    on a GPU the program (relocated there) is chosen, not the package on the CPU."""
    from types import SimpleNamespace

    from handlers.artifact import variants
    from handlers.artifact.device import Placement
    from handlers.config import parse_config

    specs = {"a": SimpleNamespace(name="cpu package"), "b": SimpleNamespace(name="program")}
    monkeypatch.setattr(variants, "_variant_dirs", lambda model_dir, config: ["a", "b"])
    monkeypatch.setattr(variants, "read_spec", lambda d: specs[d])
    monkeypatch.setattr(variants, "open_variant", lambda d, root=None: specs[d])
    where = {"cpu package": Placement("cpu", None), "program": Placement("cuda", 0)}
    monkeypatch.setattr(variants, "assess", lambda spec, *a: (where[spec.name], [], []))
    spec, placement, _ = variants.choose_variant(str(tmp_path), 0, parse_config({}))
    assert spec.name == "program" and placement.kind == "cuda"
