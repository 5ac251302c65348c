"""What ``Engine.stats()`` reports of one rank's core: the cache's hits, pools and tiers, the queues,
storage and its window objects, each mode's figures, context parallelism's KV. Units as named in
each key (tokens, pages, bytes, seconds)."""

from __future__ import annotations

from typing import Any

from .core import EngineCore


def core_stats(core: EngineCore, page_size: int) -> dict[str, Any]:
    """The cache and queue figures of ``Engine.stats()``."""
    cache, sched = core.cache, core.scheduler
    s = cache.stats
    hits = {"device": s.device_hit_tokens, "host": s.host_hit_tokens, "storage": s.storage_hit_tokens}
    out = {
        "prompt_tokens": s.prompt_tokens,
        "prefill_computed_tokens": sched.prefill_computed_tokens,  # prompt tokens the forward computed
        "hit_tokens": hits, "hit_rate": (sum(hits.values()) / s.prompt_tokens) if s.prompt_tokens else 0.0,
        "evicted_device_pages": s.evicted_device_pages, "device_pool": cache.usage(),
        "components": [c.summary() for c in core.plan.components],  # this rank's (runtime/rank_plan.py)
        "running_requests": len(sched.running), "waiting_requests": len(sched.waiting),
        "retention": cache.retention.usage(),  # clients' retention hints: retained tokens per tier, clipped, expired
    }
    if cache.storage is not None:
        st = cache.storage.stats
        out["storage"] = {
            "backend": cache.storage.backend.name,
            "prefetch_ops": st.prefetch_ops, "prefetched_tokens": st.prefetched_pages * page_size,
            "prefetch_bytes": st.prefetch_bytes, "prefetch_time_s": st.prefetch_time_s,
            # the prefetch policy's decisions and the two measurements the adaptive one weighs
            "prefetch_policy": sched.policy.prefetch_policy, "prefetch_waited": sched.prefetch_rule.waited,
            "prefetch_skipped": sched.prefetch_rule.skipped,
            "prefill_tokens_per_s": sched.prefetch_rule.prefill.tokens_per_s,
            "read_s_per_page": cache.storage.read_page_s,
            "backup_tokens": st.backup_pages * page_size, "backup_bytes": st.backup_bytes,
            **({"window": {"backup_tokens": st.window_backup_pages * page_size, "backup_bytes": st.window_backup_bytes,
                           "prefetched_tokens": st.window_prefetched_pages * page_size,
                           "prefetch_bytes": st.window_prefetch_bytes,
                           "deleted_tokens": st.window_deleted_pages * page_size}} if cache.pool.hybrid else {}),
            "backup_time_s": st.backup_time_s, "failures": dict(st.failures),
            # state (closed/open/half_open), opens, short_circuited, timeouts, ... (storage.guard)
            "breaker": cache.storage.guard.snapshot(),
        }
    if core.runner.cp is not None:
        out["kv_sharding"] = kv_sharding_stats(core)
    for mode in sched.modes:  # "speculative", "disaggregation": what each mode shows
        figures = mode.stats()
        if figures:
            out[mode.name] = figures
    host = cache.host_usage()
    if host is not None:
        out["host_pool"] = host
        out["evicted_host_pages"] = s.evicted_host_pages
        out["transfers"] = {key: getattr(s, key) for key in (
            "backup_tokens", "backup_bytes", "load_tokens", "load_bytes", "load_time_s", "backup_skipped_pages")}
    return out


def kv_sharding_stats(core: EngineCore) -> dict[str, Any]:
    """Context parallelism's KV figures as this rank sees them: the logical view (the same on
    every rank) gives each CP rank's pages in use; the gather figures are this rank's own."""
    cp = core.runner.cp
    owned = core.cache.device.owned_pages()
    gather = cp.gather
    return {
        "shards": len(owned) if cp.placement is not None else 1,
        # pages held on each CP rank: its share when sharded, every page on each when replicated
        "owned_pages": owned if cp.placement is not None else owned * cp.group.size,
        "pool_bytes_per_rank": core.pool.total_bytes,
        "gather_scratch_bytes": gather.nbytes if gather is not None else 0,
        "gathers": gather.gathers if gather is not None else 0,
        "gathered_bytes": gather.gathered_bytes if gather is not None else 0,
        "gather_time_s": gather.busy_s if gather is not None else 0.0,
        "gather_wait_s": gather.wait_s if gather is not None else 0.0,
    }
