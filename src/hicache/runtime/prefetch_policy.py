"""How long a waiting request waits for its storage prefetch (``--hicache-storage-prefetch-policy``).

- ``best_effort``: not at all; the request takes whatever pages have arrived when it is scheduled.
- ``wait_complete``: until the read ends, but at most 20x the ``timeout`` formula (a hung store
  must not hold a request forever).
- ``timeout``: at most ``--hicache-storage-prefetch-timeout-base`` + per-1K-token seconds.
- ``adaptive`` (default): wait while loading the pages is expected to be cheaper than computing
  their tokens again, both measured on this rank: prefill throughput (tokens/s, from the
  step's forward passes) and storage read time per page (from the prefetch thread). A request
  whose load would cost more does not wait; one that waits waits at most one recompute time,
  so a stuck or slow store costs at most what recomputing would have. Before both figures
  exist it falls back to the ``timeout`` formula.

Each rank computes its own deadline from its own measurements. The scheduler acts on it only
through the agreed "deadline passed" flag (``Scheduler.ready_events``, MIN-reduced; later
pipeline stages follow stage 0), so ranks that measure differently still decide alike.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

logger = logging.getLogger(__name__)

WAIT_COMPLETE_FACTOR = 20  # wait_complete gives up after this many timeout-formula spans
EWMA_ALPHA = 0.25  # weight of the newest prefill pass in the throughput average
# A skipped prefetch is stopped before its pages are read, so it never refreshes the read
# estimate: without an occasional probe, one slow spell would switch storage off for good.
PROBE_EVERY = 8  # every 8th consecutive "do not wait" decision waits anyway


class PrefillRate:
    """This rank's prefill throughput in tokens/s: exponentially weighted averages of the
    tokens and of the seconds of prefill forward passes, divided. Averaging both sides (not
    the per-pass ratio) lets long passes weigh more than short ones, whose fixed per-pass
    overhead would otherwise understate the rate."""

    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        self.alpha = alpha
        self._tokens = 0.0
        self._seconds = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One prefill forward pass: ``tokens`` new tokens computed in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        if self._seconds == 0.0:  # the first pass sets the average
            self._tokens, self._seconds = float(tokens), seconds
            return
        self._tokens += self.alpha * (tokens - self._tokens)
        self._seconds += self.alpha * (seconds - self._seconds)

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second, or None before the first prefill pass."""
        return self._tokens / self._seconds if self._seconds > 0 else None


class PrefetchPolicy:
    """Turns a new prefetch into a wait deadline (``time.perf_counter`` seconds) and counts the
    decisions: ``waited`` (deadline in the future) and ``skipped`` (deadline at arrival). ``name``:
    one of the policies above (``EngineConfig`` checked the flag)."""

    def __init__(self, name: str, timeout: Callable[[int], float]) -> None:
        self.name = name
        self.timeout = timeout  # the timeout policy's formula: seconds allowed for N tokens
        self.prefill = PrefillRate()
        self.waited = 0
        self.skipped = 0
        self._skip_run = 0  # consecutive adaptive "do not wait" decisions (for PROBE_EVERY)

    def deadline(self, rid: int, pages: int, tokens: int, read_s_per_page: float | None, now: float) -> float:
        """When a request arriving at ``now`` stops waiting for its prefetch of ``pages`` pages
        (``tokens`` tokens); ``read_s_per_page``: this rank's storage read estimate, if any."""
        recompute_s = load_s = math.nan
        if self.name == "best_effort":
            wait_s = 0.0
        elif self.name == "timeout":
            wait_s = self.timeout(tokens)
        elif self.name == "wait_complete":
            wait_s = self.timeout(tokens) * WAIT_COMPLETE_FACTOR
        elif self.prefill.tokens_per_s is None or read_s_per_page is None:
            wait_s = self.timeout(tokens)  # nothing measured yet: the timeout formula
        else:
            recompute_s, load_s = tokens / self.prefill.tokens_per_s, pages * read_s_per_page  # seconds
            wait_s = self._adaptive(recompute_s, load_s)
        if wait_s > 0:
            self.waited += 1
        else:
            self.skipped += 1
        logger.debug("prefetch decision rid=%d policy=%s pages=%d recompute_s=%.4f expected_load_s=%.4f wait_s=%.4f",
                     rid, self.name, pages, recompute_s, load_s, wait_s)
        return now + wait_s

    def _adaptive(self, recompute_s: float, load_s: float) -> float:
        """Seconds to wait: one recompute time when loading is the cheaper way (or as a probe),
        else 0."""
        if load_s > recompute_s:
            self._skip_run += 1
            if self._skip_run < PROBE_EVERY:
                return 0.0
        self._skip_run = 0
        return recompute_s
