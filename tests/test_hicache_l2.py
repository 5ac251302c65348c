"""L2 host tier: host hits keep greedy output (every write policy, both layouts), randomized
transfer delays keep the tree invariants, layer-wise load-back overlaps compute, a split
during a pending backup keeps both fragments' data, and impossible setups fail clearly."""

from __future__ import annotations

import random
import threading
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from hicache import Engine, SamplingParams
from hicache.cache.acks import AckCounts
from hicache.cache.host_pool import HostKVPool
from hicache.cache.host_transfer import BACKUP, LOAD
from hicache.cache.manager import CachePolicy, KVCacheManager
from hicache.cache.pools import DeviceKVPool
from hicache.config import ConfigError

pytestmark = pytest.mark.cache

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def plain() -> Engine:
    return Engine("random:tiny", dtype="float32", page_size=4, max_total_tokens=4096, disable_radix_cache=True)


def small_device_engine(**kw) -> Engine:
    opts = dict(dtype="float32", page_size=4, max_total_tokens=320, enable_hierarchical_cache=True, hicache_ratio=4.0)
    opts.update(kw)
    return Engine(opts.pop("model", "random:tiny"), **opts)


def assert_balanced(engine: Engine) -> None:
    u, h = engine.cache.usage(), engine.cache.host_usage()
    assert u["free_pages"] + u["cached_pages"] + u["request_pages"] == u["capacity_pages"]
    assert h["free_pages"] + h["cached_pages"] == h["capacity_pages"]
    engine.cache.tree.check_invariants()


def conversations(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 250) for _ in range(8)]
    return [shared + [rng.randrange(5, 250) for _ in range(32)] for _ in range(n)]


def three_turns_equal_to_plain(engine: Engine, plain: Engine, convs: list[list[int]],
                               after_each: Optional[Callable[[Engine], None]] = None) -> int:
    """Three greedy turns over ``convs`` (each extended in place with its reply and a new user
    turn), every reply equal to ``plain``'s; ``after_each(engine)`` after each request. Returns
    the host-tier hit tokens."""
    host_hits = 0
    for turn in range(3):
        for i, conv in enumerate(convs):
            res = engine.generate([conv], GREEDY)[0]
            assert res.output_ids == plain.generate([conv], GREEDY)[0].output_ids, (turn, i)
            host_hits += res.cached_tokens_details["host"]
            convs[i] = conv + res.output_ids + [20 + turn, 21, 22]
            if after_each is not None:
                after_each(engine)
    return host_hits


def test_host_hits_of_a_float16_kv_cache_keep_greedy_output() -> None:
    """``--kv-cache-dtype float16``: the host tier holds the same float16 rows, and a page loaded
    back from it gives the output of a run without any cache (invariant 1)."""
    plain = Engine("random:tiny", dtype="float32", kv_cache_dtype="float16", page_size=4, max_total_tokens=4096,
                   disable_radix_cache=True)
    engine = small_device_engine(kv_cache_dtype="float16")
    assert engine.host_pool.dtype == torch.float16
    convs = conversations(6, seed=5)
    host_hits = three_turns_equal_to_plain(engine, plain, convs)
    assert host_hits > 0
    assert_balanced(engine)
    for e in (engine, plain):
        e.shutdown()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_host_hits_keep_greedy_output(plain: Engine, policy: str, layout: str) -> None:
    engine = small_device_engine(hicache_write_policy=policy, hicache_mem_layout=layout)
    convs = conversations(6, seed=5)
    host_hits = three_turns_equal_to_plain(engine, plain, convs, after_each=assert_balanced)
    stats = engine.stats()
    assert host_hits > 0 and stats["hit_tokens"]["host"] == host_hits
    # A host hit skips compute: re-asking the last conversation computes only its uncached tail.
    engine.cache.drain()
    engine.cache.tree.evict(10**6)
    counts: list[int] = []
    forward = engine.scheduler.driver.forward
    engine.scheduler.driver.forward = lambda ids, *rest, **kw: (counts.append(sum(map(len, ids))), forward(ids, *rest, **kw))[1]
    res = engine.generate([convs[-1]], GREEDY)[0]
    assert res.cached_tokens_details["host"] > 0 and counts[0] == len(convs[-1]) - res.cached_tokens
    assert stats["transfers"]["load_tokens"] == host_hits and stats["transfers"]["backup_tokens"] > 0
    assert stats["evicted_device_pages"] > 0
    assert engine.flush_cache()
    assert engine.cache.host_usage()["free_pages"] == engine.cache.host_usage()["capacity_pages"]
    assert engine.cache.usage()["free_pages"] == engine.cache.capacity_pages
    engine.shutdown()


def test_random_interleavings_with_transfer_delays_keep_invariants(plain: Engine) -> None:
    """Many short requests sharing prefixes, batched together, with every layer of every
    transfer delayed by a random amount; invariants are checked after every scheduler step."""
    engine = small_device_engine(max_total_tokens=128, hicache_ratio=2.0, max_running_requests=3,
                                 chunked_prefill_size=16)
    rng, delays = random.Random(42), random.Random(7)  # delays are drawn on the worker threads
    engine.cache.controller.delay_fn = lambda op, layer: delays.random() * 0.003
    heads = [[rng.randrange(5, 250) for _ in range(12)] for _ in range(8)]
    checked = 0
    for round_ in range(4):
        prompts = [rng.choice(heads) + [rng.randrange(5, 250) for _ in range(rng.randrange(1, 14))] for _ in range(6)]
        reqs = [engine.make_request(p, GREEDY, None) for p in prompts]
        for r in reqs:
            engine.scheduler.add(r)
        while engine.scheduler.has_work():
            engine.scheduler.step()
            assert_balanced(engine)
            checked += 1
        for p, r in zip(prompts, reqs):
            assert r.output_ids == plain.generate([p], GREEDY)[0].output_ids
    assert checked > 20 and engine.stats()["hit_tokens"]["host"] > 0
    assert engine.flush_cache()
    assert engine.cache.host_usage()["cached_pages"] == 0 and engine.cache.tree.num_nodes() == 0
    engine.shutdown()


def test_layerwise_load_back_overlaps_compute() -> None:
    """The forward reads layer i as soon as layer i is loaded: its wait for layer i ends
    while layer i+1 is still copying. The copy of layer i+1 is held until the forward has
    finished waiting for layer i, so a load-back that made the forward wait for the whole
    copy (no overlap) would stall here and show layer i+1 complete."""
    engine = small_device_engine(model="random:small", max_total_tokens=256)
    prompt = list(range(5, 69))
    engine.generate([prompt], GREEDY)
    engine.cache.drain()
    engine.cache.tree.evict(10**6)  # everything now lives on the host only
    assert engine.cache.usage()["cached_pages"] == 0

    num_layers = engine.loaded.spec.num_layers
    controller = engine.cache.controller
    waited = [threading.Event() for _ in range(num_layers)]
    next_layer_done_at_wait: dict[int, bool] = {}
    loads = []

    def hold_until_previous_layer_read(op, layer: int) -> float:
        if op.kind == LOAD and layer > 0:
            waited[layer - 1].wait(5)  # (5 s: without overlap this never comes; then fail, not hang)
        return 0.0

    submit, wait_layer = controller.submit, engine.cache.kv_view.wait_layer

    def spy_submit(kind, *a):
        op = submit(kind, *a)
        if kind == LOAD:
            loads.append(op)
        return op

    def spy_wait(layer: int) -> None:
        wait_layer(layer)
        if loads and layer not in next_layer_done_at_wait:
            nxt = loads[0].layer_done[layer + 1] if layer + 1 < num_layers else None
            next_layer_done_at_wait[layer] = nxt is not None and nxt.is_set()
        waited[layer].set()

    controller.delay_fn = hold_until_previous_layer_read
    controller.submit, engine.cache.kv_view.wait_layer = spy_submit, spy_wait
    res = engine.generate([prompt], GREEDY)[0]
    assert res.cached_tokens_details["host"] == 60 and len(loads) == 1
    assert sorted(next_layer_done_at_wait) == list(range(num_layers))
    assert not any(next_layer_done_at_wait.values()), next_layer_done_at_wait
    engine.shutdown()


def _manager(page_size: int = 2, layers: int = 2) -> KVCacheManager:
    pool = DeviceKVPool(layers, 1, 4, num_pages=16, page_size=page_size, dtype=torch.float32, device="cpu")
    return KVCacheManager(pool, HostKVPool(pool, num_pages=32), policy=CachePolicy(write_policy="write_through"))


def _fill(mgr: KVCacheManager, pages: np.ndarray, tokens: np.ndarray) -> None:
    """Write a recognisable KV for each token (value = token id) into ``pages``."""
    ps = mgr.page_size
    for layer, (k, v) in enumerate(zip(mgr.pool.k_buffers, mgr.pool.v_buffers)):
        for i, tok in enumerate(tokens.tolist()):
            slot = int(pages[i // ps]) * ps + i % ps
            k[slot] = tok + 1000 * layer
            v[slot] = -tok - 1000 * layer


def _read(mgr: KVCacheManager, pages: np.ndarray, n: int) -> list[float]:
    ps = mgr.page_size
    slots = [int(pages[i // ps]) * ps + i % ps for i in range(n)]
    return [float(mgr.pool.k_buffers[layer][s, 0, 0]) for layer in range(len(mgr.pool.k_buffers)) for s in slots]


def test_split_during_pending_backup_keeps_both_fragments() -> None:
    mgr = _manager()
    release_backup = threading.Event()

    def hold_backups(op, layer) -> float:
        if op.kind == BACKUP:
            release_backup.wait(5)
        return 0.0

    mgr.controller.delay_fn = hold_backups
    tokens = np.arange(10, 22, dtype=np.int32)  # 6 pages of 2
    state = mgr.admit("ns", tokens, len(tokens))
    _fill(mgr, state.pages, tokens)
    mgr.release("ns", tokens, state)
    mgr.submit_transfers()  # the backup now blocks in the worker
    assert mgr.ack_counts().backup == 0
    # A request sharing the first 3 pages splits the node while its backup is pending.
    other = np.concatenate([tokens[:6], np.array([90, 91, 92, 93], dtype=np.int32)])
    st2 = mgr.admit("ns", other, len(other))
    assert st2.device_hit_tokens == 6
    mgr.tree.check_invariants()
    release_backup.set()
    mgr.consume_acks(AckCounts(backup=mgr.controller.pending(BACKUP)))
    mgr.release("ns", other[:6], st2)
    mgr.drain()
    mgr.tree.check_invariants()
    assert mgr.tree.protected_pages == 0
    # Drop every device copy; both fragments come back from host with the right data.
    mgr.tree.evict(10**6)
    st3 = mgr.admit("ns", np.concatenate([tokens, [1]]).astype(np.int32), 14)
    assert st3.host_hit_tokens == 12 and st3.device_hit_tokens == 0
    mgr.submit_transfers()
    mgr.drain()
    assert _read(mgr, st3.pages, 12) == [float(t + 1000 * layer) for layer in range(2) for t in tokens.tolist()]
    mgr.shutdown()


def test_bad_setups_fail_clearly() -> None:
    with pytest.raises(ConfigError, match="needs the radix cache"):
        Engine("random:tiny", enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ConfigError, match="host memory"):
        Engine("random:tiny", max_total_tokens=256, enable_hierarchical_cache=True, hicache_size=100000.0)
    with pytest.raises(ConfigError, match="hicache-write-policy"):
        Engine("random:tiny", enable_hierarchical_cache=True, hicache_write_policy="sometimes")
