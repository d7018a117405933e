"""The request pipeline in process: one request at a time after a failed batch, device faults."""
import torch

from handlers.errors import ServingError
from handlers.pipeline import infer
from worker_kit import make_spec, make_worker, ready_health


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
    from handlers.torchserve import restart

    real = restart.exit_soon
    restart.exit_soon = lambda reason, delay_s=0: None
    try:
        outs = infer(worker, health, [{"x": torch.zeros(1, 4)}] * 3)
    finally:
        restart.exit_soon = real
    assert calls == [3, 1] and all(isinstance(o, ServingError) for o in outs)
    assert [o.error_type for o in outs[1:]] == ["WorkerRestarting"] * 2 and health.state == "broken"
