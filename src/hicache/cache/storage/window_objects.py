"""A hybrid pool's window objects in storage (issue 48, docs/hybrid_kv.md): the window layers of a
checkpoint page, written beside its page objects and read for the window a prefetched range ends
with. Best effort both ways: a reader missing one cuts its hit back to a boundary whose window it
has; the page objects decide what is stored.

:class:`StoredWindows` is the window component's part of the storage controller (its ``parts``):
an op carries its pages under ``op.parts["window"]`` (:class:`~.storage_ops.PartRead` /
:class:`~.storage_ops.PartWrite`).

Units: pages of an op (indices into its hashes); host window pages are the host window pool's.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from .guard import GuardedBackend
from .page_objects import PageObject, read_pages, write_pages
from .storage_ops import BackupOp, PrefetchOp, StorageStats

logger = logging.getLogger(__name__)


class StoredWindows:
    """``reads`` / ``writes``: the objects of a checkpoint page's window layers (of its own host
    window page); ``span(end)``: how many pages before a boundary of ``end`` pages its window reads."""

    name = "window"

    def __init__(self, reads: Sequence[PageObject], writes: Sequence[PageObject], span: Callable[[int], int]) -> None:
        self.reads, self.writes, self.span = list(reads), list(writes), span

    def read(self, guard: GuardedBackend, op: PrefetchOp, stats: StorageStats,
             agree: Callable[[list[int]], list[int]]) -> None:
        """Read the window objects of the pages the end of the read range's window covers (a
        checkpoint where the writer's request ended) into the op's host window pages. Every rank
        agrees, all or nothing (every op: the agreement runs on every rank in op order)."""
        part = op.parts.get(self.name)
        done = op.progress[-1][0] if op.progress else 0
        first = done - min(self.span(op.start_page + done), done)
        ok = 0
        if done and part is not None and done == op.hit_pages and not op.stop.is_set() \
                and done - first <= len(part.host_pages):
            try:  # each page's objects into its host window page
                _, failure, nbytes = read_pages(guard, self.reads, op.ns_digest, op.hashes,
                                                list(zip(range(first, done), part.host_pages)))
                if failure:
                    stats.failures[failure] += 1
                else:
                    ok = 1
                    stats.window_prefetched_pages += done - first
                    stats.window_prefetch_bytes += nbytes
            except Exception as e:  # the full pages stand; the tree cuts the hit back without the window
                logger.warning("prefetch op=%d: reading its window failed: %s", op.op_id, e)
        if agree([ok])[0] and part is not None:
            part.first = first

    def write(self, guard: GuardedBackend, op: BackupOp, stats: StorageStats) -> None:
        """The window objects of the op's checkpoint pages, then (stored whole) the deletion of the
        window objects it supersedes."""
        part = op.parts.get(self.name)
        if part is None or not self.writes:  # (another rank writes them all)
            return
        pages, nbytes = write_pages(guard, self.writes, op.ns_digest, op.hashes, list(zip(part.index, part.host_pages)))
        stats.backup_bytes += nbytes
        stats.window_backup_bytes += nbytes
        stats.window_backup_pages += pages
        if pages == len(part.index) and part.superseded:  # the new checkpoint is stored whole
            guard.delete([obj.key(h, op.ns_digest) for h in part.superseded for obj in self.writes])
            stats.window_deleted_pages += len(part.superseded)
