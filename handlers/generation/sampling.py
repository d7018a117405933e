"""The next token from a step's logits, on the device that holds them: greedy at temperature 0,
else temperature, top-k and top-p (nucleus) sampling, drawn from a generator seeded per request
so that a seed reproduces its tokens. The token stays on the device (it is the next step's input);
the host reads it separately (handlers/generation/loop.py)."""
from __future__ import annotations

import torch

from handlers.generation.request import MIN_TEMPERATURE, Params


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
    # shifted so that the best is 0 before the division: a small temperature sends the others to
    # -inf, never the best to inf (whose softmax is NaN, refused by multinomial)
    x = logits.float()
    # (not below MIN_TEMPERATURE, which request.py reads as greedy: float32 holds no 1e-300, and 0/0 is NaN)
    x = (x - x.max()) / max(params.temperature, MIN_TEMPERATURE)
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = (torch.cumsum(probs, -1) - probs) >= params.top_p
        drop[0] = False  # a top_p below float32's smallest (1e-300 reads as 0) would drop the first too
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, -1)
    return torch.multinomial(probs, 1, generator=gen).view(1, 1)
