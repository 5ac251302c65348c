"""The tier contract: what a tier below the device offers the manager, and the counters
every tier writes.

The tiers are the device (L1, :mod:`.device_tier`: admission and eviction on the device pool),
the host (L2, :mod:`.host_tier`) and storage (L3, :mod:`.storage_tier`). All of them share one
:class:`~.radix.RadixCache` for their node state. Each lower tier hangs below the one above it
and learns of a new copy there through :meth:`Tier.on_insert`::

    device --on_insert(node)--> host --on_insert(node) on backup ack--> storage

Background work (copies, storage writes, prefetch readers) finishes into ordered queues. A tier
reports its *leading* acks and applies exactly the counts it is given, only at the fixed point
of the step, so every rank changes the tree identically (DESIGN invariant 3). Each tier owns
its own fields of :class:`~.acks.AckCounts` and leaves the others 0.

Units: page counts are logical pages of the tier's own pool; ``*_tokens`` are tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..config import EngineConfig
from .acks import AckCounts
from .tree_node import TreeNode


@dataclass(frozen=True)
class CachePolicy:
    """How the tiers behave: device eviction order and reuse, the host write policy, when
    storage is asked and how much of the host it may fill, the deadline (seconds) of each
    storage backend call (a breaker skips a backend that keeps failing; None: no deadline);
    ``cache_generated``: finished requests cache their generated tokens' KV too, not only their
    prompt's (``--cache-generated-kv``; a hybrid pool's requests keep the window it caches);
    ``turn_end_states``: with them, a recurrent model's decode keeps a snapshot at the last grid
    boundary of a turn (off under deterministic inference: a decode step's state is not a chunked
    scan's bits, so a hit there would not give a cold run's). The
    engine's flags are checked where they are parsed (:class:`~hicache.config.EngineConfig`)."""

    eviction_policy: str = "lru"
    enable_prefix_cache: bool = True
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    prefetch_threshold: int = 256
    prefetch_max_host_fraction: float = 0.5
    storage_op_timeout: float | None = 10.0
    cache_generated: bool = True
    turn_end_states: bool = False
    retention_max_fraction: float = 0.5  # of each tier's pool, for clients' retention hints (cache/retention.py)
    storage_write_policy: str = "write_through"  # or "selective": retained or hit-threshold prefixes only

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> CachePolicy:
        """The policy the engine's flags ask for."""
        return cls(eviction_policy=cfg.radix_eviction_policy, enable_prefix_cache=cfg.decode_reuses_prefix,
                   write_policy=cfg.hicache_write_policy, write_through_threshold=cfg.hicache_write_through_threshold,
                   prefetch_threshold=cfg.hicache_storage_prefetch_threshold,
                   storage_op_timeout=cfg.hicache_storage_op_timeout, cache_generated=cfg.caches_generated_kv,
                   turn_end_states=cfg.caches_generated_kv and not cfg.enable_deterministic_inference,
                   retention_max_fraction=cfg.cache_retention_max_fraction,
                   storage_write_policy=cfg.hicache_storage_write_policy)


class Tier(Protocol):
    """A tier below the device, as the tier above and the manager drive it."""

    def on_insert(self, node: TreeNode | None) -> None:
        """The tier above now holds ``node`` and its path: copy down what the policy asks."""

    def ready_acks(self) -> AckCounts:
        """Leading acks of this tier's queues that are ready on this rank (agreement input)."""

    def pending_acks(self) -> AckCounts:
        """Every ack this tier's queues still owe (what a drain waits for)."""

    def consume_acks(self, acks: AckCounts) -> None:
        """Apply exactly this tier's fields of ``acks``, in queue order."""

    def has_pending(self) -> bool:
        """Whether queued or in-flight work remains."""

    def shutdown(self) -> None:
        """Stop the tier's threads (after a drain)."""


@dataclass
class CacheStats:
    """Cumulative counters since start, written by every tier."""

    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    evicted_device_pages: int = 0
    evicted_window_pages: int = 0  # hybrid: window pages tombstoned to make room in the window component
    backup_skipped_window_pages: int = 0  # hybrid: checkpoint window pages a backup found no host room for
    superseded_host_window_pages: int = 0  # hybrid: host window pages freed once a later checkpoint extends theirs
    evicted_host_pages: int = 0
    backup_tokens: int = 0
    backup_bytes: int = 0
    load_tokens: int = 0
    load_bytes: int = 0
    load_time_s: float = 0.0  # submit -> finish, summed over load-backs
    backup_skipped_pages: int = 0  # host pool full of locked data
