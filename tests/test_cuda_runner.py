"""The CUDA runner in process (pytest -m gpu; skipped without CUDA): its own stream, pinned
staging, persistent device input buffers per batch size, exact results across chunks and
pieces, and a clean state after a failing call."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine: GPU tests run on the GPU machine",
                allow_module_level=True)

from handlers.artifact.kinds import LoadedModel  # noqa: E402
from handlers.artifact.metadata import ArtifactSpec, TensorSpec  # noqa: E402
from handlers.run import runner_for  # noqa: E402
from handlers.config import parse_config  # noqa: E402
from handlers.run.cuda import CudaRunner  # noqa: E402


def make(batch_min=1, batch_max=4, fn=None, piece_mb=0.0, sync="spin", spin_us=200.0):
    spec = ArtifactSpec(backend="export", artifact="m", sha256="", device="cuda",
                        inputs=(TensorSpec("x", "float32", (None, 64)), TensorSpec("m", "bool", (None, 64))),
                        outputs=(TensorSpec("y", "float32", (None, 64)),), output_structure="tensor",
                        batch_min=batch_min, batch_max=batch_max, torch_version=torch.__version__)
    dev = torch.device("cuda:0")
    fn = fn or (lambda x, m: torch.where(m, x * 2.0, x - 1.0))
    model = LoadedModel(fn, spec, dev, "test")

    cfg = parse_config({"handler": {"staging_piece_mb": piece_mb, "cuda_sync": sync, "cuda_spin_us": spin_us}})
    return runner_for(model, spec, dev, cfg), spec


def ref(r):
    return torch.where(r["m"], r["x"] * 2.0, r["x"] - 1.0)


def reqs(*rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(n, 64, generator=g), "m": torch.rand(n, 64, generator=g) > 0.5} for n in rows]


@pytest.mark.parametrize("piece_mb,sync", [(0.0, "spin"), (0.0005, "spin"), (0.0, "block"), (0.0, "hybrid")])
def test_results_exact_across_chunks_and_pieces(piece_mb, sync):
    runner, _ = make(batch_min=2, batch_max=3, piece_mb=piece_mb, sync=sync)
    assert isinstance(runner, CudaRunner) and runner.sync == sync
    for rows in [(1,), (2, 1), (3, 2, 2), (1, 1, 1, 1, 1)]:
        rs = reqs(*rows, seed=sum(rows))
        out = runner.run(rs)
        assert [o["y"].shape[0] for o in out] == list(rows)
        for o, r in zip(out, rs):
            assert torch.equal(o["y"], ref(r))
    assert runner.host_inputs._bufs["x"].is_pinned() and runner.host_outputs._bufs["y"].is_pinned()


def test_device_inputs_persist_per_batch_size():
    seen = []
    runner, _ = make(fn=lambda x, m: seen.append((x.data_ptr(), m.data_ptr(), torch.cuda.current_stream()))
                     or x * 1.0)
    # The device buffers are sized for the largest batch so far (warm-up runs the largest
    # first); from then on each batch size finds its inputs at the same addresses.
    for rows in (3, 2, 3, 2, 3, 2):
        runner.run(reqs(rows))
    ptrs = [(a, b) for a, b, _ in seen]
    assert ptrs[0] == ptrs[2] == ptrs[4] and ptrs[1] == ptrs[3] == ptrs[5]
    assert all(s == runner.stream for _, _, s in seen)  # the model runs on the runner's stream
    assert runner.stream != torch.cuda.default_stream(0)


def test_a_failing_call_leaves_the_runner_usable():
    calls = {"n": 0}

    def flaky(x, m):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return torch.where(m, x * 2.0, x - 1.0)

    runner, _ = make(fn=flaky)
    rs = reqs(2)
    assert torch.equal(runner.run(rs)[0]["y"], ref(rs[0]))
    with pytest.raises(RuntimeError, match="boom"):
        runner.run(reqs(2, seed=1))
    rs = reqs(2, seed=2)
    assert torch.equal(runner.run(rs)[0]["y"], ref(rs[0]))


@pytest.mark.parametrize("spin_us", [0.0, 50.0, 1e6])
def test_hybrid_wait_outlasting_its_spin_still_waits_for_the_gpu(spin_us):
    """A GPU call far longer than the spin (a chain of large matmuls) falls through to the
    blocking synchronize: the outputs read after the wait are the finished ones."""
    def slow(x, m):
        y = x
        big = torch.randn(2048, 2048, device=x.device)
        for _ in range(30):
            big = big @ big / 2048.0
        return torch.where(m, y * 2.0, y - 1.0) + big[0, 0] * 0.0
    runner, _ = make(fn=slow, sync="hybrid", spin_us=spin_us)
    assert "spinning up to" in runner.describe_sync()
    rs = reqs(3, 1, seed=5)
    out = runner.run(rs)
    for r, o in zip(rs, out):
        torch.testing.assert_close(o["y"], ref(r), rtol=0, atol=0)
