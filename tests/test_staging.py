"""Staging buffers, uploads in pieces, row views and batch planning (in process)."""

import pytest
import torch
from worker_kit import make_spec

from handlers.batch import plan_chunks, warmup_sizes
from handlers.run.cuda import upload
from handlers.staging import StagingBuffers


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


def test_one_piece_upload_of_several_requests_converts_dtypes():
    """Several request blocks in one piece go into pinned memory by one torch.cat; a block of
    another dtype than the buffer takes the per-block copy, which converts it."""
    s = StagingBuffers(pinned=False)
    same = [torch.full((1, 3), float(i)) for i in range(3)]
    dev = torch.empty(4, 3)
    upload(s, "x", same, dev, piece_bytes=0)
    assert torch.equal(dev[:3], torch.cat(same)) and not dev[3:].any()
    mixed = [torch.ones(1, 3, dtype=torch.float64), torch.full((2, 3), 2.0)]
    dev = torch.empty(3, 3)
    upload(s, "x", mixed, dev, piece_bytes=0)
    assert dev.dtype == torch.float32 and torch.equal(dev, torch.tensor([[1.0] * 3, [2.0] * 3, [2.0] * 3]))
