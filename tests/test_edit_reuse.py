"""Reuse after an edit on the engine (issue 61): the KV past an edit is reused, re-rotated, with the
first tokens of each span computed; the gate falls back to exact prefix reuse; approximate KV is never
cached for anyone else; opt-in per engine and per request; what cannot run it is refused in one sentence."""

from __future__ import annotations

import numpy as np
import pytest

from hicache import Engine, SamplingParams
from hicache.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_new_tokens=8, temperature=0)
BODY = np.random.default_rng(0).integers(0, 256, 600).tolist()
SYSTEM = [1, 2, 3, 4] * 8  # two pages of 16
ORIGINAL = SYSTEM + BODY
EDITED = SYSTEM + [9, 9, 9, 7, 7] + BODY  # five tokens inserted after the system block


def engine(**kw) -> Engine:
    return Engine("random:small", dtype="float32", max_total_tokens=4096, **kw)


@pytest.fixture(scope="module")
def prefix_only():
    """The same engine without edit reuse: what exact prefix reuse computes."""
    e = engine()
    e.generate(ORIGINAL, SamplingParams(max_new_tokens=1))
    yield e
    e.shutdown()


def warmed(**kw) -> Engine:
    e = engine(enable_edit_reuse=True, **kw)
    e.generate(ORIGINAL, SamplingParams(max_new_tokens=1))
    return e


def test_the_tokens_after_an_insertion_are_reused_not_computed(prefix_only) -> None:
    e = warmed()
    try:
        res = e.generate(EDITED, GREEDY)[0]
        assert res.cached_tokens == len(SYSTEM)  # the exact prefix, as before
        head = e.stats()["edit_reuse"]["recompute_tokens"]
        # the body's whole pages (37 of its 600 tokens' 37.5), less the span's first tokens
        assert res.reused_tokens == 37 * 16 - head and res.edit_reuse.recomputed_tokens == head
        assert res.reused_tokens >= 0.85 * len(EDITED) and not res.edit_reuse.gated
        assert 0 < res.edit_reuse.deviation <= e.stats()["edit_reuse"]["max_deviation"]
        assert e.stats()["edit_reuse"]["reused_tokens"] == res.reused_tokens
        assert len(res.output_ids) == 8
    finally:
        e.shutdown()


def test_a_gate_that_refuses_gives_exactly_the_prefix_only_reply(prefix_only) -> None:
    e = warmed(edit_reuse_max_deviation=1e-9)
    try:
        res = e.generate(EDITED, GREEDY)[0]
        assert res.edit_reuse.gated and res.reused_tokens == 0 and res.edit_reuse.deviation > 1e-9
        assert res.output_ids == prefix_only.generate(EDITED, GREEDY)[0].output_ids
        assert e.stats()["edit_reuse"]["gated_off"] == 1
    finally:
        e.shutdown()


def test_approximate_kv_is_never_served_to_a_request_without_edit_reuse(prefix_only) -> None:
    e = warmed()
    try:
        assert e.generate(EDITED, GREEDY)[0].reused_tokens > 0
        plain = e.generate(EDITED, SamplingParams(max_new_tokens=8, temperature=0, edit_reuse=False))[0]
        assert plain.edit_reuse is None and plain.cached_tokens == len(SYSTEM)  # the reused KV was not cached
        assert plain.output_ids == prefix_only.generate(EDITED, GREEDY)[0].output_ids
    finally:
        e.shutdown()


def test_the_next_turn_hits_what_the_edited_turn_left_in_its_own_namespace(prefix_only) -> None:
    e = warmed()
    try:
        first = e.generate(EDITED, GREEDY)[0]
        turn = EDITED + first.output_ids + [11, 12, 13, 14, 15]
        nxt = e.generate(turn, GREEDY)[0]
        hit = (len(EDITED) + len(first.output_ids) - 1) // 16 * 16  # (the reply's last token has no KV)
        assert nxt.cached_tokens == hit and nxt.edit_reuse.approximate_hit_tokens == hit
        plain = e.generate(turn, SamplingParams(max_new_tokens=8, temperature=0, edit_reuse=False))[0]
        assert plain.cached_tokens == len(SYSTEM)  # the approximate namespace is not its to read
        assert plain.output_ids == prefix_only.generate(turn, GREEDY)[0].output_ids
    finally:
        e.shutdown()


def test_an_exact_prefix_hit_is_unchanged_with_the_feature_on(prefix_only) -> None:
    e = warmed()
    try:
        longer = ORIGINAL + [5, 6, 7]
        res = e.generate(longer, GREEDY)[0]
        assert res.reused_tokens == 0 and res.cached_tokens == len(ORIGINAL) // 16 * 16
        assert res.output_ids == prefix_only.generate(longer, GREEDY)[0].output_ids
    finally:
        e.shutdown()


def test_the_decision_is_deterministic_and_a_salt_never_reads_another() -> None:
    runs = []
    for _ in range(2):
        e = warmed()
        try:
            res = e.generate(EDITED, GREEDY)[0]
            other = e.generate(EDITED, GREEDY, cache_salt="tenant-b")[0]
            runs.append((res.output_ids, res.edit_reuse.to_json(), other.reused_tokens))
        finally:
            e.shutdown()
    assert runs[0] == runs[1] and runs[0][2] == 0


def test_opt_in_and_refusals() -> None:
    with pytest.raises(InvalidRequestError, match="--enable-edit-reuse"):
        e = engine()
        try:
            e.generate(EDITED, SamplingParams(max_new_tokens=1, edit_reuse=True))
        finally:
            e.shutdown()
    for kw, says in ((dict(enable_deterministic_inference=True), "deterministic inference"),
                     (dict(tp_size=2), "--tp-size 1"), (dict(disable_radix_cache=True), "radix cache")):
        with pytest.raises(ConfigError, match=f"--enable-edit-reuse: .*{says}"):
            engine(enable_edit_reuse=True, **kw)
    # (models whose KV cannot move: tests/test_engine.py, one case per refused component)


def test_edits_under_eviction_with_a_host_tier_keep_every_page_accounted() -> None:
    """A pool of ~3 prompts and a host tier: edited turns of several conversations evict each other's
    exact and approximate pages, spans come from whatever is on the device (a turn-2 edit finds the body
    in turn 1's approximate pages when turn 0's exact ones went to the host); no page is lost or shared."""
    rng = np.random.default_rng(1)
    e = Engine("random:small", dtype="float32", max_total_tokens=3072, enable_hierarchical_cache=True,
               hicache_ratio=4.0, enable_edit_reuse=True)
    try:
        bodies = [rng.integers(0, 256, 500).tolist() for _ in range(4)]
        reused = [0, 0, 0]
        for turn in range(3):
            for i, body in enumerate(bodies):
                prompt = SYSTEM + [200 + turn, 100 + i] * (turn + 1) + body  # the edit grows every turn
                res = e.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0))[0]
                assert len(res.output_ids) == 4
                reused[turn] += res.reused_tokens
                u, h = e.cache.usage(), e.cache.host_usage()
                assert u["free_pages"] + u["cached_pages"] + u["request_pages"] == u["capacity_pages"]
                assert h["free_pages"] + h["cached_pages"] == h["capacity_pages"]
                e.cache.tree.check_invariants()
        assert reused[0] == 0 and reused[1] > 0 and reused[2] > 0
    finally:
        e.shutdown()


def test_spans_whose_pages_went_to_the_host_are_read_from_there_bit_for_bit() -> None:
    """A device pool too small to keep the original: its body is found in host pages (L2), copied
    into the request's slots and re-rotated like device pages, so the reply is the one an engine
    that kept it on the device gives."""
    filler = np.random.default_rng(2).integers(0, 256, 700).tolist()
    replies = []
    for tokens in (8192, 1024):
        e = Engine("random:small", dtype="float32", max_total_tokens=tokens, enable_edit_reuse=True,
                   enable_hierarchical_cache=True, hicache_ratio=8.0)
        try:
            e.generate(ORIGINAL, SamplingParams(max_new_tokens=1))
            e.generate(filler, SamplingParams(max_new_tokens=1))  # (in the small pool: the original's pages go)
            res = e.generate(EDITED, GREEDY)[0]
            replies.append((res.output_ids, res.reused_tokens, e.stats()["edit_reuse"]["reused_host_tokens"]))
        finally:
            e.shutdown()
    (device_reply, device_reused, from_host_big), (host_reply, host_reused, from_host_small) = replies
    assert from_host_big == 0 and from_host_small > 0 and host_reused == device_reused > 0
    assert host_reply == device_reply
