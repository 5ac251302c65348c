"""Tensor and pipeline parallelism over recurrent layers (issue 59, step e).

TP: LFM2's short convolutions split by channels, Qwen3.5's gated DeltaNet by key heads with the value
heads that read them, Granite's Mamba2 by heads with the groups they read, each rank's state pool
holding its shard of every state tensor at the same slot ids. At the model level, Mamba2 ranks run as
threads summing through a barrier: TP2 and TP4 logits within float32 rounding of TP1's whether the
groups are split between ranks or one group spans them (its gated norm's squares summed over the
group), and the same greedy tokens through decode steps. TP2 gives TP1's greedy tokens; a repeated
prompt hits a device snapshot at TP2 with the cold run's tokens; a TP2 writer's "-state" objects (one
per rank: the namespace names the rank's shard) serve a fresh TP2 reader's storage hit; on the
unified key scheme a TP1 and a TP2 engine continue each other's conversation from the store.

PP: each stage holds the state slots of its own recurrent layers. The tiny models' three layers split
[recurrent, recurrent] / [attention] at PP2: stage 0 holds every state and no KV, stage 1 the KV and a
state pool of no layer; both make the same slot and snapshot decisions. PP2 gives PP1's tokens, hits
its device snapshots and a fresh reader's storage snapshots with the cold run's tokens.

The rank consensus checker watches every cache decision."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from hicache import Engine
from hicache.cache.state_pool import StatePool
from hicache.config import EngineConfig
from hicache.model import DenseKV, load_model, make_forward_batch
from hicache.model.parallel import model_shard, shard_model
from hicache.runtime import rank_plan
from recurrent_runs import GREEDY, MODELS, assert_as_cold, ids

pytestmark = pytest.mark.parallel

PROMPTS = [ids(n, seed) for seed, n in enumerate((150, 70, 133, 9))]  # past the 64-token grid, and short


def make_engine(model: str, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=4, max_total_tokens=2048, chunked_prefill_size=64)
    opts.update(kw)
    return Engine(model, **opts)


def snapshot_stats(engine: Engine) -> dict:
    return engine.stats()["device_pool"]["recurrent_state"]


def one_rank(model: str) -> tuple[list[list[int]], int]:
    """PROMPTS' greedy tokens on one rank, and its state slot's bytes."""
    one = make_engine(model)
    try:
        return [o.output_ids for o in one.generate(PROMPTS, GREEDY)], snapshot_stats(one)["slot_bytes"]
    finally:
        one.shutdown()


def expect_hit(engine: Engine, prompt: list[int], out, tier: str) -> None:
    """``out``, a repeat of ``prompt``, hit ``tier`` up to the prompt's checkpoint with a cold run's tokens."""
    grid = snapshot_stats(engine)["grid_tokens"]
    assert out.cached_tokens_details[tier] == out.cached_tokens == (len(prompt) - 1) // grid * grid > 0
    assert_as_cold(engine, prompt, out)
    assert engine.group.monitor.divergence is None and engine.group.monitor.compared > 50


ONE_GROUP = 'random:{"preset": "mamba2-tiny", "mamba_groups": 1}'  # Granite 4.0-H's: B and C on every rank
# each rank's state bytes where B and C are replicated: half of the whole, plus half of their conv channels
# (2 Mamba2 layers x 2 x 1 group x 16 states x 3 taps x 4 bytes) that every rank holds whole
REPLICATED = {ONE_GROUP: 2 * 2 * 16 * 3 * 4 // 2}


@pytest.mark.parametrize("model", MODELS + [ONE_GROUP])
@pytest.mark.multirank
@pytest.mark.slow
def test_tp2_gives_tp1s_tokens_and_a_repeated_prompt_hits_its_snapshot(model: str, checker: None) -> None:
    want, whole = one_rank(model)
    engine = make_engine(model, tp_size=2)
    try:
        assert [o.output_ids for o in engine.generate(PROMPTS, GREEDY)] == want
        stats = snapshot_stats(engine)
        assert stats["slot_bytes"] == whole // 2 + REPLICATED.get(model, 0)  # each rank half of every state tensor
        again = engine.generate([PROMPTS[0]], GREEDY)[0]
        assert again.output_ids == want[0]
        expect_hit(engine, PROMPTS[0], again, "device")
    finally:
        engine.shutdown()


class ThreadGroup:
    """A TP group of threads: each rank's ``reduce(rank)`` returns the sum, in rank order, of every rank's
    tensor once all have given theirs."""

    def __init__(self, size: int) -> None:
        self.barrier, self.parts = threading.Barrier(size), [None] * size

    def reduce(self, rank: int):
        def tp_reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()  # (every rank has read the parts before any gives its next)
            return total
        return tp_reduce


def run_rank(name: str, tp: int, rank: int, reduce, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Rank ``rank`` of ``tp`` of random model ``name`` (float32): the prompt's logits in one pass, then
    ``steps`` greedy decode steps (one token a pass), on a KV view of its shard's sizes."""
    loaded = load_model(name, dtype=torch.float32)
    model, spec = loaded.model, loaded.spec
    shard = model_shard(spec, rank, tp, 0, 1)
    shard_model(model, shard, reduce)
    kv = DenseKV(spec, len(prompt) + steps + 1, torch.float32)
    shape = (len(prompt) + steps + 1, len(shard.kv_heads), spec.head_dim)
    kv.k_buffers = [torch.zeros(shape) for _ in kv.k_buffers]
    kv.v_buffers = [torch.zeros(shape) for _ in kv.v_buffers]
    kv.state_buffers = [tuple(torch.zeros(2, *one) for one in shard.state_shapes(spec, layer))
                        for layer in spec.recurrent_layers]
    slots = torch.arange(1, len(prompt) + steps + 1)
    with torch.no_grad():
        logits = model(make_forward_batch([prompt], [0], [slots[:len(prompt)]], logits="all", state_slots=[(0, 1)]), kv)
        out = [int(logits[-1].argmax())]
        while len(out) < steps:
            n = len(prompt) + len(out)
            batch = make_forward_batch([out[-1:]], [n - 1], [slots[:n]], generated=True, state_slots=[(1, 1)])
            out.append(int(model(batch, kv)[-1].argmax()))
    return logits, out


def run_tp(name: str, tp: int, prompt: list[int], steps: int) -> list[tuple[torch.Tensor, list[int]]]:
    """Every rank of ``tp`` in its own thread; each rank's result."""
    group, results = ThreadGroup(tp), [None] * tp

    def one(rank: int) -> None:
        results[rank] = run_rank(name, tp, rank, group.reduce(rank) if tp > 1 else None, prompt, steps)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)  # (a rank that raised left None)
    return results


MAMBA2_TP = [  # (model, TP): groups split between ranks, one group over every rank, two groups over two ranks each
    ("random:mamba2-tiny", 2), (ONE_GROUP, 2),
    ('random:{"preset": "mamba2-tiny", "mamba_groups": 1, "mamba_proj_bias": true}', 4),
    ("random:mamba2-tiny", 4)]


@pytest.mark.parametrize("model, tp", MAMBA2_TP)
def test_mamba2_ranks_give_one_ranks_logits_and_tokens(model: str, tp: int) -> None:
    """150 prompt tokens (past the 64-token scan grid) in one pass, then 6 decode steps: every rank's
    logits within 1e-5 of TP1's spread (the partial sums' rounding), the same greedy tokens."""
    prompt = ids(150, 3)
    (want, tokens), = run_tp(model, 1, prompt, 6)
    for logits, out in run_tp(model, tp, prompt, 6):
        assert float((logits - want).abs().max() / (want.max() - want.min())) < 1e-5
        assert out == tokens


def storage_engine(path: Path, **kw) -> Engine:
    return make_engine("random:gdn-tiny", enable_hierarchical_cache=True, hicache_ratio=4.0,
                       hicache_storage_backend="file",
                       hicache_storage_backend_extra_config=json.dumps({"path": str(path)}),
                       hicache_storage_prefetch_threshold=16, hicache_storage_prefetch_policy="wait_complete", **kw)


def stored_states(path: Path) -> list[Path]:
    return sorted(path.rglob("*-state*"))


def store_prompt(path: Path, prompt: list[int], **kw) -> list[Path]:
    """Run ``prompt`` on a storage engine over ``path`` (ranks as ``kw`` says) to its end: the state
    objects it stored."""
    engine = storage_engine(path, **kw)
    try:
        engine.generate([prompt], GREEDY)
    finally:
        engine.shutdown()  # every write reaches the store
    return stored_states(path)


@pytest.mark.storage
@pytest.mark.multirank
@pytest.mark.slow
def test_a_tp2_writers_state_objects_serve_a_fresh_tp2_reader(tmp_path: Path, checker: None) -> None:
    prompt = PROMPTS[0]
    whole = store_prompt(tmp_path / "tp1", prompt)  # what one rank stores: a -state object per stored snapshot
    shards = store_prompt(tmp_path / "tp2", prompt, tp_size=2)
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


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.multirank
@pytest.mark.slow
def test_pp2_gives_pp1s_tokens_and_a_repeated_prompt_hits_its_snapshot(model: str, checker: None) -> None:
    want, whole = one_rank(model)
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
    whole, staged = store_prompt(tmp_path / "pp1", prompt), store_prompt(tmp_path / "pp2", prompt, pp_size=2)
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
    assert asked[0][-1][0] == rank_plan.UNBOUNDED > asked[1][-1][0]  # alone, stage 0's pages are unbounded
    assert first.device_pages == last.device_pages == asked[1][-1][0]  # agreed: stage 1's
    assert (first.states.running, first.states.snapshots) == (last.states.running, last.states.snapshots) \
        == tuple(asked[0][0])  # agreed: stage 0's slots
    pool = StatePool(last.states.layers, last.states.running, last.states.snapshots, last.states.grid, cpu)
    assert pool.buffers == [] and pool.total_bytes == 0 and pool.snapshots.alloc() == 1 + last.states.running


@pytest.mark.storage
@pytest.mark.multirank
@pytest.mark.slow
def test_tp1_and_tp2_continue_each_others_conversation_on_the_unified_grid(tmp_path: Path, checker: None) -> None:
    """The unified key scheme: a TP1 engine stores a conversation's first turn (page cells and snapshot
    cells); a TP2 engine (each rank one of gdn-tiny's two key heads, one state group) continues it from the
    store and stores its longer second turn; a fresh TP1 engine hits that turn, whose cells past the first
    turn only the TP2 ranks wrote. Every hit has the cold run's tokens."""
    turn1 = ids(100, seed=11)
    turn2 = turn1 + ids(110, seed=12)
    opts = dict(hicache_storage_key_scheme="unified", hicache_storage_layer_partition=1)
    first = storage_engine(tmp_path, **opts)
    try:
        grid = snapshot_stats(first)["grid_tokens"]
        assert first.generate([turn1], GREEDY)[0].cached_tokens == 0
    finally:
        first.shutdown()
    wide = storage_engine(tmp_path, tp_size=2, **opts)
    try:
        out = wide.generate([turn2], GREEDY)[0]
        assert out.cached_tokens_details["storage"] == out.cached_tokens == (len(turn1) - 1) // grid * grid > 0
        assert_as_cold(wide, turn2, out)
        assert wide.group.monitor.divergence is None
    finally:
        wide.shutdown()
    last = storage_engine(tmp_path, **opts)
    try:
        out = last.generate([turn2], GREEDY)[0]
        assert out.cached_tokens_details["storage"] == out.cached_tokens == (len(turn2) - 1) // grid * grid
        assert_as_cold(last, turn2, out)
    finally:
        last.shutdown()
