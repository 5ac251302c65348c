"""Page keys: chained hashes over pages, headed by a namespace digest."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.storage.keys import (
    DIGEST_SIZE,
    KeyNamespace,
    continue_chain,
    namespace_digest,
    object_key,
    page_hashes,
    page_keys,
    tree_namespace,
)

pytestmark = pytest.mark.storage

NS = namespace_digest(model="smollm2", dtype="bfloat16", page_size=16, layout="layer_first")


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n, dtype=np.int32)


def test_definition_matches_spec():
    t = _tokens(40)
    hs = page_hashes(t, 16, NS)
    assert len(hs) == 2  # the trailing 8 tokens are not a whole page
    h1 = hashlib.sha256(NS + t[:16].astype("<i4").tobytes()).digest()
    h2 = hashlib.sha256(h1 + t[16:32].astype("<i4").tobytes()).digest()
    assert hs == [h1, h2]
    assert all(len(h) == DIGEST_SIZE for h in hs)
    assert object_key(h1) == h1.hex() and len(object_key(h1)) == 64
    assert page_keys(t, 16, NS) == [h1.hex(), h2.hex()]


def test_namespace_digest_is_order_independent_and_field_sensitive():
    a = namespace_digest(model="m", dtype="bf16", page_size=16, cache_salt="x")
    assert a == namespace_digest(cache_salt="x", page_size=16, dtype="bf16", model="m")
    assert len(a) == DIGEST_SIZE
    assert a != namespace_digest(model="m", dtype="bf16", page_size=16, cache_salt="y")
    assert a != namespace_digest(model="m", dtype="bf16", page_size=16)
    assert a != namespace_digest(model="m", dtype="fp32", page_size=16, cache_salt="x")
    assert a != namespace_digest(model="m2", dtype="bf16", page_size=16, cache_salt="x")


def test_different_namespace_salt_or_page_size_gives_different_keys():
    t = _tokens(64)
    base = dict(model="m", dtype="bf16", layout="layer_first")
    k16 = page_keys(t, 16, namespace_digest(page_size=16, **base))
    salted = page_keys(t, 16, namespace_digest(page_size=16, cache_salt="tenant-a", **base))
    other_model = page_keys(t, 16, namespace_digest(page_size=16, **{**base, "model": "m2"}))
    k32 = page_keys(t, 32, namespace_digest(page_size=32, **base))
    # Same page size under two namespaces that differ only by page size still differs.
    k16_ns32 = page_keys(t, 16, namespace_digest(page_size=32, **base))
    for other in (salted, other_model, k16_ns32):
        assert not set(k16) & set(other)
    assert not set(k16) & set(k32)


def test_input_types_agree():
    t = _tokens(48)
    ref = page_hashes(t, 16, NS)
    assert page_hashes(t.astype(np.int64), 16, NS) == ref
    assert page_hashes(t.tolist(), 16, NS) == ref
    assert page_hashes(t.astype(">i4"), 16, NS) == ref  # byte order is normalized
    assert page_hashes(t[::-1][::-1], 16, NS) == ref  # non-contiguous views


def test_edge_cases():
    assert page_hashes(np.zeros(0, np.int32), 16, NS) == []
    assert page_hashes(_tokens(15), 16, NS) == []
    with pytest.raises(ValueError):
        page_hashes(_tokens(16), 0, NS)
    with pytest.raises(ValueError):
        page_hashes(_tokens(16), 16, b"short")
    with pytest.raises(ValueError):
        page_hashes(np.array([2**40] * 16), 16, NS)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 300),
    page_size=st.sampled_from([1, 4, 16, 64]),
    split_pages=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
def test_chain_continuation_equals_one_shot(n, page_size, split_pages, seed):
    t = _tokens(n, seed)
    whole = page_hashes(t, page_size, NS)
    cut = min(split_pages, len(whole)) * page_size
    first = page_hashes(t[:cut], page_size, NS)
    rest = page_hashes(t[cut:], page_size, first[-1] if first else NS)
    assert first + rest == whole


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 300),
    extra=st.integers(0, 200),
    page_size=st.sampled_from([1, 8, 16]),
    seed=st.integers(0, 2**16),
)
def test_prefix_property(n, extra, page_size, seed):
    long = _tokens(n + extra, seed)
    k = n // page_size
    assert page_hashes(long, page_size, NS)[:k] == page_hashes(long[: k * page_size], page_size, NS)
    # Changing one token changes that page's key and every later one, never an earlier one.
    if n + extra >= page_size:
        pos = (n + extra) // page_size * page_size - 1  # last token of the last whole page
        changed = long.copy()
        changed[pos] += 1
        a = page_hashes(long, page_size, NS)
        b = page_hashes(changed, page_size, NS)
        p = pos // page_size
        assert a[:p] == b[:p] and a[p] != b[p]


# ---- pinned bytes: objects written by earlier versions must still be found ----------------
# Literal values computed once with the formulas before storage.keys owned the namespace
# (engine.py's sha256 of "identity|dtype|page=N", KVCacheManager.ns_digest's field list,
# h.hex() in storage.prefetch_backup). If one of these changes, every stored object is orphaned.
PIN_IDENTITY, PIN_DTYPE, PIN_PAGE = "pin-model:v1:float32", "float32", 4
PIN_TOKENS = np.arange(100, 114, dtype=np.int32)  # 3 whole pages of 4 and a partial one
PIN_NS = "90fb23443a0e1fdd"
PIN_SALTED = "90fb23443a0e1fdd|tenant-a"
PIN = {  # (shard, tree namespace) -> (digest hex, keys of the first 3 pages)
    ("", PIN_NS): ("4a130fd774331df598be345794e78f5e0f202c58d11b153197e37a2aeb93e777", [
        "44f5aeff02c090dcc038fe955424af3150200b91e4f357b86508f7b59df6554b",
        "d8f438527128ed3e7da5a42085b42c7a03f6e4dc24682dbc960f70c4738d0e2c",
        "ff35b26bb61abd4439044c16b027a2db37b57cc62df981cb9bdfd2fb11a2bc08"]),
    ("", PIN_SALTED): ("999a0d312a135f83f7f503fa7b8ee8ba3dd43b90d8c2c84e84f9943f591fe405", [
        "4802777c0315590248bbcf71f5745e8b0b042596ccb467667664b2acb76669a2",
        "c3b4ee3bd0a65eb9604da2a2c15a1c5a0bfd1208517257672b085b8e4d2a254b",
        "08a1300e9e17e511f00b6515af17ed702bd40318d091d092b450e9832e2f8ac8"]),
    ("layers0-2,kvh0-1", PIN_NS): ("fb5a2bfedfef43ff712ef0c8d1dd47b236141b38a680017089541cf031f507ce", [
        "fc7037432233fcce30fcc1c78ff6573dcaa9b60a7a73da4b8adc36f60aac4dd2",
        "0938b9c5b0f908e96650d4718f123f31e90601c1f4a152fb07427fecfe6062c9",
        "bd78a32f6ec84b07cbe7e574cb219af00e4c4f5d9045ebfb31973cb1b1da6658"]),
    ("layers0-2,kvh0-1", PIN_SALTED): ("af3fa221f7e34615ec23492c84d8b69f7c4e314888781decc509cba4c0d3f250", [
        "46c8aa7c1c5b5318190fdfc9b4d938d48f0f03a395b8994a925bd527706b0b7c",
        "916a97daee3a6a57651c1e9a15c675ebeb6574bd0f88fdfd17e3f05858a73824",
        "81a01ad8081bcaa52c85850bd322c3f8e2746d633fd129953b8e2b0a23742a62"]),
}


def _pin_pool():
    """3 layers, 2 KV heads of dim 8, float32, pages of 4: the pool the pins were taken on."""
    import torch

    from hicache.cache.pools import DeviceKVPool

    return DeviceKVPool(3, 2, 8, 16, PIN_PAGE, torch.float32, "cpu")


def test_tree_namespace_is_pinned():
    assert tree_namespace(PIN_IDENTITY, PIN_DTYPE, PIN_PAGE) == PIN_NS
    assert tree_namespace(PIN_IDENTITY, PIN_DTYPE, PIN_PAGE, None) == PIN_NS
    assert tree_namespace(PIN_IDENTITY, PIN_DTYPE, PIN_PAGE, "") == PIN_NS  # an empty salt is no salt
    assert tree_namespace(PIN_IDENTITY, PIN_DTYPE, PIN_PAGE, "tenant-a") == PIN_SALTED


@pytest.mark.parametrize("shard, ns", sorted(PIN))
def test_builder_digest_and_keys_are_pinned(shard, ns):
    digest_hex, keys = PIN[(shard, ns)]
    spec = KeyNamespace(page_size=PIN_PAGE, kv_dtype="torch.float32", kv_shape=(2, 8), layers=3, shard=shard)
    digest = spec.digest(ns)
    assert digest.hex() == digest_hex
    assert page_keys(PIN_TOKENS, PIN_PAGE, digest) == keys
    assert [object_key(h) for h in page_hashes(PIN_TOKENS, PIN_PAGE, digest)] == keys


@pytest.mark.parametrize("shard, ns", sorted(PIN))
def test_cache_manager_digest_and_chain_are_pinned(shard, ns):
    """The manager feeds the builder its pool's fields, and continues chains along tree nodes
    (a path cut into two nodes by a second insert) to the same keys."""
    from hicache.cache.manager import KVCacheManager, RankLayout
    from hicache.cache.storage_tier import node_hashes

    digest_hex, keys = PIN[(shard, ns)]
    cache = KVCacheManager(_pin_pool(), layout=RankLayout(shard=shard))
    assert cache.ns_digest(ns).hex() == digest_hex
    tree = cache.tree
    tree.insert(ns, PIN_TOKENS[:12], cache.allocator.alloc(3))
    other = np.concatenate([PIN_TOKENS[:4], [7, 7, 7, 7]]).astype(np.int32)
    tree.insert(ns, other, cache.allocator.alloc(2))  # splits the first node after page 1
    lower = tree.node_at(ns, PIN_TOKENS[:12])
    assert len(lower.key) == 8 and lower.parent.parent.is_root
    assert [object_key(h) for h in node_hashes(lower, cache.keys)] == keys[1:]
    assert [object_key(h) for h in lower.parent.hash_values] == keys[:1]  # kept on the node


def test_key_namespace_fields_all_matter():
    base = KeyNamespace(page_size=16, kv_dtype="torch.bfloat16", kv_shape=(3, 64), layers=30)
    variants = [
        KeyNamespace(32, "torch.bfloat16", (3, 64), 30),
        KeyNamespace(16, "torch.float32", (3, 64), 30),
        KeyNamespace(16, "torch.bfloat16", (1, 64), 30),
        KeyNamespace(16, "torch.bfloat16", (3, 64), 15),
        KeyNamespace(16, "torch.bfloat16", (3, 64), 30, shard="layers0-14,kvh0-2"),
        KeyNamespace(16, "torch.bfloat16", (3, 64), 30, object_layout="other/v2"),
    ]
    digests = {v.digest("ns") for v in variants} | {base.digest("ns"), base.digest("ns|salt")}
    assert len(digests) == len(variants) + 2
    assert KeyNamespace(16, "torch.bfloat16", [3, 64], 30).digest("ns") == base.digest("ns")  # a list shape too


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 5), max_size=6),
    page_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_continue_chain_equals_one_shot(cuts, page_size, seed):
    t = _tokens(sum(cuts) * page_size, seed)
    bounds = np.cumsum([0] + cuts) * page_size
    segments = [t[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    got = continue_chain(segments, page_size, NS)
    assert [len(h) for h in got] == cuts
    assert [h for seg in got for h in seg] == page_hashes(t, page_size, NS)
