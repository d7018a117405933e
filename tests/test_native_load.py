"""bench/native_load.py: reading wrk's report and h2load's per-request log (the tools themselves run on
the GPU machine, carried there; their output formats are these)."""
import pytest

from bench import native_load

WRK_REPORT = """Running 3s test @ http://127.0.0.1:60887/predictions/m
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     4.12ms    3.22ms  42.36ms   92.16%
    Req/Sec   529.67     98.31   680.00     66.67%
  Latency Distribution
     50%  {p50}
     75%    4.13ms
     90%    6.31ms
     99%  {p99}
  1602 requests in 3.04s, 641.43KB read
{extra}Requests/sec:    527.75
Transfer/sec:    211.31KB
"""


@pytest.mark.parametrize("p50,p99,want50,want99", [("3.34ms", "16.92ms", 3.34, 16.92),
                                                    ("812.00us", "1.20s", 0.81, 1200.0)])
def test_wrk_report_latency_units(p50, p99, want50, want99):
    got = native_load.parse_wrk(WRK_REPORT.format(p50=p50, p99=p99, extra=""), 3.0)
    assert (got["p50_ms"], got["p99_ms"]) == (want50, want99)
    assert got["ok"] == got["requests"] == 1602 and got["errors"] == 0
    assert got["req_s"] == round(1602 / 3.0, 1)  # over the measured seconds, not wrk's own clock


def test_wrk_report_counts_bad_answers_and_socket_errors():
    extra = "  Socket errors: connect 0, read 2, write 0, timeout 1\n  Non-2xx or 3xx responses: 10\n"
    got = native_load.parse_wrk(WRK_REPORT.format(p50="3ms", p99="9ms", extra=extra), 2.0)
    assert got["ok"] == 1592 and got["errors"] == 13 and got["requests"] == 1605
    assert got["req_s"] == 796.0
    assert any("non-2xx" in s for s in got["error_samples"]) and any("socket" in s for s in got["error_samples"])


def test_h2load_log_percentiles_and_statuses(tmp_path):
    import numpy as np

    elapsed_us = [1000 + 37 * i for i in range(200)]
    lines = [f"{1795603362482575 + i}\t{503 if i % 50 == 0 else 200}\t{us}" for i, us in enumerate(elapsed_us)]
    log = tmp_path / "log"
    log.write_text("\n".join(lines) + "\n")
    got = native_load.parse_h2load_log(str(log), 2.0)
    ok_ms = [us / 1e3 for i, us in enumerate(elapsed_us) if i % 50]
    assert got["errors"] == 4 and got["ok"] == 196 and got["error_samples"] == ["HTTP 503"]
    assert got["p50_ms"] == round(float(np.percentile(ok_ms, 50)), 2)
    assert got["p99_ms"] == round(float(np.percentile(ok_ms, 99)), 2)


def test_missing_tool_says_how_to_get_it(monkeypatch):
    monkeypatch.delenv("LOADGEN", raising=False)
    monkeypatch.setattr(native_load.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="nghttp2-client"):
        native_load.tool("h2load")
    monkeypatch.setenv("LOADGEN", "/opt/kit/run")
    assert native_load.tool("wrk") == ["/opt/kit/run", "wrk"]
