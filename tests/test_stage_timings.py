"""Per-stage timings: rate-limited gauges and profiler labels (in process)."""

import torch


def test_stage_times_emit_means_at_most_once_per_interval():
    from handlers.torchserve.stage_timings import StageTimes

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
    from handlers.torchserve.stage_timings import StageTimes

    got = []
    st = StageTimes(lambda name, ms: got.append(name), 0.0, clock=lambda: 5.0)
    for _ in range(3):
        st.record(decode=1.0, run=1.0, encode=1.0)
    assert got == ["HandlerDecodeTime", "HandlerRunTime", "HandlerEncodeTime"] * 3


def test_stage_labels_only_while_a_profiler_records():
    from torch.profiler import profile

    from handlers.torchserve.stage_timings import label

    with label("run"):  # no profiler: a plain no-op context
        torch.ones(2).add_(1)
    with profile() as prof:
        with label("run"):
            torch.ones(2).add_(1)
        with label("encode"):
            pass
    names = {e.name for e in prof.events()}
    assert {"handler.run", "handler.encode"} <= names, sorted(names)[:20]
