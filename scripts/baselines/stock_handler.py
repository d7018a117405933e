"""The handler a user writes without this project: the baseline of scripts/bench_e2e.py.

A plain BaseHandler subclass running the eager model on TorchServe's assigned device:
each request's safetensors body is read with the `safetensors` package, the batch is
concatenated, moved with `.to(device)` on the default stream, run, and brought back with
`.cpu()`. Options come from model-config.yaml under `stock:` (factory, input and output
names, precision, and cpu_threads so a comparison can give it the same thread budget).
"""
import importlib.util
import os

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from ts.torch_handler.base_handler import BaseHandler


class StockHandler(BaseHandler):
    def initialize(self, context):
        props = context.system_properties
        cfg = (context.model_yaml_config or {}).get("stock", {})
        if cfg.get("cpu_threads"):
            torch.set_num_threads(int(cfg["cpu_threads"]))
        gpu = props.get("gpu_id")
        self.device = torch.device(f"cuda:{gpu}" if torch.cuda.is_available() and gpu is not None else "cpu")
        path, factory = cfg["factory"].rsplit(":", 1)
        spec = importlib.util.spec_from_file_location("stock_models", os.path.join(props["model_dir"], path))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        model = getattr(mod, factory)().eval().to(self.device)
        self.model = model.half() if cfg.get("precision") == "fp16" else model
        self.input_name, self.output_name = cfg["input"], cfg["output"]
        self.initialized = True

    def handle(self, data, context):
        inputs = [st_load(bytes(r.get("body") or r.get("data")))[self.input_name] for r in data]
        with torch.inference_mode():
            out = self.model(torch.cat(inputs).to(self.device)).cpu()
        responses, at = [], 0
        for t in inputs:
            responses.append(st_save({self.output_name: out[at:at + t.shape[0]].contiguous()}))
            at += t.shape[0]
        return responses
