"""handlers/timeline.py and bench/timeline_report.py: a worker served by the engine marks when its
jobs were sent and when the engine answered them, and the report splits the batch's run into
those parts (the heavy-load benchmarks' account of where a worker's cycle goes)."""
import json

import pytest

import engine_kit as kit
from bench import timeline_report
from handlers import timeline
from handlers.engine.client import InProcessEngine
from handlers.engine.core import Engine, start
from handlers.engine.runner import EngineRunner


@pytest.fixture
def marks(monkeypatch):
    seen = []
    monkeypatch.setattr(timeline, "ON", True)
    monkeypatch.setattr(timeline, "mark", lambda name, rows=0: seen.append(name))
    return seen


def test_a_worker_served_by_the_engine_marks_sent_then_answered(marks):
    model = kit.Recorder(sleep=0.01)
    engine = Engine(kit.runner(model))
    thread, stop = start(engine)
    client = InProcessEngine(engine, "w", 1 << 16, 1 << 16)
    try:
        runner = EngineRunner(client, kit.runner(model).spec, reconnect=lambda: client)
        outs = runner.run([kit.request(2, 0), kit.request(1, 1)])
        assert marks == ["launched", "synced"]
        assert all(not isinstance(o, Exception) for o in outs)
    finally:
        stop.set()
        thread.join(5)
        client.close()


def _line(t0: float, gaps: dict) -> dict:
    """A batch's marks: each mark of handlers.timeline.MARKS `gaps[mark]` seconds after the one
    before (a mark not in gaps is absent, as a path that does not pass it leaves it)."""
    c, t = {"rows": 4}, t0
    for m in timeline.MARKS:
        if m == "wait" or m in gaps:
            t += gaps.get(m, 0.0)
            c[m] = t
    return c


def test_the_report_splits_the_engines_round_trip_from_the_workers_own_steps(tmp_path):
    engine = {"arrived": 0.001, "read": 0.0001, "handle": 0.0001, "decoded": 0.0003, "launched": 0.0002,
              "synced": 0.0009, "ran": 0.00005, "encoded": 0.0001, "replied": 0.00005}
    # a worker calling the model itself marks neither launched nor synced: the call is in decoded -> ran
    cpu = {**{k: v for k, v in engine.items() if k not in ("launched", "synced")}, "ran": 0.00115}
    for pid, gaps in ((101, engine), (102, cpu)):
        lines = [_line(i * 0.01, gaps) for i in range(5)]
        (tmp_path / f"timeline-{pid}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in lines))
    one = timeline_report.report(str(tmp_path / "none"))
    assert one == {"batches": 0}
    rep = timeline_report.report(str(tmp_path))
    assert rep["batches"] == 8 and rep["workers"] == 2  # a worker's last batch has no next wait
    ms = {k: v["mean_ms"] for k, v in rep["intervals"].items()}
    assert ms["pad, into the arena, sent"] == pytest.approx(0.1)  # (0.2 + 0) / 2
    assert ms["the engine's answers"] == pytest.approx(0.45)
    assert ms["split outputs (a worker calling the model itself: its call)"] == pytest.approx((0.05 + 1.15) / 2)
    assert ms["read, decode, admit"] == pytest.approx(0.3)
    assert sum(ms.values()) == pytest.approx(10.0)  # the intervals cover the whole cycle
