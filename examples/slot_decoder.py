"""The export contract for many sequences on one compiled cache (docs/generation.md "Many
sequences"): a Llama-architecture decoder whose KV cache has a row per slot, and whose call names
the slot and the positions of every row.

    forward(tokens: int64[B, S], input_pos: int64[B, S], slots: int64[B]) -> logits: float[B, S, vocab]

- the cache: buffers of (slots, heads, max_seq_length, head_dim), one row per sequence slot;
- row b of a call writes its keys and values into cache row `slots[b]` at `input_pos[b]` and
  attends over that row with the causal mask indexed by `input_pos[b]`, so rows never read each
  other's state and a sequence that starts at position 0 overwrites every entry it will read;
- B and S are dynamic: B from 1 to the slot count (the handler's decode step runs every busy
  slot at once), S from 1 to max_seq_length (a prompt in one call).

The same modules as examples/tiny_decoder.py (TorchChat's Llama) with a slotted cache; seeded random
weights, no download. Plain torch calls, the ones a user copies for their own model:

  python -m examples.slot_decoder --out decoder.pt2 --package pkg.pt2 --slots 8

    model = build(Config(...), slots=64)
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=1, max=cfg.max_seq_length)
    ep = torch.export.export(model, (tokens[2, 2], input_pos[2, 2], slots[2]),
                             dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch}))
    torch._inductor.aoti_compile_and_package(ep, package_path="pkg.pt2")
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F

from examples.tiny_decoder import Block, Config, Transformer


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D]; table: [B, S, D/2, 2] (each row's own positions)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    t = table.unsqueeze(2)
    out = torch.stack([xs[..., 0] * t[..., 0] - xs[..., 1] * t[..., 1],
                       xs[..., 1] * t[..., 0] + xs[..., 0] * t[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)


class SlotKVCache(nn.Module):
    """A cache row per slot: row b of a call writes cache row slots[b] at its positions."""

    def __init__(self, slots: int, heads: int, length: int, head_dim: int, dtype=torch.float32):
        super().__init__()
        shape = (slots, heads, length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, slots, input_pos, k, v):
        # k, v: [B, S, H, D]; the index (slots [B, 1], :, input_pos [B, S]) addresses [B, S, H, D]
        self.k_cache[slots[:, None], :, input_pos] = k
        self.v_cache[slots[:, None], :, input_pos] = v
        return self.k_cache[slots], self.v_cache[slots]  # [B, H, L, D]: each row's own slot


class SlotAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.kv_cache = None

    def forward(self, x, table, mask, input_pos, slots):
        b, s, _ = x.shape
        h, d = self.cfg.n_heads, self.cfg.head_dim
        q, k, v = self.wqkv(x).split(self.cfg.dim, dim=-1)
        q, k, v = (t.view(b, s, h, d) for t in (q, k, v))
        q, k = apply_rope(q, table), apply_rope(k, table)
        keys, values = self.kv_cache.update(slots, input_pos, k, v)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.cfg.dim))


class SlotBlock(Block):
    def __init__(self, cfg: Config):
        super().__init__(cfg, SlotAttention)

    def forward(self, x, table, mask, input_pos, slots):
        x = x + self.attention(self.attention_norm(x), table, mask, input_pos, slots)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class SlotTransformer(Transformer):
    """forward(tokens[B, S], input_pos[B, S], slots[B]) -> logits[B, S, vocab]: examples/tiny_decoder's
    Transformer with SlotBlock layers."""

    block = SlotBlock

    def setup_caches(self, slots: int):
        for layer in self.layers:
            layer.attention.kv_cache = SlotKVCache(slots, self.cfg.n_heads, self.cfg.max_seq_length,
                                                   self.cfg.head_dim)

    def forward(self, tokens, input_pos, slots):
        mask = self.causal_mask[input_pos].unsqueeze(1)  # [B, 1, S, L]
        table = self.rope[input_pos]  # [B, S, D/2, 2]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, table, mask, input_pos, slots)
        return self.output(self.norm(x))


def build(cfg: Config = Config(), slots: int = 8, seed: int = 0, std: float = 0.08, device=None,
          dtype=None) -> SlotTransformer:
    """Seeded random weights (as examples/tiny_decoder.build: the same seed gives the same weights),
    a cache of `slots` rows, on `device` in `dtype`."""
    torch.manual_seed(seed)
    model = SlotTransformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model.setup_caches(slots)
    return model.to(device=device, dtype=dtype).eval()


def export(model: SlotTransformer):
    """torch.export with the batch (1..slots) and the sequence (1..max_seq_length) dynamic."""
    slots = model.layers[0].attention.kv_cache.k_cache.shape[0]
    batch = torch.export.Dim("batch", min=1, max=slots)
    seq = torch.export.Dim("seq", min=1, max=model.cfg.max_seq_length)
    device = model.tok_embeddings.weight.device
    tokens = torch.zeros(2, 2, dtype=torch.int64, device=device)
    pos = torch.arange(2, device=device).repeat(2, 1)
    rows = torch.arange(2, device=device)
    with torch.no_grad():
        return torch.export.export(model, (tokens, pos, rows),
                                   dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where to torch.export.save the program")
    p.add_argument("--package", help="also compile it with AOTInductor into this .pt2 package")
    p.add_argument("--slots", type=int, default=8, help="sequences the cache holds at once")
    p.add_argument("--max-seq", type=int, default=64, help="positions per sequence (prompt and generated)")
    args = p.parse_args(argv)
    ep = export(build(Config(max_seq_length=args.max_seq), slots=args.slots))
    torch.export.save(ep, args.out)
    print(f"wrote {args.out}")
    if args.package:
        from torch._inductor import aoti_compile_and_package

        aoti_compile_and_package(ep, package_path=args.package)
        print(f"wrote {args.package}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
