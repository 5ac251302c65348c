"""Prometheus metrics (``hicache_`` prefix) in a registry of their own per server.

Per-request counters and histograms are updated on the engine-loop thread when a request
finishes; gauges are refreshed from ``Engine.stats()`` (taken on the loop thread) at scrape
time. Tiers and pools are read from whatever ``stats()`` reports, so a new tier shows up
without a code change here.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from ..runtime.request import GenerateResult
from .edit_reuse_usage import request_outcome

ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)  # tokens per verify pass
STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_EVICTED = re.compile(r"^evicted_(\w+)_pages$")
disable_created_metrics()  # no `*_created` series: they double the scrape for nothing here


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("hicache_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("hicache_generation_tokens", "Generated tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("hicache_cached_tokens", "Prompt tokens served from the cache, by tier.",
                                     ["tier"], registry=r)
        self.requests = Counter("hicache_requests", "Finished requests by finish reason (stop, length, abort).",
                                ["finish_reason"], registry=r)
        self.running = Gauge("hicache_num_running_requests", "Requests admitted and running.", registry=r)
        self.waiting = Gauge("hicache_num_waiting_requests", "Requests queued for admission.", registry=r)
        self.pool_usage = Gauge("hicache_pool_usage_ratio", "Used fraction of a KV pool (request + cached pages).",
                                ["pool"], registry=r)
        self.pool_pages = Gauge("hicache_pool_pages", "KV pool pages by state.", ["pool", "state"], registry=r)
        self.hit_rate = Gauge("hicache_cache_hit_rate", "Cached prompt tokens / prompt tokens since start.", registry=r)
        self.other = Gauge("hicache_engine_stat", "Other numeric groups of Engine.stats() (e.g. transfers), as reported.",
                           ["group", "field"], registry=r)
        self.evicted = Counter("hicache_evicted_pages", "Pages evicted from a tier.", ["tier"], registry=r)
        latency = functools.partial(Histogram, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = latency("hicache_time_to_first_token_seconds", "Arrival to first token.")
        self.e2e = latency("hicache_e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = latency("hicache_queue_time_seconds", "Arrival to admission.")
        self.rejected = Counter("hicache_rejected_requests", "Requests answered with an error instead of a result, "
                                "by error code (invalid_value, server_overloaded, engine_dead, invalid_api_key, ...).",
                                ["reason"], registry=r)
        self.storage_failures = Counter("hicache_storage_failures", "Storage (L3) operations that failed, by backend "
                                        "and kind (timeout, breaker_open, backend_error, missing, checksum, ...).",
                                        ["backend", "kind"], registry=r)
        self.breaker_state = Gauge("hicache_storage_breaker_state", "1 for the storage circuit breaker's current "
                                   "state (closed, open, half_open), 0 for the others.", ["backend", "state"], registry=r)
        self.breaker_opens = Counter("hicache_storage_breaker_opens", "Times the storage circuit breaker opened.",
                                     ["backend"], registry=r)
        self.kv_pages = Gauge("hicache_kv_shard_pages", "KV pages held (in use) on each rank of the shard group.",
                              ["shard_rank"], registry=r)
        self.kv_gather = Gauge("hicache_kv_gather", "Each stage rank's prefix gathers: gathers, gathered_bytes, "
                               "gather_time_s, gather_wait_s, gather_scratch_bytes.", ["tp_rank", "field"], registry=r)
        # Speculative decoding, per finished request: mean tokens per verify pass (the target's own
        # included) and how many passes it took; accepted tokens / verify steps sum is the
        # token-weighted accept length over any window (hicache bench's "Accept length").
        self.spec_accept_length = Histogram("hicache_spec_accept_length", "Speculative decoding: a request's mean "
                                            "tokens per verify pass.", buckets=ACCEPT_BUCKETS, registry=r)
        self.spec_verify_steps = Histogram("hicache_spec_verify_steps", "Speculative decoding: a request's verify "
                                           "passes.", buckets=STEP_BUCKETS, registry=r)
        self.spec_accepted = Counter("hicache_spec_accepted_tokens", "Speculative decoding: tokens verify passes "
                                     "gave finished requests.", registry=r)
        # Prefill/decode disaggregation: KV that crossed between the servers (this server's side)
        self.kv_transfer = Counter("hicache_kv_transfer", "P/D KV transfers of this server's side: requests, failed, "
                                   "tokens, bytes, seconds (decode side: asking to stored), decode_prefix_tokens "
                                   "(prompt tokens the decode side's own tiers supplied), states (a recurrent model's "
                                   "states, moved whole).", ["field"], registry=r)
        # Clients' retention hints (docs/agent_contract.md)
        self.retained_tokens = Gauge("hicache_retained_tokens", "Tokens a client's retention hint keeps, held in each "
                                     "tier now.", ["tier"], registry=r)
        self.retention = Counter("hicache_retention", "Retention hints: hints (applied), clipped (granted in part or "
                                 "not at all), expired_tokens, released_tokens.", ["field"], registry=r)
        self._add_edit_reuse()
        self._seen: dict[tuple, float] = {}  # cumulative figures already counted
        for tier in ("device", "host", "storage"):
            self.cached_tokens.labels(tier=tier)

    def _add_edit_reuse(self) -> None:
        """Reuse after an edit (docs/edit_reuse.md), per finished request that tried it (server/edit_reuse_usage.py)."""
        self.edit_reuse_tokens = Counter("hicache_edit_reuse_tokens", "Reuse after an edit: prompt tokens whose KV "
                                         "was reused from another position (reused) or computed at a reused span's "
                                         "start (recomputed).", ["kind"], registry=self.registry)
        self.edit_reuse_requests = Counter("hicache_edit_reuse_requests", "Reuse after an edit: finished requests "
                                           "that tried it, by outcome (kept: tokens reused; gated: the quality gate "
                                           "fell back to exact prefix reuse; none: no span found).", ["outcome"],
                                           registry=self.registry)

    def refused(self, status: int, reason: str) -> None:
        """A request answered with an error (``reason``: its code); not a client that left (499)."""
        if status != 499:
            self.rejected.labels(reason=reason).inc()

    def observe_finished(self, res: GenerateResult) -> None:
        """Called on the engine-loop thread once per finished request."""
        self.requests.labels(finish_reason=res.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(res.prompt_tokens)
        self.generation_tokens.inc(res.completion_tokens)
        for tier, n in res.cached_tokens_details.items():
            self.cached_tokens.labels(tier=tier).inc(n)
        for histogram, seconds in ((self.ttft, res.ttft_s if res.completion_tokens else 0.0), (self.e2e, res.e2e_s),
                                   (self.queue_time, res.queue_time_s)):
            if seconds > 0:
                histogram.observe(seconds)
        if (outcome := request_outcome(res)) is not None:
            self.edit_reuse_requests.labels(outcome=outcome).inc()
            self.edit_reuse_tokens.labels(kind="reused").inc(res.edit_reuse.reused_tokens)
            self.edit_reuse_tokens.labels(kind="recomputed").inc(res.edit_reuse.recomputed_tokens)
        if res.spec_verify_steps:
            self.spec_accept_length.observe(res.spec_accept_length)
            self.spec_verify_steps.observe(res.spec_verify_steps)
            self.spec_accepted.inc(round(res.spec_accept_length * res.spec_verify_steps))

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        """Refresh gauges from ``Engine.stats()``: every ``*_pool`` dict becomes a pool."""
        self.running.set(stats.get("running_requests", 0))
        self.waiting.set(stats.get("waiting_requests", 0))
        self.hit_rate.set(stats.get("hit_rate", 0.0))
        for tier in stats.get("hit_tokens", {}):
            self.cached_tokens.labels(tier=tier)
        if "edit_reuse" in stats:  # (an engine with it on: every series shows, at 0 until it moves)
            for kind in ("reused", "recomputed"):
                self.edit_reuse_tokens.labels(kind=kind)
            for outcome in ("kept", "gated", "none"):
                self.edit_reuse_requests.labels(outcome=outcome)
        for key, value in stats.items():
            if key.endswith("_pool") and isinstance(value, dict):
                pool = key[: -len("_pool")]
                for field, n in value.items():
                    if field.endswith("_pages") and isinstance(n, (int, float)):
                        self.pool_pages.labels(pool=pool, state=field[: -len("_pages")]).set(n)
                cap, free = value.get("capacity_pages"), value.get("free_pages")
                if cap:
                    self.pool_usage.labels(pool=pool).set(1.0 - free / cap if free is not None else 0.0)
            elif key not in ("hit_tokens", "retention") and isinstance(value, dict):
                for field, n in value.items():
                    if isinstance(n, (int, float)) and not isinstance(n, bool):
                        self.other.labels(group=key, field=field).set(n)
            if (m := _EVICTED.match(key)) and isinstance(value, (int, float)):
                self._advance(self.evicted.labels(tier=m.group(1)), ("evicted", m.group(1)), value)
        if isinstance(stats.get("storage"), dict):
            self._update_storage(stats["storage"])
        if isinstance(retention := stats.get("retention"), dict):
            for tier, n in retention.get("retained_tokens", {}).items():
                self.retained_tokens.labels(tier=tier).set(n)
            for field in ("hints", "clipped", "expired_tokens", "released_tokens"):
                self._advance(self.retention.labels(field=field), ("retention", field), retention.get(field, 0))
        if isinstance(stats.get("kv_sharding"), dict):
            self._update_kv_sharding(stats["kv_sharding"])
        for field, n in (stats.get("disaggregation") or {}).items():
            if field not in ("open", "bootstrap_port") and isinstance(n, (int, float)):
                self._advance(self.kv_transfer.labels(field=field), ("pd", field), n)

    def _update_kv_sharding(self, sharding: dict[str, Any]) -> None:
        """Context parallelism: pages held per shard rank; each stage rank's gather figures."""
        for rank, pages in enumerate(sharding.get("owned_pages", [])):
            self.kv_pages.labels(shard_rank=str(rank)).set(pages)
        for rank, figures in enumerate(sharding.get("per_rank", [])):
            for field, n in figures.items():
                self.kv_gather.labels(tp_rank=str(rank), field=field).set(n)

    def _advance(self, counter: Any, key: tuple, total: float) -> None:
        """Move ``counter`` to a cumulative ``total`` read from stats (a smaller total: restarted)."""
        prev = self._seen.get(key, 0)
        counter.inc(total - prev if total >= prev else total)
        self._seen[key] = total

    def _update_storage(self, storage: dict[str, Any]) -> None:
        backend = str(storage.get("backend", "unknown"))
        for kind, n in (storage.get("failures") or {}).items():
            self._advance(self.storage_failures.labels(backend=backend, kind=kind), ("fail", backend, kind), n)
        if isinstance(breaker := storage.get("breaker"), dict):
            for state in ("closed", "open", "half_open"):
                self.breaker_state.labels(backend=backend, state=state).set(float(breaker.get("state") == state))
            self._advance(self.breaker_opens.labels(backend=backend), ("opens", backend), breaker.get("opens", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
