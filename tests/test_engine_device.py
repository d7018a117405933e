"""The engine's device steps (handlers/engine/device.py) on the CPU: the same plan, padding on
the device, copies into the arenas and launched steps answered out of flight, with "graphs"
whose replay calls the model on their own buffers, against the runner's own call of the same
requests (differential). The CUDA parts (pinning, the stream, the events) run on the GPU machine
only (bench/bench_e2e.py's engine variant compares every answer with the eager model there)."""
import gc
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from handlers.artifact.metadata import ArtifactSpec, TensorSpec
from handlers.batch import PadPlan
from handlers.engine import core
from handlers.engine.client import InProcessEngine
from handlers.engine.device import DeviceSteps
from handlers.engine.runner import EngineRunner
from handlers.errors import ServingError
from handlers.artifact.kinds.base import LoadedModel
from handlers.run import runner_for
from handlers.run.graphs import GraphBucket, GraphSet, shape_key

SPEC = ArtifactSpec("export", "m", "", "cpu",
                    (TensorSpec("ids", "int64", (None, "S")), TensorSpec("mask", "int64", (None, "S")),
                     TensorSpec("x", "float32", (None, 3))),
                    (TensorSpec("tok", "float32", (None, "S", 2)), TensorSpec("pooled", "float32", (None, 2))),
                    "dict", 1, 16, torch.__version__, dims={"S": (1, 32)})
PLAN = PadPlan.of(SPEC, {"ids": 7, "mask": 0})
ROWS = (1, 2, 4, 8)  # the largest bucket (8) is under batch_max (16): larger jobs take the runner's call


def model(ids, mask, x):
    """Row-independent, and padding (mask 0) changes nothing of a row's own outputs."""
    kept = (ids * mask).float()
    return {"tok": kept.unsqueeze(-1) * torch.tensor([1.0, -0.5]) + x[:, None, :2],
            "pooled": kept.sum(1, keepdim=True) * x[:, 1:] + mask.sum(1, keepdim=True)}


class Replayed:
    """A captured graph's stand-in: the model on the bucket's buffers, results into its outputs."""

    def __init__(self, inputs, outputs):
        self.inputs, self.outputs, self.replays = inputs, outputs, 0

    def replay(self):
        self.replays += 1
        for k, v in model(*self.inputs).items():
            self.outputs[k].copy_(v)


def graph_set() -> GraphSet:
    buckets = {}
    for s in PLAN.buckets["S"]:
        for rows in ROWS:
            inputs = list(SPEC.example(rows, None, {"S": s}).values())
            outputs = {k: v.clone() for k, v in model(*inputs).items()}
            bucket = GraphBucket(rows, Replayed(inputs, outputs), inputs, outputs, (("S", s),), 0.01 + rows * s * 1e-4)
            buckets[(rows, shape_key(inputs))] = bucket
    return GraphSet(buckets, 0, dynamic=True)


class Event:
    """A CPU event done after `after` queries from its record (a step stays in flight that long);
    recorded again, it is not done again until as many queries later, as a CUDA event recorded
    again is not complete until its new work is."""

    def __init__(self, after: int = 2):
        self.after = self.left = after

    def record(self, stream):
        self.left = self.after

    def query(self):
        self.left -= 1
        return self.left < 0

    def synchronize(self):
        self.left = -1


def engine(**kw):
    plain = runner_for(LoadedModel(model, SPEC, torch.device("cpu"), "test"), SPEC, torch.device("cpu"))
    plain.pad = PLAN
    graphs = graph_set()
    fake = SimpleNamespace(graphs=graphs, pad=PLAN, spec=SPEC,
                           call_cost_ms=lambda rows, sizes: (graphs.replay_ms(rows, sizes) or 0) + 0.2 if graphs.replay_ms(rows, sizes) else None)
    device = DeviceSteps(fake, None, Event)
    return core.Engine(plain, device=device, **kw), plain, graphs


def requests(seed: int, n: int, max_rows: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rows, length = int(torch.randint(1, max_rows + 1, (1,), generator=g)), int(torch.randint(1, 33, (1,), generator=g))
        mask = (torch.arange(length) < torch.randint(1, length + 1, (rows, 1), generator=g)).long()
        out.append({"ids": torch.randint(0, 50, (rows, length), generator=g), "mask": mask,
                    "x": torch.randn(rows, 3, generator=g)})
    return out


@pytest.fixture
def served():
    eng, plain, graphs = engine()
    thread, stop = core.start(eng)
    clients = []

    def worker(name, **kw):
        c = InProcessEngine(eng, name, **kw)
        clients.append(c)
        return EngineRunner(c, SPEC, lambda: None, pad=PLAN)

    yield SimpleNamespace(engine=eng, plain=plain, graphs=graphs, worker=worker)
    stop.set()
    thread.join(5)
    for c in clients:
        c.close()
    names = {f"/memfd:cs-arena-{c.name} " for c in clients}
    clients.clear()
    gc.collect()
    # these workers' arenas unmapped on both sides once nothing views them (no step, error or reply keeps one)
    assert not [ln for ln in open("/proc/self/maps") if any(n in ln for n in names)]


def alone(plain, req: dict) -> dict:
    """The runner's own call of one request (in inference mode, as the engine runs it: its
    buffers are inference tensors)."""
    with torch.inference_mode():
        return {k: v.clone() for k, v in plain.run([req])[0].items()}


def equal(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_steps_from_several_workers_answer_each_request_as_the_runner_alone_would(served):
    """Four workers' batches of texts of every length, at once: every request's outputs equal the
    runner's own call of it, bit for bit; the steps went through the graphs (replays counted),
    several jobs per step."""
    results, errors = {}, []

    def one(i):
        runner = served.worker(f"w{i}")
        try:
            for b in range(6):
                batch = requests(100 * i + b, 5)
                results[(i, b)] = (batch, [{k: v.clone() for k, v in o.items()} for o in runner.run(batch)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for batch, outs in results.values():
        for req, out in zip(batch, outs):
            assert not isinstance(out, ServingError), out
            assert equal(out, alone(served.plain, req))
    eng = served.engine
    replays = sum(b.graph.replays for b in served.graphs.buckets.values())
    assert eng.calls > 0 and eng.jobs > eng.calls and replays >= eng.calls
    assert len(results) == 24 and not eng.flights and not eng.queue


def test_a_job_over_the_largest_graph_takes_the_runners_call_and_a_full_arena_fails_alone(served):
    runner = served.worker("w")
    big = requests(7, 1, max_rows=1)[0]
    big = {k: v.expand(12, *v.shape[1:]).clone() for k, v in big.items()}  # 12 rows: over the largest bucket (8)
    small = requests(8, 2)
    plain_calls, plain_run = [], served.plain.run
    served.plain.run = lambda reqs: (plain_calls.append(len(reqs)), plain_run(reqs))[1]
    try:
        out = runner.run([big] + small)
    finally:
        served.plain.run = plain_run
    assert plain_calls, "the step with a 12-row job did not go through the runner's own call"
    for req, o in zip([big] + small, out):
        assert equal(o, alone(served.plain, req))
    # a worker whose arena's engine half holds 256 bytes: its outputs never fit; that worker's
    # requests fail (503, retryable), the other worker's in the same steps are answered
    tiny = served.worker("tiny", engine_bytes=256)
    reqs = requests(9, 4)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("tiny", tiny.run(reqs)))
    t.start()
    others = runner.run(reqs)
    t.join(30)
    assert all(isinstance(o, ServingError) and o.status == 503 and o.retryable for o in got["tiny"])
    assert all(equal(o, alone(served.plain, r)) for o, r in zip(others, reqs))


def test_a_step_in_flight_for_a_worker_that_is_gone_is_dropped_and_the_others_answered():
    eng, plain, _ = engine()
    a, b = InProcessEngine(eng, "a"), InProcessEngine(eng, "b")
    ra, rb = requests(1, 1)[0], requests(2, 1)[0]
    ja = a.submit(PLAN.pad(ra, {"S": PLAN.bucket("S", ra["ids"].shape[1])}))
    jb = b.submit(PLAN.pad(rb, {"S": PLAN.bucket("S", rb["ids"].shape[1])}))
    eng.step()
    assert len(eng.flights) == 1 and not eng.queue  # launched, not answered yet
    to_a = []
    a.session.reply = to_a.append  # what the engine would still send the gone worker
    a.close()
    while eng.flights:
        eng.step()
    with b.wait(jb, 5) as reply:
        got = PLAN.cut(dict(reply.outputs), PLAN.sizes(rb))
        assert equal({k: v.clone() for k, v in got.items()}, alone(plain, rb))
    assert ja and eng.jobs == 2 and len(eng.sessions) == 1
    assert to_a == [] and a.session.held == {}  # the gone worker's job was dropped, nothing held for it
    b.close()


@pytest.mark.parametrize("launch", ["eager", "late"])
def test_late_launch_holds_jobs_until_the_step_on_the_device_is_due_or_a_step_is_full(launch):
    """eager: a job queued behind a running step is launched at once. late: it waits while the
    running step is not due to end, and goes once the queued rows fill the largest graph or the
    step is due; every job is then answered as the runner alone would."""
    eng, plain, graphs = engine(launch=launch)
    eng.device.new_event = lambda **kw: Event(10 ** 6)  # no step ends until synchronize()
    c = InProcessEngine(eng, "w")
    reqs = requests(7, 12, max_rows=2)
    padded = [PLAN.pad(r, {"S": PLAN.bucket("S", r["ids"].shape[1])}) for r in reqs]
    ids = [c.submit(padded[0])]
    assert eng.step() == 1 and len(eng.flights) == 1
    eng.flights[-1].due = time.perf_counter() + 60  # the device is busy for a long while
    ids.append(c.submit(padded[1]))
    eng.step()
    if launch == "eager":
        assert len(eng.flights) == 2 and not eng.queue
    else:
        assert len(eng.flights) == 1 and len(eng.queue) == 1  # held: more may join it
        eng.flights[-1].due = time.perf_counter()  # about to end: launched now
        assert eng.step() == 1 and len(eng.flights) == 2 and not eng.queue
        for f in eng.flights:
            f.event.synchronize()
        eng.step()
        assert not eng.flights
        ids.append(c.submit(padded[2]))
        assert eng.step() == 1
        eng.flights[-1].due = time.perf_counter() + 60
        full = min(eng.max_rows, eng.device.largest)
        queued = 0
        for r in padded[3:]:  # rows enough to fill the largest graph go at once
            if queued >= full:
                break
            ids.append(c.submit(r))
            queued += r["ids"].shape[0]
            eng.step()
            assert len(eng.flights) == (2 if queued >= full else 1)
        assert queued >= full and len(eng.flights) == 2 and not eng.queue
    for f in eng.flights:
        f.event.synchronize()
    while eng.flights or eng.queue:
        for f in eng.flights:
            f.event.synchronize()
        eng.step()
    for job_id, r in zip(ids, reqs):
        with c.wait(job_id, 5) as reply:
            got = PLAN.cut(dict(reply.outputs), PLAN.sizes(r))
            assert equal({k: v.clone() for k, v in got.items()}, alone(plain, r))
    c.close()


FIXED = ArtifactSpec("export", "m", "", "cpu", (TensorSpec("x", "float32", (None, 3)),),
                     (TensorSpec("y", "float32", (None, 2)),), "dict", 1, 8, torch.__version__)


class FixedReplay:
    """A fixed-shape model's graph stand-in: y = x[:, :2] * 2 + 1, on the bucket's buffers."""

    def __init__(self, inputs, outputs):
        self.inputs, self.outputs = inputs, outputs

    def replay(self):
        self.outputs["y"].copy_(self.inputs[0][:, :2] * 2 + 1)


class Fills(torch.overrides.TorchFunctionMode):
    """Counts fill_ calls (the device's fills of a graph's pad rows)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.Tensor.fill_
        return func(*args, **(kwargs or {}))


def test_pad_rows_of_a_fixed_shape_graph_hold_zeros_after_every_step_and_steady_steps_fill_none():
    """Whatever rows the steps before wrote, a step leaves the rows of its graph past its own jobs'
    holding the pad value (0), as the runner's padding would; steps of one size after the first
    launch no fill, and a call of the runner's own makes the next step fill again."""
    buckets = {}
    for rows in (1, 2, 4, 8):
        inputs = [torch.full((rows, 3), 7.0)]  # what a capture's example left: not the pad value
        outputs = {"y": torch.zeros(rows, 2)}
        buckets[(rows, shape_key(inputs))] = GraphBucket(rows, FixedReplay(inputs, outputs), inputs, outputs, (), 0.01)
    graphs = GraphSet(buckets, 0)
    plain = runner_for(LoadedModel(lambda x: {"y": x[:, :2] * 2 + 1}, FIXED, torch.device("cpu"), "t"), FIXED,
                       torch.device("cpu"))
    device = DeviceSteps(SimpleNamespace(graphs=graphs, pad=None, spec=FIXED, call_cost_ms=lambda r, s: 0.01),
                         None, lambda **kw: Event(0))
    eng = core.Engine(plain, device=device)
    c = InProcessEngine(eng, "w")
    eight = graphs.buckets[(8, ((3,),))].inputs[0]

    def step(rows: int, fills_wanted=None) -> None:
        x = torch.randn(rows, 3)
        job = c.submit({"x": x})
        with Fills() as fills:
            assert eng.step() == 1
        while eng.flights:
            eng.step()
        with c.wait(job, 5) as reply:
            assert torch.equal(reply.outputs["y"], x[:, :2] * 2 + 1)
        if rows > 4:  # the 8-row graph served it
            assert torch.equal(eight[rows:], torch.zeros(8 - rows, 3)), (rows, eight)
        assert fills_wanted is None or fills.n == fills_wanted, (rows, fills.n)

    step(5, 1)  # unknown rows: filled
    step(5, 0)
    step(5, 0)  # steady: none
    step(8, 0)  # no pad rows
    step(6, 1)  # rows 6 and 7 held the 8-row step's inputs
    step(7, 0)  # rows 7 on held zeros since the 6-row step
    with torch.inference_mode():
        eng.run([core.Job(c.session, 99, {"x": torch.randn(7, 3)}, 7)])
    step(7, 1)  # the runner's call wrote the graphs' inputs: filled again
    c.close()
