"""The contract read from a torch.export program (compiled_serving/contract.py): named dimensions with
their ranges, output names, and the value ranges the graph walk derives for integer inputs
that index something; the per-request value check (handlers/values.py); layout-1 files still
load; requests of different lengths run in groups (handlers/run/base.py)."""
import json

import pytest
import torch
from torch import nn
from torch.export import Dim

from handlers.artifact.metadata import ArtifactSpec, TensorSpec, read_spec, write_spec
from handlers.config import parse_config
from handlers.errors import LoadError, RequestError
from handlers.values import ValueContract
from compiled_serving import contract


def export(module, *inputs, dynamic=None):
    return torch.export.export(module.eval(), tuple(inputs), dynamic_shapes=dynamic)


class Through(nn.Module):
    """ids reach the table through a view, a cast between integer types and `+ 2`."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 3)

    def forward(self, ids):
        return self.table((ids.view(-1).to(torch.int32) + 2).long())


class TwoUses(nn.Module):
    """One input indexes two tables (7 and 5 rows): the bounds intersect."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Embedding(7, 2), nn.Embedding(5, 2)

    def forward(self, ids):
        return self.a(ids) + self.b(ids)


class Gathers(nn.Module):
    def forward(self, x, idx, sel):
        return torch.gather(x, 1, idx).sum(1) + torch.index_select(x, 1, sel).sum(1).sum(0)


class Scaled(nn.Module):
    """ids * 3 before the table: not a shift by a constant, so no bound is derived."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(30, 2)

    def forward(self, ids, flags):
        return self.table(ids * 3).sum(1) + flags.float().unsqueeze(-1)


def test_bound_flows_through_views_casts_and_a_constant_shift():
    ep = export(Through(), torch.tensor([[1, 2]]))
    assert contract.value_ranges(ep) == {"ids": {"min": -2, "max": 7,
                                                 "source": "embedding table of 10 rows (after adding 2)"}}


def test_two_tables_intersect():
    got = contract.value_ranges(export(TwoUses(), torch.tensor([[1, 2]])))
    assert (got["ids"]["min"], got["ids"]["max"]) == (0, 4)


def test_gather_and_index_select_bound_by_the_dimension_they_index():
    x = torch.randn(2, 6)
    got = contract.value_ranges(export(Gathers(), x, torch.tensor([[0, 5], [1, 2]]), torch.tensor([0, 3])))
    assert (got["idx"]["min"], got["idx"]["max"]) == (0, 5) and (got["sel"]["min"], got["sel"]["max"]) == (0, 5)


def test_no_derivable_bound_is_reported_unchecked_and_non_indexing_inputs_get_nothing():
    got = contract.value_ranges(export(Scaled(), torch.tensor([[1, 2]]), torch.tensor([1])))
    assert got["ids"]["checked"] is False and "aten.mul" in got["ids"]["why"]
    assert "flags" not in got
    spec = ArtifactSpec("export", "m", "", "cpu", (TensorSpec("ids", "int64", (None, 2), got["ids"]),),
                        (), "tensor", 1, 4, torch.__version__)
    vc = ValueContract.of(spec, parse_config({}))
    assert vc.ranges == () and "UNCHECKED: ids" in vc.describe()


def test_named_dims_and_outputs_are_read_with_their_ranges():
    class M(nn.Module):
        def forward(self, ids, mask):
            return {"per_token": ids.float() * mask, "total": (ids * mask).sum(1)}

    ep = export(M(), torch.ones(3, 9, dtype=torch.long), torch.ones(3, 9, dtype=torch.long),
                dynamic={"ids": {0: Dim("b", min=1, max=8), 1: Dim("s", min=4, max=40)},
                         "mask": {0: Dim("b", min=1, max=8), 1: Dim("s", min=4, max=40)}})
    structure, names = contract.output_layout(ep)
    found = contract.read(ep, names)
    assert (structure, names) == ("dict", ["per_token", "total"])
    assert found.batch == (1, 8) and found.dims == {"D1": (4, 40)}
    assert found.inputs == [("ids", "int64", [None, "D1"]), ("mask", "int64", [None, "D1"])]
    assert found.outputs == [("per_token", "float32", [None, "D1"]), ("total", "int64", [None])]


def test_a_dimension_without_an_upper_bound_is_refused_with_the_fix():
    class M(nn.Module):
        def forward(self, x):
            return x * 2

    ep = export(M(), torch.ones(2, 5), dynamic={"x": {0: Dim("b", min=1, max=8), 1: Dim("s")}})
    with pytest.raises(contract.ContractError) as e:
        contract.read(ep, ["output"])
    # the input and dimension by name, not torch's symbol for it (s86)
    assert e.value.args[0] == ("input 'x' dimension 1 has no upper bound; export with Dim('seq', max=...) "
                               "(dynamic_shapes={'x': {1: torch.export.Dim('seq', max=...)}}) so requests can "
                               "be bounded")


def test_user_ranges_narrow_and_a_wider_one_is_refused_naming_the_table():
    """--input-range may narrow the graph's bound, never widen it: a wider range is refused with
    the table it would index past (it was silently intersected before)."""
    derived = {"ids": {"min": 0, "max": 999, "source": "embedding table of 1000 rows"}}
    inputs = [("ids", "int64", [None, "D1"]), ("x", "float32", [None, 3])]
    got = contract.tighten(derived, contract.parse_ranges(["ids=5:900", "x=0:1"]), inputs)
    assert got["ids"] == {"min": 5, "max": 900, "source": "given with --input-range; embedding table of 1000 rows"}
    assert (got["x"]["min"], got["x"]["max"]) == (0, 1)  # an input without a bound gets one
    for wide in ("ids=5:2000", "ids=-1:10", "ids=1000:2000"):
        with pytest.raises(contract.ContractError) as e:
            contract.tighten(derived, contract.parse_ranges([wide]), inputs)
        assert e.value.args[0] == (f"--input-range {wide} is wider than what the model accepts: input 'ids' takes "
                                   "values from 0 to 999 (embedding table of 1000 rows); a value outside would index "
                                   "past it. Give a range inside [0, 999]")
    with pytest.raises(contract.ContractError, match="LO:HI"):
        contract.parse_ranges(["ids=zero:9"])
    with pytest.raises(contract.ContractError, match="no input of that name"):
        contract.tighten(derived, {"nope": (0, 1)}, inputs)


def spec_with(values, dtype="int64"):
    return ArtifactSpec("export", "m", "", "cpu", (TensorSpec("ids", dtype, (None, "S"), values),),
                        (), "tensor", 1, 4, torch.__version__, dims={"S": (1, 16)})


def test_value_check_names_the_first_offending_value_its_position_and_the_range():
    vc = ValueContract.of(spec_with({"min": 0, "max": 9, "source": "embedding table of 10 rows"}), parse_config({}))
    vc.check({"ids": torch.tensor([[0, 9, 3]])})
    with pytest.raises(RequestError) as e:
        vc.check({"ids": torch.tensor([[0, 1, 2], [3, 10, -4]])})
    assert e.value.status == 400
    assert e.value.message == ("input 'ids' holds 10 at position [1, 1]; this model accepts values from 0 to 9 "
                               "(embedding table of 10 rows)")


def test_handler_options_add_tighten_and_switch_off_checks():
    spec = spec_with({"min": 0, "max": 9, "source": "t"})
    tight = ValueContract.of(spec, parse_config({"handler": {"value_ranges": {"ids": [2, 5]}}}))
    assert [(c.lo, c.hi) for c in tight.ranges] == [(2, 5)]
    with pytest.raises(RequestError, match="from 2 to 5"):
        tight.check({"ids": torch.tensor([[1]])})
    # wider than the model's own bound, or naming no input: the load fails saying so
    with pytest.raises(LoadError, match="handler.value_ranges ids=2:50 is wider than what the model accepts: "
                                        "input 'ids' takes values from 0 to 9"):
        ValueContract.of(spec, parse_config({"handler": {"value_ranges": {"ids": [2, 50]}}}))
    with pytest.raises(LoadError, match="handler.value_ranges nope: no input of that name"):
        ValueContract.of(spec, parse_config({"handler": {"value_ranges": {"nope": [2, 5]}}}))
    assert ValueContract.of(spec, parse_config({"handler": {"check_values": False}})).ranges == ()
    floats = ArtifactSpec("export", "m", "", "cpu", (TensorSpec("x", "float32", (None, 2)),), (), "tensor",
                          1, 4, torch.__version__)
    finite = ValueContract.of(floats, parse_config({"handler": {"refuse_nonfinite": True}}))
    with pytest.raises(RequestError, match="nan at position \\[0, 1\\]"):
        finite.check({"x": torch.tensor([[1.0, float("nan")]])})
    ValueContract.of(floats, parse_config({})).check({"x": torch.tensor([[float("inf"), 0.0]])})
    # a range on a floating-point input compares the values themselves, never truncated
    unit = ValueContract.of(floats, parse_config({"handler": {"value_ranges": {"x": [0, 1]}}}))
    unit.check({"x": torch.tensor([[0.0, 1.0]])})
    for bad in ([[1.5, 0.5]], [[0.5, -0.5]], [[0.9, 1.9]]):
        with pytest.raises(RequestError, match="from 0 to 1"):
            unit.check({"x": torch.tensor(bad)})


def test_value_check_agrees_with_a_plain_loop_on_random_batches():
    """Differential: the vectorised check against an element-by-element reference."""
    vc = ValueContract.of(spec_with({"min": -3, "max": 40, "source": "s"}), parse_config({}))
    g = torch.Generator().manual_seed(7)
    for _ in range(200):
        t = torch.randint(-6, 44, (int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))),
                          generator=g)
        flat = t.flatten().tolist()
        bad = next((i for i, v in enumerate(flat) if not -3 <= v <= 40), None)
        if bad is None:
            vc.check({"ids": t})
            continue
        with pytest.raises(RequestError) as e:
            vc.check({"ids": t})
        pos = [bad // t.shape[1], bad % t.shape[1]]
        assert f"holds {flat[bad]} at position {pos}" in e.value.message


def test_layout_1_files_still_load_and_layout_2_round_trips(tmp_path):
    old = {"format": 1, "backend": "export", "artifact": "model.pt2", "sha256": "x", "device": "cpu",
           "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 4]}],
           "outputs": [{"name": "output", "dtype": "float32", "shape": [None, 2]}],
           "output_structure": "tensor", "batch_min": 1, "batch_max": 8, "torch_version": "2.13.0"}
    (tmp_path / "artifact.json").write_text(json.dumps(old))
    spec = read_spec(str(tmp_path))
    assert spec.dims == {} and spec.inputs[0].values is None
    new = ArtifactSpec("export", "model.pt2", "x", "cpu",
                       (TensorSpec("ids", "int64", (None, "S"), {"min": 0, "max": 9, "source": "t"}),),
                       (TensorSpec("y", "float32", (None, "S", 3)),), "tensor", 1, 8, "2.13.0", dims={"S": (2, 30)})
    write_spec(new, str(tmp_path))
    again = read_spec(str(tmp_path))
    assert again.dims == {"S": (2, 30)} and again.inputs == new.inputs and again.outputs == new.outputs
    raw = json.loads((tmp_path / "artifact.json").read_text())
    raw["inputs"][0]["shape"] = [None, "T"]
    (tmp_path / "artifact.json").write_text(json.dumps(raw))
    with pytest.raises(LoadError, match="names listed under \"dims\""):
        read_spec(str(tmp_path))


def test_runner_groups_requests_of_different_lengths_each_as_if_alone():
    from handlers.artifact.kinds import LoadedModel
    from handlers.run import runner_for

    spec = ArtifactSpec("export", "m", "", "cpu", (TensorSpec("ids", "int64", (None, "S")),),
                        (TensorSpec("y", "float32", (None, "S")), TensorSpec("n", "float32", (None,))),
                        "dict", 1, 4, torch.__version__, dims={"S": (1, 50)})

    def fn(ids):
        return {"y": ids.float().cumsum(1), "n": ids.float().sum(1) / ids.shape[1]}

    runner = runner_for(LoadedModel(fn, spec, torch.device("cpu"), "test"), spec, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    reqs = [{"ids": torch.randint(0, 9, (r, n), generator=g)} for r, n in [(1, 5), (2, 17), (1, 5), (3, 1), (1, 17)]]
    out = runner.run(reqs)
    for r, o in zip(reqs, out):
        want = fn(r["ids"])
        assert torch.equal(o["y"], want["y"]) and torch.equal(o["n"], want["n"])


def test_pad_plan_pads_to_buckets_cuts_outputs_and_names_the_fix():
    from handlers.batch import PadPlan

    spec = ArtifactSpec("export", "m", "", "cpu",
                        (TensorSpec("ids", "int64", (None, "S")), TensorSpec("mask", "int64", (None, "S")),
                         TensorSpec("x", "float32", (None, 3))),
                        (TensorSpec("tok", "float32", (None, "S", 2)), TensorSpec("pooled", "float32", (None, 2))),
                        "dict", 1, 4, torch.__version__, dims={"S": (3, 50)})
    plan = PadPlan.of(spec, {"ids": 7, "mask": 0})
    assert plan.buckets == {"S": [4, 8, 16, 32, 50]} and [plan.bucket("S", n) for n in (3, 4, 5, 33, 50)] == [4, 4, 8, 50, 50]
    req = {"ids": torch.tensor([[1, 2, 3, 4, 5]]), "mask": torch.ones(1, 5, dtype=torch.int64), "x": torch.ones(1, 3)}
    sizes = plan.sizes(req)
    [target] = plan.targets([sizes], [1], lambda rows, at: None)
    padded = plan.pad(req, target)
    assert sizes == {"S": 5} and target == {"S": 8} and padded["ids"].tolist() == [[1, 2, 3, 4, 5, 7, 7, 7]]
    assert padded["mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]] and padded["x"] is req["x"]
    cut = plan.cut({"tok": torch.zeros(1, 8, 2), "pooled": torch.zeros(1, 2)}, sizes)
    assert cut["tok"].shape == (1, 5, 2) and cut["pooled"].shape == (1, 2)
    assert PadPlan.of(spec, {}) is None
    with pytest.raises(ValueError, match="missing: \\['mask'\\]"):
        PadPlan.of(spec, {"ids": 0})
    with pytest.raises(ValueError, match="unknown: \\['nope'\\]"):
        PadPlan.of(spec, {"ids": 0, "mask": 0, "nope": 1})
    with pytest.raises(ValueError, match="outside"):
        PadPlan.of(spec, {"ids": 0, "mask": 0}, (2, 16))
    assert PadPlan.of(spec, {"ids": 0, "mask": 0}, (16,)).buckets == {"S": [16, 50]}


def _text_spec(dims=None):
    return ArtifactSpec("export", "m", "", "cpu",
                        (TensorSpec("ids", "int64", (None, "S")), TensorSpec("mask", "int64", (None, "S"))),
                        (TensorSpec("pooled", "float32", (None,)),), "dict", 1, 16, torch.__version__,
                        dims=dims or {"S": (1, 64)})


def test_pad_targets_merge_length_buckets_exactly_as_the_cheapest_split():
    """Differential: the dynamic programme's split against every contiguous split of the sorted
    buckets tried one by one, on random batches and random call costs (a fixed part per call,
    a part per padded token, some shapes of unknown cost)."""
    import itertools

    from handlers.batch import PadPlan

    plan = PadPlan.of(_text_spec(), {"ids": 0, "mask": 0})
    g = torch.Generator().manual_seed(11)
    for trial in range(300):
        n = int(torch.randint(1, 9, (1,), generator=g))
        sizes = [{"S": int(torch.randint(1, 65, (1,), generator=g))} for _ in range(n)]
        rows = [int(torch.randint(1, 4, (1,), generator=g)) for _ in range(n)]
        fixed, per_token = float(torch.rand(1, generator=g)), float(torch.rand(1, generator=g)) / 100
        unknown = {int(x) for x in torch.randint(1, 25, (2,), generator=g)} if trial % 3 == 0 else set()

        def cost(r, at):
            return None if r in unknown else fixed + per_token * r * at["S"]

        got = plan.targets(sizes, rows, cost)
        own = [plan.bucket("S", s["S"]) for s in sizes]
        keys = sorted(set(own))
        rows_at = [sum(r for b, r in zip(own, rows) if b == k) for k in keys]
        best = None
        for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, len(keys)), m)
                                                  for m in range(len(keys))):
            bounds = [0, *cuts, len(keys)]
            costs = [cost(sum(rows_at[a:b]), {"S": keys[b - 1]}) for a, b in zip(bounds, bounds[1:])]
            if None not in costs and (best is None or sum(costs) < best - 1e-12):
                best = sum(costs)
        if len(keys) == 1 or best is None:
            assert got == [{"S": b} for b in own]  # nothing to merge, or no split of known cost
            continue
        runs = {}
        for b, t in zip(own, got):
            assert t["S"] >= b and t["S"] in plan.buckets["S"]
            runs.setdefault(t["S"], set()).add(b)
        chosen = sum(cost(sum(r for b, r in zip(own, rows) if b in members), {"S": at})
                     for at, members in runs.items())
        assert chosen == pytest.approx(best), (sizes, rows, got)


def test_runner_pads_a_batch_of_mixed_lengths_into_one_call_when_that_is_cheaper():
    """A masking model: requests of lengths in four buckets become one call when the runner
    says a call's fixed cost outweighs the padding, three calls when it does not; every answer
    equals the request alone either way."""
    from handlers.artifact.kinds import LoadedModel
    from handlers.run import runner_for

    spec = _text_spec()
    calls = []

    def fn(ids, mask):
        calls.append(tuple(ids.shape))
        keep = mask.float()
        return {"pooled": (ids.float() * keep).sum(1) / keep.sum(1)}

    def served(cost):
        runner = runner_for(LoadedModel(fn, spec, torch.device("cpu"), "test"), spec, torch.device("cpu"),
                            parse_config({"handler": {"pad": {"ids": 0, "mask": 0}}}))
        runner.call_cost_ms = cost
        calls.clear()
        return runner.run(reqs), list(calls)

    g = torch.Generator().manual_seed(5)
    reqs = [{"ids": torch.randint(1, 100, (1, n), generator=g), "mask": torch.ones(1, n, dtype=torch.int64)}
            for n in (3, 30, 5, 60, 31)]
    alone = [fn(**r)["pooled"] for r in reqs]
    merged, merged_calls = served(lambda rows, at: 1.0 + 0.0001 * rows * at["S"])
    split, split_calls = served(lambda rows, at: 0.001 + 0.01 * rows * at["S"])
    assert merged_calls == [(5, 64)]
    assert sorted(split_calls) == [(1, 4), (1, 8), (1, 64), (2, 32)]  # lengths 3, 5, 30 and 31, 60
    for out in (merged, split):
        assert all(torch.allclose(o["pooled"], a) for o, a in zip(out, alone))


def test_pad_along_an_inner_axis_equals_filling_and_copying():
    """Differential: PadPlan.pad's one-op padding against a tensor filled with the pad value and
    the request copied in, for a named dimension in the middle of a 4-D input."""
    from handlers.batch import PadPlan

    spec = ArtifactSpec("export", "m", "", "cpu", (TensorSpec("emb", "float32", (None, 2, "S", 3)),),
                        (TensorSpec("y", "float32", (None,)),), "dict", 1, 4, torch.__version__, dims={"S": (1, 40)})
    plan = PadPlan.of(spec, {"emb": -1.5})
    g = torch.Generator().manual_seed(2)
    for n in (1, 7, 16, 17, 33, 40):
        req = {"emb": torch.randn(2, 2, n, 3, generator=g)}
        target = {"S": plan.bucket("S", n)}
        want = torch.full((2, 2, target["S"], 3), -1.5)
        want[:, :, :n] = req["emb"]
        assert torch.equal(plan.pad(req, target)["emb"], want)


def test_pad_targets_keep_own_buckets_where_merged_runs_meet_in_a_call_of_unknown_cost():
    """Two named dimensions: the cheapest split may send two runs to one target, which then run
    as one call; where that call has no known cost (no graph) each request keeps its own buckets."""
    from handlers.batch import PadPlan

    spec = ArtifactSpec("export", "m", "", "cpu",
                        (TensorSpec("a", "int64", (None, "S")), TensorSpec("b", "int64", (None, "T"))),
                        (TensorSpec("y", "float32", (None,)),), "dict", 1, 8, torch.__version__,
                        dims={"S": (1, 4), "T": (1, 2)})
    plan = PadPlan.of(spec, {"a": 0, "b": 0})
    sizes = [{"S": 2, "T": 2}, {"S": 4, "T": 1}, {"S": 4, "T": 2}, {"S": 4, "T": 2}]
    got = plan.targets(sizes, [1, 1, 1, 1], lambda rows, at: 1.0 if rows <= 2 else None)
    assert got == sizes
    # where the meeting call is priced, the merge stands: one call at the largest buckets
    assert plan.targets(sizes, [1, 1, 1, 1], lambda rows, at: 1.0) == [{"S": 4, "T": 2}] * 4


def test_a_dimension_no_input_carries_is_not_padded():
    from handlers.batch import PadPlan

    spec = ArtifactSpec("export", "m", "", "cpu", (TensorSpec("ids", "int64", (None, "S")),),
                        (TensorSpec("y", "float32", (None, "U")),), "dict", 1, 8, torch.__version__,
                        dims={"S": (1, 16), "U": (1, 4)})
    plan = PadPlan.of(spec, {"ids": 0})
    assert plan.buckets == {"S": [1, 2, 4, 8, 16]}
    assert plan.targets([{"S": 3}, {"S": 9}], [1, 1], lambda rows, at: 1.0) == [{"S": 16}] * 2


def test_declared_padding_is_checked_at_load_and_refused_where_it_changes_answers():
    """handlers/run/padding.py: a model that masks padded positions passes (the note says so);
    one that averages every position, padding included, fails the load naming the output, the
    sizes and the fix: its padded answers would be silently wrong."""
    from handlers.artifact.kinds import LoadedModel
    from handlers.run import runner_for
    from handlers.run.padding import trial_sizes, verify_padding

    spec = _text_spec({"S": (4, 64)})
    cfg = parse_config({"handler": {"pad": {"ids": 0, "mask": 0}}})

    def masked(ids, mask):
        keep = mask.float()
        return {"pooled": (ids.float() * keep).sum(1) / keep.sum(1)}

    def unmasked(ids, mask):
        return {"pooled": ids.float().mean(1)}

    runner = runner_for(LoadedModel(masked, spec, torch.device("cpu"), "test"), spec, torch.device("cpu"), cfg)
    assert trial_sizes(runner.pad, spec.dims) == [{"S": 5}, {"S": 33}]  # padded to 8 and to 64
    note = verify_padding(LoadedModel(masked, spec, torch.device("cpu"), "test"), runner, spec, torch.device("cpu"))
    assert note == "padding checked (2 trials: answers unchanged)"
    bad = LoadedModel(unmasked, spec, torch.device("cpu"), "test")
    runner = runner_for(bad, spec, torch.device("cpu"), cfg)
    with pytest.raises(LoadError) as e:
        verify_padding(bad, runner, spec, torch.device("cpu"))
    assert "padding changes this model's answers: output 'pooled' differs by" in e.value.message
    assert "sizes {'S': 5} padded to {'S': 8}" in e.value.message and "remove handler.pad" in e.value.message
    # a mask padded with 1 (keep) instead of 0 makes the masking model read the padding too
    ones = parse_config({"handler": {"pad": {"ids": 0, "mask": 1}}})
    model = LoadedModel(masked, spec, torch.device("cpu"), "test")
    with pytest.raises(LoadError, match="give the mask input the value that marks padding"):
        verify_padding(model, runner_for(model, spec, torch.device("cpu"), ones), spec, torch.device("cpu"))


class Columns(nn.Module):
    """A recommender's sparse features: column j of `sparse` indexes table j (100, 5000 and 20
    rows), taken apart as users write it."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.tables = nn.ModuleList(nn.Embedding(n, 2) for n in (100, 5000, 20))

    def forward(self, sparse):
        cols = {"select": lambda: [sparse[:, j] for j in range(3)],
                "unbind": lambda: sparse.unbind(1),
                "split": lambda: [c.squeeze(1) for c in sparse.split(1, dim=1)],
                "chunk": lambda: [c.reshape(-1) for c in sparse.chunk(3, dim=1)],
                "slice": lambda: [sparse[:, j:j + 1] for j in range(3)],
                "index": lambda: [sparse[:, torch.tensor([j])] for j in range(3)],
                "t": lambda: list(sparse.t())}[self.how]()
        return sum(t(c).reshape(sparse.shape[0], -1).sum(1) for t, c in zip(self.tables, cols))


TABLES = [{"min": 0, "max": n - 1, "source": f"embedding table of {n} rows"} for n in (100, 5000, 20)]


@pytest.mark.parametrize("how", ["select", "unbind", "split", "chunk", "slice", "index", "t"])
def test_columns_indexing_different_tables_get_a_range_each(how):
    """The graph walk follows each position along the fixed dimension through select, slice,
    unbind, split, chunk, constant indexing and a transpose to the table it indexes; "min"/"max"
    hold what every column accepts (for readers of one range)."""
    ep = export(Columns(how), torch.zeros(2, 3, dtype=torch.long), dynamic={"sparse": {0: Dim("b", min=1, max=64)}})
    assert contract.value_ranges(ep) == {"sparse": {"min": 0, "max": 19, "axis": 1, "columns": TABLES,
                                                    "source": "a range per position along dimension 1"}}


def test_columns_mixed_back_together_share_the_tightest_bound_and_unused_columns_take_any():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Embedding(100, 2), nn.Embedding(20, 2)

        def forward(self, ids):
            # columns 0-1 reach table a through a reshape that mixes them; column 1 also table b;
            # column 2 is a count, never an index; column 3 indexes b after adding 5
            both = self.a(ids[:, :2].reshape(-1)).sum()
            return both + self.b(ids[:, 1]).sum(1) + ids[:, 2].float() + self.b(ids[:, 3] + 5).sum(1)

    got = contract.value_ranges(export(Mixed(), torch.zeros(2, 4, dtype=torch.long)))["ids"]
    assert got["axis"] == 1 and [None if c is None else (c["min"], c["max"]) for c in got["columns"]] == \
        [(0, 99), (0, 19), None, (-5, 14)]
    assert got["columns"][3]["source"] == "embedding table of 20 rows (after adding 5)"
    # every position indexing the same table: one range, as before
    same = contract.value_ranges(export(TwoUses(), torch.zeros(2, 3, dtype=torch.long)))["ids"]
    assert "columns" not in same and (same["min"], same["max"]) == (0, 4)


def rec_spec(values=None):
    values = values or {"min": 0, "max": 19, "axis": 1, "columns": TABLES, "source": "s"}
    return ArtifactSpec("export", "m", "", "cpu", (TensorSpec("dense", "float32", (None, 13)),
                                                   TensorSpec("sparse", "int64", (None, 3), values)),
                        (TensorSpec("y", "float32", (None, 1)),), "tensor", 1, 64, torch.__version__)


def test_column_ranges_are_checked_each_and_named_in_the_refusal():
    vc = ValueContract.of(rec_spec(), parse_config({}))
    assert vc.describe() == ("values checked: sparse per column of dimension 1: 0 in [0, 99] | 1 in [0, 4999] | "
                             "2 in [0, 19]")
    vc.check({"sparse": torch.tensor([[50, 840, 19], [99, 4999, 0]])})  # valid in their own columns
    cases = {(5000, 1): ([0, 1], 5000, 1, 4999, 5000), (20, 2): ([0, 2], 20, 2, 19, 20),
             (-1, 0): ([0, 0], -1, 0, 99, 100)}
    for bad, (pos, value, col, hi, rows) in cases.items():
        t = torch.tensor([[50, 840, 3]])
        t[0, bad[1]] = bad[0]
        with pytest.raises(RequestError) as e:
            vc.check({"sparse": t})
        assert e.value.message == (f"input 'sparse' holds {value} at position {pos}; column {col} of this input "
                                   f"(dimension 1) accepts values from 0 to {hi} (embedding table of {rows} rows)")


def test_column_check_agrees_with_a_plain_loop_on_random_batches():
    """Differential: the one vectorized comparison against an element-by-element reference."""
    vc = ValueContract.of(rec_spec(), parse_config({}))
    bounds = [(0, 99), (0, 4999), (0, 19)]
    g = torch.Generator().manual_seed(9)
    for _ in range(200):
        t = torch.randint(-3, 5003, (int(torch.randint(1, 5, (1,), generator=g)), 3), generator=g)
        t[:, 0] = t[:, 0] % 104 - 2
        t[:, 2] = t[:, 2] % 24 - 2
        flat = [(i, j, v) for i, row in enumerate(t.tolist()) for j, v in enumerate(row)]
        bad = next(((i, j, v) for i, j, v in flat if not bounds[j][0] <= v <= bounds[j][1]), None)
        if bad is None:
            vc.check({"sparse": t})
            continue
        with pytest.raises(RequestError) as e:
            vc.check({"sparse": t})
        assert f"holds {bad[2]} at position [{bad[0]}, {bad[1]}]; column {bad[1]} " in e.value.message


def test_user_ranges_per_column_set_one_and_refuse_a_wider_one_naming_its_table():
    derived = {"sparse": {"min": 0, "max": 19, "axis": 1, "columns": TABLES, "source": "s"}}
    inputs = [("dense", "float32", [None, 13]), ("sparse", "int64", [None, 3])]
    got = contract.tighten(derived, contract.parse_ranges(["sparse[1]=0:999"]), inputs)["sparse"]
    assert [(c["min"], c["max"]) for c in got["columns"]] == [(0, 99), (0, 999), (0, 19)]
    assert got["columns"][1]["source"] == "given with --input-range; embedding table of 5000 rows"
    # NAME=LO:HI sets every column; a NAME[COL] after it its own
    got = contract.tighten(derived, contract.parse_ranges(["sparse=0:9", "sparse[1]=5:50"]), inputs)["sparse"]
    assert [(c["min"], c["max"]) for c in got["columns"]] == [(0, 9), (5, 50), (0, 9)]
    # the case: a range fitting the largest table, given for the whole input
    with pytest.raises(contract.ContractError) as e:
        contract.tighten(derived, contract.parse_ranges(["sparse=0:4999"]), inputs)
    assert e.value.args[0] == ("--input-range sparse=0:4999 is wider than what the model accepts: column 0 of input "
                               "'sparse' takes values from 0 to 99 (embedding table of 100 rows); a value outside "
                               "would index past it. Give a range inside [0, 99], or one per column: sparse[0]=LO:HI")
    with pytest.raises(contract.ContractError, match=r"sparse\[2\]=0:20 is wider .* column 2 of input 'sparse' takes "
                                                     r"values from 0 to 19 \(embedding table of 20 rows\)"):
        contract.tighten(derived, contract.parse_ranges(["sparse[2]=0:20"]), inputs)
    with pytest.raises(contract.ContractError, match=r"has 3 columns along dimension 1 \(0 to 2\)"):
        contract.tighten(derived, contract.parse_ranges(["sparse[3]=0:1"]), inputs)
    # a column range on an input the graph gave one range (or none): along its one fixed dimension
    plain = contract.tighten({}, contract.parse_ranges(["sparse[0]=1:7"]), inputs)["sparse"]
    assert plain["axis"] == 1 and plain["columns"][0]["min"] == 1 and plain["columns"][1:] == [None, None]
    with pytest.raises(contract.ContractError, match="a range per column needs exactly one"):
        contract.tighten({}, contract.parse_ranges(["ids[0]=1:7"]), [("ids", "int64", [None, "S"])])


def test_column_contracts_round_trip_as_layout_3_and_show_in_describe(tmp_path):
    spec = rec_spec()
    write_spec(spec, str(tmp_path))
    raw = json.loads((tmp_path / "artifact.json").read_text())
    assert raw["format"] == 3 and raw["inputs"][1]["values"]["columns"] == TABLES
    again = read_spec(str(tmp_path))
    assert again.inputs == spec.inputs and again.inputs[1].columns == (1, ((0, 99), (0, 4999), (0, 19)))
    assert again.inputs[1].describe() == ("sparse: int64[Bx3] per column of dimension 1: 0 in [0, 99] | "
                                          "1 in [0, 4999] | 2 in [0, 19]")
    # files with one range stay layout 2 (older handlers read them)
    write_spec(spec_with({"min": 0, "max": 9, "source": "t"}), str(tmp_path))
    assert json.loads((tmp_path / "artifact.json").read_text())["format"] == 2
    raw["inputs"][1]["values"]["columns"] = TABLES[:2]
    (tmp_path / "artifact.json").write_text(json.dumps(raw))
    with pytest.raises(LoadError, match=r"inputs\[1\] in artifact.json is malformed \(values.axis 1 must name"):
        read_spec(str(tmp_path))


def test_examples_for_warm_up_and_capture_are_valid_requests():
    """Warm-up, graph capture and the probe run spec.example: ids inside their ranges (per
    column; not all zeros where 0 is outside), masks all ones (no fully masked row), floats and
    inputs without a range zeros; the same values every call."""
    spec = ArtifactSpec("export", "m", "", "cpu",
                        (TensorSpec("input_ids", "int64", (None, "S"), {"min": 5, "max": 9, "source": "t"}),
                         TensorSpec("attention_mask", "int64", (None, "S")), TensorSpec("x", "float32", (None, 2)),
                         TensorSpec("sparse", "int64", (None, 3), rec_spec().inputs[1].values),
                         TensorSpec("n", "int32", (None, 1))),
                        (), "dict", 2, 8, torch.__version__, dims={"S": (4, 16)})
    ex = spec.example(8)
    assert ex["input_ids"].shape == (8, 4) and ex["input_ids"].min() >= 5 and ex["input_ids"].max() <= 9
    assert len(ex["input_ids"].unique()) > 1 and bool((ex["attention_mask"] == 1).all())
    assert not ex["x"].any() and not ex["n"].any() and ex["n"].dtype == torch.int32
    for j, hi in enumerate((99, 4999, 19)):
        assert 0 <= ex["sparse"][:, j].min() and ex["sparse"][:, j].max() <= hi
    assert ex["sparse"][:, 1].max() > 19  # drawn across its own column's range, not the smallest table's
    ValueContract.of(spec, parse_config({})).check(ex)
    assert all(torch.equal(a, b) for a, b in zip(ex.values(), spec.example(8).values()))


def test_one_rule_for_masks_and_one_parser_for_name_ranges():
    """The mask rule lives in handlers/artifact/metadata.is_mask alone (padding's random requests,
    find_padding's candidates, the CUDA graphs' check and the benchmark's requests follow it), and
    NAME=LO:HI is parsed by contract.parse_named_ranges alone (--input-range and --dim)."""
    import torch

    from compiled_serving import compile as cs_compile
    from compiled_serving import find_padding
    from handlers.artifact.metadata import ArtifactSpec, TensorSpec
    from handlers.run.padding import random_request

    spec = ArtifactSpec(backend="export", artifact="m.pt2", sha256="", device="cpu",
                        inputs=(TensorSpec("ids", "int64", (None, "S")), TensorSpec("Padding_MASK", "int64", (None, "S"))),
                        outputs=(TensorSpec("y", "float32", (None, 2)),), output_structure="dict",
                        batch_min=1, batch_max=4, torch_version=torch.__version__, dims={"S": (1, 8)})
    req = random_request(spec, {"S": 5}, torch.Generator().manual_seed(0))
    assert torch.equal(req["Padding_MASK"], torch.ones(1, 5, dtype=torch.int64))  # upper case: still a mask
    assert find_padding.candidates(spec)["Padding_MASK"] == [0]
    assert cs_compile.parse_dims(["S=8:512"]) == contract.parse_named_ranges(["S=8:512"], "--dim", "")
    for bad, flag in (("S=9:8", "--dim"), ("ids=9:8", "--input-range")):
        parse = cs_compile.parse_dims if flag == "--dim" else contract.parse_ranges
        with pytest.raises((SystemExit, contract.ContractError), match=f"{flag} '{bad}': the low end must not exceed"):
            parse([bad])
