"""How far a reply with reused KV is from the reply with every prompt token computed (the edit-reuse
benchmark, issue 61). Token ids are compared position by position; distributions come from the
engine's top-k logprobs (natural log), so divergences are in nats.

- :func:`agreement`: the share of the first positions where the two greedy replies hold the same
  token. Not teacher-forced (the engine cannot score a given continuation): after a first difference
  the replies may drift apart, so a single early divergence costs every later position.
- :func:`first_divergence`: where the replies first differ (None: never, over the shorter one and
  both of the same length).
- :func:`topk_kl`: KL(reference || other) over the tokens in both top-k lists plus one bucket for
  the rest of each distribution. Merging tokens into one bucket can only lower a KL divergence, so
  this is a lower bound of the full-vocabulary KL, tight when the top-k hold almost all the mass.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

FLOOR = 1e-12  # probability floor of the remainder bucket (a top-k list holding all of the mass)


def agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Positions where both replies hold the same token over the longer reply's length (a missing
    token differs); 1.0 when both are empty."""
    longest = max(len(reference), len(other))
    if not longest:
        return 1.0
    return sum(a == b for a, b in zip(reference, other)) / longest


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> Optional[int]:
    """The first position whose tokens differ, or where one reply has ended and the other not."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def topk_kl(reference: Sequence[tuple[int, float]], other: Sequence[tuple[int, float]]) -> float:
    """KL(reference || other) in nats of two top-k lists of (token, logprob), over the tokens both
    lists hold plus the rest of each distribution as one bucket (a lower bound: module docstring)."""
    ref, oth = dict(reference), dict(other)
    shared = sorted(set(ref) & set(oth))
    kl = sum(math.exp(ref[t]) * (ref[t] - oth[t]) for t in shared)
    rest_ref = max(1.0 - sum(math.exp(ref[t]) for t in shared), FLOOR)
    rest_oth = max(1.0 - sum(math.exp(oth[t]) for t in shared), FLOOR)
    return max(kl + rest_ref * math.log(rest_ref / rest_oth), 0.0)
