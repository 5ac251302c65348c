"""The ``memory`` backend: objects in this process's memory, with an LRU size cap.

An L3 that dies with its process: for the trace simulator (``hicache simulate``: the storage
tier's decisions at full scale without disks), tests, and trying the storage tier out. Reads
refresh recency; a write over the cap drops the least recently used objects first.
"""

from __future__ import annotations

from typing import Optional

from .base import CountingBackend, positive
from .file_index import LruIndex


class MemoryBackend(CountingBackend):
    name = "memory"

    def __init__(self, max_bytes: Optional[int] = None, max_objects: Optional[int] = None) -> None:
        """``max_bytes``, ``max_objects``: caps on the objects' bytes and count (None: unlimited)."""
        self.max_bytes = positive("max_bytes", max_bytes)
        self.max_objects = positive("max_objects", max_objects)
        self._objects: dict[str, bytes] = {}
        self._index = LruIndex()  # their sizes and recency (the file backend's bookkeeping)
        super().__init__()  # its lock guards the objects too: the prefetch and backup threads call concurrently

    def exists_prefix(self, keys: list[str]) -> int:
        with self._lock:
            return next((i for i, key in enumerate(keys) if key not in self._objects), len(keys))

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            values = [self._objects.get(key) for key in keys]
            for key, value in zip(keys, values):
                if value is not None:
                    self._index.touch(key, len(value))
            return self._count_gets(len(keys), values)

    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        """An object bigger than the whole byte cap is refused (and the ones after it), never
        stored by evicting everything."""
        stored = 0
        with self._lock:
            for key, value in zip(keys, values):
                if self.max_bytes is not None and len(value) > self.max_bytes:
                    break
                self._objects[key] = bytes(value)
                self._index.put(key, len(value))
                self._count_sets([value])
                stored += 1
                # least recently used objects dropped while over a cap
                dropped = self._index.evict_to_fit(0, self.max_bytes, max_objects=self.max_objects)
                for old, _ in dropped:
                    del self._objects[old]
                self._c.evictions += len(dropped)
            return stored

    def retain(self, keys: list[str], until: float, now: float) -> None:
        with self._lock:
            self._index.retain(keys, until, now)

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)
                self._index.pop(key)

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()
            self._index = LruIndex()

    def _extra(self) -> dict:
        return {"objects": len(self._objects), "stored_bytes": self._index.total}
