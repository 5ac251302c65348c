"""Context parallelism (issue 13): CP ranks split the prefill tokens and, with
--enable-kv-cache-sharding, hold each KV page on one rank only -- and the greedy tokens stay
those of one rank, whatever the split, the eviction pressure or the attention-TP inside."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rank_workloads import BASE, MODEL, multi_turn

from hicache import Engine, SamplingParams
from hicache.config import ConfigError, EngineConfig
from hicache.errors import HicacheError
from hicache.runtime import rank_plan
from hicache.model import load_model
from hicache.model.context_parallel import split_new_tokens
from hicache.parallel.faults import ENV_VAR as FAULTS_ENV
from hicache.parallel.groups import CPGroup
from hicache.runtime.core import build_core

# The workload's single-rank cache-off reference (multi_turn_reference) and the checker switch
# (checker) are conftest.py fixtures.
pytestmark = pytest.mark.cp


# ---- token split -------------------------------------------------------------------------------
@pytest.mark.parametrize("n,first", [(1, 0), (7, 0), (37, 5), (64, 16), (3, 9)])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["zigzag", "interleave"])
def test_split_covers_every_new_token_once(n: int, first: int, size: int, strategy: str) -> None:
    pieces = split_new_tokens(first, n, size, strategy, page_size=4)
    covered = sorted(t for rank in pieces for off, length in rank for t in range(off, off + length))
    assert covered == list(range(n))
    for rank in pieces:  # ascending, non-adjacent pieces
        assert all(a[0] + a[1] < b[0] for a, b in zip(rank, rank[1:]))


def test_zigzag_pairs_an_early_piece_with_a_late_one() -> None:
    # 16 tokens over 2 ranks: 4 pieces of 4; rank 0 takes the first and last, rank 1 the middle.
    assert split_new_tokens(0, 16, 2, "zigzag", page_size=4) == [[(0, 4), (12, 4)], [(4, 8)]]


def test_interleave_deals_whole_pages_by_position() -> None:
    # New tokens from position 6 with 4-token pages: positions 6-7 are page 1 (rank 1), 8-11
    # page 2 (rank 0), 12-15 page 3 (rank 1), 16 page 4 (rank 0): the pages each rank owns.
    assert split_new_tokens(6, 11, 2, "interleave", page_size=4) == [[(2, 4), (10, 1)], [(0, 2), (6, 4)]]


# ---- engines ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [
    # attention-TP 2 inside each CP rank; tiny chunks and pool: chunked prefill, evictions
    dict(tp_size=4, attn_cp_size=2, enable_kv_cache_sharding=True, max_total_tokens=96, chunked_prefill_size=8),
    dict(tp_size=3, attn_cp_size=3, enable_kv_cache_sharding=True, cp_strategy="interleave", max_total_tokens=48),
    dict(tp_size=2, attn_cp_size=2, max_total_tokens=4096),  # replicated KV: CP splits only the compute
], ids=["cp2xtp2-sharded-evicting", "cp3-interleave-evicting", "cp2-replicated"])
@pytest.mark.multirank
def test_output_equals_single_rank(layout: dict, multi_turn_reference: list[list[int]], checker: None) -> None:
    engine = Engine(MODEL, **layout, **BASE)
    try:
        outputs = multi_turn(engine, seed=7, storage_round=False)
        assert len(outputs) == 12 and outputs == multi_turn_reference[:12]  # 3 agents x 4 turns (no storage round)
        stats = engine.stats()
        assert stats["hit_tokens"]["device"] > 0
        sharding = stats["kv_sharding"]
        cp = layout["attn_cp_size"]
        assert len(sharding["owned_pages"]) == cp and len(sharding["per_rank"]) == layout["tp_size"]
        owned = sharding["owned_pages"]
        if layout.get("enable_kv_cache_sharding"):
            assert sharding["shards"] == cp and sharding["gather_scratch_bytes"] > 0
            assert all(rank["gathers"] > 0 for rank in sharding["per_rank"])  # prefixes were gathered
            # Replicated, every rank would hold all sum(owned) pages; sharded, each holds ~1/N
            # (the rotation gives each rank every N-th page of every sequence).
            assert sum(owned) > 20 and max(owned) <= sum(owned) // cp + 3
        else:
            assert sharding["shards"] == 1 and sharding["gathers"] == 0
            assert len(set(owned)) == 1  # every page on every rank
        if layout["max_total_tokens"] < 100:
            assert stats["evicted_device_pages"] > 0
        assert engine.group.monitor.divergence is None and engine.group.monitor.compared > 50
    finally:
        engine.shutdown()
    assert [p.exitcode for p in engine.group.procs] == [0] * layout["tp_size"]


@pytest.mark.parametrize("layout", [
    dict(tp_size=2, attn_cp_size=2, enable_kv_cache_sharding=True, max_total_tokens=80),
    dict(tp_size=3, attn_cp_size=3, enable_kv_cache_sharding=True, cp_strategy="interleave", max_total_tokens=48),
], ids=["cp2-sharded", "cp3-interleave-sharded"])
@pytest.mark.multirank
@pytest.mark.storage
def test_every_tier_hits_and_output_equals_single_rank(layout: dict, tmp_path: Path,
                                                       multi_turn_reference: list[list[int]], checker: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """HiCache under CP: each rank backs up, reloads and stores the pages it owns (host pages
    follow the same rotation as device pages), copies finishing late by different amounts on
    each rank; a flushed cache is served again from storage alone."""
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"seed": layout["tp_size"], "max_delay_s": 0.01}))
    engine = Engine(MODEL, enable_hierarchical_cache=True, hicache_ratio=8, hicache_storage_backend="file",
                    hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}),
                    hicache_storage_prefetch_threshold=16, hicache_storage_prefetch_policy="wait_complete",
                    **layout, **BASE)
    try:
        assert multi_turn(engine, seed=7, storage_round=True) == multi_turn_reference
        stats = engine.stats()
        assert stats["evicted_device_pages"] > 0
        assert all(stats["hit_tokens"][tier] > 0 for tier in ("device", "host", "storage")), stats["hit_tokens"]
        assert engine.group.monitor.divergence is None and engine.group.monitor.compared > 100
    finally:
        engine.shutdown()
    assert [p.exitcode for p in engine.group.procs] == [0] * layout["tp_size"]


def test_bad_combinations_stop_at_start_up_with_one_sentence() -> None:
    with pytest.raises(ConfigError, match="--attn-cp-size 3 must .* divide --tp-size 2"):
        Engine(MODEL, tp_size=2, attn_cp_size=3, **BASE)
    with pytest.raises(ConfigError, match="needs a shard group"):
        Engine(MODEL, enable_kv_cache_sharding=True, **BASE)
    with pytest.raises(ConfigError, match="--cp-strategy must be one of zigzag, interleave"):
        Engine(MODEL, tp_size=2, attn_cp_size=2, cp_strategy="ring", **BASE)
    with pytest.raises(ConfigError, match="not supported yet"):
        Engine(MODEL, tp_size=2, attn_cp_size=2, pp_size=2, **BASE)
    with pytest.raises(HicacheError, match="--tp-size 5 exceeds the model's 4 attention heads"):
        Engine(MODEL, tp_size=10, attn_cp_size=2, **BASE)  # 5 attention-TP ranks per CP rank


@pytest.mark.multirank
def test_a_cp_rank_killed_mid_gather_stops_the_group_with_its_name() -> None:
    engine = Engine(MODEL, tp_size=2, attn_cp_size=2, enable_kv_cache_sharding=True, max_total_tokens=4096, **BASE)
    try:
        prompt = [7 + i % 200 for i in range(200)]
        engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0.0))  # cached: later turns gather
        victim = engine.group.procs[1]
        killer = threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        # Long enough to be mid-step (prefix gathers, decode merges) when the rank dies.
        with pytest.raises(HicacheError, match="rank PP0/TP1 .* was killed by signal 9"):
            engine.generate([prompt + [9] * 20] * 3,
                            SamplingParams(max_new_tokens=3000, temperature=0.0, ignore_eos=True))
        killer.join()
        assert time.monotonic() - t0 < 30  # stopped, not hung in a collective
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in engine.group.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(p.is_alive() for p in engine.group.procs)
    finally:
        engine.shutdown()


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.storage
def test_smollm2_multi_turn_cp2_sharded_equals_single_rank(tmp_path: Path, checker: None,
                                                          smollm2_reference: Engine) -> None:
    """A chat whose history is pushed out of the device pool by other traffic between turns
    (so it comes back from host memory), then asked again after a flush (from storage): every
    reply is the one-rank cache-off engine's (conftest.py's smollm2_reference, 16-token pages)."""
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    questions = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]

    def session(engine: Engine, traffic: bool) -> list[list[int]]:
        """The replies; with ``traffic``, other requests between the turns and a flush before the
        last turn is asked again (a cache-off engine computes every reply whole either way)."""
        messages = [{"role": "system", "content": "You are a concise assistant."}]
        outputs = []
        for turn, question in enumerate(questions):
            messages.append({"role": "user", "content": question})
            res = engine.chat(messages, greedy)
            outputs.append(res.output_ids)
            messages.append({"role": "assistant", "content": res.text})
            if traffic:
                # ~230 tokens: more than the device pool has left, so the chat goes to host memory
                # and the next turn's prefix comes back from there
                filler = [{"role": "user", "content": f"{turn}: " + "Describe the sea. " * 50}]
                engine.chat(filler, SamplingParams(max_new_tokens=1, temperature=0.0))
        if traffic:
            assert engine.flush_cache()
        outputs.append(engine.chat(messages[:-1], greedy).output_ids)  # the last turn again
        return outputs

    want = session(smollm2_reference, traffic=False)
    engine = Engine("smollm2", tp_size=2, attn_cp_size=2, enable_kv_cache_sharding=True, max_total_tokens=128,
                    dtype="float32", page_size=16, enable_hierarchical_cache=True, hicache_ratio=4,
                    hicache_storage_backend="file", hicache_storage_prefetch_threshold=32,
                    hicache_storage_prefetch_policy="wait_complete",
                    hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}))
    try:
        assert session(engine, traffic=True) == want
        hits = engine.stats()["hit_tokens"]
        assert all(hits[tier] > 0 for tier in ("device", "host", "storage")), hits
        assert engine.group.monitor.divergence is None
    finally:
        engine.shutdown()


def test_gather_scratch_is_taken_from_the_budget_before_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN invariant 6: with sharded KV the prefix-gather scratch comes out of the same
    memory budget as the pool (a one-rank group here: no collective runs while building)."""
    monkeypatch.setattr(rank_plan, "device_memory_budget", lambda device, fraction: 64 << 20)  # a fixed budget
    loaded = load_model(MODEL, dtype=torch.float32)
    cpu = torch.device("cpu")
    plain = build_core(EngineConfig(model=MODEL, context_length=4096, **BASE), loaded, cpu, torch.float32)
    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1)
    cfg = EngineConfig(model=MODEL, tp_size=2, attn_cp_size=2, enable_kv_cache_sharding=True, context_length=4096,
                       **BASE)
    sharded = build_core(cfg, loaded, cpu, torch.float32, rank_plan.RankContext(cp_group=CPGroup(group, group, 0, 1)))
    scratch = sharded.runner.cp.gather.nbytes
    assert scratch > 0
    page = sharded.pool.bytes_per_page
    assert sharded.pool.total_bytes + scratch <= (64 << 20) + page  # (+ the reserved padding page 0)
    assert plain.pool.total_bytes - sharded.pool.total_bytes >= scratch - plain.pool.bytes_per_page
    for built in (plain, sharded):
        built.cache.shutdown()
