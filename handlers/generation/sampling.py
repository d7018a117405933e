"""The next token from a step's logits, on the device that holds them: greedy at temperature 0,
else temperature, top-k and top-p (nucleus) sampling, drawn from a generator seeded per request
so that a seed reproduces its tokens. The token stays on the device (it is the next step's input);
the host reads it separately (handlers/generation/loop.py)."""
from __future__ import annotations

import torch

from handlers.generation.request import Params


def generator(params: Params, device: torch.device):
    """The request's generator: seeded with its seed, else from fresh entropy; None for greedy."""
    if params.temperature == 0:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def pick(logits: torch.Tensor, params: Params, gen) -> torch.Tensor:
    """int64[1, 1]: the next token for `logits` (float[vocab])."""
    if params.temperature == 0:
        return logits.argmax(-1).view(1, 1)
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = (torch.cumsum(probs, -1) - probs) >= params.top_p
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, -1)
    return torch.multinomial(probs, 1, generator=gen).view(1, 1)
