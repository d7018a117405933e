"""The handler a user writes to serve an AOTInductor package without this project: the
"stock AOTI" peer of bench/bench_e2e.py (the same artifact ours serves). StockHandler's
request handling, with the model loaded by `torch._inductor.aoti_load_package` on the assigned
GPU instead of built from the factory (it returns the model's own output structure, so
StockHandler.forward reads it as it reads the eager model's); one CPU thread
(model-config.yaml `stock.cpu_threads`)."""
import os

import torch

from stock_handler import StockHandler


class StockAotiHandler(StockHandler):
    def load(self, model_dir, cfg):
        path = os.path.join(model_dir, cfg["artifact"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            return torch._inductor.aoti_load_package(path, device_index=self.device.index)
        return torch._inductor.aoti_load_package(path)
