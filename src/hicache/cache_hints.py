"""Cache hints: what a client asks the cache to keep, and what it was given (the agent contract).

A :class:`RetentionHint` asks that a prefix of a request's sequence stay cached for a while: an
Anthropic ``cache_control`` breakpoint (the prompt up to it, 5 minutes or 1 hour), OpenAI's
``prompt_cache_retention="24h"`` (the prompt and the reply, a day), SGLang's
``retention_seconds``. The tree (:mod:`.cache.retention`) grants it within each tier's retention
budget and says what it gave in a :class:`RetentionOutcome`; hints never change tokens.

Units: ``tokens`` are tokens of the request's sequence (prompt, then reply), cut to whole pages
when granted; ``seconds`` are seconds from the request's arrival; ``until`` is unix time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Tier levels, top down: a prefix retained at level L is kept in tier L and every tier below it.
TIER_NAMES = ("device", "host", "storage")


@dataclass(frozen=True)
class RetentionHint:
    """Keep the first ``tokens`` of the request's sequence (None: all of it that gets cached,
    prompt and reply) for ``seconds`` after the request's arrival; among retained prefixes a
    higher ``priority`` is evicted later. ``ttl``: the client's name for the duration ("5m",
    "1h", "24h"; reported back, e.g. Anthropic's ``cache_creation`` by ttl)."""

    tokens: int | None
    seconds: float
    priority: int = 0
    ttl: str = ""

    def __post_init__(self) -> None:
        if self.tokens is not None and self.tokens < 0:
            raise ValueError(f"a retention hint's tokens must be >= 0, got {self.tokens}")
        if not (self.seconds >= 0 and math.isfinite(self.seconds)):
            raise ValueError(f"a retention hint's seconds must be finite and >= 0, got {self.seconds}")


@dataclass(frozen=True)
class RetentionOutcome:
    """What the cache gave a request's hints: ``retained_tokens`` (whole pages, the longest prefix
    any hint retained), ``tier`` (the top tier that keeps all of them: "device", "host",
    "storage"; None when nothing was retained), ``until`` (unix seconds, the latest expiry
    granted), ``clipped`` (why less than asked was retained; None when all of it was)."""

    retained_tokens: int = 0
    tier: str | None = None
    until: float = 0.0
    clipped: str | None = None

    def to_json(self) -> dict:
        """The ``usage.hicache_retention`` object every API reports."""
        return {"retained_tokens": self.retained_tokens, "tier": self.tier,
                "until": round(self.until, 3) if self.until else None, "clipped": self.clipped}
