"""The ``file`` and ``memory`` backends' bookkeeping: which objects they hold, their sizes, their recency.

Units: object bytes (header + payload), not filesystem blocks. Invariants: ``total`` is the
sum of ``sizes``; ``sizes`` runs least recently used first. No file I/O happens here: the
backend (:mod:`.file`, :mod:`.memory`) deletes the objects :meth:`LruIndex.evict_to_fit` hands back.
Retained keys (a client's retention hint, :meth:`LruIndex.retain`) are dropped only after every
other one, until they expire on the clock the callers' stamps advance (unix seconds).
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
    retained: dict[str, float] = field(default_factory=dict)  # key -> until (unix s); present or not yet
    clock: float = 0.0  # the newest ``now`` a retain call gave

    def retain(self, keys: list[str], until: float, now: float) -> None:
        """Keep ``keys`` (written or about to be) past every unretained object until ``until``."""
        self.clock = max(self.clock, now)
        for key in keys:
            self.retained[key] = max(self.retained.get(key, 0.0), until)
        if len(self.retained) > 2 * max(len(self.sizes), 1024):  # forget expired and long-gone keys
            self.retained = {k: u for k, u in self.retained.items() if u > self.clock and k in self.sizes}

    def put(self, key: str, size: int) -> None:
        """Index ``key`` at ``size`` bytes as the most recently used object."""
        self.total += size - self.sizes.pop(key, 0)
        self.sizes[key] = size

    def pop(self, key: str) -> int:
        """Forget ``key``; returns its size (0 if it was not indexed)."""
        self.retained.pop(key, None)
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
        """Drop least recently used keys, unretained ones first, until ``total + incoming <= max_bytes``
        and at most ``max_objects`` remain (None: no such cap); returns the dropped ``(key, size)``
        pairs, for the caller to delete. ``keep`` (the object being replaced, accounted for in
        ``incoming`` by the caller) is never dropped."""
        sizes, parked = self.sizes, []  # retained keys set aside (key, size), least recently used first

        def over() -> bool:
            return ((max_bytes is not None and self.total + incoming > max_bytes)
                    or (max_objects is not None and len(sizes) + len(parked) > max_objects))

        dropped: list[tuple[str, int]] = []
        while sizes and over():
            key = next(iter(sizes))
            if key == keep:
                sizes.move_to_end(key)
                if len(sizes) == 1:
                    break
                key = next(iter(sizes))
            if self.retained.get(key, 0.0) > self.clock:
                parked.append((key, sizes.pop(key)))
                continue
            dropped.append((key, self.pop(key)))
        while parked and over():  # nothing unretained left to drop: the retained ones, oldest first
            key, size = parked.pop(0)
            sizes[key] = size
            dropped.append((key, self.pop(key)))
        for key, size in reversed(parked):  # back in front, in their order
            sizes[key] = size
            sizes.move_to_end(key, last=False)
        return dropped
