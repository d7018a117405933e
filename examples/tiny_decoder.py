"""A small Llama-architecture decoder exported the way TorchChat exports one for AOTInductor
(torchchat/export.py `export_for_server`, torchchat/model.py `KVCache`): a static KV cache held in
registered buffers of (max_batch_size=1, heads, max_seq_length, head_dim), written in place at
`input_pos`, the causal mask indexed by `input_pos`, and

    forward(tokens: int64[1, S], input_pos: int64[S]) -> logits: float[1, S, vocab]

with S dynamic (1..max_seq_length). Seeded random weights, no download.

  python -m examples.tiny_decoder --out decoder.pt2                 # torch.export program
  python -m examples.tiny_decoder --out decoder.pt2 --form batch1   # input_pos as [1, S]
  python -m examples.tiny_decoder --out decoder.pt2 --package pkg.pt2  # + AOTInductor package

`--form batch1` is what a user writes to get past a handler that batches along dimension 0 of
every input: the same model behind a wrapper that takes `input_pos` as [1, S].
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Config:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_length: int = 64
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class KVCache(nn.Module):
    """TorchChat's cache: buffers updated in place at the positions of the call."""

    def __init__(self, batch: int, heads: int, length: int, head_dim: int, dtype=torch.float32):
        super().__init__()
        shape = (batch, heads, length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos, k, v):
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


def rope_table(cfg: Config) -> torch.Tensor:
    half = cfg.head_dim // 2
    freqs = 1.0 / (cfg.rope_base ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.max_seq_length, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # [L, half, 2]


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # x: [B, S, H, D]; table: [S, D/2, 2]
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    t = table.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * t[..., 0] - xs[..., 1] * t[..., 1],
                       xs[..., 1] * t[..., 0] + xs[..., 0] * t[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.kv_cache = None

    def forward(self, x, table, mask, input_pos):
        b, s, _ = x.shape
        h, d = self.cfg.n_heads, self.cfg.head_dim
        q, k, v = self.wqkv(x).split(self.cfg.dim, dim=-1)
        q, k, v = (t.view(b, s, h, d) for t in (q, k, v))
        q, k = apply_rope(q, table), apply_rope(k, table)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.cfg.dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, cfg: Config, attention=Attention):
        super().__init__()
        self.attention = attention(cfg)
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        hidden = 4 * cfg.dim
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x, table, mask, input_pos):
        x = x + self.attention(self.attention_norm(x), table, mask, input_pos)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    """forward(tokens[1, S], input_pos[S]) -> logits[1, S, vocab], TorchChat's signature."""

    block = Block  # the layer class (examples/slot_decoder.py's has a slotted cache)

    def __init__(self, cfg: Config = Config()):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(cfg), persistent=False)
        length = cfg.max_seq_length
        self.register_buffer("causal_mask", torch.tril(torch.ones(length, length, dtype=torch.bool)),
                             persistent=False)

    def setup_caches(self, max_batch_size: int = 1):
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, self.cfg.n_heads, self.cfg.max_seq_length,
                                               self.cfg.head_dim)

    def forward(self, tokens, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        table = self.rope[input_pos]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, table, mask, input_pos)
        return self.output(self.norm(x))


class Batch1Positions(nn.Module):
    """The same model taking input_pos as [1, S]: what a user writes so that every input has the
    batch first."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens, input_pos):
        return self.model(tokens, input_pos[0])


def build(cfg: Config = Config(), seed: int = 0, std: float = 0.08, device=None, dtype=None) -> Transformer:
    """Seeded random weights (normal, `std`; 0.02 is Llama's initialisation, for deep models in
    fp16), caches for one sequence, on `device` in `dtype` (caches too)."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model.setup_caches(1)
    return model.to(device=device, dtype=dtype).eval()


def export(model: nn.Module, form: str = "torchchat", max_seq: int | None = None):
    """torch.export the way TorchChat does: example inputs tokens [1, 1] and input_pos [1], a
    Dim("seq", 1..max_seq_length) on both (form "torchchat"), or input_pos [1, S] (form "batch1")."""
    inner = model if isinstance(model, Transformer) else model.model
    max_seq = max_seq or inner.cfg.max_seq_length
    seq = torch.export.Dim("seq", min=1, max=max_seq)
    device = inner.tok_embeddings.weight.device
    tokens = torch.zeros(1, 2, dtype=torch.int64, device=device)
    if form == "batch1":
        module, pos, pos_dims = Batch1Positions(inner), torch.arange(2, device=device).view(1, 2), {1: seq}
    else:
        module, pos, pos_dims = inner, torch.arange(2, device=device), {0: seq}
    with torch.no_grad():
        return torch.export.export(module, (tokens, pos), dynamic_shapes=({1: seq}, pos_dims))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where to torch.export.save the program")
    p.add_argument("--form", choices=("torchchat", "batch1"), default="torchchat")
    p.add_argument("--package", help="also compile it with AOTInductor into this .pt2 package")
    args = p.parse_args(argv)
    ep = export(build(), args.form)
    torch.export.save(ep, args.out)
    print(f"wrote {args.out}")
    if args.package:
        from torch._inductor import aoti_compile_and_package

        aoti_compile_and_package(ep, package_path=args.package)
        print(f"wrote {args.package}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
