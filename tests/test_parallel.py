"""Multi-rank runtime (TP, PP, TP x PP on gloo): the same greedy tokens as one rank without a
cache, whatever the tiers hit and however late each rank's copies finish (DESIGN inv. 1, 3)."""

from __future__ import annotations

import fcntl
import gc
import json
import multiprocessing
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections import deque
from pathlib import Path

import httpx
import psutil
import pytest

from hicache import Engine, SamplingParams, consensus_record
from hicache.bench.main import launch_server
from hicache.cli import main as cli_main
from hicache.config import ConfigError
from hicache.engine.events import StepEvents
from hicache.errors import HicacheError
from hicache.parallel.faults import ENV_VAR as FAULTS_ENV
from hicache.parallel.stage_step import DISABLE_PP_SYNC_ENV
from hicache.parallel.worker import ALTER_MATCH_ENV

MODEL = "random:small"  # 4 layers, 4 heads, 2 KV heads: TP2, PP2 and TP2 x PP2 all fit
BASE = dict(dtype="float32", page_size=4)


def multi_turn(engine: Engine, seed: int, storage_round: bool) -> list[list[int]]:
    """Three agents take turns (one batch per round); each prompt is the agent's whole history
    plus a new message. Then, with ``storage_round``, the cache is flushed and every agent's
    first turn is asked again: only storage can serve it."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 250) for _ in range(24)]
    history = [system + [100 + a] * 3 for a in range(3)]
    first_prompts: list[list[int]] = []
    outputs = []
    for turn in range(4):
        prompts = [h + [rng.randrange(5, 250) for _ in range(rng.randrange(6, 20))] for h in history]
        if turn == 0:
            first_prompts = prompts
        sampling = [SamplingParams(max_new_tokens=rng.randrange(3, 9), temperature=0.0) for _ in prompts]
        results = engine.generate(prompts, sampling)
        outputs += [r.output_ids for r in results]
        history = [p + r.output_ids for p, r in zip(prompts, results)]
    if storage_round:
        assert engine.flush_cache()
        outputs += [r.output_ids for r in engine.generate(first_prompts, SamplingParams(max_new_tokens=4, temperature=0.0))]
    return outputs


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    engine = Engine(MODEL, max_total_tokens=4096, disable_radix_cache=True, **BASE)
    try:
        return multi_turn(engine, seed=7, storage_round=True)
    finally:
        engine.shutdown()


@pytest.fixture
def checker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank consensus checker on, for ranks started from now on."""
    monkeypatch.setenv(consensus_record.ENV_VAR, "1")


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_every_tier_hits_and_output_equals_single_rank(
    tp: int, pp: int, tmp_path: Path, reference: list[list[int]], checker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"seed": tp * 10 + pp, "max_delay_s": 0.01}))
    engine = Engine(
        MODEL, tp_size=tp, pp_size=pp, max_total_tokens=160, enable_hierarchical_cache=True, hicache_ratio=8,
        hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}),
        hicache_storage_prefetch_threshold=16, hicache_storage_prefetch_policy="wait_complete", **BASE,
    )
    try:
        assert multi_turn(engine, seed=7, storage_round=True) == reference
        stats = engine.stats()
        assert stats["parallel"] == {"tp_size": tp, "pp_size": pp, "attn_cp_size": 1, "kv_cache_sharding": False}
        assert stats["evicted_device_pages"] > 0
        assert all(stats["hit_tokens"][tier] > 0 for tier in ("device", "host", "storage")), stats["hit_tokens"]
        assert engine.group.monitor.divergence is None
        assert engine.group.monitor.compared > 100  # the checker really compared every rank's calls
    finally:
        engine.shutdown()
    # An orderly stop: every rank drained its transfers and storage writes and exited by itself.
    assert [p.exitcode for p in engine.group.procs] == [0] * (tp * pp)


def random_waves(engine: Engine, seed: int) -> list[list[int]]:
    """Waves of concurrent requests over a few shared prefixes, random lengths; greedy ones
    (whose tokens are returned) mixed with seeded sampling ones (which only exercise the
    ranks' agreement: their tokens may differ from one rank's by float rounding)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 250) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    greedy = []
    for _ in range(6):
        prompts, sampling = [], []
        for _ in range(rng.randrange(2, 7)):
            prompts.append(rng.choice(prefixes) + [rng.randrange(5, 250) for _ in range(rng.randrange(1, 30))])
            temperature = rng.choice([0.0, 0.0, 0.8])
            sampling.append(SamplingParams(max_new_tokens=rng.randrange(1, 12), temperature=temperature,
                                           seed=rng.randrange(1000) if temperature else None))
        results = engine.generate(prompts, sampling)
        greedy += [r.output_ids for r, s in zip(results, sampling) if s.temperature == 0.0]
    return greedy


def test_long_randomized_run_reports_no_divergence(checker: None, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = Engine(MODEL, max_total_tokens=4096, disable_radix_cache=True, **BASE)
    try:
        want = random_waves(plain, seed=11)
    finally:
        plain.shutdown()
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"seed": 5, "max_delay_s": 0.005}))
    engine = Engine(MODEL, tp_size=2, pp_size=2, max_total_tokens=256, enable_hierarchical_cache=True,
                    hicache_ratio=2, chunked_prefill_size=16, **BASE)
    try:
        assert random_waves(engine, seed=11) == want
        assert engine.stats()["evicted_device_pages"] > 0
        assert engine.group.monitor.divergence is None and engine.group.monitor.compared > 500
    finally:
        engine.shutdown()


@pytest.mark.parametrize("reduce", ["shm", "gloo"])
def test_tp_partial_sums_through_shared_memory_or_gloo(reduce: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of summing TP partial outputs (shared memory, the CPU default; gloo, the
    fallback) give one rank's greedy tokens, prefill chunks and decode batches alike."""
    plain = Engine(MODEL, max_total_tokens=4096, disable_radix_cache=True, **BASE)
    try:
        want = random_waves(plain, seed=3)
    finally:
        plain.shutdown()
    monkeypatch.setenv("HICACHE_TP_ALLREDUCE", reduce)
    engine = Engine(MODEL, tp_size=4, max_total_tokens=1024, chunked_prefill_size=16, **BASE)
    try:
        assert random_waves(engine, seed=3) == want
    finally:
        engine.shutdown()


def backup_counts(trace: deque[consensus_record.Entry]) -> list[int]:
    """Backup acks consumed at each cache check that consumed any (of a snapshot: the monitor
    thread appends to a live trace)."""
    entries = trace.copy()
    consumed = (StepEvents.from_list(e.params).acks.backup for e in entries if e.function == "scheduler.consume_events")
    return [n for n in consumed if n > 0]


def seed_pp_engine(monkeypatch: pytest.MonkeyPatch, pp_sync: bool) -> Engine:
    """Seed section 2: backups A and B complete at once on stage 1, while stage 0 sees A
    finish well before B."""
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"delays": {"PP0/TP0": {"backup": {"0": 0.3, "1": 2.0}}}}))
    if not pp_sync:
        monkeypatch.setenv(DISABLE_PP_SYNC_ENV, "1")
    return Engine(MODEL, pp_size=2, max_total_tokens=512, enable_hierarchical_cache=True, **BASE)


def finish_two_requests(engine: Engine) -> None:
    """Two requests that finish one step apart: A's release backs up its pages, then B's."""
    prompts = [[7] * 20, [9] * 20]  # distinct prompts: one backup op each
    engine.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0) for n in (3, 4)])


def test_pp_sync_makes_stages_consume_the_same_acks(checker: None, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = seed_pp_engine(monkeypatch, pp_sync=True)
    try:
        finish_two_requests(engine)
        trace = engine.group.trace
        deadline = time.monotonic() + 15  # idle steps keep checking: stage 0 sees A at ~0.3 s, B at ~2.3 s
        while time.monotonic() < deadline and min(len(backup_counts(trace[s])) for s in ("PP0/TP0", "PP1/TP0")) < 2:
            time.sleep(0.2)
        # Stage 0 consumed A alone, then B; stage 1 (where both finished together) did the same.
        assert backup_counts(trace["PP0/TP0"]) == [1, 1]
        assert backup_counts(trace["PP1/TP0"]) == [1, 1]
        assert engine.group.monitor.divergence is None
    finally:
        engine.shutdown()


def test_without_pp_sync_the_checker_reports_the_divergence(checker: None, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = seed_pp_engine(monkeypatch, pp_sync=False)
    try:
        with pytest.raises(HicacheError, match="Found rank divergence") as info:
            finish_two_requests(engine)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                engine.stats()  # raises once the checker has stopped the engine
                time.sleep(0.2)
    finally:
        engine.shutdown()
    div = engine.group.monitor.divergence
    # Entries are recorded as calls return: the cache call inside consume_events comes first.
    assert div is not None and div.function == "cache.consume_acks" and div.kind == "parameters"
    assert {div.reference_rank, div.divergent_rank} == {"PP0/TP0", "PP1/TP0"}
    assert "cache.consume_acks" in str(info.value)


@pytest.mark.parametrize("tp,pp,altered", [(3, 1, "PP0/TP1"), (2, 2, "PP0/TP0")])
def test_checker_names_an_injected_divergence(
    tp: int, pp: int, altered: str, checker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALTER_MATCH_ENV, altered)
    engine = Engine(MODEL, tp_size=tp, pp_size=pp, max_total_tokens=512, **BASE)
    try:
        prompt = [(i * 13) % 240 + 5 for i in range(40)]
        engine.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0.0))
        with pytest.raises(HicacheError, match="Found rank divergence"):
            for _ in range(20):  # the second turn hits the cache: the altered rank matches a page less
                engine.generate([prompt + [3, 4, 5]], SamplingParams(max_new_tokens=2, temperature=0.0))
        div = engine.group.monitor.divergence
        # Three ranks or more: a majority names the odd rank, even when it is the leader and
        # its entries arrive first.
        assert div.divergent_rank == altered and div.reference_rank != altered
        # The altered rank matched twice (full, then a page shorter) where its peer moved on.
        assert "tree.match_prefix" in (div.expected.function, div.got.function)
    finally:
        engine.shutdown()


def test_a_dead_rank_stops_the_engine_with_its_name() -> None:
    engine = Engine(MODEL, tp_size=2, max_total_tokens=512, **BASE)
    try:
        os.kill(engine.group.procs[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # the watchdog stops the other ranks while nobody calls
        while any(p.is_alive() for p in engine.group.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(p.is_alive() for p in engine.group.procs)
        with pytest.raises(HicacheError, match="rank PP0/TP1 .* was killed by signal 9"):
            engine.generate([[5] * 30], SamplingParams(max_new_tokens=4, temperature=0.0))
    finally:
        engine.shutdown()


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie waiting to be reaped has ended)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


def _shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hicache-tp-")} if os.path.isdir("/dev/shm") else set()


_FRONTEND_SCRIPT = """
import sys, time
from hicache import Engine
if __name__ == "__main__":
    engine = Engine("random:small", tp_size=2, dtype="float32", page_size=4, max_total_tokens=512)
    print("RANKS", *[p.pid for p in engine.group.procs], flush=True)
    time.sleep(600)
"""


def test_ranks_exit_when_the_frontend_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the user's process (OOM killer, kill -9): the ranks notice and exit; no
    shared-memory segment is left behind."""
    script = tmp_path / "frontend.py"
    script.write_text(_FRONTEND_SCRIPT)
    before = _shm_segments()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("RANKS"), line
        ranks = [int(x) for x in line.split()[1:]]
        assert len(_alive(ranks)) == 2
        assert _shm_segments() == before  # the all-reduce segment's name is dropped once mapped
    finally:
        proc.kill()
        proc.wait()
    assert _wait_gone(ranks) == []


def test_serve_stops_its_ranks_in_order_on_sigterm() -> None:
    """`docker stop` / systemd / k8s send SIGTERM: the server stops the engine (ranks exit 0)."""
    proc, url = launch_server("--model random:small --tp-size 2 --dtype float32 --page-size 4 "
                              "--max-total-tokens 512", timeout=180)
    ranks = _children(proc.pid)
    try:
        assert httpx.get(url + "/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _wait_gone(ranks, timeout=10) == []


def test_a_leader_killed_mid_message_is_an_error_not_a_hang() -> None:
    """The leader dies while the frontend lags behind its updates (a message half-written in a
    full pipe): the frontend's next read raises, naming the rank, instead of waiting forever."""
    engine = Engine(MODEL, tp_size=2, max_total_tokens=16384, max_running_requests=256, **BASE)
    group = engine.group
    try:
        sampling = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
        for i in range(256):  # queued to the leader; nobody reads its updates meanwhile
            engine.scheduler.add(engine._make_request([5 + i % 200, 7, 9, 11], sampling, None))
        deadline = time.monotonic() + 30
        while _unread_bytes(group.outbox) < 60_000 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the leader's writer is now blocked inside a message
        os.kill(group.procs[0].pid, signal.SIGKILL)
        raised: list[BaseException] = []

        def drive() -> None:
            try:
                while engine.scheduler.has_work():
                    engine.scheduler.step()
            except BaseException as e:
                raised.append(e)

        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        driver.join(timeout=30)
        assert not driver.is_alive(), "the frontend is stuck reading from a dead leader"
        assert raised and isinstance(raised[0], HicacheError)
        assert "rank PP0/TP0" in str(raised[0]) and "killed by signal 9" in str(raised[0])
    finally:
        engine.shutdown()


def _unread_bytes(q) -> int:
    """Bytes waiting in a multiprocessing queue's pipe (test instrumentation)."""
    buf = fcntl.ioctl(q._reader.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return struct.unpack("i", buf)[0]


def test_an_engine_dropped_without_shutdown_stops_its_ranks() -> None:
    def start() -> list[int]:
        engine = Engine(MODEL, tp_size=2, max_total_tokens=512, **BASE)
        engine.generate([[5] * 12], SamplingParams(max_new_tokens=2, temperature=0.0))
        return [p.pid for p in engine.group.procs]

    ranks = start()  # the engine is garbage now
    gc.collect()
    assert _wait_gone(ranks) == []
    assert multiprocessing.active_children() == []


def _listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket these processes listen on."""
    return [(pid, c.laddr.ip, c.laddr.port) for pid in pids
            for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def test_ranks_listen_on_loopback_only() -> None:
    """One machine: rank 0's rendezvous store and every rank's gloo sockets listen on
    127.0.0.1, nothing on a wildcard (torch's own tcp:// rendezvous listens on ``*:port``)."""
    engine = Engine("random:tiny", tp_size=2, max_total_tokens=512, **BASE)
    try:
        listening = _listening([p.pid for p in engine.group.procs])
        assert len(listening) >= 2 and {ip for _, ip, _ in listening} == {"127.0.0.1"}, listening
    finally:
        engine.shutdown()


def test_bad_parallel_layout_is_one_clear_error() -> None:
    with pytest.raises(HicacheError, match="exceeds the model's 4 attention heads"):
        Engine(MODEL, tp_size=5, **BASE)
    with pytest.raises(HicacheError, match="exceeds the model's 4 layers"):
        Engine(MODEL, pp_size=5, **BASE)


@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2), (2, 2)])
def test_smollm2_sharded_matches_single_rank(tp: int, pp: int) -> None:
    """SmolLM2 has 9 heads and 3 KV heads: TP3 gives each rank one KV head; TP2 splits the
    heads 5 + 4, both ranks holding KV head 1."""
    messages = [{"role": "user", "content": "Name three colors."}]
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    single = Engine("smollm2", dtype="float32", max_total_tokens=1024)
    try:
        want = single.chat(messages, sampling).output_ids
    finally:
        single.shutdown()
    engine = Engine("smollm2", dtype="float32", max_total_tokens=1024, tp_size=tp, pp_size=pp)
    try:
        assert engine.chat(messages, sampling).output_ids == want
    finally:
        engine.shutdown()


def test_server_with_ranks_serves_every_tier(tmp_path: Path, checker: None) -> None:
    """The HTTP server in front of TP2 x PP2 ranks: a multi-turn session whose turns hit the
    device tier, then (after the device pool is overrun) the host tier, then (after a flush)
    storage under the default prefetch policy, with the consensus checker watching."""
    import httpx

    from hicache.server.serve import ServerThread

    engine = Engine(
        MODEL, tp_size=2, pp_size=2, max_total_tokens=96, enable_hierarchical_cache=True, hicache_ratio=8,
        hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}),
        hicache_storage_prefetch_threshold=16, **BASE,  # the default prefetch policy (adaptive)
    )
    srv = ServerThread(engine, served_model_name="tiny")
    url = srv.start()
    try:
        def complete(prompt: list[int]) -> dict:
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                          "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        history = [(i * 11) % 240 + 5 for i in range(40)]
        other = [(i * 17) % 240 + 5 for i in range(60)]
        complete(history)
        history += [9, 9, 9, 9]  # the next turn: the same history and a new message
        details = [complete(history)["usage"]["prompt_tokens_details"]["cached_tokens_details"]]  # device hit
        complete(other)  # overruns the 96-token device pool: the session's pages go to host
        details.append(complete(history)["usage"]["prompt_tokens_details"]["cached_tokens_details"])  # host hit
        assert httpx.post(f"{url}/flush_cache?timeout=10").status_code == 200
        details.append(complete(history)["usage"]["prompt_tokens_details"]["cached_tokens_details"])  # storage
        assert details[0]["device"] > 0 and details[1]["host"] > 0 and details[2]["storage"] > 0, details
        assert engine.group.monitor.divergence is None
    finally:
        srv.stop()
        engine.shutdown()


def test_abort_and_flush_keep_the_stages_in_step() -> None:
    """An abort in the same step as its add, and a flush in a step where a batch returns, leave
    every stage with the same requests and in-flight batches (PP2)."""
    engine = Engine(MODEL, pp_size=2, max_total_tokens=512, **BASE)
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0)
    prompt = [(i * 7) % 240 + 5 for i in range(30)]
    try:
        want = engine.generate([prompt], greedy)[0].output_ids
        for round_ in range(4):
            req = engine._make_request(prompt, greedy, cache_salt=f"r{round_}")
            engine.scheduler.add(req)
            if round_ % 2:  # abort while it decodes, so its batch may be returning at the flush
                while len(req.output_ids) < 3:
                    engine.scheduler.step()
            assert engine.scheduler.abort(req.rid)
            assert engine.flush_cache()
            assert engine.generate([prompt], greedy)[0].output_ids == want
    finally:
        engine.shutdown()


def test_a_corrupt_object_on_one_rank_shortens_the_hit_on_every_rank(tmp_path: Path, checker: None) -> None:
    """Each rank stores its own shard of every page; a corrupt shard on one rank ends the hit
    there for all ranks (agreed completed length), and the rest is recomputed (DESIGN inv. 5)."""
    prompt = [(i * 29) % 240 + 5 for i in range(120)]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    plain = Engine(MODEL, max_total_tokens=1024, disable_radix_cache=True, **BASE)
    try:
        want = plain.generate([prompt], greedy)[0].output_ids
    finally:
        plain.shutdown()
    engine = Engine(
        MODEL, tp_size=2, max_total_tokens=1024, enable_hierarchical_cache=True,
        hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}),
        hicache_storage_prefetch_threshold=16, hicache_storage_prefetch_policy="wait_complete", **BASE,
    )
    try:
        engine.generate([prompt], greedy)
        assert engine.flush_cache()  # device and host emptied; storage keeps both ranks' shards
        objects = sorted(p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith("."))
        assert len(objects) == 2 * 31  # 31 pages (prompt + output with KV, page 4) x 2 ranks
        victim = objects[len(objects) // 2]  # one shard of one page, on whichever rank wrote it
        data = bytearray(victim.read_bytes())
        data[-10] ^= 0xFF
        victim.write_bytes(bytes(data))
        res = engine.generate([prompt], greedy)[0]
        assert res.output_ids == want
        assert res.cached_tokens_details["storage"] < 116  # a full hit would be 29 pages
        assert engine.stats()["storage"]["failures"]  # "checksum" on its rank, "peer_rank" on the other
        assert engine.group.monitor.divergence is None
    finally:
        engine.shutdown()


_UNGUARDED_SCRIPT = """
import json
from hicache import Engine, SamplingParams
with open({marker!r}, "a") as marker:  # one line per run of this top level
    marker.write("ran\\n")
engine = Engine("random:tiny", dtype="float32", tp_size=2, max_total_tokens=1024)
result = engine.generate([{prompt!r}], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
print("OUTPUT", json.dumps(result.output_ids), flush=True)
engine.shutdown()
"""


def test_a_script_without_main_guard_runs_once_and_gets_one_ranks_tokens(tmp_path: Path) -> None:
    """The rank processes never re-run the user's script: a plain script with no
    ``if __name__ == "__main__":`` guard starts a TP2 engine and gets one rank's greedy tokens."""
    prompt = [5, 17, 42, 99, 3, 250, 7, 61, 12, 33]
    marker = tmp_path / "ran.txt"
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT.format(marker=str(marker), prompt=prompt))
    src = Path(__file__).resolve().parents[1] / "src"
    done = subprocess.run([sys.executable, str(script)], env=dict(os.environ, PYTHONPATH=str(src)),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert marker.read_text().splitlines() == ["ran"]  # the ranks did not import it again
    outputs = [line.split(maxsplit=1)[1] for line in done.stdout.splitlines() if line.startswith("OUTPUT ")]
    plain = Engine("random:tiny", dtype="float32", max_total_tokens=1024)
    try:
        want = plain.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))[0].output_ids
    finally:
        plain.shutdown()
    assert [json.loads(o) for o in outputs] == [want]


def _two_turns(engine: Engine) -> tuple[list[list[int]], int]:
    """Two prompts, then a second turn of the first (its prompt + output + a new message):
    the greedy tokens of all three, and how many tokens the second turn found cached."""
    sampling = SamplingParams(max_new_tokens=5, temperature=0.0)
    first = engine.generate([[5, 17, 42, 99] * 5, [7, 8, 9] * 7], sampling)
    second = engine.generate([[5, 17, 42, 99] * 5 + first[0].output_ids + [11, 12, 13]], sampling)[0]
    return [r.output_ids for r in first] + [second.output_ids], second.cached_tokens


def test_ranks_on_two_nodes_match_one_rank(tmp_path: Path) -> None:
    """``--nnodes 2`` on loopback: node 1 (``hicache node``, another process tree) runs PP0/TP1,
    node 0 (this process) runs the frontend and PP0/TP0. The tokens equal one rank's, the
    second turn hits the cache, and node 0's shutdown stops node 1 in order (exit 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    flags = ["--model", MODEL, "--dtype", "float32", "--page-size", "4", "--max-total-tokens", "512",
             "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr]
    src = Path(__file__).resolve().parents[1] / "src"
    log = tmp_path / "node1.log"
    with open(log, "w") as err:
        node = subprocess.Popen([sys.executable, "-m", "hicache.cli", "node", *flags], stderr=err,
                                env=dict(os.environ, PYTHONPATH=str(src)))
    try:
        engine = Engine(MODEL, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, max_total_tokens=512, **BASE)
        try:
            assert len(engine.group.procs) == 1  # only node 0's rank runs here
            ranks = [engine.group.procs[0].pid] + [c.pid for c in psutil.Process(node.pid).children()]
            assert {ip for _, ip, _ in _listening(ranks)} == {"127.0.0.1"}  # both nodes: the route's address
            got, cached = _two_turns(engine)
        finally:
            engine.shutdown()
        assert node.wait(timeout=30) == 0, log.read_text()[-4000:]
        assert [p.exitcode for p in engine.group.procs] == [0]
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert "ranks stopped in order" in log.read_text()
    assert cached >= 24
    single = Engine(MODEL, max_total_tokens=512, **BASE)
    try:
        assert got == _two_turns(single)[0]
    finally:
        single.shutdown()
    assert multiprocessing.active_children() == []


def test_bad_node_flags_are_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"needs --dist-init-addr HOST:PORT"):
        Engine(MODEL, tp_size=2, nnodes=2, **BASE)
    with pytest.raises(ConfigError, match=r"\(3\) must be divisible by --nnodes 2"):
        Engine(MODEL, tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:29500", **BASE)
    with pytest.raises(ConfigError, match=r"--node-rank must be in \[0, 2\)"):
        Engine(MODEL, tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:29500", **BASE)
    with pytest.raises(ConfigError, match=r"node 1 of 2 serves nothing: start its ranks with `hicache node"):
        Engine(MODEL, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500", **BASE)
    # `hicache node` for node 0 (or one node): one `error:` line, status 2, nothing started.
    assert cli_main(["node", "--model", MODEL, "--tp-size", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: `hicache node` runs the ranks of a node other than 0")
    assert multiprocessing.active_children() == []
