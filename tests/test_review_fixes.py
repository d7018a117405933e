"""Defects found in review of this revision, each pinned by a test that fails without its fix."""
from __future__ import annotations

import json

import pytest
import torch

from handlers import oip
from handlers.admission import Limits, admit
from handlers.errors import PayloadTooLarge, ServingError
from handlers.pipeline import infer
from test_units import make_spec
from worker_kit import make_worker, ready_health


class ReusingRunner:
    """Returns views of one reused output buffer, as the CUDA runner's pinned host outputs are;
    fails on batches of several requests, so the handler retries them one by one."""

    def __init__(self):
        self.out = torch.zeros(1, 4)

    def run(self, requests):
        if len(requests) > 1:
            raise RuntimeError("simulated batch failure")
        self.out.copy_(requests[0]["x"] * 10)
        return [{"y": self.out[:1]}]


def test_one_by_one_retry_keeps_each_requests_own_answer():
    worker = make_worker(make_spec(), ReusingRunner())
    batch = [{"x": torch.full((1, 4), float(i))} for i in range(3)]
    outs = infer(worker, ready_health(), batch)
    assert [o["y"][0, 0].item() for o in outs] == [0.0, 10.0, 20.0]  # not [20, 20, 20]


def test_retry_stops_running_after_a_device_fault():
    calls = []

    class Sticky:  # the batch fails for an ordinary reason, its first request with a device fault
        def run(self, requests):
            calls.append(len(requests))
            raise RuntimeError("CUDA error: device-side assert triggered" if len(requests) == 1
                               else "simulated batch failure")

    worker, health = make_worker(make_spec(), Sticky()), ready_health()
    import handlers.faults as faults

    real = faults.exit_soon
    faults.exit_soon = lambda reason, delay_s=0: None
    try:
        outs = infer(worker, health, [{"x": torch.zeros(1, 4)}] * 3)
    finally:
        faults.exit_soon = real
    assert calls == [3, 1] and all(isinstance(o, ServingError) for o in outs)
    assert [o.error_type for o in outs[1:]] == ["WorkerRestarting"] * 2 and health.state == "broken"


def test_v2_binary_json_part_obeys_the_json_cap():
    limits = Limits(1 << 30, 1024, 8, True, max_json_bytes=1 << 10)
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                     "data": [0.0] * 4}], "pad": "x" * 2048}).encode()
    with pytest.raises(PayloadTooLarge, match=r"JSON part of this v2 binary request is 2\d{3} bytes.*handler\.max_json_mb"):
        admit({"body": bytearray(header)}, make_spec(), limits, None, None, str(len(header)))


def test_oversized_oip_body_is_classified_without_parsing_and_refused_413(monkeypatch):
    class Ctx:
        def get_all_request_header(self, idx):
            return {}

    body = bytearray(b'{"id": "r", "model_name": "m", "inputs": [' + b"0," * 4096 + b"0]}")
    monkeypatch.setattr(oip.strict_json, "loads", lambda *a: pytest.fail("parsed before the cap"))
    req = {"body": body}
    assert oip.is_grpc(Ctx(), 0, req, max_json_bytes=1024) and req["body"] is body
    monkeypatch.undo()
    with pytest.raises(PayloadTooLarge, match="max_json_mb"):
        admit(req, make_spec(), Limits(1 << 30, 1024, 8, True, max_json_bytes=1024))


def test_scratch_root_must_be_private(tmp_path):
    from handlers import scratch

    mine = tmp_path / "mine"
    assert scratch._owned_root(str(mine)) == str(mine) and (mine.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # writable by others: extracted libraries could be swapped
    assert scratch._owned_root(str(shared)) is None
    link = tmp_path / "link"
    link.symlink_to(mine)
    assert scratch._owned_root(str(link)) is None


def test_probe_child_loads_as_the_worker_will(monkeypatch):
    """The crash-safe probe passes the worker's cuda_graphs setting, which decides how an AOTI
    package loads (run_single_threaded), so the child tries the load the worker will make."""
    import subprocess
    import types

    from handlers import probe
    from handlers.config import parse_config
    from handlers.device import Placement

    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return types.SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    spec = types.SimpleNamespace(variant_dir="/nonexistent", artifact="model.pt2", backend="aoti")
    probe.crash_safe_probe(spec, Placement("cpu", None), parse_config({"handler": {"cuda_graphs": "off"}}))
    assert seen["cmd"][-4:] == ["/nonexistent", "cpu", "-1", "off"]
    probe.crash_safe_probe(spec, Placement("cpu", None), parse_config({}))
    assert seen["cmd"][-1] == "auto"
