"""Prompts computed once when requests that share them arrive together.

Agents fanned out on one system prompt (or several users of one agent) send requests that start
with the same tokens at the same moment. Admitted together, each computes those tokens: the
radix tree can only share what a finished chunk has put there. So a request whose first tokens
another running request has still to compute waits, step by step, until they are cached (at the
other's next chunk boundary or its prefill end), then hits those pages and computes only what
follows them. On a CPU a step's
time grows with its tokens, so the wait costs the request no more than computing them beside
the other would have. A function of the requests' tokens and states alone: every rank decides
the same (DESIGN invariant 3).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .request import Request, Status

# A request waits only to save at least this many tokens: fewer cost little to compute again,
# and waiting delays it by the rest of the other's prompt.
SHARED_PREFILL_MIN = 64


def computing_prefix_of(req: Request, running: Sequence[Request], min_tokens: int = SHARED_PREFILL_MIN) -> Optional[int]:
    """The rid of the first request in ``running`` computing a prompt that starts with at least
    ``min_tokens`` of ``req``'s tokens it has not computed yet; None if there is none."""
    for other in running:
        if other.status is not Status.PREFILL or other.namespace != req.namespace:
            continue
        n = min(len(other.tokens_np), len(req.tokens_np))
        differ = np.flatnonzero(other.tokens_np[:n] != req.tokens_np[:n])
        shared = int(differ[0]) if len(differ) else n
        if shared - other.computed >= min_tokens:
            return other.rid
    return None
