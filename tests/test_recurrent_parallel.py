"""Tensor and pipeline parallelism over recurrent layers (issue 59, step e).

TP: LFM2's short convolutions split by channels, Qwen3.5's gated DeltaNet by key heads with the value
heads that read them, each rank's state pool holding its shard of every state tensor at the same slot
ids. TP2 gives TP1's greedy tokens; a repeated prompt hits a device snapshot at TP2 with the cold run's
tokens; a TP2 writer's "-state" objects (one per rank: the namespace names the rank's shard) serve a
fresh TP2 reader's storage hit.

PP: each stage holds the state slots of its own recurrent layers. The tiny models' three layers split
[recurrent, recurrent] / [attention] at PP2: stage 0 holds every state and no KV, stage 1 the KV and a
state pool of no layer; both make the same slot and snapshot decisions. PP2 gives PP1's tokens, hits
its device snapshots and a fresh reader's storage snapshots with the cold run's tokens.

The rank consensus checker watches every cache decision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torch

from hicache import Engine
from hicache.cache.state_pool import StatePool
from hicache.config import EngineConfig
from hicache.model.loader import load_model
from hicache.model.parallel import model_shard
from hicache.runtime import rank_plan
from test_recurrent_cache import GREEDY, MODELS, assert_as_cold, ids

pytestmark = pytest.mark.parallel

PROMPTS = [ids(n, seed) for seed, n in enumerate((150, 70, 133, 9))]  # past the 64-token grid, and short


def make_engine(model: str, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=4, max_total_tokens=2048, chunked_prefill_size=64)
    opts.update(kw)
    return Engine(model, **opts)


def snapshot_stats(engine: Engine) -> dict:
    return engine.stats()["device_pool"]["recurrent_state"]


@pytest.mark.parametrize("model", [m for m in MODELS if "mamba2" not in m])  # (Mamba2: TP refused)
@pytest.mark.multirank
@pytest.mark.slow
def test_tp2_gives_tp1s_tokens_and_a_repeated_prompt_hits_its_snapshot(model: str, checker: None) -> None:
    one = make_engine(model)
    try:
        want = [o.output_ids for o in one.generate(PROMPTS, GREEDY)]
        whole = snapshot_stats(one)["slot_bytes"]
    finally:
        one.shutdown()
    engine = make_engine(model, tp_size=2)
    try:
        assert [o.output_ids for o in engine.generate(PROMPTS, GREEDY)] == want
        stats = snapshot_stats(engine)
        assert stats["slot_bytes"] == whole // 2  # each rank holds half of every state tensor
        again = engine.generate([PROMPTS[0]], GREEDY)[0]
        grid = stats["grid_tokens"]
        assert again.cached_tokens_details["device"] == (len(PROMPTS[0]) - 1) // grid * grid > 0
        assert again.output_ids == want[0]
        assert_as_cold(engine, PROMPTS[0], again)
        assert engine.group.monitor.divergence is None and engine.group.monitor.compared > 50
    finally:
        engine.shutdown()


def storage_engine(path: Path, **kw) -> Engine:
    return make_engine("random:gdn-tiny", enable_hierarchical_cache=True, hicache_ratio=4.0,
                       hicache_storage_backend="file",
                       hicache_storage_backend_extra_config=json.dumps({"path": str(path)}),
                       hicache_storage_prefetch_threshold=16, hicache_storage_prefetch_policy="wait_complete", **kw)


def stored_states(path: Path) -> list[Path]:
    return sorted(path.rglob("*-state*"))


@pytest.mark.storage
@pytest.mark.multirank
@pytest.mark.slow
def test_a_tp2_writers_state_objects_serve_a_fresh_tp2_reader(tmp_path: Path, checker: None) -> None:
    prompt = PROMPTS[0]
    one = storage_engine(tmp_path / "tp1")  # what one rank stores: a -state object per stored snapshot
    try:
        one.generate([prompt], GREEDY)
    finally:
        one.shutdown()
    writer = storage_engine(tmp_path / "tp2", tp_size=2)
    try:
        writer.generate([prompt], GREEDY)
    finally:
        writer.shutdown()  # every write reaches the store
    whole, shards = stored_states(tmp_path / "tp1"), stored_states(tmp_path / "tp2")
    assert whole and len(shards) == 2 * len(whole)  # each rank its own object of each snapshot
    assert max(p.stat().st_size for p in shards) < min(p.stat().st_size for p in whole)  # of its half
    reader = storage_engine(tmp_path / "tp2", tp_size=2)
    try:
        out = reader.generate([prompt], GREEDY)[0]
        grid = snapshot_stats(reader)["grid_tokens"]
        assert out.cached_tokens_details["storage"] > 0
        assert out.cached_tokens == (len(prompt) - 1) // grid * grid
        assert_as_cold(reader, prompt, out)
        assert reader.group.monitor.divergence is None and reader.group.monitor.compared > 50
    finally:
        reader.shutdown()


def expect_hit(engine: Engine, prompt: list[int], out, tier: str) -> None:
    """``out``, a repeat of ``prompt``, hit ``tier`` up to the prompt's checkpoint with a cold run's tokens."""
    grid = snapshot_stats(engine)["grid_tokens"]
    assert out.cached_tokens_details[tier] == out.cached_tokens == (len(prompt) - 1) // grid * grid > 0
    assert_as_cold(engine, prompt, out)
    assert engine.group.monitor.divergence is None and engine.group.monitor.compared > 50


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.multirank
@pytest.mark.slow
def test_pp2_gives_pp1s_tokens_and_a_repeated_prompt_hits_its_snapshot(model: str, checker: None) -> None:
    one = make_engine(model)
    try:
        want = [o.output_ids for o in one.generate(PROMPTS, GREEDY)]
        whole = snapshot_stats(one)["slot_bytes"]
    finally:
        one.shutdown()
    engine = make_engine(model, pp_size=2)
    try:
        assert [o.output_ids for o in engine.generate(PROMPTS, GREEDY)] == want
        stats = engine.stats()  # the leader's: stage 0, the two recurrent layers and no attention layer
        assert [c["name"] for c in stats["components"]] == ["recurrent_state"]
        assert stats["device_pool"]["recurrent_state"]["slot_bytes"] == whole
        again = engine.generate([PROMPTS[0]], GREEDY)[0]
        assert again.output_ids == want[0]
        expect_hit(engine, PROMPTS[0], again, "device")
    finally:
        engine.shutdown()


@pytest.mark.storage
@pytest.mark.multirank
@pytest.mark.slow
def test_a_pp2_writers_state_objects_serve_a_fresh_pp2_reader(tmp_path: Path, checker: None) -> None:
    """Only the stage with the recurrent layers stores a snapshot (the other holds none of it); a fresh
    PP2 engine prefetches pages (stage 1's) and states (stage 0's) to a storage hit."""
    prompt = PROMPTS[0]
    one = storage_engine(tmp_path / "pp1")
    try:
        one.generate([prompt], GREEDY)
    finally:
        one.shutdown()
    writer = storage_engine(tmp_path / "pp2", pp_size=2)
    try:
        writer.generate([prompt], GREEDY)
    finally:
        writer.shutdown()  # every write reaches the store
    whole, staged = stored_states(tmp_path / "pp1"), stored_states(tmp_path / "pp2")
    assert whole and len(staged) == len(whole)
    assert sorted(p.stat().st_size for p in staged) == sorted(p.stat().st_size for p in whole)
    reader = storage_engine(tmp_path / "pp2", pp_size=2)
    try:
        expect_hit(reader, prompt, reader.generate([prompt], GREEDY)[0], "storage")
    finally:
        reader.shutdown()


def test_a_stage_without_attention_or_recurrent_layers_plans_a_pool_of_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """lfm2-tiny at PP2, sized from a budget: stage 0 (conv, conv) plans no KV, stage 1 (attention) no
    state; each counts what it lacks as unbounded, so the MIN-agreed counts are the other stage's, and
    both stages run the same page and slot counts (their trees decide alike)."""
    cfg, cpu = EngineConfig(model="random:lfm2-tiny", pp_size=2), torch.device("cpu")
    spec = load_model("random:lfm2-tiny", torch.float32, weights=False).spec
    monkeypatch.setattr(rank_plan, "device_memory_budget", lambda device, fraction: 2**24)
    asked: dict[int, list[list[int]]] = {0: [], 1: []}

    def plan(stage: int, agree) -> rank_plan.RankPlan:
        place = rank_plan.RankContext(model_shard(spec, 0, 1, stage, 2), agree=agree)
        return rank_plan.plan_rank(cfg, spec, place, None, cpu, torch.float32, True)

    for stage in (0, 1):  # what each stage would run alone: its own counts
        plan(stage, lambda counts, stage=stage: asked[stage].append(counts) or counts)

    def world():  # the ranks' agree: each call's counts, the least either stage asked
        calls = zip(asked[0], asked[1])
        return lambda counts: [min(a, b) for a, b in zip(*next(calls))]

    first, last = plan(0, world()), plan(1, world())
    assert first.layers == 0 and [c.name for c in first.components] == ["recurrent_state"]
    assert len(first.states.layers) == 2 and last.states.layers == () and last.states.total_bytes == 0
    assert [c.name for c in last.components] == ["full", "recurrent_state"]
    assert asked[0][-1][0] == rank_plan.UNBOUNDED_PAGES > asked[1][-1][0]  # alone, stage 0's pages are unbounded
    assert first.device_pages == last.device_pages == asked[1][-1][0]  # agreed: stage 1's
    assert (first.states.running, first.states.snapshots) == (last.states.running, last.states.snapshots) \
        == tuple(asked[0][0])  # agreed: stage 0's slots
    pool = StatePool(last.states.layers, last.states.running, last.states.snapshots, last.states.grid, cpu)
    assert pool.buffers == [] and pool.total_bytes == 0 and pool.snapshots.alloc() == 1 + last.states.running
