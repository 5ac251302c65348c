"""Recurrent-state snapshots in the host tier (issue 59, step d): a prompt whose pages and snapshot
were evicted from the device comes back from the host tier with its snapshot -- a host hit (the
shape SGLang's host tier gets wrong for gated DeltaNet, #39830, and never hits for Mamba, #33713),
whose tokens and log-probabilities are a cold run's. In storage (L3), on both key schemes: a fresh
engine hits the stored snapshot; a corrupt one cuts the hit back."""

from __future__ import annotations

import json

import pytest

from hicache import Engine
from recurrent_runs import GREEDY, MODELS, assert_as_cold, ids

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


def storage_engine(model: str, path, **kw) -> Engine:
    return make_engine(model, hicache_storage_backend="file",
                       hicache_storage_backend_extra_config=json.dumps({"path": str(path)}),
                       hicache_storage_prefetch_threshold=16, hicache_storage_prefetch_policy="wait_complete", **kw)


# The unified grid at one layer per range: the attention layer's page cells, each recurrent layer's state cells.
SCHEMES = {"rank-suffix": {}, "unified": dict(hicache_storage_key_scheme="unified", hicache_storage_layer_partition=1)}
STATE_OBJECTS = {"rank-suffix": "*-state", "unified": "*_state"}  # a snapshot's objects: one, or its cells


@pytest.mark.storage
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_fresh_engine_over_a_file_store_hits_the_stored_snapshot(model: str, scheme: str, tmp_path) -> None:
    """A writer stores a prompt's pages and its snapshot (a "-state" object, or on the unified grid its
    cells); a new engine over the same store prefetches them: a storage hit up to the snapshot's boundary,
    the cold run's tokens."""
    prompt = ids(150, seed=5)
    writer = storage_engine(model, tmp_path, **SCHEMES[scheme])
    grid = writer.stats()["device_pool"]["recurrent_state"]["grid_tokens"]
    writer.generate([prompt], GREEDY)
    writer.shutdown()  # every write reaches the store
    states = list(tmp_path.rglob(STATE_OBJECTS[scheme]))
    assert states, "no state object was written"
    if scheme == "unified":  # cells of the recurrent layers 0 and 1; the pages' of the attention layer 2 only
        cells = {p.name.split("_", 2)[2] for p in tmp_path.rglob("*_*")}
        assert {c for c in cells if c.endswith("_state")} >= {"L0-1_G0_state", "L1-2_G0_state"}
        assert {c for c in cells if not c.endswith("_state")} == {"L2-3_H0", "L2-3_H1"}
    reader = storage_engine(model, tmp_path, **SCHEMES[scheme])
    out = reader.generate([prompt], GREEDY)[0]
    assert out.cached_tokens_details["storage"] > 0
    assert out.cached_tokens == (len(prompt) - 1) // grid * grid
    assert_as_cold(reader, prompt, out)
    reader.cache.tree.check_invariants()
    reader.shutdown()


@pytest.mark.storage
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_corrupt_state_object_cuts_the_hit_back_never_a_wrong_token(model: str, scheme: str, tmp_path) -> None:
    prompt = ids(150, seed=6)
    writer = storage_engine(model, tmp_path, **SCHEMES[scheme])
    writer.generate([prompt], GREEDY)
    writer.shutdown()
    # flip a byte of every stored snapshot's payload (on the unified grid: of one cell of each)
    for path in tmp_path.rglob("*-state" if scheme == "rank-suffix" else "*_L1-2_G0_state"):
        blob = bytearray(path.read_bytes())
        blob[-1] ^= 0xFF
        path.write_bytes(bytes(blob))
    reader = storage_engine(model, tmp_path, **SCHEMES[scheme])
    out = reader.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 0  # pages arrived, but no snapshot: nothing to resume from
    assert_as_cold(reader, prompt, out)
    assert reader.stats()["storage"]["failures"].get("state_checksum", 0) > 0
    reader.shutdown()
