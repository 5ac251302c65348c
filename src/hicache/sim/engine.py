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

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..cache.host_pool import HostKVPool
from ..cache.manager import CachePolicy, KVCacheManager
from ..cache.pools import DeviceKVPool
from ..cache.storage.memory import MemoryBackend
from ..runtime.request import Request, Status
from ..runtime.sampling import SamplingParams
from ..runtime.scheduler import SchedulePolicy, Scheduler
from ..runtime.step import StepDriver

logger = logging.getLogger(__name__)

GREEDY_ONE = SamplingParams(max_new_tokens=1, temperature=0.0)
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


def _no_forward(input_ids, prefix_lens, context_slots, hidden=None, logits="last", window_slots=None,
                generated=False) -> torch.Tensor:
    """One row of (zero) logits per sequence over a one-token vocabulary."""
    return torch.zeros(len(input_ids), 1)


def shared_storage(spec: EngineSpec) -> Optional[MemoryBackend]:
    """The L3 every engine shares (as a Mooncake Store or 3FS cluster is), or None."""
    return None if spec.storage_pages is None else MemoryBackend(max_objects=spec.storage_pages)


class SimEngine:
    def __init__(self, spec: EngineSpec, prompt_tokens: int, storage: Optional[MemoryBackend] = None) -> None:
        """``prompt_tokens``: the longest prompt (synthetic tokens): one prefill chunk takes it
        whole. ``storage``: the shared L3 (:func:`shared_storage`)."""
        self.spec = spec
        pool = DeviceKVPool(1, 1, 1, spec.device_pages + 1, spec.page_size, torch.float32, "cpu")
        host = HostKVPool(pool, spec.host_pages, "page_first", pin_memory=False) if spec.host_pages else None
        policy = CachePolicy(eviction_policy=spec.eviction_policy, write_policy=spec.write_policy,
                             write_through_threshold=spec.write_through_threshold, prefetch_threshold=spec.page_size,
                             storage_op_timeout=None)
        self.cache = KVCacheManager(pool, host, storage, policy)
        for controller in (self.cache.controller, self.cache.storage):  # nothing to overlap copies with
            if controller is not None:
                controller.run_inline()
        self.scheduler = Scheduler(self.cache, lambda ids: "", set(), SchedulePolicy(
            prompt_tokens + spec.page_size, max_running_requests=1, prefetch_policy="wait_complete"))
        self.driver = StepDriver(self.scheduler, _no_forward)
        self._rid = 0

    def serve(self, tokens: list[int]) -> dict[str, int]:
        """Run one request to its first token; returns its hit tokens per tier (synthetic
        tokens). Every copy and storage write it queued has landed when this returns (copies
        run inline, at submit; between requests a real engine's copy threads are far ahead of
        arrivals)."""
        if self.cache.pages_for(len(tokens) + 1) > self.spec.device_pages:
            raise ValueError(f"a {len(tokens)}-token prompt does not fit the device pool ({self.spec.device_pages} "
                             f"pages of {self.spec.page_size})")
        self._rid += 1
        req = Request(rid=self._rid, prompt_ids=tokens, sampling=GREEDY_ONE, namespace=NAMESPACE, max_new_tokens=1)
        sched = self.scheduler
        sched.add(req)
        while req.status is not Status.FINISHED:
            self.driver.step()
        self.cache.drain()
        return req.cached

    def close(self) -> None:
        self.cache.shutdown()


def block_token_ids(hash_ids: tuple[int, ...], block_tokens: int, own: int) -> list[int]:
    """The prompt's synthetic tokens: ``block_tokens`` per block, then the request's own token
    (``own`` > 0; negative ids never collide with block ids)."""
    base = np.asarray(hash_ids, dtype=np.int64)[:, None] * block_tokens + np.arange(1, block_tokens + 1)
    return base.ravel().tolist() + [-own]
