"""Multi-rank runtime (TP, PP, TP x PP on gloo): the same greedy tokens as one rank without a
cache, whatever the tiers hit and however late each rank's copies finish (DESIGN inv. 1, 3).
How ranks start and stop (dead ranks, killed frontends, nodes) is in test_rank_lifecycle.py."""

from __future__ import annotations

import json
import random
import time
from collections import deque
from pathlib import Path

import pytest
from rank_workloads import BASE, MODEL, multi_turn

from hicache import Engine, SamplingParams, consensus_record
from hicache.errors import HicacheError
from hicache.parallel.faults import ENV_VAR as FAULTS_ENV
from hicache.parallel.stage_step import DISABLE_PP_SYNC_ENV
from hicache.parallel.worker import ALTER_MATCH_ENV
from hicache.runtime.events import StepEvents

pytestmark = [pytest.mark.parallel, pytest.mark.multirank]


@pytest.mark.storage
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_every_tier_hits_and_output_equals_single_rank(
    tp: int, pp: int, tmp_path: Path, multi_turn_reference: list[list[int]], checker: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"seed": tp * 10 + pp, "max_delay_s": 0.01}))
    engine = Engine(
        MODEL, tp_size=tp, pp_size=pp, max_total_tokens=160, enable_hierarchical_cache=True, hicache_ratio=8,
        hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}),
        hicache_storage_prefetch_threshold=16, hicache_storage_prefetch_policy="wait_complete", **BASE,
    )
    try:
        assert multi_turn(engine, seed=7, storage_round=True) == multi_turn_reference
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


@pytest.fixture(scope="module")
def waves_seed3() -> list[list[int]]:
    """One rank's greedy tokens for ``random_waves(seed=3)`` (both all-reduce variants compare to it)."""
    plain = Engine(MODEL, max_total_tokens=4096, disable_radix_cache=True, **BASE)
    try:
        return random_waves(plain, seed=3)
    finally:
        plain.shutdown()


@pytest.mark.parametrize("reduce,tp", [("shm", 4), ("gloo", 2)])
def test_tp_partial_sums_through_shared_memory_or_gloo(reduce: str, tp: int, waves_seed3: list[list[int]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of summing TP partial outputs (shared memory, the CPU default, over four ranks;
    gloo, the fallback, over two) give one rank's greedy tokens, prefill chunks and decode
    batches alike."""
    monkeypatch.setenv("HICACHE_TP_ALLREDUCE", reduce)
    engine = Engine(MODEL, tp_size=tp, max_total_tokens=1024, chunked_prefill_size=16, **BASE)
    try:
        assert random_waves(engine, seed=3) == waves_seed3
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


COLORS = [{"role": "user", "content": "Name three colors."}]
COLORS_SAMPLING = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def smollm2_colors(smollm2_reference: Engine) -> list[int]:
    """One SmolLM2 rank's greedy answer to COLORS (every layout below compares to it)."""
    return smollm2_reference.chat(COLORS, COLORS_SAMPLING).output_ids


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(3, 1), (2, 2)])  # (2, 2) holds PP2 alone's claim too: 15 layers a stage
def test_smollm2_sharded_matches_single_rank(tp: int, pp: int, smollm2_colors: list[int]) -> None:
    """SmolLM2 has 9 heads and 3 KV heads: TP3 gives each rank one KV head; TP2 splits the
    heads 5 + 4, both ranks holding KV head 1; PP2 splits its 30 layers 15 + 15 (the hidden
    states cross between stages)."""
    engine = Engine("smollm2", dtype="float32", max_total_tokens=1024, tp_size=tp, pp_size=pp)
    try:
        assert engine.chat(COLORS, COLORS_SAMPLING).output_ids == smollm2_colors
    finally:
        engine.shutdown()


@pytest.mark.server
@pytest.mark.storage
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
            req = engine.make_request(prompt, greedy, cache_salt=f"r{round_}")
            engine.scheduler.add(req)
            if round_ % 2:  # abort while it decodes, so its batch may be returning at the flush
                while len(req.output_ids) < 3:
                    engine.scheduler.step()
            assert engine.scheduler.abort(req.rid)
            assert engine.flush_cache()
            assert engine.generate([prompt], greedy)[0].output_ids == want
    finally:
        engine.shutdown()


@pytest.mark.storage
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
        assert len(objects) == 2 * 30  # the prompt's 30 pages (page 4; a reply's KV is not cached) x 2 ranks
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
