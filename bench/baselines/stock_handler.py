"""The handler a user writes without this project: the baseline of bench/bench_e2e.py.

A plain BaseHandler subclass running the eager model on TorchServe's assigned device:
each request's safetensors body is read with the `safetensors` package, the batch's requests are
concatenated, moved with `.to(device)` on the default stream, run, and brought back with
`.cpu()`. Texts of different lengths are padded to the batch's longest with zeros (ids 0, mask
0), one call, as users' handlers and Hugging Face pipelines do (a tokenizer's padding="longest"),
and outputs that carry the length are cut back to each request's own. Options come from
model-config.yaml under `stock:` (factory, input and output names, precision, cpu_threads so a
comparison can give it the same thread budget, and the axes of the inputs and outputs that carry
a variable length: `in_axes` / `out_axes`, [[name, axis, dimension name]]).
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
        self.cfg = cfg = (context.model_yaml_config or {}).get("stock", {})
        if cfg.get("cpu_threads"):
            torch.set_num_threads(int(cfg["cpu_threads"]))
        gpu = props.get("gpu_id")
        self.device = torch.device(f"cuda:{gpu}" if torch.cuda.is_available() and gpu is not None else "cpu")
        self.model = self.load(props["model_dir"], cfg)
        self.input_names, self.output_names = cfg["inputs"], cfg["outputs"]
        self.in_axes, self.out_axes = cfg.get("in_axes") or [], cfg.get("out_axes") or []
        self.initialized = True

    def load(self, model_dir, cfg):
        path, factory = cfg["factory"].rsplit(":", 1)
        spec = importlib.util.spec_from_file_location("stock_models", os.path.join(model_dir, path))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        model = getattr(mod, factory)().eval().to(self.device)
        return model.half() if cfg.get("precision") == "fp16" else model

    def forward(self, tensors):
        out = self.model(*tensors)
        if isinstance(out, dict):
            return [out[n] for n in self.output_names]
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def padded(self, requests):
        """The requests padded with zeros to the batch's longest along every variable length,
        and each request's own lengths."""
        own = [{d: r[n].shape[a] for n, a, d in self.in_axes} for r in requests]
        longest = {d: max(o[d] for o in own) for d in own[0]}
        out = []
        for r in requests:
            r = dict(r)
            for n, a, d in self.in_axes:
                extra = longest[d] - r[n].shape[a]
                if extra:
                    r[n] = torch.nn.functional.pad(r[n], [0, 0] * (r[n].dim() - 1 - a) + [0, extra])
            out.append(r)
        return out, own

    def handle(self, data, context):
        requests = [st_load(bytes(r.get("body") or r.get("data"))) for r in data]
        own = None
        if self.in_axes:
            requests, own = self.padded(requests)
        groups = {}
        for i, r in enumerate(requests):
            groups.setdefault(tuple(tuple(r[n].shape[1:]) for n in self.input_names), []).append(i)
        responses = [None] * len(requests)
        for idxs in groups.values():
            inputs = [torch.cat([requests[i][n] for i in idxs]).to(self.device) for n in self.input_names]
            with torch.inference_mode():
                outs = [o.cpu() for o in self.forward(inputs)]
            at = 0
            for i in idxs:
                rows = requests[i][self.input_names[0]].shape[0]
                mine = {n: o[at:at + rows] for n, o in zip(self.output_names, outs)}
                for n, a, d in (self.out_axes if own else ()):
                    mine[n] = mine[n].narrow(a, 0, own[i][d])
                responses[i] = st_save({n: o.contiguous() for n, o in mine.items()})
                at += rows
        return responses
