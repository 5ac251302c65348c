"""The ``mooncake`` backend: objects in a Mooncake Store, the distributed in-memory store that
SGLang deployments use as a cluster-wide L3.

A Mooncake master keeps the key -> replica map; the memory is "segments" that clients
contribute (``global_segment_size``), and Mooncake's transfer engine moves bytes between a
segment and a client over TCP or RDMA. Every key is stored as ``prefix + key``. Reads and
writes go through one registered buffer per direction, reused across calls
(``batch_get_into`` / ``batch_put_from``: the transfer engine fills and drains it directly;
one copy between it and the Python bytes). Reads use a slot per key sized to the largest
object seen; an object that does not fit is measured (``get_size``) and read again.

Where objects live: in the segment of whichever client the master placed them in. When that
process exits, its segment and the objects in it go away. For history that outlives engine
processes, run store services (``mooncake_client``, shipped in the wheel) that contribute the
memory and give engines ``global_segment_size=0`` (as ``tests/mooncake_servers.py`` does).

Writes are put-if-absent: keys are content-addressed (same key, same bytes), so an object that
already exists counts as stored and keeps its first copy. An object becomes readable only once
written whole, so a reader never sees a partial one.

Failure model: the constructor checks (``check_at_open``) that the master, and an HTTP
metadata server if one is configured, accept a TCP connection within ``connect_timeout_s``
and raises :class:`StorageError` if not (Mooncake's own setup retries for about 90 s against
a down master). Afterwards a call in which every key fails with anything but "not found"
(``exists_prefix``: the first key; a write: the first object, unless the store is full)
raises StorageError after one try, e.g. RPC_FAIL when the master is down; other per-key
errors become misses (None) or end a write's leading count. Against a down master reads and
existence checks fail at once, writes after about 4 s. The store evicts on its own (master's
high watermark); ``evictions`` stays 0 since it does not tell us. ``delete`` and ``clear``
force removal past Mooncake's read leases: a reader racing them may copy a torn object,
which the object checksum refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import numpy as np

from ...ports import split_host_port
from .base import RemoteStore, RemoteStoreOptions, StorageError

log = logging.getLogger(__name__)

# Mooncake ErrorCode values this backend tells apart.
OK, NO_SPACE, INVALID_PARAMS, NOT_READY = 0, -200, -600, -703
NOT_FOUND, ALREADY_EXISTS, RPC_FAIL = -704, -705, -900
_NAMES = {NO_SPACE: "NO_AVAILABLE_HANDLE (store full)", INVALID_PARAMS: "INVALID_PARAMS",
          NOT_READY: "REPLICA_IS_NOT_READY", NOT_FOUND: "OBJECT_NOT_FOUND",
          ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS", RPC_FAIL: "RPC_FAIL (master unreachable?)",
          -800: "TRANSFER_FAIL", -706: "OBJECT_HAS_LEASE", -1: "INTERNAL_ERROR"}
MIN_BUFFER = 1 << 20
SLOT_ALIGN = 4096


def code_name(code: int) -> str:
    """A Mooncake error code as ``NAME (code)``."""
    return f"{_NAMES.get(code, 'error')} ({code})"


def reachable(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class _Buffer:
    """A byte array registered with the client for zero-copy transfers, grown on demand (``fail``:
    the backend's counted StorageError); :meth:`use` lends it out."""

    def __init__(self, client, fail: Callable[[str], StorageError]) -> None:
        self.client, self.fail = client, fail
        self.arr: np.ndarray | None = None
        self.lock = threading.Lock()

    def ensure(self, nbytes: int) -> tuple[int, memoryview]:
        """(address, view) of at least ``nbytes`` registered bytes."""
        if self.arr is None or self.arr.nbytes < nbytes:
            size = max(nbytes, MIN_BUFFER, 0 if self.arr is None else 2 * self.arr.nbytes)
            self.release()
            arr = np.empty(size, dtype=np.uint8)
            rc = self.client.register_buffer(arr.ctypes.data, size)
            if rc != OK:
                raise self.fail(f"mooncake could not register a {size}-byte buffer: {code_name(rc)}")
            self.arr = arr
        return self.arr.ctypes.data, memoryview(self.arr)

    def release(self) -> None:
        if self.arr is not None:
            self.client.unregister_buffer(self.arr.ctypes.data)
            self.arr = None

    @contextlib.contextmanager
    def use(self, nbytes: int) -> Iterator[tuple[int, memoryview]]:
        """(address, view) of at least ``nbytes`` of this buffer; of a temporary one while it is busy
        (a call abandoned by the caller's deadline may still be using it)."""
        buf = self if self.lock.acquire(blocking=False) else _Buffer(self.client, self.fail)
        try:
            yield buf.ensure(nbytes)
        finally:
            if buf is self:
                self.lock.release()
            else:
                buf.release()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MooncakeOptions(RemoteStoreOptions):
    """A Mooncake Store client's setup (SGLang's names).

    ``master_server_address``: the master's ``HOST:PORT`` (its RPC port).
    ``metadata_server``: ``P2PHANDSHAKE`` (peers exchange transfer metadata directly) or the
    URL of an HTTP metadata server (``http://HOST:PORT/metadata``; the master runs one with
    ``-enable_http_metadata_server``); it must match what the store services use.
    ``local_hostname``: the address peers reach this client at. ``protocol``: ``tcp`` or
    ``rdma``; ``device_name``: RDMA device(s), "" for TCP.
    ``global_segment_size``: bytes of memory this process contributes to the pool (4 GiB,
    allocated lazily). 0 contributes nothing: the process only reads and writes objects held
    by store services or other engines (then the objects outlive this process).
    ``local_buffer_size``: Mooncake's own staging buffer; this backend moves data through its
    own registered buffers, so 0 suffices.
    ``batch_size``: most keys per Mooncake call. ``check_at_open``: see the module docstring;
    with False the constructor does not connect, each call connects until it succeeds.
    """

    master_server_address: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 4 << 30
    local_buffer_size: int = 0
    batch_size: int = 128
    connect_timeout_s: float = 2.0


class MooncakeBackend(RemoteStore):
    """Page objects in a Mooncake Store (:class:`MooncakeOptions`) under its ``prefix``."""

    name = "mooncake"
    options_type = MooncakeOptions

    def __init__(self, options: MooncakeOptions = MooncakeOptions()) -> None:
        super().__init__(options)
        o = self.options = options
        if int(o.global_segment_size) < 0 or int(o.local_buffer_size) < 0:
            raise ValueError("buffer sizes must not be negative")
        self.master = o.master_server_address
        self._master_hp = split_host_port(o.master_server_address)
        if self._master_hp is None:
            raise ValueError(f"expected HOST:PORT, got {o.master_server_address!r}")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StorageError("the mooncake backend needs Mooncake Store: pip install "
                               "mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine with CUDA), and "
                               f"libibverbs1 / librdmacm1 from the OS packages ({e})") from e
        self._client = MooncakeDistributedStore()
        self._ready = False
        self._open_lock = threading.Lock()
        self._bufs = {"get": _Buffer(self._client, self._fail), "put": _Buffer(self._client, self._fail)}
        self._slot = 0  # read slot per key: the largest object seen, rounded up
        if o.check_at_open:
            self._connect()
        log.info("mooncake storage at master %s (metadata %s) prefix %r segment %d bytes: %s",
                 self.master, o.metadata_server, o.prefix, int(o.global_segment_size),
                 "connected" if self._ready else "not checked")

    # -- helpers --------------------------------------------------------------------------
    def _connect(self) -> None:
        """Set the client up once; StorageError (fast) if the master or metadata server is down."""
        if self._ready:
            return
        with self._open_lock:
            if self._ready:
                return
            o = self.options
            targets = [("master", self.master, self._master_hp)]
            url = urlsplit(o.metadata_server)
            if url.scheme in ("http", "https") and url.hostname:
                port = url.port or (443 if url.scheme == "https" else 80)
                targets.append(("metadata server", o.metadata_server, (url.hostname, port)))
            for what, where, (host, port) in targets:
                if not reachable(host, port, float(o.connect_timeout_s)):
                    raise self._fail(f"mooncake {what} at {where} is unreachable")
            rc = self._client.setup(o.local_hostname, o.metadata_server, int(o.global_segment_size),
                                    int(o.local_buffer_size), o.protocol, o.device_name, self.master)
            if rc != OK:
                raise self._fail(f"mooncake setup against master {self.master} failed: {code_name(rc)}")
            self._ready = True

    def _check_codes(self, op: str, codes: list[int], ok: tuple[int, ...]) -> None:
        """StorageError when every key failed with an error (the store failed as a whole)."""
        if codes and all(c < 0 and c not in ok for c in codes):
            raise self._fail(f"mooncake {op} at master {self.master} failed: {code_name(codes[0])}")

    # -- StorageBackend -------------------------------------------------------------------
    def exists_prefix(self, keys: list[str]) -> int:
        self._connect()
        for start, chunk in self._chunks(keys):
            codes = self._client.batch_is_exist(chunk)
            for i, found in enumerate(codes):
                if found == 1:
                    continue
                if found < 0 and start + i == 0:  # not even the first key could be checked
                    raise self._fail(f"mooncake exists at {self.master} failed: {code_name(found)}")
                return start + i
        return len(keys)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        self._connect()
        return self._count_gets(len(keys), [v for _, chunk in self._chunks(keys) for v in self._get_chunk(chunk)])

    def _get_chunk(self, mkeys: list[str]) -> list[bytes | None]:
        """One chunk's objects. Slots are the largest size seen; objects that do not fit are
        measured (the first, then each if they still do not fit) and read again."""
        out: list[bytes | None] = [None] * len(mkeys)
        if self._slot == 0 and mkeys:
            self._grow_slot(self._client.get_size(mkeys[0]))
        too_small = self._read_into(mkeys, list(range(len(mkeys))), None, out)
        if too_small and self._grow_slot(self._client.get_size(mkeys[too_small[0]])):
            too_small = self._read_into(mkeys, too_small, None, out)
        if too_small:  # objects of several sizes
            fit = [(i, n) for i in too_small if (n := self._client.get_size(mkeys[i])) > 0]
            if fit:
                self._grow_slot(max(n for _, n in fit))
                self._read_into(mkeys, [i for i, _ in fit], [n for _, n in fit], out)
        return out

    def _grow_slot(self, size: int) -> bool:
        """Make the read slot hold ``size`` bytes; False if it already did (or size is an error)."""
        if size <= self._slot:
            return False
        self._slot = -(-size // SLOT_ALIGN) * SLOT_ALIGN
        return True

    def _read_into(self, mkeys: list[str], todo: list[int], sizes: list[int] | None, out: list) -> list[int]:
        """Read ``todo``'s keys into ``out`` (slots of ``sizes``, default the read slot); the
        indices whose object did not fit."""
        sizes = sizes or [max(self._slot, SLOT_ALIGN)] * len(todo)
        offsets = list(itertools.accumulate(sizes, initial=0))
        with self._bufs["get"].use(offsets[-1]) as (ptr, view):
            ptrs = [ptr + o for o in offsets[:-1]]
            codes = self._client.batch_get_into([mkeys[i] for i in todo], ptrs, sizes)
            self._check_codes("get", codes, (NOT_FOUND, NOT_READY, INVALID_PARAMS))
            too_small = []
            for i, off, n in zip(todo, offsets, codes):
                if n >= 0:
                    out[i] = bytes(view[off : off + n])
                elif n == INVALID_PARAMS:
                    too_small.append(i)
                elif n not in (NOT_FOUND, NOT_READY):
                    log.debug("mooncake get %s: %s", mkeys[i], code_name(n))
        return too_small

    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        self._connect()
        stored = 0
        for start, chunk in self._chunks(keys):
            vs = values[start : start + self.batch_size]
            n = self._put_chunk(chunk, vs)
            self._count_sets(vs[:n])
            stored += n
            if n < len(vs):
                break
        return stored

    def _put_chunk(self, mkeys: list[str], values: list[bytes]) -> int:
        """Store one chunk from the registered buffer; how many leading objects are stored."""
        sizes = [memoryview(v).nbytes for v in values]
        self._grow_slot(max(sizes, default=0))
        with self._bufs["put"].use(sum(sizes)) as (ptr, view):
            offsets = list(itertools.accumulate(sizes, initial=0))
            for v, off, n in zip(values, offsets, sizes):
                view[off : off + n] = memoryview(v).cast("B")
            codes = self._client.batch_put_from(mkeys, [ptr + off for off in offsets[:-1]], sizes)
        for i, rc in enumerate(codes):
            if rc not in (OK, ALREADY_EXISTS):
                if i == 0 and rc != NO_SPACE:
                    raise self._fail(f"mooncake put at master {self.master} failed: {code_name(rc)}")
                log.debug("mooncake put stopped at object %d of %d: %s", i, len(codes), code_name(rc))
                return i
        return len(codes)

    def delete(self, keys: list[str]) -> None:
        self._connect()
        for _, chunk in self._chunks(keys):
            self._check_codes("remove", self._client.batch_remove(chunk, True), (NOT_FOUND,))

    def clear(self) -> None:
        """Remove every object whose key starts with ``prefix`` (a forced regex removal; with an
        empty prefix that is every object in the store)."""
        self._connect()
        # regex syntax characters (ECMAScript's set, also valid for RE2) escaped: a literal prefix
        n = self._client.remove_by_regex("^" + re.sub(r"([\^$\\.*+?()\[\]{}|])", r"\\\1", self.prefix), True)
        if n < 0:
            raise self._fail(f"mooncake clear at master {self.master} failed: {code_name(n)}")
        log.info("mooncake storage at %s cleared %d objects under %r", self.master, n, self.prefix)

    def _extra(self) -> dict:
        return {"master": self.master, "prefix": self.prefix, "segment_bytes": int(self.options.global_segment_size),
                "buffer_bytes": sum(b.arr.nbytes for b in self._bufs.values() if b.arr is not None)}

    def close(self) -> None:
        """Unregister the buffers (unless a call still uses one) and close the client."""
        for buf in self._bufs.values():
            if buf.lock.acquire(timeout=5):
                try:
                    buf.release()
                finally:
                    buf.lock.release()
        if self._ready:
            self._ready = False
            self._client.close()
