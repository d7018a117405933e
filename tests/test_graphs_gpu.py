"""CUDA graphs on the GPU (pytest -m gpu; skipped without CUDA): every bucket and every padding
through the graph path against the plain path, with different values back to back (a stale
input or output buffer would show). Exact where both run the same kernels at the same padded
batch; within the compile tolerance against the unpadded plain call. GPU_RESULTS=path writes
the counts (device, date, torch, command first)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("results_file")]
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine: GPU tests run on the GPU machine",
                allow_module_level=True)

from handlers.artifact.device import Placement  # noqa: E402
from handlers.artifact.kinds import kind_of  # noqa: E402
from handlers.artifact.load import load_artifact  # noqa: E402
from handlers.artifact.metadata import read_spec  # noqa: E402
from handlers.config import parse_config  # noqa: E402
from handlers.run import graphs, runner_for  # noqa: E402

RESULTS = {"graphs": []}


def request(spec, rows, g):
    out = {}
    for s in spec.inputs:
        dt = getattr(torch, s.dtype)
        shape = (rows,) + tuple(s.shape[1:])
        out[s.name] = torch.randn(shape, generator=g).to(dt) if dt.is_floating_point else torch.rand(shape, generator=g) > 0.3
    return out


def own(out: dict) -> dict:
    return {k: v.clone() for k, v in out.items()}


def padded(req, rows):
    return {k: torch.cat([v, torch.zeros((rows - v.shape[0],) + tuple(v.shape[1:]), dtype=v.dtype)]) for k, v in req.items()}


@pytest.mark.parametrize("name", ["cls_aoti", "cls_export", "two_aoti", "two_export"])
def test_graph_path_matches_the_plain_path(gpu_artifacts, name):
    spec = read_spec(str(gpu_artifacts.get(name)))
    cfg = parse_config({"handler": {"cuda_graph_max_batch": 16}})
    model = load_artifact(spec, Placement("cuda", 0), cfg)
    with_graphs = runner_for(model, spec, torch.device("cuda:0"), cfg)
    note = with_graphs.prepare(cfg, kind_of(spec))
    plain = runner_for(model, spec, torch.device("cuda:0"), parse_config({"handler": {"cuda_graphs": "off"}}))
    row = {"artifact": name, "note": note, "calls": 0, "exact_mismatches": 0, "max_abs_vs_unpadded": 0.0}
    RESULTS["graphs"].append(row)
    assert with_graphs.graphs is not None, note
    g = torch.Generator().manual_seed(0)
    for rows in [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 1, 16, 3]:
        req = request(spec, rows, g)
        bucket = graphs.bucket_for(rows, with_graphs.graphs.sizes)
        with torch.inference_mode():  # outputs live in reused buffers until the runner's next call
            got = own(with_graphs.run([req])[0])
            same_kernels = own(plain.run([padded(req, bucket)])[0])
            unpadded = own(plain.run([req])[0])
        row["calls"] += 1
        for k in got:
            if not torch.equal(got[k], same_kernels[k][:rows]):
                row["exact_mismatches"] += 1
            d = (got[k].float() - unpadded[k].float()).abs().max().item()
            row["max_abs_vs_unpadded"] = max(row["max_abs_vs_unpadded"], d)
    # two requests in one call share a bucket: each gets exactly its own rows
    a, b = request(spec, 2, g), request(spec, 3, g)
    with torch.inference_mode():
        ga, gb = map(own, with_graphs.run([a, b]))
        pa, pb = own(plain.run([a])[0]), own(plain.run([b])[0])
    row["batched_max_abs"] = max((ga[k].float() - pa[k].float()).abs().max().item() for k in ga)
    row["batched_max_abs"] = max(row["batched_max_abs"], max((gb[k].float() - pb[k].float()).abs().max().item() for k in gb))
    assert row["exact_mismatches"] == 0
    assert row["max_abs_vs_unpadded"] <= 1e-4 and row["batched_max_abs"] <= 1e-4


def test_mixed_lengths_share_one_graph_when_that_is_cheaper(gpu_artifacts):
    """A text encoder with declared padding: graphs per (batch, length) bucket carry their replay
    time; a batch of texts in four length buckets runs as one call at the longest bucket (a call's
    fixed cost outweighs the padding for a model this small), every answer equal to the text run
    alone without padding."""
    spec = read_spec(str(gpu_artifacts.get("text_tiny_aoti")))
    cfg = parse_config({"handler": {"pad": {"input_ids": 0, "attention_mask": 0}, "cuda_graph_max_batch": 8}})
    model = load_artifact(spec, Placement("cuda", 0), cfg)
    runner = runner_for(model, spec, torch.device("cuda:0"), cfg)
    note = runner.prepare(cfg, kind_of(spec))
    plain = runner_for(model, spec, torch.device("cuda:0"), parse_config({"handler": {"cuda_graphs": "off"}}))
    assert runner.graphs is not None, note
    assert 0 < runner.graphs.replay_ms(1, {"S": 4}) and runner.call_cost_ms(3, {"S": 64}) > 0.2
    g = torch.Generator().manual_seed(1)
    reqs = [{"input_ids": torch.randint(0, 1000, (1, n), generator=g), "attention_mask": torch.ones(1, n, dtype=torch.int64)}
            for n in (5, 20, 40, 9, 64)]
    calls, call = [], runner.call
    runner.call = lambda parts, rows: calls.append((rows, tuple(parts["input_ids"][0].shape))) or call(parts, rows)
    with torch.inference_mode():
        together = [own(o) for o in runner.run(reqs)]
        alone = [own(plain.run([r])[0]) for r in reqs]
    row = {"artifact": "text_tiny_aoti", "note": note, "merged_calls": calls,
           "max_abs_vs_alone": max((t[k].float() - a[k].float()).abs().max().item()
                                   for t, a in zip(together, alone) for k in t)}
    RESULTS["graphs"].append(row)
    assert calls == [(5, (1, 64))], calls
    assert row["max_abs_vs_alone"] <= 1e-4


def test_a_shape_whose_capture_fails_runs_plain_calls_on_the_gpu():
    """A model that cannot be captured at one batch size (a host synchronization at batch 4, as
    a kernel that refuses one size would fail): that bucket's calls run the plain call, the
    other buckets replay their graphs, the stream stays usable after the failed capture, and
    every answer equals the plain call; the load line names the shape and the error. The
    capture and its check run valid requests (ids in range, masks of ones)."""
    from handlers.artifact.kinds import LoadedModel
    from handlers.artifact.metadata import ArtifactSpec, TensorSpec

    device = torch.device("cuda:0")
    spec = ArtifactSpec("aoti", "m", "", "cuda",
                        (TensorSpec("ids", "int64", (None, 6), {"min": 0, "max": 9, "source": "t"}),
                         TensorSpec("attention_mask", "int64", (None, 6))),
                        (TensorSpec("y", "float32", (None,)),), "dict", 1, 8, torch.__version__)
    table = torch.randn(10, device=device)

    def fn(ids, mask):
        if ids.shape[0] == 4:
            float(ids.sum())  # a host synchronization: refused while capturing
        return {"y": (table[ids] * mask).sum(1) / mask.sum(1)}

    cfg = parse_config({"handler": {"cuda_graph_max_batch": 8}})
    runner = runner_for(LoadedModel(fn, spec, device, "test"), spec, device, cfg)
    note = runner.prepare(cfg, kind_of("aoti"))
    RESULTS["graphs"].append({"test": "capture_fallback", "note": note})
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 8], note
    assert "capture failed, plain calls for batch 4 (" in note, note
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 4, 5, 8, 4, 1):
        req = {"ids": torch.randint(0, 10, (rows, 6), generator=g), "attention_mask": torch.ones(rows, 6, dtype=torch.int64)}
        with torch.inference_mode():
            got = own(runner.run([req])[0])
        want = fn(req["ids"].to(device), req["attention_mask"].to(device))["y"].cpu()
        torch.testing.assert_close(got["y"], want, rtol=1e-5, atol=1e-6)
        bucket = runner.graphs.for_call(rows, {"ids": [req["ids"]], "attention_mask": [req["attention_mask"]]},
                                        spec.input_names)
        assert (bucket is None) == (rows in (3, 4)), rows
