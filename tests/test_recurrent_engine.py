"""The engine serving a hybrid recurrent model (issue 59, steps b and f): LFM2's short-convolution
layers, Qwen3.5's gated DeltaNet layers or Granite 4.0-H's Mamba2 layers (a conv state and a float32
recurrent matrix) keep a state slot per running request beside the attention layers' KV pages. Greedy tokens equal the
dense reference's whatever the batch and the prefill chunks; slots come back when requests end;
what is not built yet is refused in one sentence. Each test runs for every model."""

from __future__ import annotations

import random

import pytest
import torch

from dense_forward import greedy_paged
from hicache import Engine, SamplingParams
from hicache.config import ConfigError
from hicache.model.loader import load_model

pytestmark = pytest.mark.engine

MODELS = ["random:lfm2-tiny", "random:gdn-tiny", "random:mamba2-tiny"]
STEPS = 10
# One slot's bytes (float32): lfm2-tiny, two conv layers of [hidden 64, 3 taps - 1]; gdn-tiny, two DeltaNet
# layers of a conv state [conv_dim = 2 * 2 key heads * 16 + 4 value heads * 16, 4 taps - 1] and a recurrent
# matrix [4 value heads, 16, 16]; mamba2-tiny, two Mamba2 layers of a conv state [conv_dim = 4 heads * 32 +
# 2 * 2 groups * 16, 4 taps - 1] and an SSM state [4 heads, 32, 16]
SLOT_BYTES = {"random:lfm2-tiny": 2 * 64 * 2 * 4, "random:gdn-tiny": 2 * (128 * 3 * 4 + 4 * 16 * 16 * 4),
              "random:mamba2-tiny": 2 * (192 * 3 * 4 + 4 * 32 * 16 * 4)}


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    return request.param


def make_engine(model: str, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=4, max_total_tokens=2048, chunked_prefill_size=64)
    opts.update(kw)
    return Engine(model, **opts)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(rng.randrange(3, 150))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(model: str) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens from one dense forward per step, no engine (tests/dense_forward.py)."""
    dense = load_model(model, dtype=torch.float32).model
    return {tuple(p): greedy_paged(dense, p, STEPS) for p in prompts(6, seed=3)}


@pytest.mark.parametrize("chunk", [7, 64])
def test_concurrent_requests_give_the_dense_references_tokens(model: str, reference, chunk: int) -> None:
    engine = make_engine(model, chunked_prefill_size=chunk)
    outs = engine.generate([list(p) for p in reference], SamplingParams(max_new_tokens=STEPS, temperature=0.0))
    assert [o.output_ids for o in outs] == list(reference.values())
    states = engine.stats()["device_pool"]["recurrent_state"]
    assert states["running_slots_held"] == 0  # every running slot came back
    assert states["snapshots_free"] + states["snapshots_cached"] == states["snapshot_slots"]  # and every snapshot


def test_more_requests_than_state_slots_all_finish(model: str, reference) -> None:
    engine = make_engine(model, max_running_requests=2)
    assert engine.stats()["device_pool"]["recurrent_state"]["running_slots"] == 2
    outs = engine.generate([list(p) for p in reference], SamplingParams(max_new_tokens=STEPS, temperature=0.0))
    assert [o.output_ids for o in outs] == list(reference.values())


def test_stats_name_the_recurrent_state_component(model: str) -> None:
    stats = make_engine(model).stats()
    components = {c["name"]: c for c in stats["components"]}
    assert set(components) == {"full", "recurrent_state"}
    assert components["full"]["layers"] == 1 and components["recurrent_state"]["layers"] == 2
    assert components["recurrent_state"]["slot_bytes"] == SLOT_BYTES[model]
    assert stats["device_pool"]["recurrent_state"]["slot_bytes"] == SLOT_BYTES[model]


def test_context_parallelism_is_refused_in_one_sentence(model: str) -> None:
    """A scan is sequential over a prompt's tokens: CP ranks would wait for each other's states."""
    with pytest.raises(ConfigError, match="without --attn-cp-size") as e:
        make_engine(model, tp_size=2, attn_cp_size=2)
    assert str(e.value).count(". ") == 0 and model in str(e.value)


def test_tp_beyond_the_gated_deltanet_key_heads_is_refused_in_one_sentence() -> None:
    """Each rank holds whole key heads (gdn-tiny has 2): TP3 is refused before any rank starts."""
    with pytest.raises(ConfigError, match="--tp-size 3 exceeds the model's 2 gated DeltaNet key heads") as e:
        make_engine("random:gdn-tiny", tp_size=3)
    assert str(e.value).count(". ") == 0


def test_tp_that_does_not_split_the_mamba2_heads_is_refused_in_one_sentence() -> None:
    """mamba2-tiny's 4 Mamba2 heads do not split in 3 equal shares: refused before any rank starts."""
    with pytest.raises(ConfigError, match="--tp-size 3 does not split the model's 4 Mamba2 heads in 2 groups") as e:
        make_engine("random:mamba2-tiny", tp_size=3)
    assert str(e.value).count(". ") == 0


def test_state_slots_come_out_of_the_device_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN invariant 6: sized from a budget, the KV pages get what the state slots leave."""
    from hicache.config import EngineConfig
    from hicache.runtime import rank_plan

    cfg, cpu = EngineConfig(model="random:lfm2-tiny"), torch.device("cpu")
    spec = load_model("random:lfm2-tiny", torch.float32, weights=False).spec
    page = 2 * len(spec.attention_layers) * spec.num_kv_heads * spec.head_dim * 4 * cfg.page_size  # float32 K and V
    monkeypatch.setattr(rank_plan, "device_memory_budget", lambda device, fraction: 4096 * page)
    plan = rank_plan.plan_rank(cfg, spec, rank_plan.RankContext(), None, cpu, torch.float32, True)
    assert plan.states is not None and plan.states.total_bytes > page
    assert plan.device_pages - 1 == (4096 * page - plan.states.total_bytes) // page


def test_host_snapshots_that_do_not_fit_in_host_memory_are_refused_in_one_sentence(model: str,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.runtime import core

    opts = dict(enable_hierarchical_cache=True, hicache_ratio=2.0)
    host = make_engine(model, **opts).stats()["host_pool"]
    kv, states = host["host_pool_bytes"], host["recurrent_state"]["pool_bytes"]
    monkeypatch.setattr(core, "available_host_memory", lambda: int((kv + states / 2) / 0.9))  # the KV fits, not both
    with pytest.raises(ConfigError, match="recurrent-state snapshots need") as e:
        make_engine(model, **opts)
    assert str(e.value).count(". ") == 0


def test_ngrams_verify_scratch_comes_out_of_the_device_budget_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN invariant 6 with NGRAM: the scratch slots a verify pass writes its rows' states to are
    planned beside the running and snapshot slots, and the KV pages get what all of them leave."""
    from hicache.config import EngineConfig
    from hicache.runtime import rank_plan

    cpu = torch.device("cpu")
    spec = load_model("random:lfm2-tiny", torch.float32, weights=False).spec
    monkeypatch.setattr(rank_plan, "device_memory_budget", lambda device, fraction: 2**24)
    plain, ngram = (rank_plan.plan_rank(EngineConfig(model="random:lfm2-tiny", **kw), spec, rank_plan.RankContext(),
                                        None, cpu, torch.float32, True).states
                    for kw in ({}, {"speculative_algorithm": "NGRAM"}))
    assert plain.scratch == 0 and ngram.scratch > 0
    assert ngram.total_bytes == plain.total_bytes + ngram.scratch * ngram.slot_bytes
