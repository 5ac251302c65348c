"""The L3 storage tier never stalls serving: per-call deadlines and a circuit breaker around
every backend (storage.guard), idle housekeeping that only applies ready acks, and file-backend
errors that are reported instead of looking like misses. Greedy output never changes
(DESIGN inv. 1, 5); no test asserts on speed, only on what waited for what."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import threading
import uuid
from collections import Counter
from pathlib import Path

from faulty_backend import FaultyBackend, Faults
import numpy as np
import pytest
from storage_engines import GREEDY, PROMPT, storage_engine, write_history

from hicache import Engine
from hicache.cache.storage.base import BackendStats, StorageBackend, StorageError
from hicache.cache.storage.guard import (
    BreakerOpen,
    GuardedBackend,
    StorageTimeout,
    failure_reason,
)
from hicache.cache.storage.keys import page_hashes
from hicache.frontend.loop import EngineLoop

pytestmark = pytest.mark.storage

OTHERS = [[(i * (13 + 2 * s) + 7 * s) % 240 + 5 for i in range(120)] for s in range(5)]  # prefetch-sized
SHORT = [5, 6, 7, 8]  # below the prefetch threshold
WAIT_S = 30.0  # bound on any answer: far above normal, far below the hangs (600 s) it must not wait for
HANG_S = 600.0


# ---- guard unit tests: a fake backend, a fake clock --------------------------------------------
class FakeBackend(StorageBackend):
    """Answers, fails or hangs (until ``gate`` is set) according to ``mode``."""

    name = "fake"

    def __init__(self) -> None:
        self.mode = "ok"
        self.calls: Counter[str] = Counter()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _enter(self, op: str) -> None:
        self.calls[op] += 1
        self.entered.set()
        if self.mode == "hang":
            self.gate.wait(HANG_S)
        if self.mode == "fail":
            raise StorageError(f"fake {op} failed")

    def exists_prefix(self, keys: list[str]) -> int:
        self._enter("exists_prefix")
        return 0

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        self._enter("batch_get")
        return [None] * len(keys)

    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        self._enter("batch_set")
        return len(keys)

    def delete(self, keys: list[str]) -> None:
        self._enter("delete")

    def clear(self) -> None:
        self._enter("clear")

    def stats(self) -> BackendStats:
        return BackendStats()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake():
    backend = FakeBackend()
    yield backend
    backend.gate.set()  # wake any call a test left hung


def test_deadline_abandons_a_hung_call(fake: FakeBackend) -> None:
    guard = GuardedBackend(fake, timeout_s=0.05)
    fake.mode = "hang"
    with pytest.raises(StorageTimeout, match="timed out after 0.05s"):
        guard.batch_set(["k"], [b"v"])
    assert not fake.gate.is_set()  # the caller came back while the backend call is still hung
    snap = guard.snapshot()
    assert snap["timeouts"] == 1 and snap["state"] == "closed" and snap["call_failures_by_op"] == {"batch_set": 1}
    fake.mode, guard.timeout_s = "ok", WAIT_S
    fake.gate.set()
    assert guard.batch_set(["k"], [b"v"]) == 1 and guard.snapshot()["consecutive_failures"] == 0
    guard.close()


def test_hung_calls_cannot_pile_up(fake: FakeBackend) -> None:
    """At most max_workers calls ever reach a hung backend; calls abandoned while queued never run."""
    guard = GuardedBackend(fake, timeout_s=0.05, failures=100, max_workers=2)
    fake.mode = "hang"
    for _ in range(6):
        with pytest.raises(StorageTimeout):
            guard.exists_prefix(["k"])
    fake.gate.set()  # the two hung calls return; the four queued ones must be skipped
    guard.timeout_s = WAIT_S
    probe_done = guard.exists_prefix(["k"])  # runs after the queue has been worked through (FIFO)
    assert probe_done == 0
    assert fake.calls["exists_prefix"] == 3  # 2 hung + this one
    assert len([t for t in threading.enumerate() if t.name.startswith("hicache-storage-call")]) <= 2
    guard.close()


def test_breaker_opens_probes_and_closes(fake: FakeBackend, caplog) -> None:
    clock = FakeClock()
    guard = GuardedBackend(fake, timeout_s=5.0, failures=3, cooldown_s=2.0, max_cooldown_s=5.0, clock=clock)
    fake.mode = "fail"
    caplog.set_level(logging.INFO, logger="hicache.cache.storage.guard")
    for _ in range(3):
        with pytest.raises(StorageError) as e:
            guard.batch_get(["k"])
        assert failure_reason(e.value) == "backend_error"
    assert guard.snapshot()["state"] == "open" and fake.calls["batch_get"] == 3
    with pytest.raises(BreakerOpen) as e:  # refused without touching the backend
        guard.batch_get(["k"])
    assert failure_reason(e.value) == "breaker_open" and fake.calls["batch_get"] == 3
    clock.advance(2.0)
    with pytest.raises(StorageError):  # the probe goes through and fails: open for twice as long
        guard.exists_prefix(["k"])
    snap = guard.snapshot()
    assert fake.calls["exists_prefix"] == 1 and snap["state"] == "open" and snap["cooldown_s"] == 4.0
    clock.advance(3.0)
    with pytest.raises(BreakerOpen):
        guard.exists_prefix(["k"])
    clock.advance(1.0)
    with pytest.raises(StorageError):  # second failed probe: doubling stops at max_cooldown_s
        guard.exists_prefix(["k"])
    assert guard.snapshot()["cooldown_s"] == 5.0
    fake.mode = "ok"
    clock.advance(5.0)
    assert guard.exists_prefix(["k"]) == 0  # healthy probe closes it
    assert guard.batch_set(["k"], [b"v"]) == 1
    snap = guard.snapshot()
    assert snap["state"] == "closed" and snap["opens"] == 3 and snap["short_circuited"] == 2
    assert snap["call_failures"] == {"error": 5} and snap["transitions"] == 7
    lines = [r for r in caplog.records if r.name == "hicache.cache.storage.guard"]
    assert len(lines) == 7 and all("fake" in r.getMessage() for r in lines)  # one line per transition
    guard.close()


def test_half_open_lets_one_probe_through(fake: FakeBackend) -> None:
    clock = FakeClock()
    guard = GuardedBackend(fake, timeout_s=WAIT_S, failures=1, cooldown_s=1.0, clock=clock)
    fake.mode = "fail"
    with pytest.raises(StorageError):
        guard.batch_set(["k"], [b"v"])
    clock.advance(1.0)
    fake.mode, fake.entered = "hang", threading.Event()
    probe = threading.Thread(target=guard.exists_prefix, args=(["k"],))
    probe.start()
    assert fake.entered.wait(WAIT_S)
    assert guard.snapshot()["state"] == "half_open"
    with pytest.raises(BreakerOpen):  # while the probe is out, nothing else reaches the backend
        guard.batch_get(["k"])
    assert fake.calls["batch_get"] == 0
    fake.mode = "ok"
    fake.gate.set()
    probe.join(WAIT_S)
    assert guard.snapshot()["state"] == "closed" and guard.batch_get(["k"]) == [None]
    guard.close()


# ---- engines --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> dict[tuple, list[int]]:
    plain = Engine("random:tiny", dtype="float32", max_total_tokens=2048, disable_radix_cache=True)
    prompts = [PROMPT, SHORT, *OTHERS]
    out = {tuple(p): r.output_ids for p, r in zip(prompts, plain.generate(prompts, GREEDY))}
    plain.shutdown()
    return out


def backend_calls(fb: FaultyBackend) -> int:
    return sum(n for op, n in fb.calls.items() if op != "stats")


async def served_while_stuck(loop: EngineLoop, engine: Engine, reference: dict) -> dict:
    """A long request, then (idle, its backups stuck in the store) a new request and stats."""
    first = await asyncio.wait_for(loop.submit(PROMPT, GREEDY).wait(), WAIT_S)
    assert first.output_ids == reference[tuple(PROMPT)]
    pending = 0
    for _ in range(int(WAIT_S / 0.02)):  # each answer comes from the loop thread between steps
        pending = await asyncio.wait_for(asyncio.wrap_future(loop.call(engine.cache.storage.pending_backups)), WAIT_S)
        if pending:
            break
        await asyncio.sleep(0.02)
    assert pending > 0, "the loop never answered while a backup was outstanding"
    second = loop.submit(OTHERS[0], GREEDY)
    stats = await asyncio.wait_for(loop.stats(), WAIT_S)
    result = await asyncio.wait_for(second.wait(), WAIT_S)
    assert result.output_ids == reference[tuple(OTHERS[0])]
    short = await asyncio.wait_for(loop.submit(SHORT, GREEDY).wait(), WAIT_S)
    assert short.output_ids == reference[tuple(SHORT)]
    return stats


def test_hung_backend_never_holds_the_loop(tmp_path: Path, reference: dict) -> None:
    engine = storage_engine(tmp_path, hicache_storage_prefetch_policy="best_effort",
                            hicache_storage_op_timeout=HANG_S / 10)  # the deadline stays out of reach
    fb = FaultyBackend(engine.cache.storage.backend, Faults(hang_s=HANG_S))
    engine.cache.storage.backend = fb
    loop = EngineLoop(engine).start()
    try:
        stats = asyncio.run(served_while_stuck(loop, engine, reference))
        assert stats["storage"]["breaker"]["state"] == "closed"  # nothing failed: everything still hangs
        assert fb.calls["batch_set"] >= 1 and not fb._released.is_set()
    finally:
        fb.release()
        loop.stop()
        engine.shutdown()


def test_breaker_skips_a_failing_backend_then_recovers(tmp_path: Path, reference: dict) -> None:
    write_history(tmp_path)
    engine = storage_engine(tmp_path)
    guard, clock = engine.cache.storage.guard, FakeClock()
    guard.clock = clock
    fb = FaultyBackend(engine.cache.storage.backend, Faults(down=True))
    engine.cache.storage.backend = fb
    try:
        for p in OTHERS[:3]:  # each: a failed prefetch query and failed backups
            assert engine.generate([p], GREEDY)[0].output_ids == reference[tuple(p)]
        engine.cache.drain()
        breaker = engine.stats()["storage"]["breaker"]
        assert breaker["state"] == "open" and breaker["opens"] == 1
        calls = backend_calls(fb)
        for p in OTHERS[3:]:
            assert engine.generate([p], GREEDY)[0].output_ids == reference[tuple(p)]
        engine.cache.drain()
        storage = engine.stats()["storage"]
        assert backend_calls(fb) == calls  # skipped, not called
        assert storage["breaker"]["short_circuited"] >= 2 and storage["failures"]["breaker_open"] >= 2
        fb.faults.down = False
        clock.advance(guard.cooldown_s)  # the next call is the probe
        res = engine.generate([PROMPT], GREEDY)[0]
        assert res.output_ids == reference[tuple(PROMPT)]
        assert res.cached_tokens_details["storage"] == 384  # hits are back
        assert engine.stats()["storage"]["breaker"]["state"] == "closed" and backend_calls(fb) > calls
    finally:
        engine.shutdown()


def test_wait_complete_stops_waiting_once_the_breaker_opens(tmp_path: Path, reference: dict) -> None:
    engine = storage_engine(tmp_path, hicache_storage_op_timeout=0.2)
    engine.cache.storage.guard.clock = FakeClock()  # no cooldown ends during the test: no probe
    fb = FaultyBackend(engine.cache.storage.backend, Faults(hang_s=HANG_S))
    engine.cache.storage.backend = fb
    ops = []
    prefetch = engine.cache.storage.prefetch
    engine.cache.storage.prefetch = lambda *a, **k: ops.append(prefetch(*a, **k)) or ops[-1]
    try:
        for p in OTHERS[:3]:  # the hung calls time out (0.2 s each) until the breaker opens
            assert engine.generate([p], GREEDY)[0].output_ids == reference[tuple(p)]
        engine.cache.drain()
        before = engine.stats()["storage"]
        assert before["breaker"]["state"] == "open" and before["breaker"]["timeouts"] >= 3
        assert ops[0].failure == "timeout"
        calls = backend_calls(fb)
        for p in OTHERS[3:]:
            assert engine.generate([p], GREEDY)[0].output_ids == reference[tuple(p)]
        engine.cache.drain()
        after = engine.stats()["storage"]
        assert [op.failure for op in ops[3:]] == ["breaker_open"] * 2  # refused at once, not timed out
        assert after["failures"]["breaker_open"] >= 2 and after["breaker"]["timeouts"] == before["breaker"]["timeouts"]
        assert after["breaker"]["short_circuited"] > before["breaker"]["short_circuited"]
        assert backend_calls(fb) == calls and not fb._released.is_set()
    finally:
        fb.release()
        engine.shutdown()


def _server_pid(port: int) -> int:
    """The process listening on 127.0.0.1:``port`` (the fixture hides its Popen, and valkey
    rewrites its command line): the listening socket's inode, then the process holding it."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                sockets.add(f"socket:[{f[9]}]")
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in sockets and int(entry) != os.getpid():
                    return int(entry)
            except OSError:
                continue
    pytest.skip(f"no process found listening on port {port}")


def test_stopped_valkey_server_does_not_stall_serving(valkey_server, reference: dict) -> None:
    host, port = valkey_server
    extra = {"host": host, "port": port, "prefix": f"resilience-{uuid.uuid4().hex}:", "timeout_s": 2.0,
             "connect_timeout_s": 0.5}
    engine = Engine("random:tiny", dtype="float32", page_size=16, max_total_tokens=2048,
                    enable_hierarchical_cache=True, hicache_storage_backend="valkey",
                    hicache_storage_backend_extra_config=json.dumps(extra),
                    hicache_storage_prefetch_threshold=64, hicache_storage_prefetch_policy="best_effort")
    loop = EngineLoop(engine).start()
    pid = _server_pid(port)
    os.kill(pid, signal.SIGSTOP)
    try:
        during = asyncio.run(served_while_stuck(loop, engine, reference))["storage"]
        after = asyncio.run(asyncio.wait_for(loop.stats(), WAIT_S))["storage"]  # the server still stopped
        # Every answer came while the store had completed nothing: no backup landed, no prefetch
        # was waited for or loaded (best_effort skipped them) -- before or after the answers.
        for storage in (during, after):
            assert storage["backend"] == "valkey" and storage["backup_tokens"] == 0
            assert storage["prefetch_waited"] == 0 and storage["prefetched_tokens"] == 0
        assert after["prefetch_skipped"] >= 1
    finally:
        os.kill(pid, signal.SIGCONT)
        loop.stop()
        engine.shutdown()


def test_unreadable_object_path_is_reported(tmp_path: Path, reference: dict, caplog) -> None:
    write_history(tmp_path)
    engine = storage_engine(tmp_path)
    try:
        keys = [h.hex() for h in page_hashes(np.asarray(PROMPT[:384], dtype=np.int32), 16,
                                             engine.cache.ns_digest(engine.model_namespace))]
        fanout = tmp_path / keys[10][:2]
        shutil.rmtree(fanout)
        fanout.write_bytes(b"a file where a directory should be")  # stat below it: ENOTDIR
        caplog.set_level(logging.WARNING, logger="hicache.cache.storage")
        res = engine.generate([PROMPT], GREEDY)[0]
        assert res.output_ids == reference[tuple(PROMPT)]
        assert res.cached_tokens_details["storage"] == 0
        assert engine.stats()["storage"]["failures"].get("backend_error", 0) == 1
        assert engine.cache.storage.backend.stats().errors >= 1
        assert any("cannot stat" in r.getMessage() and keys[10][:2] in r.getMessage() for r in caplog.records)
    finally:
        engine.shutdown()
