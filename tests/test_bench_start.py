"""CPU smoke of the worker start benchmark (bench/bench_start.py): real TorchServe, our archive,
one worker killed with SIGKILL and measured until it serves again. Asserts what must hold whatever
the machine's speed: a request sent after the kill is answered only once the new worker has started,
the restarted worker reuses the trial load's verdict, and the files are well formed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.server


def test_bench_start_smoke(artifacts, tmp_path):
    out = tmp_path / "start.json"
    cmd = [sys.executable, "-m", "bench.bench_start", "--artifact", str(artifacts.get("cls_aoti")),
           "--workers", "1", "--restarts", "1", "--kill-all", "--timeout", "240", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result)[:4] == ["device", "date", "torch", "command"]
    (point,) = result["points"]
    first, restart = point["worker_start"][0], point["restarts"][0]
    assert first["process and imports"] > 0 and first["trial load"] > 0
    # the verdict kept by the first start: no trial load, only the verdict file read (0.01 s on a
    # loaded 2-core host, where the first start's trial load took seconds)
    assert restart["worker_start"]["trial load"] <= 0.05 < first["trial load"], (first, restart["worker_start"])
    # the answer needs the new worker: it comes after that worker's own start
    assert restart["kill_to_answer_s"] >= restart["worker_start"]["total"] - 0.05, restart
    assert restart["kill_to_ready_s"] >= restart["worker_start"]["total"] - 0.05, restart
    # every worker killed at once (here the one): answered again only by a new worker
    assert point["kill_all"]["killed"] == 1 and point["kill_all"]["kill_to_first_answer_s"] > 0.5, point["kill_all"]
    assert point["unplanned_worker_deaths"] == 0  # each kill is one disconnect logged, no other
    assert "| 1 |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").stat().st_size > 1000
