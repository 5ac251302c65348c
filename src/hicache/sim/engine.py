"""One simulated engine: the project's own scheduler, radix tree, pools, host tier and storage
tier, with a forward pass that computes nothing.

The cache decisions (what hits where, what is evicted, backed up, prefetched) are the engine's:
the same :class:`~hicache.runtime.scheduler.Scheduler` admits each request against the same
:class:`~hicache.cache.manager.KVCacheManager`. Only the bytes are gone: the pools hold one
float per token (one layer, one head of width 1), the storage tier writes to the ``memory``
backend, copies and storage calls run on the scheduler thread (``run_inline``), and the
forward pass returns zeros.

Tokens: a trace block becomes ``block_tokens`` synthetic token ids (block b: ids
``b * block_tokens + 1 ...``, b a dense index of the trace's ids), so equal blocks are equal
tokens; every prompt ends with one token of its own (the engine always computes a prompt's last
token for its logits, so this keeps a fully cached prompt's last block countable as a hit; with
two or more tokens per page it never fills a page, so the tree never caches it). Capacities are pages of these
tokens; :mod:`hicache.sim.run` converts real tokens to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..cache.host_pool import HostKVPool
from ..cache.manager import CachePolicy, KVCacheManager
from ..cache.pools import DeviceKVPool
from ..cache.storage.memory import MemoryBackend
from ..cache.tree_node import TreeNode
from ..cache_hints import RetentionHint
from ..runtime.request import Request, Status
from ..runtime.sampling import SamplingParams
from ..runtime.scheduler import SchedulePolicy, Scheduler
from ..runtime.step import StepDriver

NAMESPACE = "sim"


@dataclass(frozen=True)
class EngineSpec:
    """Capacities in pages (``None``: no such tier; storage: the store all engines share), page
    size in synthetic tokens, policies."""

    device_pages: int
    host_pages: Optional[int] = None
    storage_pages: Optional[int] = None
    page_size: int = 1
    write_policy: str = "write_through"
    eviction_policy: str = "lru"
    write_through_threshold: int = 2
    storage_write_policy: str = "write_through"
    retention_max_fraction: float = 0.5


def no_forward(input_ids, prefix_lens, context_slots, hidden=None, logits="last", window_slots=None,
               generated=False, state_slots=None) -> torch.Tensor:
    """One row of (zero) logits per sequence over a one-token vocabulary."""
    return torch.zeros(len(input_ids), 1)


def shared_storage(spec: EngineSpec) -> Optional[MemoryBackend]:
    """The L3 every engine shares (as a Mooncake Store or 3FS cluster is), or None."""
    return None if spec.storage_pages is None else MemoryBackend(max_objects=spec.storage_pages)


class NoForwardEngine:
    """The project's scheduler over ``cache``, stepping :func:`no_forward`: what it admits, evicts
    and hits is the engine's; no number is computed. Requests go in :attr:`namespace`."""

    namespace = NAMESPACE

    def __init__(self, cache: KVCacheManager, policy: SchedulePolicy) -> None:
        self.cache = cache
        self.scheduler = Scheduler(cache, lambda ids: "", set(), policy)
        self.driver = StepDriver(self.scheduler, no_forward)
        self.rid = 0

    def add(self, tokens: list[int], max_new_tokens: int = 1, hints: Sequence[RetentionHint] = (),
            wall_time: float = 0.0) -> Request:
        """``hints`` in synthetic tokens; ``wall_time``: the arrival on the virtual clock (seconds),
        the retention clock."""
        self.rid += 1
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        req = Request(self.rid, list(tokens), params, self.namespace, max_new_tokens=max_new_tokens,
                      hints=tuple(hints), wall_time=wall_time)
        self.scheduler.add(req)
        return req

    def run(self, reqs: list[Request], max_steps: int = 100_000) -> int:
        """Step until every request of ``reqs`` finished; the steps taken."""
        for steps in range(1, max_steps + 1):
            self.driver.step()
            if all(r.status is Status.FINISHED for r in reqs):
                return steps
        raise RuntimeError(f"requests still running after {max_steps} steps")

    def serve(self, tokens: list[int], hints: Sequence[RetentionHint] = (), wall_time: float = 0.0) -> dict[str, int]:
        """Run one request to its first token; returns its hit tokens per tier. Every copy and
        storage write it queued has landed when this returns (the simulator's copies run inline,
        at submit; between requests a real engine's copy threads are far ahead of arrivals)."""
        req = self.add(tokens, hints=hints, wall_time=wall_time)
        self.run([req])
        self.cache.drain()
        return req.cached


class SimEngine(NoForwardEngine):
    def __init__(self, spec: EngineSpec, prompt_tokens: int, storage: Optional[MemoryBackend] = None,
                 eviction_order: Callable[[TreeNode], tuple] | None = None) -> None:
        """``prompt_tokens``: the longest prompt (synthetic tokens; :func:`hicache.sim.run.simulate`
        checked that it fits the device pool): one prefill chunk takes it whole. ``storage``: the
        shared L3 (:func:`shared_storage`). ``eviction_order``: replaces the policy's order in the
        device and host tiers (the offline optimal's, :mod:`hicache.sim.oracle`)."""
        pool = DeviceKVPool(1, 1, 1, spec.device_pages + 1, spec.page_size, torch.float32, "cpu")
        host = HostKVPool(pool, spec.host_pages, "page_first", pin_memory=False) if spec.host_pages else None
        policy = CachePolicy(eviction_policy=spec.eviction_policy, write_policy=spec.write_policy,
                             write_through_threshold=spec.write_through_threshold, prefetch_threshold=spec.page_size,
                             storage_op_timeout=None, storage_write_policy=spec.storage_write_policy,
                             retention_max_fraction=spec.retention_max_fraction)
        cache = KVCacheManager(pool, host, storage, policy)
        cache.tree.eviction_order = eviction_order
        for controller in (cache.controller, cache.storage):  # nothing to overlap copies with
            if controller is not None:
                controller.run_inline()
        super().__init__(cache, SchedulePolicy(prompt_tokens + spec.page_size, max_running_requests=1,
                                               prefetch_policy="wait_complete"))

    def close(self) -> None:
        self.cache.shutdown()


def block_token_ids(hash_ids: tuple[int, ...], block_tokens: int, own: int) -> list[int]:
    """The prompt's synthetic tokens: ``block_tokens`` per block, then the request's own token
    (``own`` > 0; negative ids never collide with block ids)."""
    base = np.asarray(hash_ids, dtype=np.int64)[:, None] * block_tokens + np.arange(1, block_tokens + 1)
    return base.ravel().tolist() + [-own]
