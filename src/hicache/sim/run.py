"""Replay a trace through simulated engines (:mod:`hicache.sim.engine`) behind a router, on a
virtual clock (:mod:`hicache.sim.costs`), and count hits per tier in real tokens.

Units: capacities are given in real tokens per engine and become pages (``page_size`` real
tokens each; a page holds ``block_tokens x page_size / BLOCK_TOKENS`` synthetic tokens); hits are counted in whole
trace blocks (a block's real token count, the last one capped at the request's input length),
by the tier that supplied the block's last token.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Optional, Sequence

from ..cache.storage.keys import page_hashes
from ..cache_hints import RetentionHint
from ..config import ConfigError
from .costs import PROFILES, CostModel
from .oracle import NextUse
from .oracle_store import OracleStore
from .router import make_router
from .trace import BLOCK_TOKENS, TraceRequest

if TYPE_CHECKING:
    from .engine import EngineSpec, SimEngine

TIERS = ("device", "host", "storage")
# Eviction policies to compare: the tree's own policy, the same with the trace's retention hints,
# and the offline optimal (sim/oracle.py)
POLICIES = ("lru", "lru+hints", "belady")
UNLIMITED = math.inf


@dataclass(frozen=True)
class Capacities:
    """In real tokens: ``UNLIMITED``, a number, or None (no such tier; the device tier always
    exists). Device and host are per engine; storage is one store every engine shares, and
    needs the host tier (its reads land in host memory)."""

    device: float = UNLIMITED
    host: Optional[float] = None
    storage: Optional[float] = None


@dataclass(frozen=True)
class SimConfig:
    capacities: Capacities = Capacities()
    page_size: int = BLOCK_TOKENS  # real tokens per page
    # Synthetic tokens per trace block: two, so a page (page_size / BLOCK_TOKENS blocks) holds two
    # or more and a request's own last token never fills a page of its own (the tree caches only
    # whole pages; at one token per page every request would cache a page no one can hit).
    block_tokens: int = 2
    write_policy: str = "write_through"
    eviction_policy: str = "lru"
    engines: int = 1
    router: str = "round-robin"
    kv_sharding: int = 1  # page-sharded CP over N ranks: the device and host tiers hold N x their capacity
    cost: CostModel = PROFILES["gpu"]
    policy: str = "lru"  # one of POLICIES
    storage_write_policy: str = "write_through"  # or "selective" (--hicache-storage-write-policy)
    retention_max_fraction: float = 0.5  # of each tier, for hints (--cache-retention-max-fraction)

    @property
    def sim_page_size(self) -> int:
        """Synthetic tokens per page."""
        return self.block_tokens * self.page_size // BLOCK_TOKENS

    def check(self) -> None:
        if self.block_tokens < 1 or self.page_size < 1 or self.block_tokens * self.page_size % BLOCK_TOKENS:
            raise ConfigError(f"a page of {self.page_size} tokens must be a whole number of synthetic tokens: "
                              f"--block-tokens x --page-size must be a multiple of {BLOCK_TOKENS}.")
        if self.engines < 1 or self.kv_sharding < 1:
            raise ConfigError("--engines and --kv-sharding must be at least 1.")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}.")
        if self.policy == "belady" and self.engines > 1:
            raise ConfigError("--policy belady needs --engines 1 (the oracle knows the next use of a block, "
                              "not which engine the router will send it to).")


@dataclass
class TierHits:
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def add(self, req: TraceRequest, hits: dict[str, int]) -> None:
        self.requests += 1
        self.input_tokens += req.input_length
        for tier in TIERS:
            self.hit_tokens[tier] += hits[tier]

    def summary(self) -> dict:
        hit = sum(self.hit_tokens.values())
        return {"requests": self.requests, "input_tokens": self.input_tokens, "hit_tokens": dict(self.hit_tokens),
                "hit_ratio": hit / self.input_tokens if self.input_tokens else 0.0}


@dataclass
class SimResult:
    total: TierHits
    per_engine: list[TierHits]
    ttft_s: list[float]
    config: SimConfig
    pages: EngineSpec  # what each engine was built with
    per_class: dict[str, TierHits] = field(default_factory=dict)  # by the trace's request class, where it has one
    storage_written_tokens: int = 0  # real tokens written to L3 (whole pages)

    def add(self, req: TraceRequest, engine: int, hits: dict[str, int]) -> None:
        self.total.add(req, hits)
        self.per_engine[engine].add(req, hits)
        if req.cls:
            self.per_class.setdefault(req.cls, TierHits()).add(req, hits)

    def to_json(self) -> dict:
        t = sorted(self.ttft_s)
        out = self.total.summary()
        out["ttft_s"] = {"mean": statistics.fmean(t) if t else 0.0, "p50": _quantile(t, 0.50), "p99": _quantile(t, 0.99)}
        out["per_engine"] = [e.summary() for e in self.per_engine]
        if self.per_class:
            out["per_class"] = {k: v.summary() for k, v in sorted(self.per_class.items())}
        out["storage_written_tokens"] = self.storage_written_tokens
        out["storage_written_bytes"] = self.storage_written_tokens * self.config.cost.kv_bytes_per_token
        cfg = asdict(self.config)
        cfg["cost"] = self.config.cost.name
        cfg["capacities"] = {k: ("unlimited" if v == UNLIMITED else v) for k, v in cfg["capacities"].items()}
        out["config"] = cfg
        out["engine_pages"] = asdict(self.pages)
        return out


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def tier_hits(cached: dict[str, int], lengths: list[int], block_tokens: int) -> dict[str, int]:
    """Real tokens hit per tier: whole blocks, each by the tier that supplied its last token
    (``cached``: synthetic tokens per tier, in prefix order device -> host -> storage)."""
    ends, out = dict(zip(TIERS, accumulate(cached.get(t, 0) for t in TIERS))), dict.fromkeys(TIERS, 0)
    for i, n in enumerate(lengths):
        last = (i + 1) * block_tokens
        tier = next((t for t in TIERS if last <= ends[t]), None)
        if tier is None:
            break
        out[tier] += n
    return out


def _pages(name: str, tokens: Optional[float], cfg: SimConfig, unlimited_pages: int, shards: int = 1) -> Optional[int]:
    """Real tokens -> pages of synthetic tokens (None stays None; UNLIMITED: the whole trace), held
    by each of ``shards`` ranks (the capacity given is per rank)."""
    if tokens is None:
        return None
    if tokens == UNLIMITED:
        return unlimited_pages
    pages = int(tokens // cfg.page_size)
    if pages < 1:
        raise ConfigError(f"the {name} capacity, {tokens:g} tokens, is smaller than one page ({cfg.page_size} tokens).")
    return pages * shards


def engine_spec(cfg: SimConfig, trace: Sequence[TraceRequest]) -> EngineSpec:
    # The engines (torch, the cache tiers) are imported on use: the ``hicache`` parser reads this
    # module's TIERS and SimConfig, and every command, ``serve`` refusing a flag included, builds it.
    from .engine import EngineSpec

    if cfg.capacities.storage is not None and cfg.capacities.host is None:
        raise ConfigError("a storage tier needs a host tier (prefetched pages land in host memory): give a host "
                          "capacity too.")
    cfg.check()
    if any(r.block_tokens != BLOCK_TOKENS for r in trace):
        raise ConfigError(f"the simulator replays traces of {BLOCK_TOKENS}-token blocks; this one has blocks of "
                          f"{next(r.block_tokens for r in trace if r.block_tokens != BLOCK_TOKENS)} tokens.")
    everything = sum(-(-(len(r.hash_ids) * cfg.block_tokens + 2) // cfg.sim_page_size) for r in trace) + 1
    cap, n = cfg.capacities, cfg.kv_sharding  # each rank of the group holds its share of the pages, device and host
    return EngineSpec(_pages("device", cap.device, cfg, everything, n), _pages("host", cap.host, cfg, everything, n),
                      _pages("storage", cap.storage, cfg, everything), cfg.sim_page_size, cfg.write_policy,
                      cfg.eviction_policy, storage_write_policy=cfg.storage_write_policy,
                      retention_max_fraction=cfg.retention_max_fraction)


def dense_blocks(trace: Sequence[TraceRequest]) -> list[tuple[int, ...]]:
    """Each request's blocks as small ints (token ids are int32; trace ids may be 64-bit hashes),
    numbered in order of first appearance."""
    dense: dict[int, int] = {}
    return [tuple(dense.setdefault(b, len(dense)) for b in req.hash_ids) for req in trace]


def sim_hints(req: TraceRequest, cfg: SimConfig) -> tuple[RetentionHint, ...]:
    """The request's hints (whole blocks, :mod:`.trace`) as retention hints in synthetic tokens,
    under ``lru+hints``; none under the other policies."""
    if cfg.policy != "lru+hints":
        return ()
    return tuple(RetentionHint(None if h.get("blocks") is None else h["blocks"] * cfg.block_tokens,
                               float(h["seconds"]), int(h.get("priority", 0)), str(h.get("ttl", "")))
                 for h in req.hints)


def foresee(oracle: NextUse, storage: object, engine: SimEngine, tokens: list[int], index: int) -> None:
    """Request ``index`` (``tokens``) is next: move the oracle's clock to it, and tell a store
    under the oracle's order which of its objects the request names."""
    oracle.now = index
    if isinstance(storage, OracleStore):
        page = engine.cache.page_size
        hashes = page_hashes(tokens, page, engine.cache.ns_digest(engine.namespace))
        storage.expect(hashes, [oracle.block_of(tokens[k * page]) for k in range(len(hashes))])


def min_device_tokens(trace: Sequence[TraceRequest], cfg: SimConfig) -> int:
    """The smallest device capacity (real tokens, whole pages) that holds the trace's longest
    prompt while it runs: its blocks' synthetic tokens, its own token and one more."""
    longest = max((len(r.hash_ids) for r in trace), default=0) * cfg.block_tokens + 1
    return -(-(longest + 1) // cfg.sim_page_size) * cfg.page_size


def simulate(trace: Sequence[TraceRequest], cfg: SimConfig) -> SimResult:
    """Replay ``trace`` (arrival order) and return hits per tier and TTFT estimates."""
    from .engine import SimEngine, block_token_ids, shared_storage

    spec = engine_spec(cfg, trace)
    longest = max((len(r.hash_ids) for r in trace), default=0) * cfg.block_tokens + 1
    if min_device_tokens(trace, cfg) > spec.device_pages * cfg.page_size:
        raise ConfigError(f"the device capacity ({spec.device_pages} pages of {cfg.page_size} tokens) cannot hold the "
                          f"trace's longest prompt ({max(r.input_length for r in trace)} tokens); raise "
                          "--device-tokens or shorten the trace.")
    blocks = dense_blocks(trace)
    oracle = NextUse(blocks, cfg.block_tokens) if cfg.policy == "belady" else None
    storage = shared_storage(spec) if oracle is None or spec.storage_pages is None else \
        OracleStore(spec.storage_pages, oracle)
    engines = [SimEngine(spec, longest, storage, oracle and oracle.key) for _ in range(cfg.engines)]
    router = make_router(cfg.router, cfg.engines)
    free_at = [0.0] * cfg.engines  # virtual time each engine's prefill queue empties
    result = SimResult(TierHits(), [TierHits() for _ in engines], [], cfg, spec)
    try:
        for n, req in enumerate(trace, 1):
            arrival = req.timestamp_ms / 1000
            i = router.pick(req, arrival)
            tokens = block_token_ids(blocks[n - 1], cfg.block_tokens, n)
            if oracle is not None:
                foresee(oracle, storage, engines[i], tokens, n - 1)
            cached = engines[i].serve(tokens, sim_hints(req, cfg), arrival)
            hits = tier_hits(cached, req.block_lengths(), cfg.block_tokens)
            result.add(req, i, hits)
            missed = req.input_length - sum(hits.values())
            ready = max(arrival + cfg.cost.storage_read_s(hits["storage"]), free_at[i])
            free_at[i] = ready + cfg.cost.forward_s(missed, hits["host"])
            result.ttft_s.append(free_at[i] - arrival)
            router.routed(req, i, free_at[i])
    finally:
        for e in engines:
            e.close()
    if storage is not None:
        result.storage_written_tokens = storage.stats().sets * cfg.page_size
    return result
