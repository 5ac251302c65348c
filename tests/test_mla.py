"""MLA (DeepSeek-V2/V3 multi-head latent attention, issue 13): logits parity with transformers'
own DeepseekV3 on the same random weights, one latent per token in the pools, and the engine's
cache, decode and tensor-parallel paths giving the tokens of a plain run."""

from __future__ import annotations

import json

import pytest
import torch
from dense_forward import greedy_paged, prefill_logits

from hicache import Engine, SamplingParams, consensus_record
from hicache.errors import HicacheError
from hicache.model import load_model
from hicache.model.tokenizer import byte_tokenizer

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # float32 on both sides; a wrong rope layout or scale shows up as ~1e-3
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4,  # transformers' default (128) would not follow the head count
            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20,
            first_k_dense_replace=2,  # every layer dense: no mixture-of-experts weights
            max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257)
CASES = {"q_lora": dict(q_lora_rank=24), "plain_q": dict(q_lora_rank=None),
         "rotate_half_rope": dict(q_lora_rank=24, rope_interleave=False)}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    config = transformers.DeepseekV3Config(**TINY, **CASES[request.param])
    hf = transformers.DeepseekV3ForCausalLM(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # randomize norms too, so a dropped or misplaced tensor shows
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    folder = tmp_path_factory.mktemp(request.param)
    hf.eval().save_pretrained(folder)
    tok = byte_tokenizer()
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": tok.chat_template}))
    return hf, load_model(str(folder), dtype=torch.float32), folder


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_match_transformers(pair) -> None:
    hf, ours, _ = pair
    ids = ours.tokenizer.encode("Latent attention keeps one vector per token; 42 times!")
    expected = _hf_logits(hf, ids)
    torch.testing.assert_close(prefill_logits(ours.model, ids), expected, atol=ATOL, rtol=0)
    assert expected.std() > 1e-2


def test_paged_greedy_continuation_matches_transformers(pair) -> None:
    hf, ours, _ = pair
    ids = ours.tokenizer.encode("Hi there, latent cache")
    seq = list(ids)
    for _ in range(8):
        seq.append(int(_hf_logits(hf, seq)[-1].argmax()))
    assert greedy_paged(ours.model, ids, steps=8) == seq[len(ids):]


def test_pool_holds_one_latent_per_token_and_layer(pair) -> None:
    _, ours, folder = pair
    engine = Engine(str(folder), dtype="float32", max_total_tokens=256, page_size=4)
    try:
        spec = ours.spec
        per_token = spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) * 4  # float32
        assert engine.pool.bytes_per_page == per_token * 4
    finally:
        engine.shutdown()


def test_moe_checkpoints_are_refused_with_one_sentence(tmp_path) -> None:
    config = dict(TINY, architectures=["DeepseekV3ForCausalLM"], first_k_dense_replace=1, n_routed_experts=8)
    from hicache.model.hf_loader import spec_from_hf_config
    from hicache.model.errors import ModelFormatError
    with pytest.raises(ModelFormatError, match="mixture-of-experts layers is not supported"):
        spec_from_hf_config(config)


@pytest.mark.parametrize("key, value", [("kv_lora_rank", "32"), ("v_head_dim", -1), ("qk_rope_head_dim", 1e30),
                                        ("first_k_dense_replace", [2])])
def test_latent_sizes_that_are_not_integers_are_refused_with_one_sentence(key, value) -> None:
    from hicache.model.hf_loader import spec_from_hf_config
    from hicache.model.errors import ModelFormatError
    config = dict(TINY, architectures=["DeepseekV3ForCausalLM"], n_routed_experts=8, **{key: value})
    with pytest.raises(ModelFormatError, match=f"config.json {key} = .* is not an integer from"):
        spec_from_hf_config(config)


def _turns(engine: Engine) -> list[list[int]]:
    """A growing conversation (each prompt extends the last one and its reply), two at a time."""
    history = [[5 + (7 * i) % 250 for i in range(30)], [9 + (11 * i) % 240 for i in range(23)]]
    out = []
    for turn in range(3):
        prompts = [h + [40 + turn, 41, 42 + turn] for h in history]
        results = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
        out += [r.output_ids for r in results]
        history = [p + r.output_ids for p, r in zip(prompts, results)]
    return out


@pytest.mark.multirank
@pytest.mark.parallel
def test_engine_cache_decode_and_tp2_equal_a_plain_run(plain_turns: list[list[int]]) -> None:
    base = dict(dtype="float32", page_size=4)
    want = plain_turns  # the cache-off engine's (fixture below)
    for layout in (dict(max_total_tokens=1024), dict(max_total_tokens=1024, tp_size=2)):
        engine = Engine("random:mla-tiny", **layout, **base)
        try:
            assert _turns(engine) == want, layout
            assert engine.stats()["hit_tokens"]["device"] > 0
        finally:
            engine.shutdown()


@pytest.fixture(scope="module")
def plain_turns() -> list[list[int]]:
    engine = Engine("random:mla-tiny", dtype="float32", page_size=4, max_total_tokens=1024, disable_radix_cache=True)
    try:
        return _turns(engine)
    finally:
        engine.shutdown()


@pytest.mark.multirank
@pytest.mark.parallel
@pytest.mark.cp
@pytest.mark.parametrize("layout", [
    dict(tp_size=2, max_total_tokens=48),  # the latent sharded over the attention-TP ranks, evicting
    dict(tp_size=2, attn_cp_size=2, max_total_tokens=48),  # ... over context-parallel ranks
    dict(tp_size=2, max_total_tokens=32, enable_hierarchical_cache=True, hicache_ratio=8, hicache_storage_backend="file",
         hicache_storage_prefetch_threshold=8),  # every history comes back from host memory
], ids=["tp2-sharded-latent", "cp2-sharded-latent", "tp2-sharded-latent-hicache"])
def test_sharded_latent_equals_one_rank(layout: dict, plain_turns: list[list[int]], tmp_path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(consensus_record.ENV_VAR, "1")
    if "hicache_storage_backend" in layout:
        layout = dict(layout, hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}))
    engine = Engine("random:mla-tiny", dtype="float32", page_size=4, enable_kv_cache_sharding=True, **layout)
    try:
        assert _turns(engine) == plain_turns
        stats = engine.stats()
        assert stats["evicted_device_pages"] > 0 and sum(stats["hit_tokens"].values()) > 0
        owned = stats["kv_sharding"]["owned_pages"]
        assert stats["kv_sharding"]["shards"] == 2 and min(owned) > 0 and abs(owned[0] - owned[1]) <= 2
        assert engine.group.monitor.divergence is None
    finally:
        engine.shutdown()


def test_latent_sharding_needs_an_mla_model() -> None:
    with pytest.raises(HicacheError, match="is not an MLA model"):
        Engine("random:tiny", tp_size=2, enable_kv_cache_sharding=True, dtype="float32")
