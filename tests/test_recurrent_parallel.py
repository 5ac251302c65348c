"""Tensor parallelism over recurrent layers (issue 59, step e): LFM2's short convolutions split by
channels, Qwen3.5's gated DeltaNet by key heads with the value heads that read them, each rank's
state pool holding its shard of every state tensor at the same slot ids. TP2 gives TP1's greedy
tokens; a repeated prompt hits a device snapshot at TP2 with the cold run's tokens; a TP2 writer's
"-state" objects (one per rank: the namespace names the rank's shard) serve a fresh TP2 reader's
storage hit; on the unified key scheme a TP1 and a TP2 engine continue each other's conversation from
the store. The rank consensus checker watches every cache decision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache import Engine
from test_recurrent_cache import GREEDY, MODELS, assert_as_cold, ids

pytestmark = [pytest.mark.parallel, pytest.mark.multirank, pytest.mark.slow]

PROMPTS = [ids(n, seed) for seed, n in enumerate((150, 70, 133, 9))]  # past the 64-token grid, and short


def make_engine(model: str, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=4, max_total_tokens=2048, chunked_prefill_size=64)
    opts.update(kw)
    return Engine(model, **opts)


def snapshot_stats(engine: Engine) -> dict:
    return engine.stats()["device_pool"]["recurrent_state"]


@pytest.mark.parametrize("model", [m for m in MODELS if "mamba2" not in m])  # (Mamba2: TP refused)
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


@pytest.mark.storage
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
