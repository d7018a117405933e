"""Models and factories for the engine's tests (tests/test_engine_core.py): a small module that
records every call's batch size, and `python -m handlers.engine.serve --factory engine_kit:slow_runner`'s
factory (ENGINE_KIT_SLOW seconds of sleep per call)."""
import os
import time

import torch

from handlers.engine.model import module_runner

TABLE_ROWS = 10


class Recorder(torch.nn.Module):
    """y = x @ w + the sum of the embedding rows `ids` picks; an id outside the table raises
    IndexError, the model's own error for a request's bad values."""

    def __init__(self, sleep: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(4, 3, generator=g)
        self.emb = torch.nn.Embedding(TABLE_ROWS, 3)
        torch.nn.init.normal_(self.emb.weight, generator=g)
        self.sleep = sleep
        self.calls = []  # rows of every call

    def forward(self, x, ids):
        self.calls.append(x.shape[0])
        if self.sleep:
            time.sleep(self.sleep)
        return {"y": x @ self.w + self.emb(ids).sum(1), "n": ids.sum(1, keepdim=True)}


def runner(model: Recorder, batch_max: int = 64):
    return module_runner(model, {"x": (torch.float32, (4,)), "ids": (torch.int64, (2,))},
                         {"y": (torch.float32, (3,)), "n": (torch.int64, (1,))}, batch_max)


def slow_runner():
    return runner(Recorder(float(os.environ.get("ENGINE_KIT_SLOW", "0"))))


def request(rows: int, seed: int, bad: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TABLE_ROWS, (rows, 2), generator=g)
    if bad:
        ids[0, 0] = TABLE_ROWS + 5
    return {"x": torch.randn(rows, 4, generator=g), "ids": ids}


def expected(model: Recorder, req: dict) -> dict:
    with torch.no_grad():
        y = req["x"] @ model.w + model.emb(req["ids"]).sum(1)
    return {"y": y, "n": req["ids"].sum(1, keepdim=True)}
