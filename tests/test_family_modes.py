"""Every mode with a family that is not Llama (issue 47): Gemma 3's layer (``random:gemma-small``: four
norms, GeGLU, QK-norm, its own attention scale, one KV head, 5 layers attending an 8-token window with
their own RoPE to 1 full layer) gives the cold one-at-a-time greedy tokens whatever serves the prompt:
cached prefixes and chunks cut across the window, the host tier, NGRAM drafts, deterministic batches,
a TP2 writer's unified-layout objects read by one rank, a P/D pair. Context parallelism refuses it in one sentence."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from hicache import Engine
from hicache.config import ConfigError
from hicache.disagg.bootstrap import Bootstrap
from hicache.runtime.sampling import SamplingParams

pytestmark = pytest.mark.engine

MODEL = "random:gemma-small"
BASE = dict(dtype="float32", page_size=4, max_total_tokens=4096)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
HEAD = [(7 * i + 3) % 200 + 20 for i in range(26)]  # a shared head three windows long
PROMPTS = [HEAD + [(5 * i + j) % 200 + 20 for i in range(6 + 9 * j)] for j in range(5)]
PROMPTS += [block * 3 for block in ([(i * 11 + j) % 200 + 20 for i in range(10 + j)] for j in range(2))]  # loops


def run(engine: Engine, prompts=PROMPTS, together: bool = False) -> list[list[int]]:
    try:
        if together:
            return [r.output_ids for r in engine.generate(prompts, GREEDY)]
        return [engine.generate([p], GREEDY)[0].output_ids for p in prompts]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def cold() -> list[list[int]]:
    return run(Engine(MODEL, disable_radix_cache=True, **BASE))


def test_cached_prefixes_chunks_and_batches_give_the_cold_tokens(cold) -> None:
    engine = Engine(MODEL, chunked_prefill_size=12, **BASE)  # chunks of 12 cross the 8-token windows
    try:
        first = [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]
        again = [engine.generate([p], GREEDY)[0] for p in PROMPTS]  # from the radix cache
        assert first == [r.output_ids for r in again] == cold
        assert all(r.cached_tokens >= len(p) - 4 for r, p in zip(again, PROMPTS))
    finally:
        engine.shutdown()


def test_host_tier_hits_give_the_cold_tokens(cold) -> None:
    # the fixed split keeps the device pool at 160 full-layer tokens (shared blocks would lend full pages the
    # window share: everything would stay on the device)
    engine = Engine(MODEL, **dict(BASE, max_total_tokens=160), enable_hierarchical_cache=True, hicache_ratio=4.0,
                    swa_full_tokens_ratio=0.8)
    try:
        for p in PROMPTS:  # each evicts the others from the small device pool: they wait in host memory
            engine.generate([p], GREEDY)
        again = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
        assert [r.output_ids for r in again] == cold
        assert sum(r.cached_tokens_details["host"] for r in again) > 0
    finally:
        engine.shutdown()


def test_ngram_drafts_give_the_cold_tokens(cold) -> None:
    engine = Engine(MODEL, speculative_algorithm="NGRAM", **BASE)
    try:
        out = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
        assert [r.output_ids for r in out] == cold
        assert engine.stats()["speculative"]["request_verify_steps"] > 0
    finally:
        engine.shutdown()


def test_deterministic_batches_equal_one_at_a_time() -> None:
    det = dict(BASE, page_size=16, enable_deterministic_inference=True)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    alone_engine, batch_engine = Engine(MODEL, disable_radix_cache=True, **det), Engine(MODEL, **det)
    try:
        alone = [alone_engine.generate([p], sampling)[0] for p in PROMPTS]
        batched = batch_engine.generate(PROMPTS, sampling)
        assert [(r.output_ids, [e.logprob for e in r.logprobs]) for r in batched] == \
               [(r.output_ids, [e.logprob for e in r.logprobs]) for r in alone]
    finally:
        alone_engine.shutdown()
        batch_engine.shutdown()


def test_context_parallelism_refuses_sliding_windows_in_one_sentence() -> None:
    with pytest.raises(ConfigError, match="has sliding-window layers, which context parallelism and KV sharding do "
                                          "not implement yet"):
        Engine(MODEL, tp_size=2, attn_cp_size=2, **BASE)


@pytest.mark.multirank
def test_a_tp2_writers_unified_objects_serve_one_rank(cold, tmp_path: Path) -> None:
    """Gemma's one KV head is held by both TP ranks: written once to the unified layout; a one-rank
    engine reads the prefix from storage and answers the cold tokens."""
    opts = dict(BASE, page_size=4, enable_hierarchical_cache=True, hicache_storage_backend="file",
                hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}),
                hicache_storage_prefetch_threshold=8, hicache_storage_prefetch_policy="wait_complete",
                hicache_storage_key_scheme="unified", hicache_storage_layer_partition=3,
                hicache_storage_head_partition=1)
    assert run(Engine(MODEL, tp_size=2, **opts), PROMPTS[:2]) == cold[:2]
    reader = Engine(MODEL, **opts)
    try:
        out = [reader.generate([p], GREEDY)[0] for p in PROMPTS[:2]]
        assert [r.output_ids for r in out] == cold[:2]
        assert out[0].cached_tokens_details["storage"] > 0
    finally:
        reader.shutdown()


@pytest.mark.pd
def test_a_pd_pair_gives_the_cold_tokens_sending_only_the_missing_suffix(cold) -> None:
    """Prefill and decode engines (zmq): the decode side reuses its cached head (three windows long),
    only the rest of each prompt's KV crosses, and the answer is the cold one."""
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **BASE)
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True, **BASE)
    try:
        port = prefill.stats()["disaggregation"]["bootstrap_port"]
        for room, (prompt, want) in enumerate(zip(PROMPTS[:3], cold[:3]), start=1):
            boot = Bootstrap("127.0.0.1", port, room)
            side = threading.Thread(target=lambda: prefill.generate([prompt], GREEDY, bootstrap=boot))
            side.start()
            got = decode.generate([prompt], GREEDY, bootstrap=boot)[0]
            side.join(timeout=60)
            assert got.output_ids == want
            if room > 1:  # the shared head is the decode side's already
                assert got.decode_prefix_len >= 24 and got.kv_transferred_tokens == len(prompt) - got.decode_prefix_len
    finally:
        prefill.shutdown()
        decode.shutdown()
