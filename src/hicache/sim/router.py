"""Which engine a request goes to: the policies of ``sglang-router`` (``--policy round_robin`` /
``cache_aware``) over the simulator's engines.

``cache-aware`` follows sglang-router 0.3.2 (the version hicache installs and tests against)
with its defaults: when the load is imbalanced (``max - min > 64`` requests and
``max > 1.5 x min``) the least loaded engine; else the engine whose routed history shares the
longest prefix with the request, if that covers more than ``cache_threshold`` (0.3) of it; else
the least loaded engine again (the first on a tie; older routers took the one with the
smallest history instead). Like the router it keeps its own approximation of each engine's
cache (every prefix it sent there, never evicted here), not the engines' real trees. Load =
requests routed to the engine whose prefill has not finished at the arrival time (virtual
clock). A consequence worth knowing: when requests never overlap (a replay one at a time),
every load is 0 and a miss always goes to engine 0, so cache-aware routing puts everything on
one engine.
"""

from __future__ import annotations

from collections import deque
from itertools import takewhile
from typing import Protocol

from .trace import TraceRequest

ROUTERS = ("round-robin", "cache-aware")


class Router(Protocol):
    def pick(self, req: TraceRequest, now: float) -> int: ...

    def routed(self, req: TraceRequest, engine: int, done_at: float) -> None:
        """``req`` went to ``engine``; its prefill ends at ``done_at`` (virtual seconds)."""
        ...


class RoundRobin:
    def __init__(self, engines: int) -> None:
        self.engines, self.next = engines, 0

    def pick(self, req: TraceRequest, now: float) -> int:
        i, self.next = self.next, (self.next + 1) % self.engines
        return i

    def routed(self, req: TraceRequest, engine: int, done_at: float) -> None:
        pass


class CacheAware:
    CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 64, 1.5  # sglang-router 0.3.2's defaults

    def __init__(self, engines: int) -> None:
        self.seen: list[set[int]] = [set() for _ in range(engines)]  # block ids (each names its whole prefix)
        self.busy: list[deque[float]] = [deque() for _ in range(engines)]  # prefill end times, in order

    def _loads(self, now: float) -> list[int]:
        for q in self.busy:
            while q and q[0] <= now:
                q.popleft()
        return [len(q) for q in self.busy]

    def pick(self, req: TraceRequest, now: float) -> int:
        loads = self._loads(now)
        lo, hi = min(loads), max(loads)
        if hi - lo > self.BALANCE_ABS and hi > lo * self.BALANCE_REL:
            return loads.index(lo)
        matched = [sum(1 for _ in takewhile(seen.__contains__, req.hash_ids)) for seen in self.seen]
        best = matched.index(max(matched))
        if req.hash_ids and matched[best] / len(req.hash_ids) > self.CACHE_THRESHOLD:
            return best
        return loads.index(lo)

    def routed(self, req: TraceRequest, engine: int, done_at: float) -> None:
        self.seen[engine].update(req.hash_ids)
        self.busy[engine].append(done_at)


def make_router(name: str, engines: int) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose {', '.join(ROUTERS)}")
    return (RoundRobin if name == "round-robin" else CacheAware)(engines)
