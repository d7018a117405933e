"""CPU check of bench/bench_lm.py (issue 65 item 7): the tiny preset through cs-export-lm
(--package), cs-archive with no options and real TorchServe at 1 and 2 streams, the package's
step limits and transformers' one-stream generate; the results carry the summary the issue asks
for, and one stream's greedy tokens equal the same prompt's among the crowd and transformers'.
Speed is judged on the GPU machine (scripts/gpu_e2e.sh part lm)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.server
def test_bench_lm_tiny_on_the_cpu_end_to_end(tmp_path):
    out = tmp_path / "lm"
    cmd = [sys.executable, "-m", "bench.bench_lm", "--device", "cpu", "--preset", "tiny", "--streams", "1,2",
           "--decode", "8", "--rounds", "1", "--warmup", "0", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert list(result)[:4] == ["device", "date", "torch", "command"]
    assert result["command"].startswith("python -m bench.bench_lm ")
    s = result["summary"]
    assert set(s) >= {"tok_s", "transformers_tok_s", "ours_over_transformers", "streams32_over_1"}
    assert set(s["tok_s"]) == {"1", "2"} and all(v > 0 for v in s["tok_s"].values()), s
    assert s["transformers_tok_s"]["1"] > 0 and "2" in result["transformers"]["batch"], s
    assert result["crowd"]["same_tokens"] is True, result["crowd"]
    assert result["transformers_vs_ours_first_difference"] is None  # fp32 on the CPU: generate's own tokens
    assert [p["streams"] for p in result["step_limits"]["points"]] == [1, 2], result["step_limits"]
    for q in result["step_limits"]["points"]:  # the round's limit pays for the prompts too
        assert q["prefill_round_ms"] > 0 and 0 < q["round_tok_s"] < q["tok_s"], q
    assert set(s["served_over_limit"]) == set(s["served_over_step_limit"]) == {"1", "2"}, s
    assert all(s["served_over_limit"][n] > s["served_over_step_limit"][n] for n in ("1", "2")), s
    m = result["model"]
    assert m["export_command"][:1] == ["cs-export-lm"] and "--package" in m["export_command"], m
    assert m["slots"] == 8 and m["max_seq"] == 512 and m["export_s"] > 0, m
    # one stream's TTFT split: the package's own prefill, the worker's (its metrics), the client's
    t = result["ttft_one_stream"]
    assert t["prefill_ms"] > 0, t  # (on this CPU its threads contend with the rest: no ordering asserted)
    assert t["worker_mean_ms"] is not None and 0 < t["worker_mean_ms"] <= t["client_p50_ms"], t  # a part of it
    assert result["points"][0]["worker_ttft_count"] == 1, result["points"][0]  # the measured stream's only
    assert "Time to first token of one stream" in out.with_suffix(".md").read_text()


def test_the_summary_compares_each_count_and_the_crowd():
    from bench.bench_lm import byte_tokenizer, summary

    points = [{"streams": n, "aggregate_tok_s": t} for n, t in ((1, 100.0), (8, 700.0), (32, 1300.0))]
    hf = {"one_stream": {"tok_s": 50.0}, "batch": {"8": {"tok_s": 350.0}, "32": {"error": "RuntimeError: x"}}}
    s = summary(points, hf)
    assert s["transformers_tok_s"] == {"1": 50.0, "8": 350.0, "32": None}
    assert s["ours_over_transformers"] == {"1": 2.0, "8": 2.0} and s["streams32_over_1"] == 13.0
    assert s["targets"] == {"ahead_of_transformers_at_every_count": False, "streams32_over_1_at_least_12": True}
    tok = byte_tokenizer(1000)
    assert len(tok) == 1000 and tok.eos_token_id == 999 and tok.decode(tok("héllo")["input_ids"]) == "héllo"
