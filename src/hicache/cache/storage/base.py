"""The L3 storage contract. Backends move opaque page objects by key; they know nothing of
trees, pools or tokens. Everything is batched (a batch is a list of keys, e.g. 128 pages).

Keys are strings naming a whole prefix (see :mod:`.keys`); an object is the encoded page
(header + payload, see :mod:`.objects`), so a backend never needs to understand its bytes.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import ClassVar, Iterator


class StorageError(RuntimeError):
    """A backend could not complete an operation (unreachable, I/O error, ...)."""


def positive(name: str, value: int | None) -> int | None:
    """Option ``name`` (a cap or a batch size) as an int, None staying None (no cap); ValueError
    unless it is positive."""
    if value is not None and int(value) <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return None if value is None else int(value)


@dataclass
class BackendStats:
    """Counters a backend keeps about itself (monotonic unless noted)."""

    gets: int = 0
    get_hits: int = 0
    sets: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    evictions: int = 0  # objects the backend dropped to respect its own size cap
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RemoteStoreOptions:
    """What every backend of a store server is told besides where the server is (the names of
    ``--hicache-storage-backend-extra-config``'s keys).

    ``prefix``: before every key (so deployments can share a server). ``batch_size``: most keys per
    round trip. ``connect_timeout_s``: seconds to wait for a connection. ``check_at_open``: connect
    in the constructor and raise StorageError if the store does not answer (so a misconfigured or
    down store is reported once, at start); with False each call raises StorageError while it is down.
    """

    prefix: str = "hicache:"
    batch_size: int = 64
    connect_timeout_s: float = 1.0
    check_at_open: bool = True

    def __post_init__(self) -> None:
        positive("batch_size", self.batch_size)


class StorageBackend(abc.ABC):
    """Implementations must be safe to call from one background thread at a time per method
    kind (the prefetch thread reads, the backup thread writes, concurrently).

    ``options_type``: a backend built from one options value (a :class:`RemoteStoreOptions`) names
    its type here, and the registry builds it from the extra-config JSON; None: the JSON's keys are
    the constructor's keyword arguments."""

    name: str = "base"
    options_type: ClassVar[type | None] = None

    @abc.abstractmethod
    def exists_prefix(self, keys: list[str]) -> int:
        """How many leading ``keys`` exist (stops at the first missing one)."""

    @abc.abstractmethod
    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        """The objects for ``keys``, None where missing. Raises StorageError when the backend
        fails as a whole; a single unreadable object is None."""

    @abc.abstractmethod
    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        """Store objects atomically per object (a reader never sees a partial one). Returns
        how many leading objects were stored."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None: ...

    @abc.abstractmethod
    def clear(self) -> None: ...

    @abc.abstractmethod
    def stats(self) -> BackendStats: ...

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections / file handles."""

    def retain(self, keys: list[str], until: float, now: float) -> None:  # noqa: B027 - optional
        """A client asked to keep ``keys`` (written, or about to be) until ``until`` (unix seconds; ``now``:
        the caller's clock): a backend that evicts by itself drops them after every other object. Default:
        nothing (the backend's own eviction decides: Valkey's maxmemory, Mooncake's watermark)."""


class CountingBackend(StorageBackend):
    """A backend that keeps its own counters (``_c``, under ``_lock``, which the reader and writer
    threads share; reentrant, so a backend may count while it holds it), shown by ``stats()`` with
    :meth:`_extra`'s figures."""

    def __init__(self) -> None:
        self._c = BackendStats()
        self._lock = threading.RLock()

    def _fail(self, msg: str) -> StorageError:
        """The error to raise, counted."""
        with self._lock:
            self._c.errors += 1
        return StorageError(msg)

    def _count_gets(self, asked: int, values: list) -> list:
        """Count one batch read of ``asked`` keys that gave ``values`` (None where missing); returns ``values``."""
        hits = [v for v in values if v is not None]
        with self._lock:
            self._c.gets += asked
            self._c.get_hits += len(hits)
            self._c.bytes_read += sum(len(v) for v in hits)
        return values

    def _count_sets(self, values: list[bytes]) -> None:
        """``values`` were stored."""
        with self._lock:
            self._c.sets += len(values)
            self._c.bytes_written += sum(memoryview(v).nbytes for v in values)

    def _extra(self) -> dict:
        return {}

    def stats(self) -> BackendStats:
        with self._lock:
            return dataclasses.replace(self._c, extra=self._extra())


class RemoteStore(CountingBackend):
    """What the backends of a store server share: keys under ``options.prefix``, batches of at most
    ``options.batch_size`` keys."""

    def __init__(self, options: RemoteStoreOptions) -> None:
        super().__init__()
        self.prefix, self.batch_size = options.prefix, int(options.batch_size)

    def _chunks(self, keys: list[str]) -> Iterator[tuple[int, list[str]]]:
        """(first index, the server's keys) of each batch of ``keys``."""
        for start in range(0, len(keys), self.batch_size):
            yield start, [self.prefix + k for k in keys[start : start + self.batch_size]]
