"""The ``file`` and ``memory`` backends' bookkeeping: which objects they hold, their sizes, their recency.

Units: object bytes (header + payload), not filesystem blocks. Invariants: ``total`` is the
sum of ``sizes``; ``sizes`` runs least recently used first. No file I/O happens here: the
backend (:mod:`.file`, :mod:`.memory`) deletes the objects :meth:`LruIndex.evict_to_fit` hands back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class LruIndex:
    """key -> object size in bytes, least recently used first; ``total`` = sum of sizes."""

    sizes: OrderedDict[str, int] = field(default_factory=OrderedDict)
    total: int = 0

    def put(self, key: str, size: int) -> None:
        """Index ``key`` at ``size`` bytes as the most recently used object."""
        self.total += size - self.sizes.pop(key, 0)
        self.sizes[key] = size

    def pop(self, key: str) -> int:
        """Forget ``key``; returns its size (0 if it was not indexed)."""
        size = self.sizes.pop(key, 0)
        self.total -= size
        return size

    def touch(self, key: str, size: int) -> None:
        """Mark ``key`` most recently used; index it at ``size`` if it is new here (an object
        another process sharing the directory wrote)."""
        if key in self.sizes:
            self.sizes.move_to_end(key)
        else:
            self.put(key, size)

    def load(self, found: Iterable[tuple[float, str, int]]) -> None:
        """Index scanned objects ``(mtime, key, size)``, oldest mtime least recently used."""
        for _, key, size in sorted(found):
            self.put(key, size)

    def evict_to_fit(self, incoming: int, max_bytes: int | None, keep: str | None = None,
                     max_objects: int | None = None) -> list[tuple[str, int]]:
        """Drop least recently used keys until ``total + incoming <= max_bytes`` and at most
        ``max_objects`` remain (None: no such cap); returns the dropped ``(key, size)`` pairs, for
        the caller to delete. ``keep`` (the object being replaced, accounted for in ``incoming`` by
        the caller) is never dropped."""
        dropped: list[tuple[str, int]] = []
        sizes = self.sizes
        while sizes and ((max_bytes is not None and self.total + incoming > max_bytes)
                         or (max_objects is not None and len(sizes) > max_objects)):
            key = next(iter(sizes))
            if key == keep:
                sizes.move_to_end(key)
                if len(sizes) == 1:
                    break
                key = next(iter(sizes))
            dropped.append((key, self.pop(key)))
        return dropped
