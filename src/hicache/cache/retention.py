"""Retention: the prefixes clients asked to keep (cache hints), granted within each tier's budget.

A grant marks the nodes of a cached prefix with an expiry (``retain_until``, unix seconds), a
priority and a level: the top tier that keeps them (0 device, 1 host, 2 storage), where they and
every tier below evict them only after every unretained leaf (:mod:`.leaf_eviction`,
:mod:`.host_tier`); a retained device victim is copied to the host (and on to storage) rather
than dropped, and storage writes it even under selective writes (:mod:`.storage_tier`).

Budget: at most ``max_fraction`` of a tier's pool may be retained in it (a node at level L counts
in tier L and every pooled tier below). A prefix that does not fit a tier is granted in the next
one down; one that fits none is clipped there (the outcome says why), never refused: a budget
never stops a request. An expired retention is plain LRU again.

Rank agreement (DESIGN invariant 3): the clock is the newest arrival stamp of a request taken in
(``Request.wall_time``, stamped once by the frontend), so grants, expiries and eviction order
depend only on the request stream; :meth:`RetainedPrefixes.apply` is consensus-checked.

Units: budgets and ``used`` are pages; hints and outcomes are tokens (whole pages).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..cache_hints import TIER_NAMES, RetentionHint, RetentionOutcome
from ..consensus_record import consensus_check
from .radix import RadixCache
from .storage_tier import StorageTier
from .tree_node import TreeNode

logger = logging.getLogger(__name__)


@dataclass
class RetentionStats:
    """Counters since start: hints applied, hints clipped, tokens whose retention expired or was released."""

    hints: int = 0
    clipped: int = 0
    expired_tokens: int = 0
    released_tokens: int = 0


class RetainedPrefixes:
    """Grants, expires and releases retention on the tree's nodes (``tree.retained``: the nodes
    with one). ``budgets``: pages each tier may retain, top down (None: the tier is absent);
    ``storage``: the L3 tier below, if any (unbounded here: the backend keeps its own size); a
    grant hands it the prefix so that it is written even under selective writes."""

    def __init__(self, tree: RadixCache | None, budgets: Sequence[int | None], storage: StorageTier | None,
                 max_fraction: float) -> None:
        self.tree, self.max_fraction, self.storage = tree, max_fraction, storage
        self.budgets = list(budgets) + [None]  # the storage level has no page budget
        self.levels = [lvl for lvl, b in enumerate(self.budgets[:2]) if b is not None] + ([2] if storage else [])
        self.stats = RetentionStats()

    # ---- the clock -------------------------------------------------------------------------
    def advance(self, stamp: float) -> None:
        """A request stamped ``stamp`` arrived: move the clock on and let lapsed retentions go."""
        tree = self.tree
        if tree is None or stamp <= tree.retain_clock:
            return
        tree.retain_clock = stamp
        lapsed = [n for n in tree.retained if n.retain_until <= stamp]
        for node in lapsed:
            self.stats.expired_tokens += len(node.key)
            self._clear(node)
        if lapsed:
            logger.debug("retention expired on %d nodes", len(lapsed))

    def held(self, node: TreeNode) -> bool:
        return node.retain_until > self.tree.retain_clock

    # ---- grants ------------------------------------------------------------------------------
    @consensus_check("retention.apply", args=lambda self, ns, tokens, hints, stamp: (ns, len(tokens), len(hints), stamp),
                     result=lambda o: None if o is None else (o.retained_tokens, o.tier, o.until))
    def apply(self, namespace: str, tokens: np.ndarray, hints: Sequence[RetentionHint],
              stamp: float) -> RetentionOutcome | None:
        """Grant ``hints`` on the cached prefix of ``tokens`` (the request's sequence; a hint without
        tokens asks for all of it that is cached); ``stamp``: the request's arrival (unix s).
        None without hints."""
        if not hints:
            return None
        self.stats.hints += len(hints)
        if self.tree is None or not self.levels:
            self.stats.clipped += len(hints)
            return RetentionOutcome(clipped="the prefix cache is off")
        self.advance(stamp)
        best, clipped, until = RetentionOutcome(), None, 0.0
        for hint in hints:
            path = self._cached_path(namespace, tokens, len(tokens) if hint.tokens is None else hint.tokens)
            got, level, why = self._grant(path, stamp + hint.seconds, hint.priority)
            if got and self.storage is not None:
                granted = self._cached_path(namespace, tokens, got)
                if granted[-1].host_pages is not None:
                    self.storage.on_insert(granted[-1])  # (a host copy selective writes skipped: written now)
                self.storage.retain(granted, stamp + hint.seconds)
            if why is not None:
                self.stats.clipped += 1
                clipped = clipped or why
            if got and got >= best.retained_tokens:
                best = RetentionOutcome(got, TIER_NAMES[level])
            until = max(until, stamp + hint.seconds) if got else until
        out = RetentionOutcome(best.retained_tokens, best.tier, until if best.retained_tokens else 0.0, clipped)
        logger.debug("retention ns=%s tokens=%d tier=%s clipped=%s", namespace[-12:], out.retained_tokens,
                     out.tier, out.clipped)
        return out

    def _cached_path(self, namespace: str, tokens: np.ndarray, length: int) -> list[TreeNode]:
        """The nodes, root first, of the longest cached prefix of ``tokens[:length]`` (whole pages,
        any tier), split so the last one ends there."""
        ps = self.tree.page_size
        tokens = tokens[: min(length, len(tokens)) // ps * ps]
        peek = self.tree.peek_prefix(namespace, tokens, cut=False)
        cached = peek.device_hit_tokens + peek.host_hit_tokens
        node = self.tree.boundary_node(namespace, tokens[:cached], host=True) if cached else None
        return [] if node is None else list(node.lineage())[::-1]

    def _grant(self, path: list[TreeNode], until: float, priority: int) -> tuple[int, int, str | None]:
        """Retain ``path`` (root first) until ``until``: (tokens retained, the deepest level given, why
        it stopped short or None). Levels only go down along a path, so an ancestor is kept at
        least as high as its descendants (eviction takes leaves first)."""
        used = {lvl: self.used(lvl) for lvl in self.levels}
        level_at, tokens, deepest, clipped = 0, 0, 0, None
        for node in path:
            if self.held(node):  # already retained: extend it where it is
                node.retain_until, node.retain_priority = max(node.retain_until, until), max(node.retain_priority, priority)
                level_at = deepest = max(deepest, node.retain_level)
                tokens += len(node.key)
                continue
            pages = self.tree.key_pages(node)
            level = next((lvl for lvl in self.levels if lvl >= level_at and self._room(used, lvl) >= pages), None)
            if level is None:  # what still fits, if anything: the node's first pages (split off), then stop
                level = next((lvl for lvl in self.levels if lvl >= level_at and self._room(used, lvl) > 0), None)
                if level is None:
                    return tokens, deepest, self._clip_reason()
                pages = self._room(used, level)
                node = self.tree.split(node, pages * self.tree.page_size)
                clipped = self._clip_reason()
            node.retain_until, node.retain_priority, node.retain_level = until, priority, level
            self.tree.retained.add(node)
            for lvl in self.levels:
                if lvl >= level and self.budgets[lvl] is not None:
                    used[lvl] += pages
            level_at = deepest = max(deepest, level)
            tokens += len(node.key)
            if clipped:
                return tokens, deepest, clipped
        return tokens, deepest, None

    def _room(self, used: dict[int, int], level: int) -> float:
        """Pages more that may be retained at ``level``: within every pooled tier's budget from there down."""
        return min((self.budgets[lvl] - used[lvl] for lvl in self.levels
                    if lvl >= level and self.budgets[lvl] is not None), default=float("inf"))

    def _clip_reason(self) -> str:
        full = [lvl for lvl in self.levels if self.budgets[lvl] is not None]
        names = " and ".join(f"{TIER_NAMES[lvl]} ({self.budgets[lvl]} pages)" for lvl in full)
        return f"retention budget full in {names}: --cache-retention-max-fraction {self.max_fraction:g}"

    def used(self, level: int) -> int:
        """Pages retained (unexpired) in tier ``level``: nodes granted there or in a tier above."""
        return sum(self.tree.key_pages(n) for n in self.tree.retained if self.held(n) and n.retain_level <= level)

    # ---- release -----------------------------------------------------------------------------
    def release(self, namespace: str, tokens: np.ndarray) -> int:
        """Drop the retention of the cached prefix of ``tokens`` (a stored conversation deleted):
        its pages are plain LRU again. Returns the tokens released."""
        if self.tree is None:
            return 0
        released = 0
        for node in self._cached_path(namespace, tokens, len(tokens)):
            if node in self.tree.retained:
                released += len(node.key) if self.held(node) else 0
                self._clear(node)
        self.stats.released_tokens += released
        return released

    def _clear(self, node: TreeNode) -> None:
        node.retain_until, node.retain_priority, node.retain_level = 0.0, 0, 0
        self.tree.retained.discard(node)

    # ---- figures -----------------------------------------------------------------------------
    def usage(self) -> dict:
        """Retained tokens held in each tier now, the budgets, and the counters."""
        tree, held = self.tree, {}
        if tree is not None:
            live = [n for n in tree.retained if self.held(n)]
            resident = {"device": lambda n: n.device_pages is not None, "host": lambda n: n.host_pages is not None,
                        "storage": lambda n: n.stored}
            held = {TIER_NAMES[lvl]: sum(len(n.key) for n in live if n.retain_level <= lvl and resident[TIER_NAMES[lvl]](n))
                    for lvl in self.levels}
        s = self.stats
        return {"retained_tokens": held, "max_fraction": self.max_fraction,
                "budget_pages": {TIER_NAMES[lvl]: self.budgets[lvl] for lvl in self.levels if self.budgets[lvl] is not None},
                "hints": s.hints, "clipped": s.clipped, "expired_tokens": s.expired_tokens,
                "released_tokens": s.released_tokens}
