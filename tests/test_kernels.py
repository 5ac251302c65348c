"""The native CPU kernels: exact block copies of GGUF weights, their matmuls, RMSNorm and paged
decode attention agree with torch's reference math; the model uses them only where they are exact,
and runs without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hicache import Engine, SamplingParams
from hicache.kernels import cpu_kernels, unavailable_reason
from hicache.model.attention import decode_attention
from hicache.model.block_quant import pack_exact
from quant_blocks import q4_1_matrix, q8_0_matrix

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("machine_threads"),  # their splits over threads
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"no native kernels: {unavailable_reason()}")]


@pytest.fixture(scope="module")
def ops():
    ops = cpu_kernels()
    assert ops is not None, "the CPU can run the kernels but they did not build (see the log)"
    return ops


def test_block_copies_rebuild_the_weights_bit_for_bit_or_are_refused():
    w4, w8 = q4_1_matrix(48, 96), q8_0_matrix(40, 64)
    q4, q8 = pack_exact(w4), pack_exact(w8)
    assert q4.kind == "q4" and q4.qs.shape == (48, 48) and q4.qs.dtype == torch.uint8
    assert q8.kind == "q8" and q8.qs.shape == (40, 64) and q8.qs.dtype == torch.int8
    low, high = (q4.qs & 15).float(), (q4.qs >> 4).float()
    q = torch.cat([low.view(48, 3, 16), high.view(48, 3, 16)], dim=-1)  # byte j: q[j], q[j + 16]
    assert torch.equal(q * q4.scale[..., None] + q4.minv[..., None], w4.view(48, 3, 32))
    assert q4.nbytes == w4.numel() * 0.75  # half a byte per weight plus float32 scale and minimum per 32
    # Not block-exact: real float32 values, one weight nudged, a bf16 model, a cut group.
    assert pack_exact(torch.randn(8, 64)) is None
    nudged = w4.clone()
    nudged[3, 7] = torch.nextafter(nudged[3, 7], torch.tensor(1.0))
    assert pack_exact(nudged) is None
    assert pack_exact(w4.bfloat16()) is None
    assert pack_exact(w4[:, 16:80].contiguous()) is None  # a TP shard cutting blocks in half


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
def test_block_matmuls_match_float32_linear(ops, rows):
    """Equal up to float32 rounding order: sums of 576 products may differ by a few ulps of the
    largest output, never by more."""
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    for w in (q4_1_matrix(200, 576), q8_0_matrix(130, 576)):
        want = F.linear(x, w)
        error = (pack_exact(w).linear(x, ops) - want).abs().max() / want.abs().max()
        assert error < 2e-6, f"relative error {error:.1e}"



def test_block_matmuls_give_each_row_the_bits_it_gets_alone(ops):
    """A decode step multiplies one row, a verify pass several: each row's result is the same bits
    either way (every row takes the one-row arithmetic; a pass only shares the unpacking)."""
    x = torch.randn(20, 544, generator=torch.Generator().manual_seed(3))  # 17 groups: an odd one out
    for w in (q4_1_matrix(70, 544), q8_0_matrix(40, 544)):
        packed = pack_exact(w)
        alone = torch.cat([packed.linear(x[i:i + 1], ops) for i in range(20)])
        for rows in (2, 3, 4, 5, 8, 9, 20):
            assert torch.equal(packed.linear(x[:rows].contiguous(), ops), alone[:rows]), f"{packed.kind}, {rows} rows"

def test_block_matmuls_refuse_what_they_cannot_do(ops):
    packed = pack_exact(q4_1_matrix(16, 64))
    assert packed.linear(torch.randn(0, 64), ops).shape == (0, 16)
    with pytest.raises(RuntimeError, match="float32"):
        packed.linear(torch.randn(2, 64).double(), ops)
    with pytest.raises(RuntimeError, match="qs must be"):
        packed.linear(torch.randn(2, 96), ops)


def test_rms_norm_matches_torch(ops):
    torch.manual_seed(0)
    for shape in [(1, 576), (7, 576), (3, 13)]:
        x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5))


def test_rope_and_silu_mul_match_the_torch_ops_they_replace(ops):
    from hicache.model.layers import rotate_half

    torch.manual_seed(0)
    t, heads, dim = 5, 12, 64
    qkv = torch.randn(t, heads * dim + 3 * dim)  # 12 rotated heads, then v's columns untouched
    angles = torch.randn(t, dim // 2) * 10
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotated = qkv[:, : heads * dim].view(t, heads, dim)
    want = rotated * cos[:, None] + rotate_half(rotated) * sin[:, None]
    got = qkv.clone()
    ops.rope_(got, cos, sin, heads, dim)
    torch.testing.assert_close(got[:, : heads * dim].view(t, heads, dim), want)
    assert torch.equal(got[:, heads * dim:], qkv[:, heads * dim:])
    gate_up = torch.randn(3, 2 * 1536) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (4, 1, 256)])
def test_paged_decode_attention_matches_padded_sdpa(ops, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(1)
    k_buf, v_buf = torch.randn(3000, kv_heads, dim, generator=g), torch.randn(3000, kv_heads, dim, generator=g)
    lengths = torch.tensor([1, 7, 300, 1500])  # one-token context, short, and long ones split across threads
    kv_slots = torch.zeros(4, 1500, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):  # scattered slots, never slot 0 (padding)
        kv_slots[b, :n] = torch.randperm(2999, generator=g)[:n] + 1
    q = torch.randn(4, heads, dim, generator=g)
    got = ops.paged_decode_attention(q, k_buf, v_buf, kv_slots, lengths)
    pad = torch.arange(1500)[None] >= lengths[:, None]
    bias = torch.zeros(4, 1500).masked_fill_(pad, float("-inf"))[:, None, None, :]
    gathered = [buf[kv_slots.view(-1)].view(4, 1500, kv_heads, dim) for buf in (k_buf, v_buf)]
    torch.testing.assert_close(got, decode_attention(q, *gathered, bias, None), rtol=1e-5, atol=1e-5)


def test_decode_attention_shares_prefix_chunks_and_each_sequence_gets_its_own_answer(ops):
    """Sequences that hold a prefix in the same slots (agents on one system prompt) attend its
    chunks in one task; each output is bit for bit that sequence's attention alone (chunks sit at
    fixed positions, so a sequence's output does not depend on what else is in its batch)."""
    g = torch.Generator().manual_seed(0)
    k_buf, v_buf = torch.randn(4000, 3, 64, generator=g), torch.randn(4000, 3, 64, generator=g)
    slots = torch.randperm(3999, generator=g) + 1
    prefix, rest = slots[:700], slots[700:]
    rows = [torch.cat([prefix, rest[:5]]), torch.cat([prefix, rest[10:140]]), rest[200:500],
            torch.cat([prefix[:640], rest[600:661]])]  # the last one leaves the prefix mid-chunk
    lengths = torch.tensor([len(r) for r in rows])
    kv_slots = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for b, r in enumerate(rows):
        kv_slots[b, :len(r)] = r
    q = torch.randn(len(rows), 9, 64, generator=g)
    together = ops.paged_decode_attention(q, k_buf, v_buf, kv_slots, lengths)
    for b, r in enumerate(rows):
        alone = ops.paged_decode_attention(q[b:b + 1].contiguous(), k_buf, v_buf, r[None].contiguous(), lengths[b:b + 1])
        assert torch.equal(together[b:b + 1], alone)



@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 6, 96)])
def test_decode_attention_gives_each_row_of_a_verify_pass_its_decode_step(ops, heads, kv_heads, dim):
    """A verify pass attends the last token and the drafts of one sequence as rows over their own
    causal contexts; they share every full chunk (one task scores and sums them for all rows), and
    each row's output is bit for bit the decode step's at its position."""
    g = torch.Generator().manual_seed(2)
    k_buf, v_buf = torch.randn(2000, kv_heads, dim, generator=g), torch.randn(2000, kv_heads, dim, generator=g)
    slots = torch.randperm(1999, generator=g)[:1100] + 1
    for context, n in ((1020, 8), (1024, 5), (250, 3), (3, 2)):  # rows ending mid-chunk, on a chunk's edge, short
        lengths = torch.arange(context + 1, context + n + 1)
        kv_slots = torch.zeros(n, context + n, dtype=torch.long)
        for b, length in enumerate(lengths.tolist()):
            kv_slots[b, :length] = slots[:length]
        q = torch.randn(n, heads, dim, generator=g)
        together = ops.paged_decode_attention(q, k_buf, v_buf, kv_slots, lengths)
        for b, length in enumerate(lengths.tolist()):
            alone = ops.paged_decode_attention(q[b:b + 1].contiguous(), k_buf, v_buf, slots[None, :length].contiguous(),
                                               lengths[b:b + 1])
            assert torch.equal(together[b:b + 1], alone), f"context {context}, row {b}"

@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 6, 96)])
def test_float16_kv_attends_as_its_float32_widening(ops, heads, kv_heads, dim):
    """A float16 KV cache (``--kv-cache-dtype float16``): the kernel widens each value exactly as it
    loads it, so its output is bit for bit the kernel's on the same values in float32 buffers, in a
    batch or alone, shared chunks and tails alike; mixed buffer dtypes are refused."""
    g = torch.Generator().manual_seed(3)
    k16, v16 = (torch.randn(3000, kv_heads, dim, generator=g).half() for _ in range(2))
    slots = torch.randperm(2999, generator=g) + 1
    rows = [slots[:1], torch.cat([slots[:700], slots[1000:1070]]), torch.cat([slots[:700], slots[1100:1111]]),
            slots[1500:2900]]
    lengths = torch.tensor([len(r) for r in rows])
    kv_slots = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for b, r in enumerate(rows):
        kv_slots[b, :len(r)] = r
    q = torch.randn(len(rows), heads, dim, generator=g)
    got = ops.paged_decode_attention(q, k16, v16, kv_slots, lengths)
    assert torch.equal(got, ops.paged_decode_attention(q, k16.float(), v16.float(), kv_slots, lengths))
    for b, r in enumerate(rows):
        alone = ops.paged_decode_attention(q[b:b + 1].contiguous(), k16, v16, r[None].contiguous(), lengths[b:b + 1])
        assert torch.equal(got[b:b + 1], alone)
    with pytest.raises(RuntimeError, match="both be float32 or both float16"):
        ops.paged_decode_attention(q, k16, v16.float(), kv_slots, lengths)


def test_a_corrupt_key_poisons_decode_attention_instead_of_vanishing(ops):
    """A NaN in the KV (a bad load) must show, as it does in SDPA, not get a zero weight."""
    k_buf, v_buf = torch.randn(300, 1, 32), torch.randn(300, 1, 32)
    k_buf[5] = float("nan")
    out = ops.paged_decode_attention(torch.randn(1, 2, 32), k_buf, v_buf, torch.arange(1, 257)[None],
                                     torch.tensor([256]))
    assert out.isnan().all()


def test_paged_decode_attention_rejects_slots_outside_the_buffers(ops):
    k_buf = torch.randn(10, 1, 32)
    q = torch.randn(1, 1, 32)
    with pytest.raises(RuntimeError, match="range"):
        ops.paged_decode_attention(q, k_buf, k_buf, torch.tensor([[3, 10]]), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="lengths"):
        ops.paged_decode_attention(q, k_buf, k_buf, torch.tensor([[3, 4]]), torch.tensor([3]))


FORWARD = """
import json, sys, torch
from hicache.kernels import cpu_kernels
from hicache.model import DenseKV, load_model, make_forward_batch
loaded = load_model("random:small", dtype=torch.float32)
kv = DenseKV(loaded.spec, 64, torch.float32)
ids = list(range(3, 23))
with torch.inference_mode():  # a prefill, then a decode step over its cached prefix
    first = loaded.model(make_forward_batch([ids], [0], [torch.arange(1, 21)]), kv)
    step = loaded.model(make_forward_batch([[7]], [20], [torch.arange(1, 22)], generated=True), kv)
print(json.dumps({"kernels": cpu_kernels() is not None, "logits": torch.cat([first, step]).tolist()}))
"""


@pytest.mark.slow
def test_model_without_kernels_runs_and_agrees_with_them():
    """``HICACHE_KERNELS=0`` (or a machine where they cannot build): torch's kernels throughout,
    the same logits up to rounding order."""
    runs = {}
    for flag in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", FORWARD], env={**os.environ, "HICACHE_KERNELS": flag},
                             capture_output=True, text=True, check=True).stdout
        runs[flag] = json.loads(out.splitlines()[-1])
    assert runs["0"]["kernels"] is False and runs["1"]["kernels"] is True
    torch.testing.assert_close(torch.tensor(runs["1"]["logits"]), torch.tensor(runs["0"]["logits"]),
                               rtol=1e-4, atol=1e-4)


BLOCKS = """
import json, torch
from hicache.kernels import loaded_isa, cpu_kernels
from tests.quant_blocks import q4_1_matrix, q8_0_matrix
from hicache.model.block_quant import pack_exact
x = torch.randn(8, 576, generator=torch.Generator().manual_seed(0))
out = {}
for rows in (1, 3, 8):
    for name, w in (("q4", q4_1_matrix(200, 576)), ("q8", q8_0_matrix(130, 576))):
        out[f"{name}x{rows}"] = pack_exact(w).linear(x[:rows].contiguous(), cpu_kernels()).tolist()
alone = all(torch.equal(p.linear(x, cpu_kernels()), torch.cat([p.linear(x[i:i + 1], cpu_kernels()) for i in range(8)]))
            for p in (pack_exact(q4_1_matrix(200, 576)), pack_exact(q8_0_matrix(130, 576))))
print(json.dumps({"isa": loaded_isa(), "out": out, "alone": alone}))
"""


# avx2 is slow on an AVX-512 machine: its first run builds a second library (~50 s; setup builds
# only the machine's own instruction set).
@pytest.mark.parametrize("isa", [pytest.param("avx2", marks=pytest.mark.slow), "avx512"])
def test_each_instruction_set_builds_its_own_kernels_and_they_agree(isa):
    """``HICACHE_KERNEL_ISA`` picks the build (each in its own cache folder); both give the
    float32 results up to summation order, each row the same bits alone or beside others. The
    AVX-512 build runs only where the CPU has it."""
    if isa == "avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"this CPU lacks AVX-512 F/BW/VL/DQ (torch sees {torch.backends.cpu.get_cpu_capability()})")
    from hicache.kernels import build_dir

    assert build_dir("avx2") != build_dir("avx512")
    root = os.path.dirname(os.path.dirname(__file__))
    got = subprocess.run([sys.executable, "-c", BLOCKS], env={**os.environ, "HICACHE_KERNEL_ISA": isa}, cwd=root,
                         capture_output=True, text=True, check=True).stdout
    run = json.loads(got.splitlines()[-1])
    assert run["isa"] == isa
    assert run["alone"], f"{isa}: a row's result depends on the rows beside it"
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(0))
    for rows in (1, 3, 8):
        for name, w in (("q4", q4_1_matrix(200, 576)), ("q8", q8_0_matrix(130, 576))):
            want = F.linear(x[:rows], w)
            error = (torch.tensor(run["out"][f"{name}x{rows}"]) - want).abs().max() / want.abs().max()
            assert error < 2e-6, f"{isa} {name} x{rows}: relative error {error:.1e}"


def test_an_instruction_set_the_cpu_lacks_is_refused_with_the_reason(monkeypatch):
    from hicache import kernels

    monkeypatch.setenv("HICACHE_KERNEL_ISA", "avx512")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert "lacks AVX-512" in kernels.unavailable_reason()
    monkeypatch.setenv("HICACHE_KERNEL_ISA", "neon")
    assert "not one of avx2, avx512" in kernels.unavailable_reason()


@pytest.mark.slow
def test_smollm2_decodes_from_its_own_4_bit_blocks_with_the_same_greedy_output(smollm2_reference):
    """SmolLM2's GGUF is Q4_1 with a Q8_0 embedding: every projection decodes from the file's own
    blocks, the cache namespace is unchanged (same weights), and greedy output equals torch's
    float32 path."""
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    blocks = smollm2_reference  # the session's float32 engine (decode weights "auto"; cache off)
    plain = Engine("smollm2", dtype="float32", max_total_tokens=2048, decode_weight_dtype="same")
    try:
        model = blocks.loaded.model
        assert model.decode_formats() == {"q4_1": 4 * model.spec.num_layers, "q8_0": 1}
        assert plain.loaded.model.decode_formats() == {"same": 4 * model.spec.num_layers + 1}
        assert blocks.model_namespace == plain.model_namespace
        prompts = [blocks.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
        a = blocks.generate(prompts, greedy)
        b = plain.generate(prompts, greedy)
        assert [r.output_ids for r in a] == [r.output_ids for r in b]
    finally:
        plain.shutdown()


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path):
    import time

    from hicache.kernels import STALE_LOCK_S, _clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    _clear_stale_lock(lock)
    assert lock.exists()  # a build may be running: torch's builder waits on it
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    _clear_stale_lock(lock)
    assert not lock.exists()  # nobody holds it: waiting on it would hang start-up forever


@pytest.mark.slow
def test_a_model_off_the_cpu_builds_no_native_kernels(tmp_path) -> None:
    """Every native kernel call is gated on CPU tensors; a GGUF file loaded for another device (here
    ``meta``: shapes, no memory) builds nothing, and one log line says so."""
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "import torch\n"
            "from hicache.model.loader import load_model\n"
            "loaded = load_model('smollm2', dtype=torch.float32, device='meta')\n"
            "assert next(loaded.model.parameters()).device.type == 'meta'\n")
    env = {**os.environ, "HICACHE_KERNEL_CACHE": str(tmp_path)}  # an empty cache: a build would show here
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "native CPU kernels" in line]
    assert said == ["INFO:hicache.model.loader:native CPU kernels off (the model runs on meta): nothing built"], said
    assert not any(tmp_path.iterdir())
