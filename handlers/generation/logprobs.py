"""Log probabilities of the generated tokens (OpenAI's `logprobs`, `top_logprobs`): the model's
own distribution at each step, `log_softmax` of the step's raw logits in float32 (before
temperature, top-k and top-p), the chosen token's value and the k most likely tokens by value.

Computed on the device in the step that picked the token, in a turn where some row's request
asked (for every row of it: `pack`; a turn without such a row runs exactly as before: the
tokens' argmax and their int64 copy out),
and read back with the tokens in the same copy: a turn with such a row copies out one float64
table, a row per sequence, instead of the tokens alone:

    [token, chosen logprob, value 1, id 1, value 2, id 2, ..., value K, id K]

(K the most any row of the turn asked for; float64 holds every token id exactly, and a float32
logprob unchanged). The host cuts each row to its own request's k (`read`). No TorchServe here:
the engine's thread calls it; the answers' shapes are handlers/generation/openai.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

MAX_TOP = 20  # the most alternatives a request may ask for (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability and its step's `top` [(id, logprob)], most likely
    first; `prev` the id before it (its text's context: handlers/generation/text.py)."""
    id: int
    logprob: float
    top: tuple = ()
    prev: Optional[int] = None


def table(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """float64[m, 1 + 2k] on the device: each row's log_softmax (float32) at `chosen` (int64[m]),
    then its k largest values, each followed by its token id."""
    lp = torch.log_softmax(logits.float(), -1)
    picked = lp.gather(1, chosen.view(-1, 1))
    if k == 0:
        return picked.double()
    vals, ids = torch.topk(lp, k, -1)
    pairs = torch.stack([vals.double(), ids.double()], -1).view(lp.shape[0], 2 * k)
    return torch.cat([picked.double(), pairs], 1)


def pack(tokens: torch.Tensor, logits: torch.Tensor, asks: list) -> Optional[torch.Tensor]:
    """The turn's readback (module docstring) for `tokens` (int64[n]) picked from `logits`
    ([n, vocab]), `asks[i]` row i's k or None; None where no row asked (the tokens go alone)."""
    want = [i for i, k in enumerate(asks) if k is not None]
    if not want:
        return None
    top = max(asks[i] for i in want)
    # every row's, though some did not ask: a log_softmax of a few rows more costs the device
    # microseconds, where picking the rows that asked would copy their indices from the host,
    # which waits for the stream (a pageable copy) and so for the step already in flight
    out = torch.empty(len(asks), 2 + 2 * top, dtype=torch.float64, device=tokens.device)
    out[:, 0] = tokens
    out[:, 1:] = table(logits, tokens, top)
    return out


def read(host: torch.Tensor, asks: list) -> tuple:
    """(token ids, [TokenLogprob or None]) of a readback: the int64 tokens alone, or `pack`'s
    table, each row cut to its own k."""
    if host.dtype == torch.int64:
        return host.view(-1).tolist(), [None] * len(asks)
    rows = host.tolist()
    tids = [int(r[0]) for r in rows]
    return tids, [None if k is None else TokenLogprob(t, r[1], tuple((int(r[3 + 2 * j]), r[2 + 2 * j])
                                                                     for j in range(k)))
                  for t, r, k in zip(tids, rows, asks)]


def stacked(tokens: list, tables: list) -> torch.Tensor:
    """One readback of several `pack` rows made apart (float64[w_i], or None where the row's
    request asked for nothing: its token, int64[1], alone), padded to the widest."""
    if all(t is None for t in tables):
        return torch.cat(tokens)
    width = max(t.shape[0] for t in tables if t is not None)
    rows = [torch.nn.functional.pad(t if t is not None else tok.double(), (0, width - (t.shape[0] if t is not None
                                                                                        else 1)))
            for tok, t in zip(tokens, tables)]
    return torch.stack(rows)
