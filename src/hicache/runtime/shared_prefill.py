"""Prompts computed once when requests that share them arrive together.

Agents fanned out on one system prompt (or several users of one agent) send requests that start
with the same tokens at the same moment. Admitted together, each computes those tokens: the
radix tree can only share what a finished chunk has put there. So a request whose first tokens
another running request has still to compute waits, step by step, until they are cached (at the
other's next chunk boundary or its prefill end), then hits those pages and computes only what
follows them. On a CPU a step's time grows with its tokens, so the wait costs the request no
more than computing them beside the other would have. A request that arrives once the other has
computed its prompt (nobody waited, so it would be cached only at the other's finish) gets that
prompt cached at its admission (:func:`computed_prompt_of`). A function of the requests' tokens
and states alone: every rank decides the same (DESIGN invariant 3).
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..cache.page_tree import common_prefix
from .request import Request, Status

# A request waits only to save at least this many tokens: fewer cost little to compute again,
# and waiting delays it by the rest of the other's prompt.
SHARED_PREFILL_MIN = 64


def _shares(a: Request, b: Request, done: int) -> bool:
    """Whether ``a`` and ``b`` (one namespace) start with at least :data:`SHARED_PREFILL_MIN` tokens in
    common past the first ``done``."""
    return a.namespace == b.namespace and common_prefix(a.tokens_np, b.tokens_np) - done >= SHARED_PREFILL_MIN


def computing_prefix_of(req: Request, running: Sequence[Request]) -> Optional[int]:
    """The rid of the first request in ``running`` computing a prompt that starts with enough of
    ``req``'s tokens it has not computed yet; None if there is none."""
    other = next((o for o in running if o.status is Status.PREFILL and _shares(o, req, o.computed)), None)
    return None if other is None else other.rid


def computed_prompt_of(req: Request, running: Sequence[Request], page_size: int) -> Optional[Request]:
    """The first request in ``running`` past its prefill whose prompt starts with enough of ``req``'s
    tokens beyond the pages the tree holds for it (computed while ``req`` was on its way); None if
    there is none. Its prompt is cached for ``req`` to hit. Not on a hybrid pool (``kv.window``
    held): a decoding request has given up the window pages behind its window, so the prompt's end
    is no longer a boundary its window component can serve. Nor one whose KV is approximate past
    ``kv_exact`` (edit reuse)."""
    return next((o for o in running if o.status is Status.DECODE and o.kv.window is None and o.kv_exact is None
                 and _shares(o, req, o.kv.cached_pages * page_size)), None)


def awaited(req: Request, waiting: Sequence[Request], page_size: int) -> bool:
    """Whether a request in ``waiting`` shares enough of ``req``'s prompt past the pages the tree
    already holds for it: ``req`` has just computed its prompt, which is then cached at once
    (instead of at its finish) for them to hit."""
    return any(_shares(w, req, req.kv.cached_pages * page_size) for w in waiting)
