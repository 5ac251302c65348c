"""What reuse after an edit (issue 61) did for one request: the outcome usage reports.

A bottom module (no engine imports), like :mod:`hicache.cache_hints`: the runtime fills it in,
the server and the benchmarks read it. Units: tokens of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EditReuseOutcome:
    """``reused_tokens``: prompt tokens whose KV was copied from cached pages at another position
    (keys re-rotated) and not computed -- never counted in ``cached_tokens``; ``recomputed_tokens``:
    tokens of reused spans computed anyway (each span's first tokens); ``gated``: the quality gate
    found a reused span's KV too far from the recomputed one and the request fell back to exact
    prefix reuse (then ``reused_tokens`` is 0); ``deviation``: the largest relative deviation the
    gate measured (0 when nothing was checked); ``approximate_hit_tokens``: of ``cached_tokens``, those
    hit in the conversation's approximate namespace (KV an earlier edit-reused turn left, exact for
    no one else)."""

    reused_tokens: int = 0
    recomputed_tokens: int = 0
    gated: bool = False
    deviation: float = 0.0
    approximate_hit_tokens: int = 0

    def to_json(self) -> dict:
        return {"reused_tokens": self.reused_tokens, "recomputed_tokens": self.recomputed_tokens,
                "gated": self.gated, "deviation": round(self.deviation, 6),
                "approximate_hit_tokens": self.approximate_hit_tokens}
