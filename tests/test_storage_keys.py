"""Page keys: chained hashes over pages, headed by a namespace digest."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.storage.keys import (
    DIGEST_SIZE,
    key_of,
    namespace_digest,
    page_hashes,
    page_keys,
)

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
    assert key_of(h1) == h1.hex() and len(key_of(h1)) == 64
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
