"""Rank consensus checker: decorator cost when off, recording, comparison, and a 2-process monitor."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

from hicache import consensus_record
from hicache.consensus_record import ENV_VAR, Entry, consensus_check, install_recorder, make_queue_sink
from hicache.parallel import consensus
from hicache.parallel.consensus import ConsensusComparator, ConsensusMonitor, Divergence

pytestmark = pytest.mark.parallel


def uninstall_recorder(monkeypatch) -> None:
    """Stop recording in this process (checked functions then only call through); the recorder
    before it comes back after the test. Rank processes never stop recording: tests only."""
    monkeypatch.setattr(consensus_record, "_record", None)


@pytest.fixture
def checker_on(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    uninstall_recorder(monkeypatch)  # (and whatever a test installs is gone after it)


@pytest.fixture
def recorded(checker_on):
    entries: list[tuple[str, Entry]] = []
    install_recorder("PP0/TP0", lambda label, e: entries.append((label, e)))
    return entries


# --- decorator on/off -------------------------------------------------------------------------

_PROBE = """
from hicache.consensus_record import consensus_check
def f(x):
    return x
g = consensus_check("f")(f)
print("same" if g is f else "wrapped", g(3))
"""


@pytest.mark.parametrize("value, expected", [(None, "same"), ("0", "same"), ("1", "wrapped")])
def test_decorator_is_identity_when_off_in_fresh_process(value, expected):
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if value is not None:
        env[ENV_VAR] = value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [expected, "3"]


def test_decision_is_taken_at_decoration_time(monkeypatch):
    def f(x):
        return x

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert consensus_check()(f) is f
    assert consensus_check(f) is f  # bare form
    monkeypatch.setenv(ENV_VAR, "1")
    wrapped = consensus_check()(f)
    assert wrapped is not f and wrapped.__wrapped__ is f and wrapped.__name__ == "f"
    monkeypatch.delenv(ENV_VAR)
    assert wrapped(4) == 4  # stays a wrapper; no recorder installed, so it just calls f


_GROUPS = """
import os
from hicache import Engine
from hicache.runtime.sampling import SamplingParams
greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
for checker in ("0", "1"):
    os.environ["HICACHE_RANK_CONSENSUS_CHECKER"] = checker
    engine = Engine("random:tiny", tp_size=2, dtype="float32", page_size=4)
    try:
        engine.generate([list(range(20, 40))], greedy)
        print(checker, engine.group.monitor.compared if engine.group.monitor is not None else -1)
    finally:
        engine.shutdown()
"""


@pytest.mark.multirank
def test_a_rank_group_with_the_checker_on_records_after_one_without_in_the_same_process():
    """Ranks fork from one fork server a process starts with its first rank group: the checker of
    a later group must not depend on the first group's environment (a test order once left every
    later group's decorators off: ``compared`` 0)."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    out = subprocess.run([sys.executable, "-c", _GROUPS], env=env, capture_output=True, text=True, check=True,
                         timeout=300)
    first, second = (line.split() for line in out.stdout.splitlines()[-2:])
    assert first == ["0", "-1"]  # off: no monitor
    assert second[0] == "1" and int(second[1]) > 0


# --- recording --------------------------------------------------------------------------------


def _make_cache():
    """Defined after the env var is set, since the decorator decides at decoration time."""

    class Cache:
        def __init__(self) -> None:
            self.tokens = 0

        @consensus_check("cache.admit", args=lambda self, rid, n=1: (rid, n, self.tokens), result=lambda r: r)
        def admit(self, rid: str, n: int = 1) -> tuple[str, int]:
            if n < 0:
                raise ValueError("negative")
            self.tokens += n
            return rid, self.tokens

        @consensus_check()
        def flush(self) -> int:
            return self.tokens

    return Cache


def test_records_consecutive_entries_with_selected_values(recorded):
    cache = _make_cache()()
    assert cache.admit("a", 3) == ("a", 3)
    assert cache.admit("b", n=2) == ("b", 5)
    assert cache.flush() == 5
    assert [label for label, _ in recorded] == ["PP0/TP0"] * 3
    assert [e for _, e in recorded] == [
        Entry(0, "cache.admit", ("a", 3, 0), ("a", 3)),  # params see the state before the call
        Entry(1, "cache.admit", ("b", 2, 3), ("b", 5)),
        Entry(2, "_make_cache.<locals>.Cache.flush", None, None),  # default name, no selectors
    ]


def test_exception_records_nothing_and_propagates(recorded):
    cache = _make_cache()()
    cache.admit("a")
    with pytest.raises(ValueError, match="negative"):
        cache.admit("b", -1)
    cache.admit("c")
    assert [(e.index, e.params[0]) for _, e in recorded] == [(0, "a"), (1, "c")]


def test_no_recorder_means_plain_call(checker_on, monkeypatch):
    uninstall_recorder(monkeypatch)
    cache = _make_cache()()
    assert cache.admit("a", 2) == ("a", 2)


def test_reinstall_restarts_indices(recorded):
    cache = _make_cache()()
    cache.admit("a")
    recorded.clear()
    install_recorder("PP0/TP1", lambda label, e: recorded.append((label, e)))
    cache.admit("b")
    assert [(label, e.index) for label, e in recorded] == [("PP0/TP1", 0)]


def test_recording_from_threads_keeps_indices_unique_and_ordered(checker_on):
    entries: list[Entry] = []
    install_recorder("TP0", lambda label, e: entries.append(e))
    step = consensus_check("step")(lambda i: i)
    threads = [threading.Thread(target=lambda: [step(i) for i in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e.index for e in entries] == list(range(800))


# --- comparator -------------------------------------------------------------------------------

LABELS = ["PP0/TP0", "PP0/TP1", "PP1/TP0"]


def _stream(n: int, *, change: int | None = None, field: str = "result") -> list[Entry]:
    out = []
    for i in range(n):
        entry = Entry(i, f"f{i % 3}", (i, "rid"), (i, i * 16))
        if i == change:
            if field == "function":
                entry.function = "other"
            elif field == "params":
                entry.params = (i, "other")
            else:
                entry.result = (i, -1)
        out.append(entry)
    return out


def _feed(cmp: ConsensusComparator, streams: dict[str, list[Entry]], lags: dict[str, int]) -> list[Divergence]:
    """Interleave the streams, rank r starting lags[r] steps late (like PP stages)."""
    found = []
    n = max(len(s) for s in streams.values())
    for t in range(n + max(lags.values())):
        for label, stream in streams.items():
            i = t - lags[label]
            if 0 <= i < len(stream):
                div = cmp.add(label, stream[i])
                if div is not None:
                    found.append(div)
    return found


def test_equal_streams_at_different_lags_agree():
    cmp = ConsensusComparator(LABELS)
    streams = {label: _stream(50) for label in LABELS}
    assert _feed(cmp, streams, {"PP0/TP0": 0, "PP0/TP1": 1, "PP1/TP0": 7}) == []
    assert cmp.diverged is None
    assert cmp.compared == 50
    assert cmp._pending == {}  # nothing kept once every rank reported an index


@pytest.mark.parametrize(
    "field, kind", [("result", "result"), ("function", "call order"), ("params", "parameters")]
)
def test_reports_kind_index_and_ranks(field, kind):
    cmp = ConsensusComparator(LABELS)
    streams = {"PP0/TP0": _stream(20), "PP0/TP1": _stream(20, change=12, field=field), "PP1/TP0": _stream(20)}
    found = _feed(cmp, streams, {"PP0/TP0": 0, "PP0/TP1": 0, "PP1/TP0": 3})
    assert len(found) == 1
    div = found[0]
    assert (div.index, div.kind, div.function) == (12, kind, "f0")
    assert (div.reference_rank, div.divergent_rank) == ("PP0/TP0", "PP0/TP1")
    assert div.expected == streams["PP0/TP0"][12] and div.got == streams["PP0/TP1"][12]
    assert cmp.diverged is div
    # Reported once the lagging PP1/TP0 reached #12 too (the vote), having confirmed 0..11.
    assert cmp.compared == 12


def test_message_names_everything():
    div = Divergence(
        12, "cache.admit", "result", "PP0/TP0", "PP1/TP1",
        Entry(12, "cache.admit", ("r", 48), (3, 32)), Entry(12, "cache.admit", ("r", 48), (3, 48)),
    )
    assert str(div) == (
        "Found rank divergence at call #12 in cache.admit: PP1/TP1 differs from PP0/TP0 "
        "in the result: (3, 48) vs (3, 32)"
    )
    long = Divergence(0, "f", "parameters", "A", "B", Entry(0, "f", "x" * 1000, None), Entry(0, "f", "y" * 1000, None))
    text = str(long)
    assert "\n" not in text and len(text) < 600 and "yyy..." in text


def test_lagging_rank_diverging_late_is_caught():
    cmp = ConsensusComparator(LABELS)
    streams = {"PP0/TP0": _stream(40), "PP0/TP1": _stream(40), "PP1/TP0": _stream(40, change=35)}
    found = _feed(cmp, streams, {"PP0/TP0": 0, "PP0/TP1": 0, "PP1/TP0": 20})
    assert [(d.index, d.kind, d.divergent_rank) for d in found] == [(35, "result", "PP1/TP0")]
    assert cmp.compared == 35


def test_first_divergence_only():
    cmp = ConsensusComparator(LABELS)
    streams = {
        "PP0/TP0": _stream(30),
        "PP0/TP1": _stream(30, change=4, field="params"),
        "PP1/TP0": _stream(30, change=2, field="function"),
    }
    found = _feed(cmp, streams, {"PP0/TP0": 0, "PP0/TP1": 0, "PP1/TP0": 5})
    # PP0/TP1's mismatch at #4 is seen first, but while it waits for the lagging PP1/TP0 to
    # vote, PP1/TP0 mismatches at #2: the earliest divergence is the one reported.
    assert [(d.index, d.kind, d.divergent_rank) for d in found] == [(2, "call order", "PP1/TP0")]
    assert cmp.add("PP1/TP0", _stream(30)[29]) is None


def test_majority_names_the_odd_rank_even_when_it_arrives_first():
    cmp = ConsensusComparator(["TP0", "TP1", "TP2"])
    odd, good = Entry(0, "f", ("r", 5), 16), Entry(0, "f", ("r", 5), 12)
    assert cmp.add("TP0", odd) is None
    assert cmp.add("TP1", good) is None  # a mismatch: waits for TP2 to vote
    assert cmp.undecided
    div = cmp.add("TP2", good)
    assert (div.reference_rank, div.divergent_rank, div.kind) == ("TP1", "TP0", "result")
    assert (div.expected, div.got) == (good, odd)
    assert not cmp.undecided and cmp.decide() is None


def test_without_a_majority_or_a_vote_the_mismatch_is_reported_as_seen():
    a, b, c = Entry(0, "f", 1, 1), Entry(0, "f", 1, 2), Entry(0, "f", 1, 3)
    cmp = ConsensusComparator(["TP0", "TP1", "TP2"])
    cmp.add("TP0", a)
    cmp.add("TP1", b)
    div = cmp.add("TP2", c)  # three different results: no majority
    assert (div.reference_rank, div.divergent_rank) == ("TP0", "TP1")
    hung = ConsensusComparator(["TP0", "TP1", "TP2"])
    hung.add("TP0", a)
    hung.add("TP1", b)  # TP2 never reports call #0 (it hung)
    div = hung.decide()
    assert (div.index, div.reference_rank, div.divergent_rank) == (0, "TP0", "TP1")
    assert hung.diverged is div and hung.add("TP2", a) is None


def test_reference_is_first_arrival():
    cmp = ConsensusComparator(["A", "B"])
    assert cmp.add("B", Entry(0, "f", 1, 1)) is None
    div = cmp.add("A", Entry(0, "f", 1, 2))
    assert (div.reference_rank, div.divergent_rank) == ("B", "A")


def test_unknown_label_and_duplicate_index_rejected():
    cmp = ConsensusComparator(["A", "B"])
    with pytest.raises(ValueError, match="unknown rank"):
        cmp.add("C", Entry(0, "f", None, None))
    cmp.add("A", Entry(0, "f", None, None))
    with pytest.raises(ValueError, match="twice"):
        cmp.add("A", Entry(0, "f", None, None))


def test_single_rank_compares_trivially():
    cmp = ConsensusComparator(["A"])
    for e in _stream(5):
        assert cmp.add("A", e) is None
    assert cmp.compared == 5


# --- monitor across processes -----------------------------------------------------------------


def _rank_main(label: str, q, altered_call: int | None) -> None:
    """A rank process: records 10 checked calls; optionally returns a wrong result at one call."""
    os.environ[ENV_VAR] = "1"

    @consensus_check("cache.admit", args=lambda rid, n: (rid, n), result=lambda r: r)
    def admit(rid: str, n: int) -> tuple[str, int]:
        return rid, n * 16 + (1 if n == altered_call else 0)

    install_recorder(label, make_queue_sink(q))
    for i in range(10):
        admit(f"r{i}", i)


def test_monitor_reports_divergence_between_processes(caplog):
    ctx = multiprocessing.get_context("spawn")
    found: list[Divergence] = []
    monitor = ConsensusMonitor(["TP0", "TP1"], found.append, mp_context=ctx)
    monitor.start()
    procs = [
        ctx.Process(target=_rank_main, args=("TP0", monitor.queue, None)),
        ctx.Process(target=_rank_main, args=("TP1", monitor.queue, 5)),
    ]
    with caplog.at_level(logging.ERROR, logger="hicache.parallel.consensus"):
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        monitor.stop(timeout=10)
    assert len(found) == 1 and monitor.divergence is found[0]
    div = found[0]
    assert (div.index, div.function, div.kind) == (5, "cache.admit", "result")
    # Which rank's call #5 arrives first (the reference) is up to the OS scheduler.
    assert {div.reference_rank, div.divergent_rank} == {"TP0", "TP1"}
    results = {div.reference_rank: div.expected.result, div.divergent_rank: div.got.result}
    assert results == {"TP0": ("r5", 80), "TP1": ("r5", 81)}
    assert monitor.compared == 5
    assert str(div).startswith("Found rank divergence at call #5 in cache.admit")
    errors = [r.getMessage() for r in caplog.records if r.name == consensus.__name__]
    assert errors == [str(div)]


def test_monitor_in_process_sink_and_idempotent_stop():
    monitor = ConsensusMonitor(["A", "B"], lambda d: None)
    monitor.stop()  # not started: no-op
    monitor.start()
    for label in ("A", "B"):
        for e in _stream(4):
            monitor.sink(label, e)
    monitor.stop(timeout=10)
    assert monitor.divergence is None and monitor.compared == 4


_KILLED_WRITER_SCRIPT = """
import multiprocessing, os, threading
from hicache.parallel.consensus import ConsensusMonitor

def killed_mid_put(q):
    q._wlock.acquire()  # what a rank killed inside a put leaves behind: the write lock held for good
    os._exit(1)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    monitor = ConsensusMonitor(["TP0", "TP1"], lambda d: None, mp_context=ctx)
    monitor.start()
    rank = ctx.Process(target=killed_mid_put, args=(monitor.queue,))
    rank.start()
    rank.join()
    monitor.stop(timeout=30)
    alive = [t.name for t in threading.enumerate() if t.name == "rank-consensus-monitor"]
    print("monitor threads alive:", alive)
"""


def test_a_rank_killed_mid_put_does_not_block_stop_or_exit(tmp_path):
    """The frontend stops its monitor and exits even when a rank died holding the queue's lock."""
    script = tmp_path / "killed_writer.py"
    script.write_text(_KILLED_WRITER_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "monitor threads alive: []" in done.stdout


@pytest.mark.parametrize("grace_s, settle", [(0.2, False), (600.0, True)])
def test_monitor_reports_an_open_vote_after_its_grace_or_when_settled(grace_s, settle):
    """TP2 never reports call #0 (it hung, or died: then the runtime settles at once)."""
    found: list[Divergence] = []
    monitor = ConsensusMonitor(["TP0", "TP1", "TP2"], found.append, vote_grace_s=grace_s)
    monitor.start()
    try:
        monitor.sink("TP0", Entry(0, "f", 1, 1))
        monitor.sink("TP1", Entry(0, "f", 1, 2))
        if settle:
            time.sleep(0.3)
            assert found == []  # still waiting for TP2's vote
            monitor.settle()
        deadline = time.monotonic() + 10
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        monitor.stop(timeout=10)
    assert [(d.index, d.divergent_rank) for d in found] == [(0, "TP1")]
