"""The token sequences the prefix tree holds, indexed for NGRAM drafts: which cached sequences
contain a given n-gram, and what followed it there.

It observes the tree (:class:`TreeObserver` hooks, called by the tree on every change of shape),
so it never points at tokens the tree no longer holds: every tier the tree knows counts (a node
whose KV went to host memory keeps its tokens in the tree); pages held only in storage are not
in the tree and do not count.

Units: a *segment* is the key of a leaf as the tree inserted it -- tokens that never change. A
split cuts a node in two but not its segment (the upper part is the segment's beginning, the
lower part the rest, its descendant); so the nodes over one segment form a chain, and deleting
a node (always with everything below it) leaves the segment's tokens before that node: a
segment's live tokens are always a prefix, ``tokens[:alive]``. An n-gram is indexed at the
position of its last token inside one segment (places pack the segment id and that position).
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .ngram_table import NgramTable, ngram_keys
from .tree_node import TreeNode

_SHIFT = 32  # place = segment id << 32 | position


@dataclass
class Segment:
    """A leaf's key as inserted; ``tokens[:alive]`` are still in the tree."""

    id: int
    namespace: str
    tokens: array  # 'i': int32 token ids, read one by one when a match is compared
    alive: int


@dataclass(frozen=True)
class Occurrence:
    """An n-gram found in a cached sequence: it ends at ``tokens[end]``; ``tokens[:limit]`` are
    in the tree (so the continuation is ``tokens[end + 1:limit]``)."""

    tokens: array
    end: int
    limit: int


class TreeTokenIndex:
    """n-gram -> the places it ends at in the tree's segments, per namespace and per n-gram
    length in ``levels``; each n-gram keeps its ``per_key`` most recent places. Past
    ``capacity`` tokens the oldest segments leave the index (the tree is untouched)."""

    def __init__(self, levels: tuple[int, ...], per_key: int = 8, capacity: int = 10_000_000) -> None:
        self.levels = tuple(sorted(set(levels)))
        self.per_key = per_key
        self.capacity = capacity
        self.tokens_held = 0
        self._tables: dict[str, dict[int, NgramTable]] = {}
        self._segments: dict[int, Segment] = {}  # oldest first
        self._where: dict[int, tuple[Segment, int]] = {}  # node id -> (its segment, where it starts there)
        self._ids = itertools.count()

    # ---- the tree's hooks ------------------------------------------------------------------
    def on_leaf(self, node: TreeNode) -> None:
        """A new leaf: its key is a new segment."""
        tokens = array("i", np.ascontiguousarray(node.key, dtype=np.int32).tobytes())
        seg = Segment(next(self._ids), node.namespace, tokens, len(tokens))
        self._segments[seg.id] = seg
        self._where[node.id] = (seg, 0)
        tables = self._tables.setdefault(node.namespace, {n: NgramTable(n, self.per_key) for n in self.levels})
        base = seg.id << _SHIFT
        for n, table in tables.items():
            table.add(ngram_keys(node.key, n), range(base + n - 1, base + len(tokens)))
        self.tokens_held += len(tokens)
        while self.tokens_held > self.capacity and len(self._segments) > 1:
            self._cut(next(iter(self._segments.values())), 0)

    def on_split(self, upper: TreeNode, node: TreeNode, at: int) -> None:
        """``node`` was cut after ``at`` tokens: ``upper`` (new) holds the first part."""
        where = self._where.get(node.id)
        if where is not None:
            seg, start = where
            self._where[upper.id] = (seg, start)
            self._where[node.id] = (seg, start + at)

    def on_delete(self, node: TreeNode) -> None:
        """``node`` left the tree (its descendants are deleted too, each reported)."""
        where = self._where.pop(node.id, None)
        if where is not None:
            self._cut(*where)

    def on_reset(self) -> None:
        self._tables.clear()
        self._segments.clear()
        self._where.clear()
        self.tokens_held = 0

    def _cut(self, seg: Segment, start: int) -> None:
        """The segment's tokens from ``start`` on left the tree (or the index)."""
        if start >= seg.alive:
            return
        key = np.frombuffer(seg.tokens, dtype=np.int32)[: seg.alive]
        base = seg.id << _SHIFT
        for n, table in self._tables[seg.namespace].items():
            first = max(start, n - 1)  # ends of the n-grams that go
            if first < seg.alive:
                table.remove(ngram_keys(key[first - n + 1:], n), range(base + first, base + seg.alive))
        self.tokens_held -= seg.alive - start
        seg.alive = start
        if start == 0:
            del self._segments[seg.id]

    # ---- lookups ---------------------------------------------------------------------------
    def occurrences(self, namespace: str, n: int, key: int) -> Iterator[Occurrence]:
        """Where the n-gram with ``key`` (:func:`~.ngram_table.tail_key`) ends, most recent first."""
        table = self._tables.get(namespace, {}).get(n)
        if table is None:
            return
        for place in reversed(table.places(key)):
            seg = self._segments[place >> _SHIFT]
            end = place & ((1 << _SHIFT) - 1)
            yield Occurrence(seg.tokens, end, seg.alive)

    def check(self) -> None:
        """Every indexed place lies in a live part of its segment (raise AssertionError if not)."""
        for tables in self._tables.values():
            for table in tables.values():
                for place in table.all_places():
                    seg = self._segments.get(place >> _SHIFT)
                    assert seg is not None, f"place {place:#x} in a segment that left the index"
                    assert (place & ((1 << _SHIFT) - 1)) < seg.alive, f"place {place:#x} past its segment's live tokens"
        assert self.tokens_held == sum(s.alive for s in self._segments.values())
