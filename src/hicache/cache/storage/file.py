"""The ``file`` backend: one file per object under a directory, with an LRU size cap.

Layout: ``<root>/<key[:2]>/<key>``; keys are page-hash hex, so the 256 fan-out
directories fill evenly and no directory grows past a few thousand entries per million
objects. Writes go to ``<root>/<key[:2]>/.tmp-<pid>-<rand>-<key>`` and are published with
``os.replace`` (atomic on POSIX within one filesystem), so a crash mid-write never leaves a
partial object under its key. Names starting with ``.`` are never objects; at start, temp
files whose writer process is gone are deleted.

The size cap counts object bytes (header + payload), not filesystem blocks. The LRU index
(:mod:`.file_index`) lives in memory; it is rebuilt at start by scanning the directory
(recency from mtime, which reads refresh), so the cap and the eviction order survive restarts.
This module does the file I/O; the index only keeps the books.

Sharing one directory between processes is safe for correctness (atomic renames, readers
treat a vanished file as a miss), but each process enforces ``max_bytes`` over its own
view of the index only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Iterator

from .base import CountingBackend, StorageError, positive
from .file_index import LruIndex

log = logging.getLogger(__name__)

ENV_DIR = "HICACHE_STORAGE_DIR"
DEFAULT_DIR = "~/.cache/hicache/kv"
TMP_PREFIX = ".tmp-"
# Keys become file names: keep them to a portable, traversal-free alphabet.
_KEY_RE = re.compile(r"^[0-9A-Za-z_\-][0-9A-Za-z_.\-]{1,199}$")


def _is_stray(name: str) -> bool:
    """Whether the writer of temp file ``name`` (``.tmp-<pid>-<rand>-<key>``) is gone: no process with
    its id exists (on this host's pid namespace)."""
    try:
        pid = int(name[len(TMP_PREFIX) :].split("-", 1)[0])
        if pid <= 0:
            return True
        os.kill(pid, 0)
    except PermissionError:  # exists, owned by someone else
        return False
    except (ProcessLookupError, OverflowError, ValueError):  # gone, or not a pid at all
        return True
    return False


class FileBackend(CountingBackend):
    """Objects as files in ``path`` (default ``$HICACHE_STORAGE_DIR`` if set, else ``~/.cache/hicache/kv``).

    ``max_bytes``: cap on stored object bytes (None = unbounded); a write that would pass
    it first evicts least recently used objects. An object larger than the cap is refused.
    ``fsync``: flush each object to disk before publishing it (durable across power loss;
    off by default since a lost cache entry is only a recompute, and atomicity against a
    process crash does not need it). ``touch_on_read``: refresh a read object's mtime so
    the LRU order survives a restart; only objects whose mtime is older than
    ``touch_interval_s`` seconds are touched, so the on-disk order is exact to that
    granularity while the in-memory order is exact.

    Thread safety: one reader thread and one writer thread (and occasional delete/clear/
    stats calls from others) may run at once; the index is guarded by a lock and file I/O
    runs outside it.
    """

    name = "file"

    def __init__(self, path: str | os.PathLike | None = None, max_bytes: int | None = None, fsync: bool = False,
                 touch_on_read: bool = True, touch_interval_s: float = 60.0) -> None:
        self.root = Path(path or os.environ.get(ENV_DIR) or DEFAULT_DIR).expanduser()
        self.max_bytes = positive("max_bytes", max_bytes)
        self.fsync = bool(fsync)
        self.touch_on_read = bool(touch_on_read)
        self.touch_interval_s = float(touch_interval_s)
        super().__init__()
        self._index = LruIndex()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create storage directory {self.root}: {e}") from e
        stray = self._scan()
        evicted = self._evict_to_fit(0)
        log.info("file storage opened at %s: %d objects, %d bytes, cap %s, removed %d stray temp files%s",
                 self.root, len(self._index.sizes), self._index.total,
                 "none" if self.max_bytes is None else f"{self.max_bytes} bytes", stray,
                 f", evicted {len(evicted)} objects to fit the cap" if evicted else "")

    # -- paths ----------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        """The file that holds ``key``'s object (whether or not it exists)."""
        if not _KEY_RE.match(key):
            raise ValueError(f"invalid storage key {key!r}")
        return self.root / key[:2] / key

    # -- start-up -------------------------------------------------------------------------
    def _scan(self) -> int:
        """Rebuild the index from disk; delete stray temp files. Returns how many."""
        found: list[tuple[float, str, int]] = []
        stray = 0
        for sub, ent in self._entries():
            name = ent.name
            if name.startswith(TMP_PREFIX):
                if _is_stray(name):
                    with contextlib.suppress(OSError):
                        os.unlink(ent.path)
                        stray += 1
                continue
            if not _KEY_RE.match(name) or name[:2] != sub:  # (never a name starting with ".")
                continue
            try:
                st = ent.stat(follow_symlinks=False)
            except OSError:
                continue
            found.append((st.st_mtime, name, st.st_size))
        self._index.load(found)
        return stray

    def _entries(self) -> Iterator[tuple[str, os.DirEntry]]:
        """(fan-out directory name, entry) of every file under the fan-out directories."""
        for sub in os.scandir(self.root):
            if sub.is_dir(follow_symlinks=False) and not sub.name.startswith("."):
                yield from ((sub.name, ent) for ent in os.scandir(sub.path))

    # -- eviction -------------------------------------------------------------------------
    def _evict_to_fit(self, incoming: int, keep: str | None = None) -> list[tuple[str, int]]:
        """Delete LRU objects until ``total + incoming <= max_bytes`` (if capped). Caller holds the lock
        (or is the constructor). Returns the (key, size) pairs evicted."""
        dropped = self._index.evict_to_fit(incoming, self.max_bytes, keep)
        for key, _ in dropped:
            _unlink_quiet(self.root / key[:2] / key, "evict")
        self._c.evictions += len(dropped)
        return dropped

    # -- StorageBackend -------------------------------------------------------------------
    def exists_prefix(self, keys: list[str]) -> int:
        # stat only; the disk (not the index) is the truth when a directory is shared. Only
        # ENOENT is a miss: EACCES, ENOTDIR, EIO, ... are errors an operator must see.
        for i, key in enumerate(keys):
            try:
                if not stat.S_ISREG(os.stat(self.path_of(key)).st_mode):
                    return i  # not an object (e.g. a stray directory): a miss
            except FileNotFoundError:
                return i
            except OSError as e:
                log.warning("file storage: cannot stat key %d of %d: %s", i, len(keys), e)
                raise self._fail(f"file storage at {self.root}: cannot stat an object: {e}") from e
        return len(keys)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        failed: list[str] = []  # unreadable, not missing: counted and logged (once per batch)
        touch_before = time.time() - self.touch_interval_s
        for key in keys:
            path, data = self.path_of(key), None
            try:
                data = _read_file(path, touch_before if self.touch_on_read else None)
                with self._lock:
                    self._index.touch(key, len(data))
            except FileNotFoundError:
                pass
            except OSError as e:
                failed.append(f"{path}: {e}")
            out.append(data)
        with self._lock:
            self._count_gets(len(keys), out)
            self._c.errors += len(failed)
        if failed:
            log.warning("file storage: %d of %d reads failed, first %s", len(failed), len(keys), failed[0])
        if failed and len(failed) == len(keys):
            raise StorageError(f"file storage at {self.root}: every read in the batch failed")
        return out

    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        stored = 0
        evicted: list[tuple[str, int]] = []
        for key, value in zip(keys, values):
            size = memoryview(value).nbytes
            if self.max_bytes is not None and size > self.max_bytes:
                log.warning("file storage: object %s (%d bytes) is larger than max_bytes %d; refused",
                            key, size, self.max_bytes)
                break
            path = self.path_of(key)
            try:
                tmp = self._write_tmp(path, value)
            except OSError as e:
                with self._lock:
                    self._c.errors += 1
                log.warning("file storage: write of %s failed: %s", path, e)
                break
            with self._lock:
                evicted += self._evict_to_fit(size - self._index.sizes.get(key, 0), keep=key)
                try:
                    os.replace(tmp, path)
                except OSError as e:
                    self._c.errors += 1
                    _unlink_quiet(tmp)
                    log.warning("file storage: publishing %s failed: %s", path, e)
                    break
                self._index.put(key, size)
                self._count_sets([value])
            stored += 1
        if evicted:
            log.info("file storage: evicted %d objects (%d bytes) to stay under max_bytes %d",
                     len(evicted), sum(size for _, size in evicted), self.max_bytes)
        return stored

    def _write_tmp(self, path: Path, value: bytes) -> Path:
        """Write ``value`` to a fresh temp file next to ``path``; return the temp path."""
        tmp = path.parent / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}"
        try:
            f = open(tmp, "xb")  # O_EXCL: never another writer's file
        except FileNotFoundError:
            # Fan-out directory missing (first write there, or removed by clear()).
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "xb")
        try:
            with f:
                f.write(memoryview(value).cast("B"))
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            _unlink_quiet(tmp)
            raise
        return tmp

    def retain(self, keys: list[str], until: float, now: float) -> None:
        with self._lock:
            self._index.retain(keys, until, now)

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._index.pop(key)
                _unlink_quiet(self.path_of(key))

    def clear(self) -> None:
        """Remove every object (and stray temp file) this directory holds."""
        with self._lock:
            n = len(self._index.sizes)
            for _, ent in self._entries():  # (a live writer's temp file publishes or cleans itself)
                if _KEY_RE.match(ent.name) or (ent.name.startswith(TMP_PREFIX) and _is_stray(ent.name)):
                    _unlink_quiet(Path(ent.path))
            self._index = LruIndex()
        log.info("file storage at %s cleared (%d indexed objects)", self.root, n)

    def _extra(self) -> dict:
        return {"path": str(self.root), "objects": len(self._index.sizes),
                "stored_bytes": self._index.total,  # current, not monotonic
                "max_bytes": self.max_bytes}


def _read_file(path: Path, touch_before: float | None = None) -> bytes:
    """The whole file (``readall``: sized by fstat, finished with a loop on a short read). If its
    mtime is older than ``touch_before`` (epoch seconds), refresh it so a restart's LRU order sees
    this read; the interval keeps that to one ``futimens`` per object per interval."""
    with open(path, "rb", buffering=0) as f:
        data = f.readall()
        if touch_before is not None and os.fstat(f.fileno()).st_mtime < touch_before:
            with contextlib.suppress(OSError):  # read-only media: recency just is not persisted
                os.utime(f.fileno() if os.utime in os.supports_fd else path)
    return data


def _unlink_quiet(path: Path, what: str = "remove") -> None:
    """Delete ``path``; gone already is fine, anything else is logged."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("file storage: could not %s %s: %s", what, path, e)

