"""A BERT-style text encoder (seeded random weights, no downloads): token and position
embeddings, post-norm transformer layers with masked self-attention, and a sentence embedding
mean-pooled over the tokens the attention mask keeps.

inputs:  input_ids      int64 [B, S]  token ids, 0..vocab-1
         attention_mask int64 [B, S]  1 for a real token, 0 for padding
output:  pooled         [B, hidden]   does not depend on what padded positions hold

text_encoder():      6 layers, hidden 384, 6 heads, vocabulary 30522, lengths up to 256 (the
                     end-to-end benchmark's text model; about 30 M parameters)
text_encoder_tiny(): 2 layers, hidden 32, vocabulary 1000 (CPU tests)
"""
import torch
import torch.nn.functional as F
from torch import nn


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.ff1, self.ff2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x, bias):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = self.norm1(x + self.out(a.transpose(1, 2).reshape(b, s, d)))
        return self.norm2(x + self.ff2(F.gelu(self.ff1(x))))


class TextEncoder(nn.Module):
    def __init__(self, vocab=30522, hidden=384, layers=6, heads=6, ffn=1536, max_len=256):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(max_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, ffn) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.norm(self.tokens(input_ids) + self.positions(pos))
        keep = attention_mask.to(x.dtype)
        bias = ((1.0 - keep) * -1e4)[:, None, None, :]  # padded keys get no attention
        for layer in self.layers:
            x = layer(x, bias)
        keep = keep.unsqueeze(-1)
        return {"pooled": (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)}


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return module.eval()


def text_encoder() -> nn.Module:
    return _seeded(TextEncoder(), 7)


def text_encoder_tiny() -> nn.Module:
    return _seeded(TextEncoder(vocab=1000, hidden=32, layers=2, heads=4, ffn=64, max_len=64), 8)
