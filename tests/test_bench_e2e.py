"""CPU smoke of the end-to-end benchmark (bench/bench_e2e.py): real TorchServe, our archive,
the stock handler and the echo transport limit, a short sweep. Asserts only that it produced
well-formed results with every answer checked and none wrong; speed is judged on the GPU
machine (docs/results/e2e_*)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.server
def test_bench_e2e_smoke(artifacts, tmp_path):
    out = tmp_path / "e2e"
    cmd = [sys.executable, "-m", "bench.bench_e2e", "--artifact", str(artifacts.get("cls_export")),
           "--factory", "examples/models.py:classifier", "--out", str(out), "--clients", "1,4",
           "--seconds", "1.0", "--warmup-seconds", "0.5", "--rounds", "2", "--cpu-workers", "1", "--batch-size", "4",
           "--thread-sweep", "1", "--sweep-clients", "2", "--processes", "1",
           "--first-request", "--idle-seconds", "0.2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert list(result)[:4] == ["device", "date", "torch", "command"]
    assert result["command"].startswith("python -m bench.bench_e2e ")
    seen = {(p["handler"], p["clients"]) for p in result["points"]}
    assert seen == {("ours", 1), ("ours", 4), ("stock", 1), ("stock", 4), ("echo", 1), ("echo", 4),
                    ("ours", 2), ("stock", 2), ("ours_t1", 2), ("stock_default", 2)}
    for p in result["points"]:
        assert len(p["rounds_req_s"]) == 2 and p["req_s"] == round(sum(p["rounds_req_s"]) / 2, 2), p
        assert p["ok"] > 0 and p["errors"] == 0, p
        assert p["req_s"] > 0 and 0 < p["p50_ms"] <= p["p99_ms"], p
        assert p["mismatches"] == 0, p  # the echo's zeros are checked too
        assert p["worker_deaths_in_run"] == 0
        assert p["ours_cpu_threads"] == 1  # 2 cores, 1 worker: one core left to the frontend
    assert result["limits"]["0"]["forward_ms"] > 0
    rows = result["summary"]["ours"]
    assert {r["clients"] for r in rows} == {1, 2, 4} and all(r["vs_stock"] for r in rows)
    assert all(r["vs_transport"] for r in rows if r["clients"] != 2)  # echo runs on the main sweep only
    assert result["summary"]["thread_budget"][0]["set"] == "0:2"
    md = out.with_suffix(".md").read_text()
    assert "| ours | 0 | 4 |" in md and result["command"] in md and "in 2 rounds" in md
    # where the cores went: the frontend, the workers and the clients all worked in every point
    for p in result["points"]:
        c = p["cpu_cores"]
        assert c["frontend"] > 0 and c["workers"] > 0 and c["load_generator"] > 0, p
        assert c["host_busy"] <= c["host_cores"] + 0.2, p
    assert "Where the host's cores went" in md
    assert out.with_suffix(".png").stat().st_size > 10_000
    # first request after READY: echo first (the frontend's own first request), every answer
    # checked (first_request raises on a wrong one), figures consistent with each other
    firsts = result["first_requests"]
    assert [f["handler"] for f in firsts] == ["echo", "ours", "stock"]
    for f in firsts:
        assert 0 < f["steady_median_ms"] and f["first_ms"] > 0 and f["after_idle_median_ms"] > 0
        assert abs(f["first_over_steady"] - f["first_ms"] / f["steady_median_ms"]) < 0.01
    assert "| ours | 0 |" in md.split("First request after READY")[1]


def test_rounds_combine_counts_and_average_rates():
    from bench.bench_e2e import combine_rounds

    a = {"requests": 10, "ok": 9, "errors": 1, "error_samples": ["503: x"], "mismatches": 0, "req_s": 100.0,
         "p50_ms": 2.0, "p99_ms": 4.0, "seconds": 1.0, "handler": "ours", "clients": 4, "round": 0}
    b = dict(a, requests=12, ok=12, errors=0, error_samples=[], req_s=120.0, p50_ms=3.0, p99_ms=5.0, round=1)
    c = combine_rounds([a, b])
    assert (c["requests"], c["ok"], c["errors"], c["mismatches"]) == (22, 21, 1, 0)
    assert (c["req_s"], c["p50_ms"], c["p99_ms"], c["rounds_req_s"]) == (110.0, 2.5, 4.5, [100.0, 120.0])
    assert c["error_samples"] == ["503: x"] and "round" not in c
    assert combine_rounds([a]) == {k: v for k, v in a.items() if k != "round"}
    # core accounting, with its nested busiest-process group, averages key by key
    cores = {"frontend": 2.0, "host_cores": 32, "busiest": {"workers": 0.5}}
    c = combine_rounds([dict(a, cpu_cores=cores), dict(b, cpu_cores=dict(cores, frontend=3.0, busiest={"workers": 0.7}))])
    assert c["cpu_cores"] == {"frontend": 2.5, "host_cores": 32, "busiest": {"workers": 0.6}}
    assert isinstance(c["cpu_cores"]["host_cores"], int)
    # a thread kind cut from one round's top 8 averages over the rounds that have it, not as 0
    c = combine_rounds([dict(a, cpu_cores={"frontend_threads": {"epoll": 4.0, "GC": 1.0}}),
                        dict(b, cpu_cores={"frontend_threads": {"epoll": 6.0}})])
    assert c["cpu_cores"] == {"frontend_threads": {"epoll": 5.0, "GC": 1.0}}


def test_ts_config_lines_must_be_key_value():
    from bench.bench_e2e import parse_args

    base = ["--artifact", "a", "--factory", "f.py:m", "--out", "o"]
    assert parse_args(base + ["--ts-config", "number_of_netty_threads=8"]).ts_config == ["number_of_netty_threads=8"]
    for bad in ("number_of_netty_threads", "=8", "netty threads=8"):
        with pytest.raises(SystemExit):
            parse_args(base + ["--ts-config", bad])


@pytest.mark.server
def test_cpu_usage_counts_a_busy_child_as_load_generator():
    """Two children of this process spinning: load generator is the CPU time their own
    /proc/PID/stat gives over the same window (the baseline, read just before and just after each
    snapshot, so the snapshot's reading lies between; a loaded host gives them less than two
    cores and both see that), and the busiest single process is one of them, not the sum."""
    import os
    import time

    from bench import cpu_usage

    tick = os.sysconf("SC_CLK_TCK")
    children = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]

    def own():
        return [cpu_usage._jiffies(cpu_usage.read_stat(f"/proc/{c.pid}/stat")[1]) for c in children]
    try:
        b0, before, b1 = own(), cpu_usage.snapshot(), own()
        deadline = time.monotonic() + 120
        while sum(own()) - sum(b1) < tick and time.monotonic() < deadline:
            time.sleep(0.1)  # until they have had a second of CPU together, however loaded the host
        a0, after, a1 = own(), cpu_usage.snapshot(), own()
    finally:
        for child in children:
            child.kill()
            child.wait()
    got, per_s = cpu_usage.usage(before, after), 1 / tick / (after["t"] - before["t"])
    low, high = [a - b for a, b in zip(a0, b1)], [a - b for a, b in zip(a1, b0)]
    assert sum(low) >= tick, f"the children had {sum(low)} jiffies"
    assert sum(low) * per_s - 0.01 <= got["load_generator"] <= sum(high) * per_s + 0.01, (got, low, high)
    assert max(low) * per_s - 0.01 <= got["busiest"]["load_generator"] <= max(high) * per_s + 0.01, (got, low, high)
    assert got["host_busy"] >= got["load_generator"] - 0.15 and got["host_cores"] >= 1 and got["irq"] >= 0, got
    assert cpu_usage.usage(None, before) is None


def test_a_process_exiting_inside_the_window_drops_out_of_its_group():
    """Group cores come from per-process differences: a worker that exited between the two
    snapshots neither subtracts its whole life (negative cores) nor counts."""
    import os

    from bench import cpu_usage

    tick = os.sysconf("SC_CLK_TCK")
    host = {"host_busy": 0, "host_irq": 0, "host_total": 0, "frontend_threads": {}}
    before = dict(host, t=0.0, procs={"1": ("workers", 50 * tick), "2": ("workers", 10 * tick)})
    after = dict(host, t=2.0, procs={"2": ("workers", 12 * tick), "3": ("workers", tick)})
    got = cpu_usage.usage(before, after)
    assert got["workers"] == 1.5 and got["busiest"]["workers"] == 1.0, got  # (2 + 1) s over 2 s


def test_py_spy_started_by_the_benchmark_is_not_load():
    """bench_e2e --spy's samplers are children of the benchmark like the clients, but their CPU
    is the measurement's, not load: no group (the host's "other")."""
    from bench.cpu_usage import _group

    me = 4242
    assert _group("7", b"/v/bin/py-spy\x00record\x00--pid\x0012", me, me) is None
    assert _group("8", b"/v/bin/python\x00-c\x00from multiprocessing.spawn", me, me) == "load_generator"
    assert _group("9", b"python3\x00/ts/model_service_worker.py", 1, me) == "workers"
    assert _group("9", b"python3\x00/r/compiled_serving/prefork.py\x00--zygote\x00k", 1, me) == "workers"


@pytest.mark.server
def test_cores_by_key_of_a_busy_process():
    """A spinning child's threads add up to the cores its process used in the same window (its
    /proc/PID/stat, the baseline: a loaded host gives the child less than a core, and both
    readings see that), all under the name of its main thread with the digits written as #, and
    its busiest thread is that main thread."""
    import os
    import time

    from bench.cpu_usage import _cores_by_key, _jiffies, _threads, read_stat

    tick = os.sysconf("SC_CLK_TCK")
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        def snap():
            threads, (_, fields) = _threads(str(child.pid)), read_stat(f"/proc/{child.pid}/stat")
            return threads, _jiffies(fields), time.monotonic()
        before = snap()
        deadline = time.monotonic() + 120
        while (after := snap())[1] - before[1] < tick // 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # until the child has had half a second of CPU, however loaded the host
    finally:
        child.kill()
        child.wait()
    seconds = after[2] - before[2]
    process = (after[1] - before[1]) / tick / seconds
    assert after[1] - before[1] >= tick // 2, f"the child had {after[1] - before[1]} jiffies in {seconds:.0f} s"
    total, top = _cores_by_key(before[0], after[0], tick, seconds)
    slack = 3 / tick / seconds  # a tick of the spinning thread may fall between the two files' reads, at each end
    assert abs(sum(total.values()) - process) <= slack, (total, process)
    assert max(top.values()) >= process - slack and all(top[k] <= total[k] + 1e-9 for k in total), (top, total)
    assert all(not any(ch.isdigit() for ch in k) for k in total), total
    assert _threads("999999999") == {}
    # two threads of one kind: the kind adds them up, the busiest is the larger; a new thread counts from 0
    total, top = _cores_by_key({"1": ("loop#", 100)}, {"1": ("loop#", 200), "2": ("loop#", 50)}, 100, 1.0)
    assert total == {"loop#": 1.5} and top == {"loop#": 1.0}


def test_variant_models_name_each_variant_once():
    """--variant NAME:OPTS is served as ours_NAME; the same names order the load points and the
    first requests, so they come from one function."""
    from bench.bench_e2e import parse_args, variant_models

    args = parse_args(["--artifact", "a", "--factory", "f.py:g", "--out", "o",
                       "--variant", "nographs:cuda_graphs=off", "--variant", "spin:cuda_sync=spin,cpu_threads=2"])
    assert variant_models(args) == ["ours_nographs", "ours_spin"]


@pytest.mark.server
def test_bench_e2e_drives_a_text_model_with_integer_inputs_and_varying_lengths(artifacts, tmp_path):
    """Two int64 inputs (ids inside the value contract's range, the mask all ones), lengths
    drawn per request; every answer of ours, the stock handlers (eager, and calling the same
    AOTInductor package) and the echo checked."""
    out = tmp_path / "text"
    cmd = [sys.executable, "-m", "bench.bench_e2e", "--artifact", str(artifacts.get("text_tiny_aoti")),
           "--factory", "examples/text_encoder.py:text_encoder_tiny", "--out", str(out), "--clients", "2",
           "--seconds", "1.0", "--warmup-seconds", "0.3", "--rounds", "1", "--cpu-workers", "1",
           "--batch-size", "4", "--processes", "1", "--handlers", "ours,stock,stock_aoti,echo",
           "--lengths", "uniform:4:40", "--distinct-inputs", "6",
           "--variant", "pad:pad={input_ids: 0, attention_mask: 0}", "--spy", "100"]
    cmd[cmd.index("--seconds") + 1] = "3.0"  # --spy samples all but the window's last second
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert {p["handler"] for p in result["points"]} == {"ours", "ours_pad", "stock", "stock_aoti", "echo"}
    assert all(r["vs_stock_aoti"] for r in result["summary"]["ours"])
    # the declared padding is measured and set against the same limits as ours
    assert [(v["handler"], v["clients"]) for v in result["summary"]["variants"]] == [("ours_pad", 2)]
    assert result["summary"]["variants"][0]["vs_transport"] > 0
    # the GPU limit covers the lengths the run sent (CPU here: plain calls only, no graphs)
    limit = result["limits"]["0"]
    assert 1 <= len(limit["per_size"]) <= 6 and all(4 <= r["S"] <= 40 for r in limit["per_size"])
    assert limit["padded_to"] is None and all(r["graph_replay_ms"] is None for r in limit["per_size"])
    for p in result["points"]:
        assert p["ok"] > 0 and p["errors"] == 0 and p["mismatches"] == 0, p
    assert "--lengths uniform:4:40" in result["command"]
    assert "processes sampled" in out.with_suffix(".md").read_text()
    # --spy: py-spy sampled the workers during each point; ours ran its model, the echo did not
    spies = {p["handler"]: p["spy"] for p in result["points"]}
    assert all(not s.get("failures") and s["processes"] >= 5 for s in spies.values()), spies
    assert spies["ours"]["stages"].get("handler: run", 0) > 0, spies["ours"]
    assert "handler: run" not in spies["echo"]["stages"] and spies["echo"]["us_per_request"] > 0
    assert spies["ours"]["workers_cpu_us_per_request"] > 0
    assert "Where the workers' time went" in out.with_suffix(".md").read_text()
    import torch

    from handlers.artifact.metadata import read_spec
    from bench.bench_e2e import draw_lengths, one_request

    spec = read_spec(str(artifacts.get("text_tiny_aoti")))

    class Args:
        lengths, mask_inputs = "uniform:4:40", ""

    g = torch.Generator().manual_seed(0)
    reqs = [one_request(spec, Args, g) for _ in range(30)]
    lengths = {x["input_ids"].shape[1] for x in reqs}
    assert len(lengths) > 5 and min(lengths) >= 4 and max(lengths) <= 40
    assert all(bool((x["attention_mask"] == 1).all()) for x in reqs)
    assert all(0 <= int(x["input_ids"].min()) and int(x["input_ids"].max()) <= 999 for x in reqs)
    assert draw_lengths("choice:8,300", spec.dims, g)["S"] in (8, 64)  # clamped into the range


@pytest.mark.server
def test_gpu_limit_weights_each_length_by_how_often_the_run_sends_it(artifacts):
    """The limit is the served batch over the mean time per batch, each distinct size counted as
    often as requests of that size are sent (here one size twice as often as the other)."""
    import torch

    from handlers.artifact.metadata import read_spec
    from bench.bench_e2e import gpu_limit

    spec = read_spec(str(artifacts.get("text_tiny_aoti")))
    got = gpu_limit(spec, torch.device("cpu"), 4, [{"S": 8}, {"S": 60}, {"S": 60}], {}, iters=5)
    by = {r["S"]: r["forward_ms"] for r in got["per_size"]}
    assert sorted(by) == [8, 60] and got["batch"] == 4
    mean = (by[8] + 2 * by[60]) / 3
    assert got["mean_batch_ms"] == pytest.approx(mean, rel=1e-3)
    assert got["img_s"] == pytest.approx(4 / mean * 1e3, rel=1e-2)


def test_declared_pad_reads_the_first_padding_variant_with_its_buckets():
    import argparse

    from bench.bench_e2e import declared_pad

    def args(*variants):
        return argparse.Namespace(variant=list(variants))

    assert declared_pad(args()) == ({}, ())
    assert declared_pad(args("nographs:cuda_graphs=off")) == ({}, ())
    assert declared_pad(args("pad:pad={input_ids: 0, attention_mask: 0}")) == ({"input_ids": 0, "attention_mask": 0}, ())
    assert declared_pad(args("x:cuda_sync=spin", "pb:pad={ids: 1},pad_buckets=[16, 64]",
                             "later:pad={ids: 2}")) == ({"ids": 1}, (16, 64))


@pytest.mark.server
def test_bench_e2e_with_a_transformers_model_archived_with_no_options(hf_bert, tmp_path):
    """The user's own files (the tiny transformers BERT's package and program) handed to bench_e2e
    as to the archive: imported, ours archived with no options (the import found padding safe, and
    the run prints the archive's choice), the stock handlers padding each batch to its longest
    request; every answer, the per-token output included, equal to eager at its own length."""
    d, _ = hf_bert
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "bench.bench_e2e", "--artifact", str(d / "package.pt2"), "--program",
           str(d / "program.pt2"), "--factory", "examples/hf_bert.py:bert_tiny", "--out", str(out),
           "--clients", "4", "--seconds", "1.0", "--warmup-seconds", "0.3", "--rounds", "1", "--cpu-workers", "1",
           "--batch-size", "4", "--max-batch-delay", "5", "--processes", "1", "--handlers", "ours,stock,stock_aoti",
           "--lengths", "uniform:4:40", "--distinct-inputs", "6"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "cs-archive: pad={input_ids: 0, attention_mask: 0}: answers unchanged" in r.stdout, r.stdout[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert {p["handler"] for p in result["points"]} == {"ours", "stock", "stock_aoti"}
    for p in result["points"]:
        assert p["ok"] > 0 and p["errors"] == 0 and p["mismatches"] == 0, p
    assert result["model"] == "bert_tiny_int64_aoti"


def test_stock_handler_pads_a_batch_to_its_longest_request(monkeypatch):
    """The stock peer as users write it for texts: one call per batch, every request padded with
    zeros (ids 0, mask 0) to the batch's longest, per-token outputs cut back to each request's
    length; each answer equals the model on that request alone (the tiny encoder masks padding).
    TorchServe's BaseHandler is stubbed: importing it sets process-wide matmul precision."""
    import importlib.util
    import types

    import torch
    from safetensors.torch import load, save

    from examples.text_encoder import text_encoder_tiny

    monkeypatch.setitem(sys.modules, "ts.torch_handler.base_handler", types.SimpleNamespace(BaseHandler=object))
    spec = importlib.util.spec_from_file_location("stock_handler_under_test", ROOT / "bench/baselines/stock_handler.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class PerToken(torch.nn.Module):  # the pooled output, and a per-token one with the length
        def __init__(self):
            super().__init__()
            self.enc = text_encoder_tiny()

        def forward(self, input_ids, attention_mask):
            calls.append(tuple(input_ids.shape))
            return {**self.enc(input_ids, attention_mask), "ids": input_ids * attention_mask}

    calls = []
    h = mod.StockHandler()
    h.device, h.model = torch.device("cpu"), PerToken().eval()
    h.input_names, h.output_names = ["input_ids", "attention_mask"], ["pooled", "ids"]
    h.in_axes, h.out_axes = [["input_ids", 1, "S"], ["attention_mask", 1, "S"]], [["ids", 1, "S"]]
    g = torch.Generator().manual_seed(0)
    reqs = [{"input_ids": torch.randint(0, 1000, (rows, n), generator=g), "attention_mask": torch.ones(rows, n, dtype=torch.int64)}
            for rows, n in ((1, 5), (2, 17), (1, 9))]
    answers = [load(a) for a in h.handle([{"body": save(r)} for r in reqs], None)]
    assert calls == [(4, 17)]
    for r, a in zip(reqs, answers):
        with torch.inference_mode():
            want = h.model(r["input_ids"], r["attention_mask"])
        torch.testing.assert_close(a["pooled"], want["pooled"], rtol=1e-4, atol=1e-5)
        assert torch.equal(a["ids"], r["input_ids"])


def test_the_summary_carries_the_engine_keys_of_issue_64():
    from bench.bench_e2e import summary

    def point(h, c, req_s, p50):
        return {"handler": h, "gpus": 1, "clients": c, "req_s": req_s, "p50_ms": p50}

    points = [point("echo", 64, 1000.0, 1.0), point("echo", 128, 2000.0, 2.0), point("echo", 1, 500.0, 1.0),
              point("ours", 64, 400.0, 2.0), point("ours", 128, 500.0, 3.0), point("ours", 1, 300.0, 2.5),
              point("ours_engine", 64, 800.0, 1.5), point("ours_engine", 128, 1500.0, 2.0),
              point("ours_engine", 1, 290.0, 2.75)]
    s = summary(points, {})
    assert s["ours_over_echo_c64"] == 0.8 and s["ours_over_echo_c128"] == 0.75
    assert s["gpu_mib_all_processes"] is None  # bench_shared's, not this run's
    # the per-worker path was retired (issue 64): no key is held against it
    assert not {"c1_p50_delta_ms", "per_worker_over_echo_c64", "per_worker_over_echo_c128"} & set(s)
    assert "ours_over_echo_c64" not in summary([p for p in points if p["handler"] != "ours_engine"], {})
    # without the archive's own count, the first engine variant of the run is the one the keys describe
    renamed = [dict(p, handler="ours_engine12") if p["handler"] == "ours_engine" else p for p in points]
    renamed += [point("ours_engine24", 64, 900.0, 1.4), point("ours_engine24", 128, 1800.0, 1.9)]
    s = summary(renamed, {})
    assert s["engine_variant"] == "ours_engine12" and s["ours_over_echo_c128"] == 0.75
    assert s["engine24_over_echo_c128"] == 0.9 and "engine12_over_echo_c128" not in s
    # ours served by the engine (handler.engine auto, the default on a GPU): ours is the one described
    s = summary(renamed, {}, ours_engine=True)
    assert s["engine_variant"] == "ours" and s["ours_over_echo_c64"] == 0.4 and s["ours_over_echo_c128"] == 0.25
    assert s["engine12_over_echo_c128"] == 0.75 and s["engine24_over_echo_c128"] == 0.9


def test_ours_is_read_from_its_own_workers_lines_not_from_a_variants_lines():
    """ours served by the engine beside ours_cpu (device_type=cpu: its workers run the model), whose
    load line names its CPU threads: ours is still the engine's (the summary's issue-64 keys depend on it)."""
    from bench.bench_e2e import chosen_threads, model_lines

    log = "\n".join([
        "2026-11-29T14:00:00,000 [INFO ] W-9000-ours_1.0-stdout MODEL_LOG - served by the engine: engine pid 7",
        "2026-11-29T14:00:00,001 [INFO ] W-9010-ours_cpu_1.0-stdout MODEL_LOG - loaded; CPU threads: 1 "
        "intra-op / 1 inter-op thread(s) (decided at load)",
    ])
    assert chosen_threads(log, "ours") is None
    assert "served by the engine" in model_lines(log, "ours")
    assert chosen_threads(log, "ours_cpu") == 1
    assert model_lines("no worker names here", "ours") == "no worker names here"
