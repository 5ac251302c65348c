"""Cache hints as the OpenAI and SGLang APIs carry them, and what each API reports back (issue 60).

- ``prompt_cache_retention`` (Chat Completions, Completions, Responses): ``"in_memory"`` (the
  default) asks nothing; ``"24h"`` keeps the prompt and the reply for a day, within the cache's
  retention budget (:data:`DAY_HINT`). Anything else is a 400 naming the field.
- ``prompt_cache_key``: a grouping key (at most :data:`MAX_KEY_CHARS` characters). It does not
  salt the cache (``cache_salt`` does); it is counted per key in ``/stats`` ("prompt_cache_keys":
  :class:`PromptCacheKeys`) and left in the body for a router in front to read.
- A stored Responses conversation (``store`` true) keeps its history retained while stored:
  :data:`STORED_HINT` (a day: the store has no clock of its own, it drops by count and bytes).
- SGLang's ``/generate``: ``retention_seconds`` (>= 0) with ``priority`` (higher is evicted later
  among retained prefixes) -- :func:`sglang_hints`; ``priority`` alone asks nothing of the cache.

Every API reports ``usage.hicache_retention`` (``/generate``: ``meta_info.hicache_retention``) when
the request carried hints: :func:`retention_usage`. Units: tokens and seconds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

from ..cache_hints import RetentionHint
from ..runtime.request import GenerateResult
from .protocol import APIError

DAY_S = 86400.0
DAY_HINT = RetentionHint(tokens=None, seconds=DAY_S, ttl="24h")  # prompt_cache_retention "24h"
STORED_HINT = RetentionHint(tokens=None, seconds=DAY_S, ttl="stored")  # a stored Responses conversation
RETENTIONS = ("in_memory", "24h")  # OpenAI's values of prompt_cache_retention
MAX_KEY_CHARS = 1024
MAX_KEYS = 1000  # prompt_cache_keys /stats keeps, the most recently used


def openai_hints(retention: Optional[str], param: str = "prompt_cache_retention") -> tuple[RetentionHint, ...]:
    """The hints of OpenAI's ``prompt_cache_retention`` (None and "in_memory": none)."""
    if retention is None or retention == "in_memory":
        return ()
    if retention == "24h":
        return (DAY_HINT,)
    raise APIError(400, f"{param} must be 'in_memory' or '24h', got {retention!r}.", param=param)


def check_key(key: Optional[str], param: str = "prompt_cache_key") -> Optional[str]:
    """``key`` when it is usable: a non-empty string of at most :data:`MAX_KEY_CHARS` characters."""
    if key is not None and not 0 < len(key) <= MAX_KEY_CHARS:
        raise APIError(400, f"{param} must be 1 to {MAX_KEY_CHARS} characters, got {len(key)}.", param=param)
    return key


def sglang_hints(retention_seconds: Optional[float], priority: Optional[int]) -> tuple[RetentionHint, ...]:
    """SGLang's ``retention_seconds`` / ``priority`` as a hint on the whole sequence (none without
    ``retention_seconds``: a priority alone retains nothing)."""
    if retention_seconds is None:
        return ()
    if retention_seconds < 0:
        raise APIError(400, f"retention_seconds must be >= 0, got {retention_seconds}.", param="retention_seconds")
    return (RetentionHint(tokens=None, seconds=float(retention_seconds), priority=priority or 0,
                          ttl=f"{retention_seconds:g}s"),)


def retention_usage(hints: Sequence[RetentionHint], res: GenerateResult) -> dict[str, Any]:
    """``{"hicache_retention": ...}`` (what the cache gave the hints; null until it says) when the
    request carried hints, else ``{}``."""
    if not hints:
        return {}
    return {"hicache_retention": res.retention.to_json() if res.retention is not None else None}


class PromptCacheKeys:
    """Requests, prompt tokens and cached prompt tokens per ``prompt_cache_key``, for ``/stats``;
    at most ``size`` keys, the least recently used forgotten first. Thread-safe."""

    def __init__(self, size: int = MAX_KEYS) -> None:
        self.size = size
        self._keys: OrderedDict[str, list[int]] = OrderedDict()  # key -> [requests, prompt, cached]
        self._lock = threading.Lock()

    def count(self, key: Optional[str], results: Sequence[GenerateResult]) -> None:
        """Count one request (its prompts once each: the first result of each)."""
        if key is None or not results:
            return
        with self._lock:
            row = self._keys.pop(key, None) or [0, 0, 0]
            row[0] += 1
            row[1] += sum(r.prompt_tokens for r in results)
            row[2] += sum(r.cached_tokens for r in results)
            self._keys[key] = row
            while len(self._keys) > self.size:
                self._keys.popitem(last=False)

    def stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {k: {"requests": n, "prompt_tokens": p, "cached_tokens": c} for k, (n, p, c) in self._keys.items()}
