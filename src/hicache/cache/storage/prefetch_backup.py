"""L3 <-> L2 movement: prefetch (storage -> host pages) and backup (host pages -> storage),
each on its own background thread.

Background threads only produce progress; the scheduler thread decides. A prefetch publishes
ordered progress acks (pages completed so far, then a final ack); the scheduler consumes an
explicit number of them (today: what is there; with several ranks: an agreed number), and only
then inserts what arrived into the tree. A backup's host pages stay protected until the
scheduler consumes its ack.

Objects are a page of every layer's K and V, laid out ``[layer, K/V, token, kv_head, head_dim]``
whatever the host pool layout, so deployments with either layout share them.

Every backend call goes through a :class:`~.guard.GuardedBackend` (per-call deadline, circuit
breaker): a hung or failing store ends an op early with a failure reason (``timeout``,
``breaker_open``, ``backend_error``), never a stuck thread the scheduler waits on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Callable, Mapping, Sequence

import numpy as np

from ..host_pool import HostKVPool
from ..host_transfer import OpThreads, leading_done
from .base import StorageBackend
from .guard import GuardedBackend, failure_reason
from .page_objects import PageObject, WholePage, read_pages, write_pages
from .storage_ops import BackupOp, PartRead, PartWrite, PrefetchOp, StorageStats, StoredPart

logger = logging.getLogger(__name__)

BATCH_PAGES = 128
READ_EWMA_ALPHA = 0.25  # weight of the newest batch read in the per-page read estimate


def _alone(values: list[int]) -> list[int]:
    """The agreement of a single rank: its own values."""
    return values


def _mine(owned: np.ndarray | None, n: int) -> np.ndarray:
    """The indices of an op's ``n`` pages this rank moves (all of them unless sharded)."""
    return np.arange(n) if owned is None else owned


def _logical(mine: np.ndarray, leading: int, n: int) -> int:
    """A leading count over this rank's pages ``mine`` as a leading count over all ``n`` pages:
    up to the first of its pages that is missing (the others are their owners' to count)."""
    return int(mine[leading]) if leading < len(mine) else n


# MIN-reduce over every rank of the deployment (see hicache.parallel), one group per thread.
Agree = Callable[[list[int]], list[int]]


def _log_failure(reason: str, msg: str, *args: object) -> None:
    """A refused call while the breaker is open is expected (its opening was logged once):
    debug only, so an open breaker does not flood the log; real failures warn."""
    logger.log(logging.DEBUG if reason == "breaker_open" else logging.WARNING, msg, *args)


class StorageController:
    def __init__(self, backend: StorageBackend, host_pool: HostKVPool, agree: tuple[Agree, Agree] | None = None,
                 op_timeout: float = 10.0, reads: Sequence[PageObject] | None = None,
                 writes: Sequence[PageObject] | None = None, parts: Sequence[StoredPart] = ()) -> None:
        """``agree``: the prefetch and the backup thread's MIN-reduce over every rank (None: one
        rank, its own values). ``op_timeout``: deadline in seconds of each backend call (see :mod:`.guard`).
        ``reads`` / ``writes``: the objects each host page is read from and written to
        (:mod:`.page_objects`; default: one :class:`WholePage` of ``host_pool`` for both). A page
        is present only when all of its read objects are; they are read, and written, together.
        A rank with none (a pipeline stage of a hybrid model's window layers only: its full layers'
        cells are empty) counts every page present: the other ranks' objects decide.
        ``parts``: the components whose objects are kept at chosen boundaries only
        (:class:`~.storage_ops.StoredPart`)."""
        self.guard = GuardedBackend(backend, timeout_s=op_timeout)
        self._agree_prefetch, self._agree_backup = agree or (_alone, _alone)
        self.reads: list[PageObject] = [WholePage(host_pool)] if reads is None else list(reads)
        self.writes: list[PageObject] = self.reads if writes is None else list(writes)
        self.parts = list(parts)
        self.stats = StorageStats()
        # Seconds to read and verify one page (exponentially weighted over batch reads; None
        # before the first). Written by the prefetch thread, read by the scheduler's prefetch
        # policy: one float, replaced whole.
        self.read_page_s: float | None = None
        self._ids = itertools.count()
        self._backups: deque[BackupOp] = deque()
        self._workers = OpThreads({"prefetch": ("hicache-prefetch", lambda op, _: self._prefetch(op)),
                                   "backup": ("hicache-storage-backup", lambda op, _: self._backup(op)),
                                   "retain": ("hicache-storage-retain", lambda op, _: self._retain(*op))})
        # Test hook (fault injection): seconds to sleep before each batch read.
        self.read_delay_fn = None

    @property
    def backend(self) -> StorageBackend:
        """The backend behind the guard; assigning one keeps the guard around it (tests swap in
        a fault-injecting wrapper this way)."""
        return self.guard.inner

    @backend.setter
    def backend(self, backend: StorageBackend) -> None:
        self.guard.inner = backend

    # ---- scheduler-thread API ------------------------------------------------------------
    def prefetch(self, namespace: str, ns_digest: bytes, hashes: list[bytes], host_pages: np.ndarray,
                 owned: np.ndarray | None = None, local_pages: np.ndarray | None = None, start_page: int = 0,
                 parts: Mapping[str, np.ndarray | None] = {}) -> PrefetchOp:
        """Read the objects of ``hashes`` (pages from ``start_page`` on) into ``host_pages``.
        Sharded KV: this rank reads the ``owned`` ones, into ``local_pages`` (its pool's ids); hit
        and completed counts are agreed over every rank in logical pages, so a page counts once its
        owner has it. ``parts``: by component, the host pages its objects at the range's end go to
        (a hybrid pool's window)."""
        op = PrefetchOp(next(self._ids), namespace, ns_digest, hashes, host_pages, owned, local_pages,
                        parts={name: PartRead(pages) for name, pages in parts.items() if pages is not None},
                        start_page=start_page)
        self.stats.prefetch_ops += 1
        self._workers.put("prefetch", op)
        return op

    def backup(self, ns_digest: bytes, hashes: list[bytes], host_pages: np.ndarray, payload: list,
               owned: np.ndarray | None = None, parts: Mapping[str, PartWrite] = {}) -> BackupOp:
        """``parts``: by component, its pages whose objects are written too (a hybrid pool's window)."""
        op = BackupOp(next(self._ids), ns_digest, hashes, host_pages, payload, owned,
                      {name: part for name, part in parts.items() if len(part.index)})
        self._backups.append(op)
        self._workers.put("backup", op)
        return op

    def retain(self, ns_digest: bytes, hashes: list[bytes], until: float, now: float) -> None:
        """Ask the backend to keep the page objects of ``hashes`` until ``until`` (unix s; ``now``: the
        cache's retention clock), on a thread of its own: no ack, nothing waits for it."""
        self._workers.put("retain", ([obj.key(h, ns_digest) for h in hashes for obj in self.writes], until, now))

    def run_inline(self) -> None:
        """From now on read and write on the calling thread, at once (the trace simulator:
        nothing to overlap with, no thread hand-offs to pay). One rank only: the agreement
        functions belong to the prefetch and backup threads."""
        self._workers.stop()
        self._workers.inline = True

    def backup_ready_count(self) -> int:
        return leading_done(self._backups)

    def pending_backups(self) -> int:
        return len(self._backups)

    def pop_backups(self, n: int) -> list[BackupOp]:
        """The first ``n`` backups; waits for any not done (only a full drain asks for those:
        each of their backend calls is bounded by the guard's deadline)."""
        ops = [self._backups.popleft() for _ in range(n)]
        for op in ops:
            op.done.wait()
        return ops

    def shutdown(self) -> None:
        self._workers.stop()  # after the ops already queued
        self.guard.close()

    # ---- background threads --------------------------------------------------------------
    def _prefetch(self, op: PrefetchOp) -> None:
        try:
            self._read(op)
        except Exception as e:  # never let one op kill the thread
            op.failure = op.failure or failure_reason(e)
            logger.warning("prefetch op=%d failed: %s", op.op_id, e)
        finally:
            for part in self.parts:  # before the final ack: a consumed final ack covers its pages
                part.read(self.guard, op, self.stats, self._agree_prefetch)
            op.progress.append((op.progress[-1][0] if op.progress else 0, True))  # the final ack
            op.done.set()

    def _read(self, op: PrefetchOp) -> None:
        mine = _mine(op.owned, len(op.hashes))
        try:  # no key of this rank's (no page, or no object): every page is the others' to count
            keys = [obj.key(op.hashes[i], op.ns_digest) for i in mine for obj in self.reads]
            present = self.guard.exists_prefix(keys) // len(self.reads) if keys else len(mine)
            hit = _logical(mine, present, len(op.hashes))
        except Exception as e:
            hit, op.failure = 0, failure_reason(e)
            _log_failure(op.failure, "prefetch op=%d: storage exists query (%d keys) failed: %s", op.op_id,
                         len(op.hashes), e)
        # Several ranks: every rank reads its own shard of the same pages, so a page counts
        # only when all have it. The agreement runs on every rank for every op, in op order.
        op.hit_pages = self._agree_prefetch([hit])[0]
        done = 0
        while done < op.hit_pages:
            stopped = op.stop.is_set()
            end = min(done + BATCH_PAGES, op.hit_pages)
            good = 0
            if not stopped:
                try:  # a local failure still joins this round's agreement: it just brings 0 pages
                    good = self._read_batch(op, done, end)
                except Exception as e:
                    op.failure = op.failure or failure_reason(e)
                    logger.warning("prefetch op=%d: reading pages %d-%d failed: %s", op.op_id, done, end, e)
            reached, go_on = self._agree_prefetch([done + good, 0 if stopped else 1])
            if reached < done + good:
                op.failure = op.failure or "peer_rank"  # another rank fell short: its pages decide
            done = reached
            op.progress.append((done, False))
            if not go_on or done < end:
                if done < end and not stopped:
                    _log_failure(op.failure, "prefetch op=%d stopped at page %d/%d: %s", op.op_id, done, op.hit_pages,
                                 op.failure)
                return

    def _read_batch(self, op: PrefetchOp, start: int, end: int) -> int:
        """Read pages ``[start, end)`` (this rank's of them) into their host pages; returns how
        many leading ones arrived intact or are another rank's (a missing, short or corrupt
        page of this rank ends the run)."""
        if self.read_delay_fn is not None:
            time.sleep(self.read_delay_fn(op))
        mine = [int(i) for i in _mine(op.owned, len(op.hashes)) if start <= i < end]
        if not mine or not self.reads:  # every page (or object) of this batch is another rank's
            return end - start
        pages = op.local_pages if op.local_pages is not None else op.host_pages
        t0 = time.perf_counter()
        try:
            got, failure, _ = read_pages(self.guard, self.reads, op.ns_digest, op.hashes, [(i, pages[i]) for i in mine])
        except Exception as e:
            op.failure = failure_reason(e)
            _log_failure(op.failure, "prefetch op=%d: storage read of %d pages failed: %s", op.op_id, len(mine), e)
            return mine[0] - start
        op.failure = failure or op.failure
        elapsed = time.perf_counter() - t0
        self.stats.prefetch_time_s += elapsed
        per_page = elapsed / (end - start)  # per page of the prompt: the owners read theirs at once
        last = self.read_page_s
        self.read_page_s = per_page if last is None else last + READ_EWMA_ALPHA * (per_page - last)
        return end - start if got == len(mine) else mine[got] - start

    def _retain(self, keys: list[str], until: float, now: float) -> None:
        try:
            self.guard.retain(keys, until, now)
        except Exception as e:  # a hint the store could not note: its own eviction decides
            _log_failure(failure_reason(e), "storage retain of %d objects failed: %s", len(keys), e)

    def _backup(self, op: BackupOp) -> None:
        """One backup op, on the backup thread (or inline)."""
        t0 = time.perf_counter()
        mine = _mine(op.owned, len(op.hashes))
        try:  # `written` is a leading count: a short write ends the chain
            op.written, nbytes = write_pages(self.guard, self.writes, op.ns_digest, op.hashes,
                                             [(i, op.host_pages[i]) for i in mine], BATCH_PAGES)
            self.stats.backup_bytes += nbytes
            op.failure = "short_write" if op.written < len(mine) else ""
            for part in self.parts if op.written == len(mine) else ():
                part.write(self.guard, op, self.stats)
        except Exception as e:
            op.failure = failure_reason(e)
            _log_failure(op.failure, "storage backup op=%d (%d pages) failed: %s", op.op_id, len(mine), e)
        finally:
            # Several ranks: a page counts as stored only when every rank stored its shard.
            agreed = self._agree_backup([_logical(mine, op.written, len(op.hashes))])[0]
            if agreed < len(op.hashes):
                op.failure = op.failure or "peer_rank"
            self.stats.backup_pages += op.written
            self.stats.backup_time_s += time.perf_counter() - t0
            op.done.set()
