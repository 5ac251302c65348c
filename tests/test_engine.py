"""Engine behaviour on tiny random models (float32): DESIGN invariant 1 (a cache hit never
changes greedy output), batching, chunked prefill, stop conditions, bad input, accounting."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from hicache import Engine, InvalidRequestError, SamplingParams
from hicache import device as device_mod
from hicache.combinations import REFUSED
from hicache.config import ConfigError
from hicache.kernels import unavailable_reason

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
LOGIT_ATOL = 1e-4  # fp32 logits of a cached vs. recomputed prefix


def make_engine(**kw) -> Engine:
    opts = dict(dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=64)
    opts.update(kw)
    return Engine(opts.pop("model", "random:tiny"), **opts)


@pytest.fixture(scope="module")
def plain() -> Engine:
    """The reference: no prefix reuse."""
    return make_engine(disable_radix_cache=True)


def prompts(n: int, length: int, shared: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(5, 250) for _ in range(shared)]
    return [head + [rng.randrange(5, 250) for _ in range(length - shared)] for _ in range(n)]


def record_logits(engine: Engine) -> list[torch.Tensor]:
    """Capture the logits of every forward pass (rows = sequences of that step)."""
    seen: list[torch.Tensor] = []
    forward = engine.scheduler.driver.forward

    def spy(*args, **kw):
        out = forward(*args, **kw)
        seen.append(out.clone())
        return out

    engine.scheduler.driver.forward = spy
    return seen


def assert_balanced(engine: Engine) -> None:
    u = engine.cache.usage()
    assert u["free_pages"] + u["cached_pages"] + u["request_pages"] == u["capacity_pages"]
    if engine.cache.tree is not None:
        engine.cache.tree.check_invariants()


def test_full_and_partial_hits_keep_greedy_output_and_logits(plain: Engine) -> None:
    engine = make_engine()
    p = prompts(1, 50, 50)[0]
    ref = plain.generate([p], GREEDY)[0]
    logits = record_logits(engine)
    cold = engine.generate([p], GREEDY)[0]
    first_cold = logits[0][0]
    full = engine.generate([p], GREEDY)[0]
    first_full = logits[len(logits) - len(full.output_ids)][0]
    partial = engine.generate([p[:30] + [7, 8, 9]], GREEDY)[0]
    assert cold.output_ids == full.output_ids == ref.output_ids
    assert cold.cached_tokens == 0
    assert full.cached_tokens == 48  # whole pages, one token left to compute
    assert full.cached_tokens_details == {"device": 48, "host": 0, "storage": 0}
    assert partial.cached_tokens == 28
    assert partial.output_ids == plain.generate([p[:30] + [7, 8, 9]], GREEDY)[0].output_ids
    torch.testing.assert_close(first_full, first_cold, atol=LOGIT_ATOL, rtol=0)
    assert_balanced(engine)


@pytest.mark.parametrize("generated", ["auto", "on"])
def test_multi_turn_reuses_previous_turn(plain: Engine, generated: str) -> None:
    """By default (``--cache-generated-kv auto``) a finished turn caches its prompt's KV: the next turn hits
    the previous prompt's whole pages and computes the reply again as prompt; with ``on`` it hits the reply's
    KV too (all but the last sampled token, which has none)."""
    engine = make_engine(cache_generated_kv=generated)
    ps = engine.config.page_size
    history = prompts(1, 40, 40, seed=3)[0]
    for turn in range(4):
        res = engine.generate([history], GREEDY)[0]
        assert res.output_ids == plain.generate([history], GREEDY)[0].output_ids
        if turn:
            # Everything but the partial last page of the previous turn's cached KV is a hit.
            assert res.cached_tokens == prev_kv_tokens // ps * ps
        prev_kv_tokens = len(history) + (len(res.output_ids) - 1 if generated == "on" else 0)
        history = history + res.output_ids + [11 + turn, 12, 13, 14, 15]
    assert_balanced(engine)


def test_eviction_pressure_keeps_output(plain: Engine) -> None:
    # Room for about three conversations: later turns evict earlier ones.
    engine = make_engine(max_total_tokens=320)
    convs = prompts(6, 40, 12, seed=5)
    for turn in range(3):
        for i, conv in enumerate(convs):
            res = engine.generate([conv], GREEDY)[0]
            assert res.output_ids == plain.generate([conv], GREEDY)[0].output_ids
            convs[i] = conv + res.output_ids + [20 + turn, 21, 22]
            assert_balanced(engine)
    assert engine.stats()["evicted_device_pages"] > 0
    assert engine.stats()["hit_tokens"]["device"] > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_batched_requests_match_one_by_one(plain: Engine, policy: str) -> None:
    engine = make_engine(radix_eviction_policy=policy, max_running_requests=3, chunked_prefill_size=16)
    batch = prompts(7, 30, 10, seed=7)
    batch = [p[: 9 + 4 * i] for i, p in enumerate(batch)]  # different lengths, some sharing a prefix
    together = engine.generate(batch, GREEDY)
    alone = [plain.generate([p], GREEDY)[0] for p in batch]
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert_balanced(engine)


def test_chunked_prefill_equals_one_pass(plain: Engine) -> None:
    p = prompts(1, 150, 150, seed=9)[0]
    ref = plain.generate([p], GREEDY)[0]
    for chunk in (4, 24, 1024):
        engine = make_engine(chunked_prefill_size=chunk)
        assert engine.generate([p], GREEDY)[0].output_ids == ref.output_ids
        # Chunk-boundary inserts make the computed prefix visible before the request finishes.
        assert engine.generate([p], GREEDY)[0].cached_tokens == 148
        assert_balanced(engine)


def test_cache_salt_isolates_namespaces() -> None:
    engine = make_engine()
    p = prompts(1, 40, 40, seed=11)[0]
    engine.generate([p], GREEDY, cache_salt="alice")
    assert engine.generate([p], GREEDY, cache_salt="bob")[0].cached_tokens == 0
    assert engine.generate([p], GREEDY)[0].cached_tokens == 0
    assert engine.generate([p], GREEDY, cache_salt="alice")[0].cached_tokens > 0


def test_stop_conditions() -> None:
    engine = make_engine()
    p = prompts(1, 20, 20, seed=13)[0]
    free = engine.generate([p], SamplingParams(max_new_tokens=10, temperature=0.0))[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 10
    stop_tok = free.output_ids[4]
    first = free.output_ids.index(stop_tok)
    res = engine.generate([p], SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    assert res.finish_reason == "stop" and res.output_ids == free.output_ids[: first + 1]
    # EOS stops unless ignore_eos.
    engine.scheduler.runtime.eos_token_ids = {stop_tok}
    assert engine.generate([p], SamplingParams(max_new_tokens=10, temperature=0.0))[0].output_ids == res.output_ids
    ignored = engine.generate([p], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert ignored.output_ids == free.output_ids
    # Stop strings cut the text before the stop string (a letter the byte tokenizer emits as one token).
    letters = [(q, t) for q in prompts(30, 20, 0, seed=14) for t in engine.generate([q], GREEDY)[0].output_ids[2:]
               if chr(t).isalpha() and t < 128]
    q, letter_tok = letters[0]
    out = engine.generate([q], GREEDY)[0]
    res = engine.generate([q], SamplingParams(max_new_tokens=12, temperature=0.0, stop=["zz", chr(letter_tok)]))[0]
    cut = out.output_ids.index(letter_tok)
    assert res.finish_reason == "stop" and res.output_ids == out.output_ids[: cut + 1]
    assert res.text == engine.tokenizer.decode(out.output_ids[:cut])
    assert_balanced(engine)


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    engine = make_engine()
    p1, p2 = prompts(2, 20, 0, seed=17)
    sp = SamplingParams(max_new_tokens=15, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate([p1], sp)[0].output_ids
    together = engine.generate([p1, p2], [sp, SamplingParams(max_new_tokens=15, temperature=1.0, seed=1)])
    assert together[0].output_ids == alone
    other_seed = engine.generate([p1], SamplingParams(max_new_tokens=15, temperature=0.9, seed=99))[0]
    assert other_seed.output_ids != alone


def test_text_prompt_and_chat() -> None:
    engine = make_engine()
    res = engine.generate("hello world", GREEDY)[0]
    assert res.prompt_tokens == len(engine.tokenizer.encode("hello world"))
    chat = engine.chat([{"role": "user", "content": "hi"}], GREEDY)
    again = engine.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert chat.output_ids == again.output_ids and again.cached_tokens > 0
    assert chat.ttft_s > 0 and chat.forward_time_s > 0
    assert chat.queue_time_s + chat.forward_time_s == pytest.approx(chat.ttft_s)  # arrival -> admit -> token


def test_queue_time_is_the_wait_for_a_running_slot() -> None:
    """With one running slot the second request is admitted only when the first finishes: its
    queue time covers the first one's whole run, the first one's is only its own admission."""
    engine = make_engine(max_running_requests=1)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    first, second = engine.generate(prompts(2, 40, 0, seed=5), sp)
    assert first.completion_tokens == second.completion_tokens == 12
    assert second.queue_time_s >= 0.9 * first.e2e_s > 0  # (less the microseconds between the arrivals)
    assert first.queue_time_s < 0.1 * second.queue_time_s
    for r in (first, second):
        assert r.queue_time_s + r.forward_time_s == pytest.approx(r.ttft_s)


@pytest.mark.parametrize(
    "prompt, sampling, message",
    [
        ([], GREEDY, "empty"),
        ("", GREEDY, "empty"),
        ([1] * 5000, GREEDY, "context length"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_k=0), "top_k"),
        ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1, 10**6], GREEDY, "token ids"),
    ],
)
def test_bad_requests_raise_one_clear_error_and_engine_keeps_serving(prompt, sampling, message) -> None:
    engine = make_engine(context_length=256)
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate([prompt] if prompt == [] else prompt, sampling)
    assert engine.generate([[5, 6, 7]], GREEDY)[0].completion_tokens == 12
    assert_balanced(engine)


def test_pool_too_small_for_one_request() -> None:
    engine = make_engine(max_total_tokens=32)
    with pytest.raises(InvalidRequestError, match="device pool holds"):
        engine.generate([list(range(5, 40))], GREEDY)
    assert engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, temperature=0))[0].completion_tokens == 4


def test_bad_options() -> None:
    with pytest.raises(ConfigError, match="unknown model"):
        Engine("no-such-model")
    with pytest.raises(ConfigError, match="unknown engine option"):
        Engine("random:tiny", max_totl_tokens=5)
    with pytest.raises(ConfigError, match="page-size"):
        Engine("random:tiny", page_size=0)
    with pytest.raises(ConfigError, match="radix-eviction-policy"):
        Engine("random:tiny", radix_eviction_policy="fifo")


# a deployment holding each pair REFUSED lists: a model with the component, the flags of the mode
STANDALONE = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="random:tiny")
HOLDING = {("window", "cp"): ("random:gemma-small", dict(tp_size=2, attn_cp_size=2)),
           ("full", "latent-tp"): ("random:tiny", dict(tp_size=2, enable_kv_cache_sharding=True)),
           ("draft", "pd"): ("random:tiny", dict(**STANDALONE, disaggregation_mode="decode")),
           ("recurrent_state", "cp"): ("random:lfm2-tiny", dict(tp_size=2, attn_cp_size=2)),
           ("recurrent_state", "standalone"): ("random:lfm2-tiny", STANDALONE),
           ("window", "edit-reuse"): ("random:gemma-small", dict(enable_edit_reuse=True)),
           ("recurrent_state", "edit-reuse"): ("random:lfm2-tiny", dict(enable_edit_reuse=True)),
           ("latent", "edit-reuse"): ("random:mla-tiny", dict(enable_edit_reuse=True))}


@pytest.mark.parametrize("component, mode", list(REFUSED))
def test_a_component_a_mode_cannot_run_with_stops_the_engine_in_one_sentence_naming_both(component: str,
                                                                                        mode: str) -> None:
    model, flags = HOLDING[component, mode]
    with pytest.raises(ConfigError) as refused:
        Engine(model, dtype="float32", **flags)  # before any pool or rank process (nothing_left_running checks)
    assert str(refused.value) == REFUSED[component, mode].format(model=model)
    assert f"{component} component" in str(refused.value)


def test_device_pool_budget_is_shared_and_counts_staging_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sized from a budget (no --max-total-tokens): ranks on one device split it, and a rank's
    staging buffers (e.g. the shared-memory all-reduce) come out of its share (DESIGN inv. 6)."""
    from hicache.config import EngineConfig
    from hicache.model.loader import load_model
    from hicache.runtime import rank_plan

    cfg, cpu = EngineConfig(model="random:tiny"), torch.device("cpu")
    spec = load_model("random:tiny", torch.float32, weights=False).spec
    page = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4 * cfg.page_size  # float32 K and V
    monkeypatch.setattr(rank_plan, "device_memory_budget", lambda device, fraction: 64 * page)

    def device_pages(**place) -> int:
        return rank_plan.plan_rank(cfg, spec, rank_plan.RankContext(**place), None, cpu, torch.float32,
                                   True).device_pages

    assert device_pages() == 64 + 1  # + the reserved page 0
    assert device_pages(memory_share=2) == 32 + 1
    assert device_pages(memory_share=2, staging_bytes=8 * page) == 24 + 1
    with pytest.raises(ConfigError, match="of staging buffers"):
        device_pages(memory_share=2, staging_bytes=32 * page)


def test_flush_and_stats() -> None:
    engine = make_engine()
    p = prompts(1, 40, 40, seed=19)[0]
    engine.generate([p], GREEDY)
    engine.generate([p], GREEDY)
    stats = engine.stats()
    assert stats["hit_tokens"]["device"] == 36 and stats["prompt_tokens"] == 80
    assert stats["device_pool"]["cached_pages"] > 0
    assert engine.flush_cache()
    assert engine.stats()["device_pool"]["free_pages"] == engine.cache.capacity_pages
    assert engine.generate([p], GREEDY)[0].cached_tokens == 0


@pytest.mark.parametrize("device, cuda_bf16, cpu_native_bf16, want, prefill", [
    ("cpu", False, False, "float32", "same"),  # AVX2-only CPU: bf16 would be emulated
    ("cpu", False, True, "float32", "bfloat16"),  # AVX512-BF16 / AMX: decode float32 (blocks), prefill bf16
    ("cuda", True, False, "bfloat16", "same"),
    ("cuda", False, False, "float16", "same"),
])
def test_dtype_auto_picks_what_the_hardware_runs_natively_per_phase(monkeypatch: pytest.MonkeyPatch, device: str,
                                                                    cuda_bf16: bool, cpu_native_bf16: bool, want: str,
                                                                    prefill: str) -> None:
    monkeypatch.setattr(device_mod, "cpu_has_native_bf16", lambda: cpu_native_bf16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: cuda_bf16)
    dev = torch.device(device)
    chosen, why = device_mod.resolve_dtype("auto", dev)
    assert chosen == want and why
    assert device_mod.resolve_prefill_weights("auto", "auto", chosen, dev)[0] == prefill
    assert device_mod.resolve_dtype("bfloat16", dev) == ("bfloat16", "requested")
    # explicit flags override: an explicit float32 prefills in float32 too
    assert device_mod.resolve_prefill_weights("auto", "float32", "float32", dev)[0] == "same"
    assert device_mod.resolve_prefill_weights("bfloat16", "bfloat16", "bfloat16", dev)[0] == "same"
    # decode: GGUF blocks times 8-bit inputs where the kernels run, unless a dtype was asked for
    int8 = device == "cpu" and unavailable_reason() is None
    assert device_mod.resolve_decode_activations("auto", "auto", chosen, dev)[0] == ("int8" if int8 else "float32")
    assert device_mod.resolve_decode_activations("auto", "float32", "float32", dev)[0] == "float32"
    assert device_mod.resolve_decode_activations("int8", "float32", "float32", dev) == ("int8", "requested")
    # KV: float16 where the native decode attention reads it, else the model's dtype; flags override
    assert device_mod.resolve_kv_cache_dtype("auto", "auto", chosen, dev)[0] == ("float16" if int8 else chosen)
    assert device_mod.resolve_kv_cache_dtype("auto", "float32", "float32", dev)[0] == "float32"
    assert device_mod.resolve_kv_cache_dtype("bfloat16", "auto", chosen, dev) == ("bfloat16", "requested")


def test_engine_resolves_dtype_auto_once_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    want, _ = device_mod.resolve_dtype("auto", torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="hicache.device"):
        auto = Engine("random:tiny", max_total_tokens=512)
    kv = auto.config.kv_cache_dtype
    assert auto.config.dtype == want and auto.pool.k_buffers[0].dtype == device_mod.DTYPES[kv] and kv != "auto"
    assert f"dtype auto -> {want}" in caplog.text and "prefill weights auto -> " in caplog.text
    assert "decode activations auto -> " in caplog.text and f"KV cache auto -> {kv}" in caplog.text
    explicit = Engine("random:tiny", max_total_tokens=512, dtype=want, kv_cache_dtype=kv,
                      prefill_weight_dtype=auto.config.prefill_weight_dtype)
    # Cache namespaces (and so storage keys) name the dtype that runs, not "auto".
    assert auto.model_namespace == explicit.model_namespace
    ids = [5, 6, 7, 8, 9, 10]
    assert auto.generate([ids], GREEDY)[0].output_ids == explicit.generate([ids], GREEDY)[0].output_ids
    auto.shutdown()
    explicit.shutdown()



def test_float16_kv_cache_keeps_hits_equal_to_cold_and_has_its_own_namespace(plain: Engine) -> None:
    """``--kv-cache-dtype float16`` (the CPU default under ``--dtype auto``): half the bytes in
    every tier. A prompt's tokens attend to each other with the rounded K/V a later hit reads, so
    hits, partial hits and chunked prompts keep the cold output (invariant 1); the KV bits differ
    from a float32 cache's, so the cache namespace and the storage keys' dtype say so."""
    engine = make_engine(kv_cache_dtype="float16", enable_hierarchical_cache=True)
    f32 = make_engine()
    assert engine.pool.k_buffers[0].dtype == torch.float16 and engine.host_pool.dtype == torch.float16
    assert engine.pool.bytes_per_page * 2 == f32.pool.bytes_per_page
    assert engine.model_namespace != f32.model_namespace
    p = prompts(1, 150, 150, seed=4)[0]  # longer than a prefill chunk (64): chunks read the cached ones
    logits = record_logits(engine)
    cold = engine.generate([p], GREEDY)[0]
    first_cold = logits[len(logits) - len(cold.output_ids)][0]
    full = engine.generate([p], GREEDY)[0]
    # ~1e-7 apart (two kernels); unrounded new K/V in the cold pass would put them ~6e-6 apart
    torch.testing.assert_close(logits[len(logits) - len(full.output_ids)][0], first_cold, atol=1e-6, rtol=0)
    partial = engine.generate([p[:90] + [7, 8, 9]], GREEDY)[0]
    assert cold.output_ids == full.output_ids and full.cached_tokens == 148
    assert partial.cached_tokens == 88
    fresh = make_engine(kv_cache_dtype="float16", disable_radix_cache=True)
    assert partial.output_ids == fresh.generate([p[:90] + [7, 8, 9]], GREEDY)[0].output_ids
    assert fresh.generate([p], GREEDY)[0].output_ids == cold.output_ids
    assert_balanced(engine)
    for e in (engine, f32, fresh):
        e.shutdown()


def test_a_step_that_raises_fails_later_calls_at_once_instead_of_hanging() -> None:
    """Issue 56 H1: after a step raised (there: a pool assertion), the next ``generate`` spun forever on
    the broken request. Now the error reaches the caller once and every later call is refused."""
    from hicache.errors import EngineDeadError

    engine = Engine("random:tiny", dtype="float32", max_total_tokens=512)
    try:
        sched = engine.backend.core.scheduler

        def broken():
            raise AssertionError("a pool invariant broke")

        sched.schedule = broken
        with pytest.raises(AssertionError, match="invariant"):
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        with pytest.raises(EngineDeadError, match="failed in an earlier step .*invariant"):
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        with pytest.raises(EngineDeadError):
            engine.check_alive()
    finally:
        engine.shutdown()
