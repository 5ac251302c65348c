"""Recurrent-state snapshots in the host tier (issue 59, step d): a prompt whose pages and snapshot
were evicted from the device comes back from the host tier with its snapshot -- a host hit (the
shape SGLang's host tier gets wrong for gated DeltaNet, #39830, and never hits for Mamba, #33713),
whose tokens and log-probabilities are a cold run's."""

from __future__ import annotations

import pytest

from hicache import Engine
from test_recurrent_cache import GREEDY, MODELS, assert_as_cold, ids

pytestmark = pytest.mark.cache


@pytest.fixture(params=MODELS)
def model(request) -> str:
    return request.param


def make_engine(model: str, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=4, max_total_tokens=320, chunked_prefill_size=64,
                enable_hierarchical_cache=True, hicache_ratio=4.0)
    opts.update(kw)
    return Engine(model, **opts)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_prompt_evicted_from_the_device_hits_its_host_snapshot(model: str, policy: str) -> None:
    engine = make_engine(model, hicache_write_policy=policy)
    grid = engine.stats()["device_pool"]["recurrent_state"]["grid_tokens"]
    first = ids(150, seed=1)
    engine.generate([first], GREEDY)
    for seed in (2, 3, 4):  # other prompts push the first one's pages and snapshot off the device
        engine.generate([ids(150, seed=seed)], GREEDY)
    again = engine.generate([first], GREEDY)[0]
    assert again.cached_tokens_details["host"] > 0
    assert again.cached_tokens == (len(first) - 1) // grid * grid  # its checkpoint, from the host copy
    assert_as_cold(engine, first, again)
    engine.cache.tree.check_invariants()
    host = engine.stats()["host_pool"]["recurrent_state"]
    assert host["snapshots_cached"] > 0 and host["snapshots_cached"] + host["snapshots_free"] == host["snapshot_slots"]


def test_a_device_hit_whose_snapshot_was_dropped_loads_the_host_copy(model: str) -> None:
    """The pages stay on the device, the device snapshot goes (its slots were needed): the host copy
    serves the hit, read into the request's running slot."""
    engine = make_engine(model)
    prompt = ids(150, seed=9)
    engine.generate([prompt], GREEDY)
    engine.cache.drain()  # the backup's ack: its node unlocked
    states = engine.cache.device.states.snapshots
    assert states.evict(states.held) > 0  # every device snapshot goes, the pages stay
    again = engine.generate([prompt], GREEDY)[0]
    assert again.cached_tokens_details["device"] > 0 and again.cached_tokens_details["host"] == 0
    assert_as_cold(engine, prompt, again)
