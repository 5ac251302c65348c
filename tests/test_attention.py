"""The mask-free attention kernels equal plain masked attention: a prefix split into runs and
merged by log-sum-exp, a gathered prefix, the batched decode path, GQA and uneven head maps,
the GPU's joined path (one SDPA call over the concatenated blocks, causal to the lower right) run
here on the CPU, and the any-device math kernel against the CPU flash kernel."""

from __future__ import annotations

import pytest
import torch
from dense_forward import prefill_logits

from hicache.model import DenseKV, load_model, make_forward_batch
from hicache.model.attention import MASKED_QUERY_BLOCK, _flash_cpu, _math, decode_attention, sequence_attention
from hicache.model.paged import MAX_VIEW_RUNS, slot_runs

pytestmark = pytest.mark.model

H, KVH, D = 6, 2, 16


def _reference(q, k, v, kv_map=None):
    """q ``[n, H, D]`` are the last n positions of a context k/v ``[L, KvH, D]``."""
    n, heads, _ = q.shape
    index = kv_map if kv_map is not None else torch.arange(heads) // (heads // k.shape[1])
    kh, vh = k.index_select(1, index).transpose(0, 1), v.index_select(1, index).transpose(0, 1)
    mask = torch.ones(n, k.shape[0], dtype=torch.bool).tril(k.shape[0] - n)  # lower-right causal
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kh, vh, attn_mask=mask)
    return out.transpose(0, 1)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("cuts", [[], [40], [5, 17, 33]])
@pytest.mark.parametrize("kv_map", [None, torch.tensor([0, 0, 1, 1, 1, 0])])
def test_prefix_blocks_merge_to_masked_attention(cuts, kv_map, joined):
    n, prefix = 7, 48
    q, k, v = _rand(n, H, D, seed=1), _rand(prefix + n, KVH, D, seed=2), _rand(prefix + n, KVH, D, seed=3)
    edges = [0, *cuts, prefix]
    blocks = [(k[a:b], v[a:b]) for a, b in zip(edges, edges[1:])] if prefix else []
    got = sequence_attention(q, blocks, (k[prefix:], v[prefix:]), kv_map, joined=joined)
    torch.testing.assert_close(got, _reference(q, k, v, kv_map))


@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("cuts", [[], [9], [3, 30]])
@pytest.mark.parametrize("kv_map", [None, torch.tensor([0, 0, 1, 1, 1, 0])])
def test_decode_token_over_runs_equals_attention_to_its_context(cuts, kv_map, joined):
    """A lone decode token sees its whole context, itself included, with no causal block."""
    length = 41
    q, k, v = _rand(1, H, D, seed=11), _rand(length, KVH, D, seed=12), _rand(length, KVH, D, seed=13)
    edges = [0, *cuts, length]
    blocks = [(k[a:b], v[a:b]) for a, b in zip(edges, edges[1:])]
    torch.testing.assert_close(sequence_attention(q, blocks, None, kv_map, joined=joined),
                               _reference(q, k, v, kv_map))


def test_math_kernel_equals_cpu_flash_kernel():
    q, k, v = _rand(3, 9, D, seed=4), _rand(3, 9, D, seed=5), _rand(3, 9, D, seed=6)
    for causal in (False, True):
        out_f, lse_f = _flash_cpu(q, k, v, causal)
        out_m, lse_m = _math(q, k, v, causal)
        torch.testing.assert_close(out_m, out_f)
        torch.testing.assert_close(lse_m.to(lse_f.dtype), lse_f)


def test_decode_attention_pads_each_context_to_its_length():
    lens = [5, 12, 1]
    q = _rand(3, H, D, seed=7)
    ctx = [(_rand(n, KVH, D, seed=10 + n), _rand(n, KVH, D, seed=20 + n)) for n in lens]
    k_pad = torch.zeros(3, max(lens), KVH, D, dtype=torch.float64)
    v_pad = torch.full_like(k_pad, 1e6)  # padding must never leak into an output
    for b, (k, v) in enumerate(ctx):
        k_pad[b, : lens[b]], v_pad[b, : lens[b]] = k, v
    padding = torch.arange(max(lens))[None] >= torch.tensor(lens)[:, None]
    bias = torch.zeros(padding.shape).masked_fill(padding, float("-inf"))[:, None, None, :]
    got = decode_attention(q, k_pad, v_pad, bias, None)
    for b, (k, v) in enumerate(ctx):
        torch.testing.assert_close(got[b], _reference(q[b:b + 1], k, v)[0])


def test_slot_runs():
    assert slot_runs(torch.tensor([], dtype=torch.long)) == []
    assert slot_runs(torch.tensor([4, 5, 6, 9, 10, 3])) == [(4, 3), (9, 2), (3, 1)]


@pytest.fixture(scope="module")
def lm():
    return load_model("random:small", dtype=torch.float32, seed=7)


@pytest.mark.parametrize("layout", ["one run", "few runs", "scattered"])
def test_cached_prefix_layouts_give_cold_logits(lm, layout):
    """The model reads a cached prefix as views (few runs) or by gathering (scattered): both
    give the logits of one cold pass."""
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    ref = prefill_logits(lm.model, ids)
    if layout == "one run":
        slots = torch.arange(1, 41)
    elif layout == "few runs":
        slots = torch.cat([torch.arange(100, 116), torch.arange(10, 26), torch.arange(60, 68)])
    else:
        slots = torch.randperm(127, generator=torch.Generator().manual_seed(9))[:40] + 1
    kv = DenseKV(lm.spec, 128, torch.float32)
    lm.model(make_forward_batch([ids[:32]], [0], [slots[:32]]), kv)
    batch = make_forward_batch([ids[32:]], [32], [slots], logits="all")
    runs = len(slot_runs(slots[:32]))
    assert (batch.attn.spans[0].full_slots is None) == (runs <= MAX_VIEW_RUNS)
    torch.testing.assert_close(lm.model(batch, kv), ref[32:], atol=1e-5, rtol=0)


def test_batched_decode_gives_each_sequence_its_own_logits(lm):
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 21, 14)]
    kv = DenseKV(lm.spec, 128, torch.float32)
    slots, offset = [], 1
    for ids in prompts:
        slots.append(torch.arange(offset, offset + len(ids)))
        offset += len(ids)
        lm.model(make_forward_batch([ids[:-1]], [0], [slots[-1][:-1]]), kv)
    batch = make_forward_batch([[ids[-1]] for ids in prompts], [len(ids) - 1 for ids in prompts], slots, generated=True)
    assert batch.attn.decode is not None
    got = lm.model(batch, kv)
    for row, ids in zip(got, prompts):
        torch.testing.assert_close(row, prefill_logits(lm.model, ids)[-1], atol=1e-5, rtol=0)


# The padding that makes a split prompt's rows take the cold pass's bits (model/attention.py, projection.py)
# was measured with torch 2.13 on Intel AVX-512 CPUs and on an AMD AVX-512 CPU (Zen 4, where MKL takes other GEMM
# kernels: the padding rule grew for it): there the tests want the same bits (on that AMD CPU a last key block of
# 256 reduces unlike a full one, so cpu_key_count pads it to 512). On another ISA the CPU kernels block
# differently and the tests want rows within float32 rounding of a few sums.
MEASURED_ISA = "AVX512"


def _cpu_vendor() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "?")


def assert_cold_bits(hit: torch.Tensor, cold: torch.Tensor) -> None:
    diff = float((hit - cold).abs().max())
    if torch.backends.cpu.get_cpu_capability() == MEASURED_ISA and _cpu_vendor() in ("GenuineIntel", "AuthenticAMD"):
        assert torch.equal(hit, cold), f"max |diff| {diff:.2e}"
    else:
        assert diff <= 1e-5 * max(1.0, float(cold.abs().max())), f"max |diff| {diff:.2e}"


@pytest.mark.parametrize("cached", [1, 2, 16, 20, 33, 47, 62, 63])
def test_a_cached_prefix_gives_the_cold_prompts_last_logits_bit_for_bit(lm, cached):
    """Issue 57: a prompt computed over a cached prefix (its first ``cached`` tokens, stored in other
    slots, leaving 1 to 63 tokens) gives the cold one-pass prompt's last-row logits bit for bit in
    float32: each query row attends the one key axis the cold pass does, and a prompt pass of a
    few rows multiplies its projections as a longer one does."""
    ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(12)).tolist()
    kv = DenseKV(lm.spec, 256, torch.float32)
    cold = lm.model(make_forward_batch([ids], [0], [torch.arange(1, 65)]), kv)
    slots = torch.cat([torch.arange(100, 100 + cached), torch.arange(180, 180 + 64 - cached)])
    lm.model(make_forward_batch([ids[:cached]], [0], [slots[:cached]]), kv)
    hit = lm.model(make_forward_batch([ids[cached:]], [cached], [slots]), kv)
    assert_cold_bits(hit, cold)


@pytest.mark.parametrize("cached", [1, 5, 300, 700, 1098])
def test_a_span_over_cached_keys_gives_the_cold_rows_bit_for_bit(cached):
    """Float32 on the CPU: the rows of a span over a cached prefix (any split of an 1100-token
    prompt, spans longer than a masked block of rows included) equal the cold one-call rows."""
    length = 1100
    assert length - 1 > MASKED_QUERY_BLOCK  # the longest spans take several blocks of rows
    q = _rand(length, 9, 64, seed=31).float()
    k, v = _rand(length, 3, 64, seed=32).float(), _rand(length, 3, 64, seed=33).float()
    cold = sequence_attention(q, [], (k, v), None)
    runs = [(k[a:b], v[a:b]) for a, b in ((0, cached // 2), (cached // 2, cached))]  # the prefix in two runs
    hit = sequence_attention(q[cached:], runs, (k[cached:], v[cached:]), None)
    assert_cold_bits(hit, cold[cached:])


@pytest.mark.parametrize("first", [150, 200, 208, 256, 300])
def test_a_prompts_first_rows_alone_give_the_longer_calls_rows_bit_for_bit(first):
    """What a hit reads was computed by a shorter prompt: the first ``first`` rows of a 418-token
    prompt attended on their own (the request that cached them) equal those rows of the cold
    one-call prompt (float32, CPU). The keys' last block is padded alike (``cpu_key_count``: on an
    AMD AVX-512 CPU, Zen 4, a block of 193-256 keys rounded unlike a full one)."""
    length = 418
    q = _rand(length, 9, 64, seed=41).float()
    k, v = _rand(length, 3, 64, seed=42).float(), _rand(length, 3, 64, seed=43).float()
    cold = sequence_attention(q, [], (k, v), None)
    alone = sequence_attention(q[:first], [], (k[:first], v[:first]), None)
    assert_cold_bits(alone, cold[:first])
