"""A transformers causal LM in the slot form (examples/slot_decoder.py's contract), on transformers'
own modeling code: its layers call the Cache API (`cache.update(key_states, value_states,
layer_idx, ...)`), so a Cache whose tensors hold a row per slot, with each call's positions and
masks given as the model's own `position_ids` and `attention_mask` arguments, is all a family
needs; nothing of its attention is rewritten.

    forward(tokens int64[B, S], input_pos int64[B, S], slots int64[B]) -> logits [B, S, vocab]

- the cache: buffers `k_cache_I`, `v_cache_I` of (slots, kv_heads, max_seq, head_dim), one pair
  per layer, written at (slots[b], :, input_pos[b]) and read as each row's own slot;
- `position_ids` = input_pos (rotary tables and GPT-2's learned positions take a row each);
- `attention_mask`: additive 4D masks [B, 1, S, max_seq] built from input_pos (key j seen from
  position p when j <= p, and j > p - window for a sliding-window layer), which transformers'
  mask code passes through as given; a model with several layer types (Gemma 2, Qwen2/3 with
  sliding layers) takes one per type (`{"full_attention": m, "sliding_attention": m}`).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn


class Unsupported(ValueError):
    """Why a model cannot go into the slot form this way (said by cs-export-lm)."""


def _cache_base():
    from transformers.cache_utils import Cache

    return Cache


class _SlotLayer:
    """One layer's entry in the Cache's list: what transformers' mask code asks of a layer."""

    is_sliding = False
    is_compileable = True
    is_initialized = True
    supports_early_init = False


def slot_cache(owner: "SlotLM", input_pos: torch.Tensor, slots: torch.Tensor):
    """A transformers Cache over `owner`'s buffers for one call. The buffers are looked up on
    `owner` at each update, not held: torch.export swaps a module's buffers for its traced ones."""
    base = _cache_base()

    class SlotCache(base):
        def __init__(self):
            super().__init__(layers=[_SlotLayer() for _ in range(owner.n_layers)])

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return owner.write(layer_idx, key_states, value_states, input_pos, slots)

        def get_seq_length(self, layer_idx: int = 0):
            return 0

    return SlotCache()


def cache_keyword(model) -> str:
    """The name the model's forward takes its cache by (`cache` in transformers 5.x, before it
    `past_key_values`)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def layer_shapes(model) -> list:
    """[(kv_heads, key_dim, value_dim)] per layer, read from the model's own run of one token
    into a DynamicCache (so a family's head dims and grouped-query heads come from its code)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True,
              **{cache_keyword(model): cache})
    shapes = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or keys.dim() != 4 or values is None or values.dim() != 4:
            raise Unsupported(f"its cache layer {type(layer).__name__} holds no (batch, heads, length, dim) keys and values "
                              "(a recurrent or linear-attention layer has no KV cache rows to give each slot)")
        shapes.append((int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3])))
    if not shapes:
        raise Unsupported("its forward wrote nothing into the cache it was given")
    return shapes


def mask_plan(config) -> dict | None:
    """{layer type: sliding window or None} for a model whose layers differ (config.layer_types:
    its forward takes a dict of masks), else None with the one window in `config.sliding_window`
    read by the single-mask families (Mistral and Phi-3 use it when set; Llama and GPT-2 have none)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not types:
        return None
    plan = {}
    for t in set(types):
        if t == "full_attention":
            plan[t] = None
        elif t == "sliding_attention" and window:
            plan[t] = int(window)
        else:
            raise Unsupported(f"it has layers of type {t!r} (config.layer_types), which the slot form's masks do not "
                              "cover (full and sliding-window attention only)")
    return plan


class SlotLM(nn.Module):
    """forward(tokens[B, S], input_pos[B, S], slots[B]) -> logits[B, S, vocab] over `model`."""

    def __init__(self, model, slots: int, max_seq: int):
        super().__init__()
        self.model = model
        self.max_seq = max_seq
        self.plan = mask_plan(model.config)
        self.window = None if self.plan is not None else getattr(model.config, "sliding_window", None)
        self.cache_kw = cache_keyword(model)
        p = next(model.parameters())
        shapes = layer_shapes(model)
        self.n_layers = len(shapes)
        for i, (heads, kd, vd) in enumerate(shapes):
            self.register_buffer(f"k_cache_{i}", torch.zeros(slots, heads, max_seq, kd, dtype=p.dtype, device=p.device),
                                 persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(slots, heads, max_seq, vd, dtype=p.dtype, device=p.device),
                                 persistent=False)

    def write(self, i: int, k, v, input_pos, slots):
        """Layer i's keys and values [B, H, S, D] into rows `slots` at `input_pos`; each row's own
        slot [B, H, max_seq, D] back."""
        kc, vc = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
        kc[slots[:, None], :, input_pos] = k.transpose(1, 2).to(kc.dtype)
        vc[slots[:, None], :, input_pos] = v.transpose(1, 2).to(vc.dtype)
        return kc[slots], vc[slots]

    def mask(self, input_pos, window, dtype):
        """Additive [B, 1, S, max_seq]: 0 where key j is seen from position p, the dtype's least elsewhere."""
        keys = torch.arange(self.max_seq, device=input_pos.device)[None, None, :]
        p = input_pos[:, :, None]
        seen = keys <= p
        if window:
            seen = seen & (keys > p - window)
        zero = torch.zeros((), dtype=dtype, device=input_pos.device)
        return torch.where(seen, zero, torch.finfo(dtype).min)[:, None]

    def forward(self, tokens, input_pos, slots):
        dtype = self.k_cache_0.dtype
        if self.plan is None:
            masks = self.mask(input_pos, self.window, dtype)
        else:
            masks = {t: self.mask(input_pos, w, dtype) for t, w in self.plan.items()}
        out = self.model(input_ids=tokens, attention_mask=masks, position_ids=input_pos, use_cache=True,
                         **{self.cache_kw: slot_cache(self, input_pos, slots)})
        return out.logits


def export(module: SlotLM, slots: int):
    """torch.export with B (1..slots) and S (1..max_seq) dynamic, as examples/slot_decoder.export."""
    batch = torch.export.Dim("batch", min=1, max=slots)
    seq = torch.export.Dim("seq", min=1, max=module.max_seq)
    device = module.k_cache_0.device
    tokens = torch.zeros(2, 2, dtype=torch.int64, device=device)
    pos = torch.arange(2, device=device).repeat(2, 1)
    rows = torch.arange(2, device=device)
    with torch.no_grad():
        return torch.export.export(module, (tokens, pos, rows), strict=False,
                                   dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch}))
