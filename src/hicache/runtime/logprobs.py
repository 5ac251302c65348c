"""Log-probabilities of sampled tokens (``SamplingParams.logprobs``).

One rule: a token's log-probability is ``log_softmax`` of the logits its row was sampled from
after the request's penalties, ``logit_bias`` and grammar mask (the logits every sampler sees),
before temperature, top-k, top-p and min-p -- vLLM's ``processed_logprobs``. So a sampled token's
log-probability is always finite, and a greedy request's token is the first of its top list.
Tokens a grammar forbids are left out of the top list (their log-probability is -inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .batch import Batch


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability and the ``k`` most likely tokens of its row (ids and
    log-probabilities, most likely first; ties: lower id first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def row_logprob(row: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp = torch.log_softmax(row.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple((int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist()) if math.isfinite(v))
    return TokenLogprob(token, float(lp[token]), top)


def batch_logprobs(batch: Batch, logits: torch.Tensor, tokens: list) -> dict[int, list[TokenLogprob]]:
    """Per batch position of a request that asked for logprobs: one entry per token it got in
    ``tokens`` (see ``Scheduler.sample``: an int, -1 for a prompt chunk, or a verify pass's list)."""
    out: dict[int, list[TokenLogprob]] = {}
    for i, (req, start, tok) in enumerate(zip(batch.reqs, batch.first_rows(), tokens)):
        k, toks = req.sampling.logprobs, tok if isinstance(tok, (list, tuple)) else [tok] if tok >= 0 else []
        if k is not None and toks:
            out[i] = [row_logprob(logits[start + j], t, k) for j, t in enumerate(toks)]
    return out
