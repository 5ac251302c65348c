"""A fault-injecting wrapper around a real backend, for tests of the cache's L3 paths.

``FaultyBackend(inner, Faults(...))`` forwards every call to ``inner`` after applying the
knobs below. Knobs are plain fields of ``fb.faults``: a test may flip them between (or during)
calls, e.g. ``fb.faults.down = True`` to take the store away mid-run.

Knobs (all off by default):
  ``delay_s``     float  sleep this many seconds at the start of every call (a slow store).
  ``hang_s``      float  block this long at the start of every call (a hung store); unlike
                         ``delay_s`` it is interruptible: ``release()`` wakes every hung
                         call at once and disables further hangs until ``hang_s`` is set
                         again with ``arm_hang()``.
  ``down``        bool   every call raises StorageError at once (an unreachable store).
  ``fail_get``    bool   ``batch_get`` / ``exists_prefix`` raise StorageError.
  ``fail_set``    bool   ``batch_set`` raises StorageError.
  ``fail_after``  int    a mid-batch failure after this many objects in total (counted over
                         all calls, per direction): ``batch_get`` returns None for the
                         objects past the limit (an unreadable object), ``batch_set``
                         stores only the objects up to it and returns that count. With
                         ``raise_mid_batch=True`` both raise StorageError instead once the
                         limit is crossed inside a batch (the leading part is still
                         stored by ``batch_set``).
  ``corrupt_get`` bool   flip the last byte of each object ``batch_get`` returns
                         (the stored copy is untouched): decode must refuse it.

``calls`` counts calls per method name; ``objects_got`` / ``objects_set`` count objects
that passed through (used by ``fail_after``); ``reset_counts()`` zeroes them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from hicache.cache.storage.base import BackendStats, StorageBackend, StorageError


@dataclass
class Faults:
    """The knobs (see the module docstring), all off by default. Not frozen: flipping them while
    the cache runs is what they are for."""

    delay_s: float = 0.0
    fail_get: bool = False
    fail_set: bool = False
    fail_after: int | None = None
    raise_mid_batch: bool = False
    hang_s: float | None = None
    down: bool = False
    corrupt_get: bool = False


class FaultyBackend(StorageBackend):
    """See the module docstring for the knobs."""

    name = "faulty"

    def __init__(self, inner: StorageBackend, faults: Faults | None = None) -> None:
        self.inner = inner
        self.faults = Faults() if faults is None else faults
        self.calls: Counter[str] = Counter()
        self.objects_got = 0
        self.objects_set = 0
        self._released = threading.Event()
        self._lock = threading.Lock()

    # -- knobs ----------------------------------------------------------------------------
    def release(self) -> None:
        """Wake every call blocked in ``hang_s`` and stop hanging new ones."""
        self._released.set()

    def arm_hang(self, hang_s: float) -> None:
        """Hang every following call for ``hang_s`` seconds (until ``release()``)."""
        self._released.clear()
        self.faults.hang_s = hang_s

    def reset_counts(self) -> None:
        with self._lock:
            self.calls.clear()
            self.objects_got = self.objects_set = 0

    def _enter(self, op: str, fail: str = "") -> None:
        """Count the call, then apply the delay, hang and down knobs and the call's own ``fail`` knob."""
        with self._lock:
            self.calls[op] += 1
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        if self.faults.hang_s and not self._released.is_set():
            self._released.wait(self.faults.hang_s)
        if self.faults.down:
            raise StorageError(f"faulty storage: backend is down ({op})")
        if fail and getattr(self.faults, fail):
            raise StorageError(f"faulty storage: {op} failed")

    def _budget(self, n: int, counter: str) -> int:
        """How many of the next ``n`` objects fit under ``fail_after``; advances the count."""
        with self._lock:
            done = getattr(self, counter)
            allowed = n if self.faults.fail_after is None else max(0, min(n, self.faults.fail_after - done))
            setattr(self, counter, done + n)
        return allowed

    # -- StorageBackend -------------------------------------------------------------------
    def exists_prefix(self, keys: list[str]) -> int:
        self._enter("exists_prefix", "fail_get")
        return self.inner.exists_prefix(keys)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        self._enter("batch_get", "fail_get")
        allowed = self._budget(len(keys), "objects_got")
        if allowed < len(keys) and self.faults.raise_mid_batch:
            raise StorageError(f"faulty storage: batch_get failed after {allowed} objects")
        out = self.inner.batch_get(keys[:allowed]) + [None] * (len(keys) - allowed)
        if self.faults.corrupt_get:  # each payload's last byte flipped: caught by the checksum
            out = [v[:-1] + bytes([v[-1] ^ 0xFF]) if v else v for v in out]
        return out

    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        self._enter("batch_set", "fail_set")
        allowed = self._budget(len(keys), "objects_set")
        stored = self.inner.batch_set(keys[:allowed], values[:allowed]) if allowed else 0
        if allowed < len(keys) and self.faults.raise_mid_batch:
            raise StorageError(f"faulty storage: batch_set failed after {stored} objects")
        return stored

    def delete(self, keys: list[str]) -> None:
        self._enter("delete")
        self.inner.delete(keys)

    def clear(self) -> None:
        self._enter("clear")
        self.inner.clear()

    def stats(self) -> BackendStats:
        # Never faulty: the cache reports stats even while the store is down.
        with self._lock:
            self.calls["stats"] += 1
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()
