"""The storage tier's operations as the scheduler and the storage threads share them: a prefetch
(storage -> host pages, with its ordered progress acks), a backup (host pages -> storage), and the
tier's counters. The threads that run them: :mod:`.prefetch_backup`.

Units: pages (indices into an op's hashes) unless named bytes or seconds.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from .guard import GuardedBackend


@dataclass
class PartRead:
    """A prefetch's pages of a component kept at one boundary only (a hybrid pool's window of the
    read range's end, its checkpoint): the host pages reserved for them, and from which page of
    the op they hold it once read (-1: not read)."""

    host_pages: np.ndarray
    first: int = -1


@dataclass(frozen=True)
class PartWrite:
    """A backup's pages of such a component: the op's pages (indices) whose objects are written
    too, their host pages, and hashes of earlier pages whose objects go once these are written."""

    index: np.ndarray
    host_pages: np.ndarray
    superseded: list[bytes]


@dataclass
class PrefetchOp:
    """Read ``keys`` (a prefix's next pages) into ``host_pages`` until one is missing or bad."""

    op_id: int
    namespace: str
    ns_digest: bytes
    hashes: list[bytes]
    host_pages: np.ndarray  # reserved by the scheduler, one per key
    # Sharded KV: the keys this rank reads (indices; None: all) into its pool's pages ``local_pages``.
    owned: np.ndarray | None = None
    local_pages: np.ndarray | None = None
    # acks: (pages completed so far (monotonic), is the final ack), appended as one item so a
    # count of consumed acks says whether the final one is among them.
    progress: list[tuple[int, bool]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)  # the thread is finished with it
    stop: threading.Event = field(default_factory=threading.Event)  # the scheduler stopped waiting
    hit_pages: int = -1  # how many keys exist (known after the first query)
    failure: str = ""  # why reading stopped early (missing, checksum, short, backend_error, ...)
    consumed: int = 0  # progress acks the scheduler has applied
    completed: int = 0  # pages the scheduler accepted (value of the last consumed ack)
    parts: dict[str, PartRead] = field(default_factory=dict)  # by component (a hybrid pool's window)
    start_page: int = 0  # the page of the prompt its first key names

    @property
    def final_applied(self) -> bool:
        """The scheduler has applied the final progress ack: nothing more will arrive."""
        return self.consumed > 0 and self.progress[self.consumed - 1][1]


@dataclass
class BackupOp:
    op_id: int
    ns_digest: bytes
    hashes: list[bytes]
    host_pages: np.ndarray  # this rank's host pool pages, one per key
    payload: list  # what the cache attaches (nodes whose host data must stay)
    owned: np.ndarray | None = None  # sharded KV: the keys this rank writes (indices; None: all)
    parts: dict[str, PartWrite] = field(default_factory=dict)  # by component (a hybrid pool's window)
    done: threading.Event = field(default_factory=threading.Event)
    written: int = 0  # leading pages of ``owned`` written
    failure: str = ""


@dataclass
class StorageStats:
    prefetch_ops: int = 0
    prefetched_pages: int = 0
    prefetch_bytes: int = 0
    prefetch_time_s: float = 0.0
    backup_pages: int = 0
    backup_bytes: int = 0
    backup_time_s: float = 0.0
    # hybrid: checkpoint pages whose window objects were written / read (their bytes are in the totals above)
    window_backup_pages: int = 0
    window_backup_bytes: int = 0
    window_prefetched_pages: int = 0
    window_prefetch_bytes: int = 0
    window_deleted_pages: int = 0  # superseded checkpoints' window objects deleted
    failures: Counter[str] = field(default_factory=Counter)  # reason -> count


class StoredPart(Protocol):
    """A component whose objects storage keeps at chosen boundaries only, read and written with an
    op's pages under ``op.parts[name]`` (a hybrid pool's window: ``window_objects.StoredWindows``)."""

    name: str

    def read(self, guard: GuardedBackend, op: PrefetchOp, stats: StorageStats,
             agree: Callable[[list[int]], list[int]]) -> None: ...  # every op, on every rank (it agrees)

    def write(self, guard: GuardedBackend, op: BackupOp, stats: StorageStats) -> None: ...
