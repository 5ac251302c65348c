"""Paged attention: chunked prefill over scattered slots and mixed batches give the same logits
as one cold pass (which uses the causal-SDPA fast path)."""

from __future__ import annotations

import pytest
import torch
from dense_forward import prefill_logits

from hicache.model import DenseKV, load_model, make_forward_batch

pytestmark = pytest.mark.model

ATOL = 1e-5  # fp32; the paths differ only in summation order


@pytest.fixture(scope="module")
def lm():
    return load_model("random:small", dtype=torch.float32, seed=7)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _scattered_slots(n: int, pool: int, seed: int) -> torch.Tensor:
    """n distinct, non-contiguous, unordered slots from 1..pool-1 (slot 0 is padding)."""
    return torch.randperm(pool - 1, generator=torch.Generator().manual_seed(seed))[:n] + 1


def _fill_prefix(model, kv, ids, slots, start=0):
    """Compute ids[start:] given ids[:start] already cached; returns all-row logits."""
    batch = make_forward_batch([ids[start:]], [start], [slots[: len(ids)]], logits="all")
    return model(batch, kv)


def test_single_prefill_equals_chunked_scattered(lm):
    ids = _prompt(40, seed=1)
    ref = prefill_logits(lm.model, ids)
    kv = DenseKV(lm.spec, 256, torch.float32)
    slots = _scattered_slots(len(ids), 256, seed=2)
    chunks = [0, 13, 14, 31, 40]  # includes a one-token (decode-like) chunk
    got = [_fill_prefix(lm.model, kv, ids[:end], slots, start) for start, end in zip(chunks, chunks[1:])]
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def test_cold_prefill_writes_kv_that_later_chunks_read(lm):
    """The cold-prefill fast path (no cached keys: one causal block) must still fill the buffers: a
    suffix computed against that prefix matches the one-pass result."""
    ids = _prompt(30, seed=3)
    ref = prefill_logits(lm.model, ids)
    kv = DenseKV(lm.spec, 64, torch.float32)
    slots = _scattered_slots(len(ids), 64, seed=4)
    batch = make_forward_batch([ids[:20]], [0], [slots[:20]], logits="all")
    assert batch.attn.spans[0].full_runs == () and batch.attn.spans[0].full_slots is None
    torch.testing.assert_close(lm.model(batch, kv), ref[:20], atol=ATOL, rtol=0)
    torch.testing.assert_close(_fill_prefix(lm.model, kv, ids, slots, 20), ref[20:], atol=ATOL, rtol=0)


def test_batch_of_three_with_different_cached_prefixes(lm):
    prompts = [_prompt(n, seed=10 + n) for n in (30, 17, 25)]
    prefix_lens = [10, 0, 24]
    refs = [prefill_logits(lm.model, ids) for ids in prompts]
    pool = 128
    kv = DenseKV(lm.spec, pool, torch.float32)
    perm = _scattered_slots(sum(map(len, prompts)), pool, seed=5)
    slots, offset = [], 0
    for ids in prompts:  # each sequence owns a disjoint, scattered set of slots
        slots.append(perm[offset : offset + len(ids)])
        offset += len(ids)
    for ids, p, s in zip(prompts, prefix_lens, slots):
        if p:
            _fill_prefix(lm.model, kv, ids[:p], s)
    batch = make_forward_batch(
        [ids[p:] for ids, p in zip(prompts, prefix_lens)], prefix_lens, slots, logits="all"
    )
    out = lm.model(batch, kv)
    rows = torch.split(out, [len(ids) - p for ids, p in zip(prompts, prefix_lens)])
    for ref, row, p in zip(refs, rows, prefix_lens):
        torch.testing.assert_close(row, ref[p:], atol=ATOL, rtol=0)
    # logits="last" selects each sequence's final row only.
    kv2 = DenseKV(lm.spec, pool, torch.float32)
    for ids, p, s in zip(prompts, prefix_lens, slots):
        if p:
            _fill_prefix(lm.model, kv2, ids[:p], s)
    last = lm.model(make_forward_batch([ids[p:] for ids, p in zip(prompts, prefix_lens)], prefix_lens, slots), kv2)
    torch.testing.assert_close(last, torch.stack([r[-1] for r in refs]), atol=ATOL, rtol=0)


def test_wait_layer_called_before_each_layer(lm):
    calls: list[int] = []

    class RecordingKV(DenseKV):  # a load-back in flight: every layer waits before it reads
        def wait_layer(self, layer: int) -> None:
            calls.append(layer)

        def layer_ready(self, layer: int) -> bool:
            return False

    kv = RecordingKV(lm.spec, 16, torch.float32)
    lm.model(make_forward_batch([[1, 2, 3]], [0], [torch.arange(1, 4)]), kv)
    assert calls == list(range(lm.spec.num_layers))


def test_bf16_paths_agree(lm):
    """In bf16 the fast and paged paths round differently; they must still agree closely."""
    model = load_model("random:small", dtype=torch.bfloat16, seed=7).model
    ids = _prompt(24, seed=6)
    ref32 = prefill_logits(lm.model, ids)
    ref = prefill_logits(model, ids)
    kv = DenseKV(model.spec, 64, torch.bfloat16)
    slots = _scattered_slots(len(ids), 64, seed=8)
    _fill_prefix(model, kv, ids[:10], slots)
    got = _fill_prefix(model, kv, ids, slots, 10)
    assert ref.dtype == torch.float32
    torch.testing.assert_close(got, ref[10:], atol=2e-2, rtol=0)
    torch.testing.assert_close(ref, ref32, atol=3e-2, rtol=0)
