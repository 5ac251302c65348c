"""The ``memory`` backend: objects in this process's memory, with an LRU size cap.

An L3 that dies with its process: for the trace simulator (``hicache simulate``: the storage
tier's decisions at full scale without disks), tests, and trying the storage tier out. Reads
refresh recency; a write over the cap drops the least recently used objects first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .base import CountingBackend


class MemoryBackend(CountingBackend):
    name = "memory"

    def __init__(self, max_bytes: Optional[int] = None, max_objects: Optional[int] = None) -> None:
        """``max_bytes``, ``max_objects``: caps on the objects' bytes and count (None: unlimited)."""
        for name, cap in (("max_bytes", max_bytes), ("max_objects", max_objects)):
            if cap is not None and int(cap) <= 0:
                raise ValueError(f"{name} must be positive, got {cap}")
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.max_objects = None if max_objects is None else int(max_objects)
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        super().__init__()  # its lock guards the objects too: the prefetch and backup threads call concurrently

    def exists_prefix(self, keys: list[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._objects:
                    return i
            return len(keys)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            values = []
            for key in keys:
                value = self._objects.get(key)
                if value is not None:
                    self._objects.move_to_end(key)
                values.append(value)
            self._c.count_gets(len(keys), values)
            return values

    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        """An object bigger than the whole byte cap is refused (and the ones after it), never
        stored by evicting everything."""
        stored = 0
        with self._lock:
            for key, value in zip(keys, values):
                if self.max_bytes is not None and len(value) > self.max_bytes:
                    break
                old = self._objects.pop(key, None)
                self._bytes += len(value) - (len(old) if old is not None else 0)
                self._objects[key] = bytes(value)
                self._c.count_sets([value])
                stored += 1
                self._evict()
            return stored

    def _evict(self) -> None:
        """Drop least recently used objects while over a cap."""
        while self._objects and ((self.max_bytes is not None and self._bytes > self.max_bytes)
                                 or (self.max_objects is not None and len(self._objects) > self.max_objects)):
            _, dropped = self._objects.popitem(last=False)
            self._bytes -= len(dropped)
            self._c.evictions += 1

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                old = self._objects.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()
            self._bytes = 0

    def _extra(self) -> dict:
        return {"objects": len(self._objects), "stored_bytes": self._bytes}
