"""Speculative decoding (issue 14): the draft's KV lives beside the target's in every tier.

The tier tests use a tiny random target and a requantized copy as its draft (agreement ~3 of 4
tokens: high enough that a draft proposing from a hole visibly loses acceptance); the SmolLM2
test uses the embedded draft, ``smollm2:int4-g64``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache import Engine, SamplingParams
from hicache.config import ConfigError, EngineConfig
from hicache.runtime.sampling import probabilities
from hicache.runtime.speculative import greedy_accept, rejection_accept
from hybrid_conversations import conversations

pytestmark = pytest.mark.spec

SRC = str(Path(__file__).resolve().parents[1] / "src")
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)
TARGET, DRAFT = "random:tiny", "random:tiny:int4-g16"
SPEC = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=DRAFT, speculative_num_steps=3)
BASE = dict(dtype="float32", page_size=16, max_total_tokens=4096)
# A two-turn session: the second prompt is the first, its answer, and a new question.
TURN1 = [(i * 37 + 11) % 240 + 5 for i in range(200)]
NEW_QUESTION = [(i * 13 + 3) % 240 + 5 for i in range(40)]


def prompts(n: int) -> list[list[int]]:
    return [[(i * 37 + 11 + 7 * j) % 240 + 5 for i in range(90 + 37 * j)] for j in range(n)]


# ---- flags ------------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    (dict(speculative_num_draft_tokens=0), "--speculative-num-draft-tokens must be at least 1, got 0"),
    (dict(speculative_num_draft_tokens=-2), "--speculative-num-draft-tokens must be at least 1, got -2"),
    (dict(speculative_num_steps=0), "--speculative-num-steps must be at least 1"),
    (dict(speculative_num_steps=3, speculative_num_draft_tokens=3), "must be --speculative-num-steps \\+ 1 \\(4\\)"),
    (dict(speculative_draft_model_path=None), "needs --speculative-draft-model-path"),
    (dict(speculative_algorithm="EAGLE"), "must be one of STANDALONE"),
    (dict(attn_cp_size=2, tp_size=2), "not supported yet"),
])
def test_bad_speculative_flags_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{**SPEC, **options})


def test_draft_steps_default_and_derive() -> None:
    assert EngineConfig().speculative_steps == 0
    assert EngineConfig(**{**SPEC, "speculative_num_steps": None}).speculative_steps == 3
    assert EngineConfig(**{**SPEC, "speculative_num_steps": None, "speculative_num_draft_tokens": 6}).speculative_steps == 5
    with pytest.raises(ConfigError, match="needs --speculative-algorithm STANDALONE"):
        EngineConfig(speculative_draft_model_path=DRAFT)


def test_draft_with_another_vocabulary_is_refused() -> None:
    other = 'random:{"vocab_size": 400}'
    with pytest.raises(ConfigError) as e:
        Engine(TARGET, **BASE, **{**SPEC, "speculative_draft_model_path": other})
    assert str(e.value) == (f"the draft model {other!r} cannot speculate for 'random:tiny': its vocabulary has 400 "
                            "tokens, the target's 320; a draft must share the target's tokenizer.")


# ---- acceptance rules -----------------------------------------------------------------
def test_greedy_accept_keeps_the_matching_drafts_and_adds_the_targets_token() -> None:
    logits = torch.full((4, 8), -1.0)
    for row, tok in enumerate([5, 2, 7, 1]):
        logits[row, tok] = 1.0
    assert greedy_accept([5, 2, 7], logits) == [5, 2, 7, 1]  # all drafts, then the bonus token
    assert greedy_accept([5, 3, 7], logits) == [5, 2]  # stops at the first mismatch, with the fix
    assert greedy_accept([4, 2, 7], logits) == [5]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_rejection_sampling_gives_the_targets_distribution(top_p: float) -> None:
    """Draft q, target p over 5 tokens: the first token out of the rule is distributed as p
    whatever q proposes (Leviathan et al., Theorem 1); with top-p, as the truncated p."""
    class Req:
        sampling = SamplingParams(temperature=1.0, top_p=top_p)
        generator = torch.Generator().manual_seed(7)

    target_logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]] * 2)
    p = probabilities(target_logits[0], Req.sampling)
    p = p / p.sum()
    q = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.1])
    n, counts = 6000, torch.zeros(5)
    for _ in range(n):
        draft = int(torch.multinomial(q, 1, generator=Req.generator))
        counts[rejection_accept([draft], q[None], target_logits, Req)[0]] += 1
    assert (counts / n - p).abs().max() < 0.02, (counts / n, p)


# ---- the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain() -> Engine:
    return Engine(TARGET, **BASE)


def test_greedy_output_equals_the_plain_engine(plain: Engine) -> None:
    """Continuous batching and chunked prefill with a draft: every request says what the
    target alone says, and the drafts are mostly accepted."""
    ps = prompts(4)
    ref = plain.generate(ps, GREEDY)
    spec = Engine(TARGET, **BASE, **SPEC, chunked_prefill_size=64)
    out = spec.generate(ps, GREEDY)
    assert [r.output_ids for r in out] == [r.output_ids for r in ref]
    for r in out:
        assert r.spec_verify_steps > 0 and 1.0 <= r.spec_accept_length <= 4.0
        # every token after the first (the prefill's) came out of a verify pass
        assert round(r.spec_accept_length * r.spec_verify_steps) == r.completion_tokens - 1
    stats = spec.stats()["speculative"]
    assert stats["request_verify_steps"] == sum(r.spec_verify_steps for r in out)
    assert stats["accept_length"] > 1.5
    # fewer target passes than tokens: that is what speculation is for
    assert sum(r.spec_verify_steps for r in out) < sum(r.completion_tokens - 1 for r in out)
    assert spec.cache.usage()["free_pages"] == spec.cache.capacity_pages - spec.cache.usage()["cached_pages"]


def test_a_stop_inside_the_accepted_tokens_ends_the_request_there(plain: Engine) -> None:
    """The stop token is accepted mid-round: the output ends with it, the tokens drafted after
    it are neither output nor counted, and what is cached covers only tokens with KV."""
    prompt = prompts(1)[0]
    free = plain.generate([prompt], GREEDY)[0].output_ids
    stop = next(t for t in free[3:] if t not in free[:3])
    want = free[: free.index(stop) + 1]
    spec = Engine(TARGET, **BASE, **SPEC)
    res = spec.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[stop]))[0]
    assert res.output_ids == want and res.finish_reason == "stop"
    assert round(res.spec_accept_length * res.spec_verify_steps) == len(want) - 1
    again = spec.generate([prompt + want + [7, 8]], GREEDY)[0]  # its history comes from the cache
    ref = plain.generate([prompt + want + [7, 8]], GREEDY)[0]
    assert again.cached_tokens > 0 and again.output_ids == ref.output_ids


def test_a_draft_with_other_kv_rows_gets_a_sidecar(plain: Engine) -> None:
    draft = 'random:{"num_layers": 1, "num_kv_heads": 1, "head_dim": 32}'
    with pytest.raises(ConfigError, match="packed needs the draft's KV rows to match the target's"):
        Engine(TARGET, **BASE, **{**SPEC, "speculative_draft_model_path": draft}, speculative_draft_kv_layout="packed")
    spec = Engine(TARGET, **BASE, **{**SPEC, "speculative_draft_model_path": draft}, enable_hierarchical_cache=True)
    assert len(spec.pool.k_buffers) == 2 and spec.cache.sidecar_view.k_buffers[0].shape[1:] == (1, 32)
    # the draft's bytes are part of every page's budget
    assert spec.stats()["host_pool"]["host_pool_bytes"] > spec.host_pool.total_bytes
    ps = prompts(2)
    assert [r.output_ids for r in spec.generate(ps, GREEDY)] == [r.output_ids for r in plain.generate(ps, GREEDY)]


def test_sampled_requests_stop_where_asked() -> None:
    spec = Engine(TARGET, **BASE, **SPEC)
    sampled = SamplingParams(max_new_tokens=17, temperature=0.8, top_p=0.9, seed=3)
    a, b = spec.generate(prompts(2), sampled)
    assert a.completion_tokens <= 17 and b.completion_tokens <= 17
    assert spec.generate(prompts(2), sampled)[0].output_ids == a.output_ids  # seeded: reproducible


# ---- draft state in every tier --------------------------------------------------------------
LAYOUTS = ["packed", "sidecar"]


def tiered(path: Path, **kw) -> Engine:
    # replies cached too (--cache-generated-kv on): the history a tier brings back holds the first turn's
    # reply, whose draft KV was computed by draft steps and verified, not by a prefill
    opts = dict(BASE, enable_hierarchical_cache=True, hicache_storage_backend="file",
                hicache_storage_backend_extra_config=json.dumps({"path": str(path)}),
                hicache_storage_prefetch_threshold=64, hicache_storage_prefetch_policy="wait_complete",
                cache_generated_kv="on")
    return Engine(TARGET, **{**opts, **SPEC, **kw})


def second_turn(engine: Engine) -> list[int]:
    """Run turn 1 on ``engine``; the second turn's prompt."""
    first = engine.generate([TURN1], GREEDY)[0]
    return TURN1 + first.output_ids + NEW_QUESTION


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[list[int], list[int], float]:
    """(turn-2 prompt, its output, its acceptance length) computed cold in a fresh engine."""
    engine = tiered(tmp_path_factory.mktemp("warmup"))
    prompt = second_turn(engine)
    engine.shutdown()
    fresh = Engine(TARGET, **BASE, **SPEC)
    res = fresh.generate([prompt], GREEDY)[0]
    assert res.cached_tokens == 0
    return prompt, res.output_ids, res.spec_accept_length


@pytest.mark.cache
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("drop_draft", [False, True])
def test_history_from_device_and_host_keeps_acceptance(tmp_path: Path, cold, drop_draft: bool, layout: str) -> None:
    prompt, output, accept = cold
    engine = tiered(tmp_path, speculative_draft_kv_layout=layout)
    assert second_turn(engine) == prompt
    device = engine.generate([prompt], GREEDY)[0]  # history still in L1
    assert device.cached_tokens_details["device"] >= 208
    assert (device.output_ids, device.spec_accept_length) == (output, accept)
    engine.cache.drain()
    engine.cache.tree.evict(10**6)  # the history now lives in L2 only
    if drop_draft:  # the load-back restores the target's layers and leaves the draft's out
        engine.cache.controller.load_layers = engine.loaded.spec.num_layers
    host = engine.generate([prompt], GREEDY)[0]
    assert host.cached_tokens_details["host"] >= 208
    assert host.output_ids == output  # the target's KV came back: the output never changes
    if drop_draft:
        assert host.spec_accept_length < accept - 0.3, (host.spec_accept_length, accept)
    else:
        assert host.spec_accept_length == accept
    engine.shutdown()


@pytest.mark.storage
@pytest.mark.parametrize("layout,drop_draft", [("packed", False), ("sidecar", False), ("sidecar", True)])
def test_history_from_storage_in_a_new_process_keeps_acceptance(tmp_path: Path, cold, drop_draft: bool,
                                                               layout: str) -> None:
    prompt, output, accept = cold
    writer = tiered(tmp_path, speculative_draft_kv_layout=layout)
    second_turn(writer)
    writer.shutdown()  # its pages are flushed down to the file store
    code = f"""
import json
from hicache import Engine, SamplingParams
e = Engine({TARGET!r}, **{dict(BASE)!r}, **{SPEC!r}, speculative_draft_kv_layout={layout!r},
           enable_hierarchical_cache=True, hicache_storage_backend="file",
           hicache_storage_backend_extra_config=json.dumps({{"path": {str(tmp_path)!r}}}),
           hicache_storage_prefetch_threshold=64, hicache_storage_prefetch_policy="wait_complete")
if {drop_draft!r}:
    e.cache.controller.load_layers = e.loaded.spec.num_layers
r = e.generate([{prompt!r}], SamplingParams(max_new_tokens=24, temperature=0.0))[0]
print(json.dumps({{"ids": r.output_ids, "details": r.cached_tokens_details, "accept": r.spec_accept_length}}))
e.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=SRC))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["details"]["storage"] >= 208 and got["ids"] == output
    names = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    sidecar_objects = [n for n in names if n.endswith("-sidecar1")]
    # sidecar: one more object per page, on the same hash chain; packed: one object holds both
    assert len(sidecar_objects) == (len(names) // 2 if layout == "sidecar" else 0)
    if drop_draft:
        assert got["accept"] < accept - 0.3, (got["accept"], accept)
    else:
        assert got["accept"] == accept


# ---- the embedded model ---------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_greedy_output_is_unchanged_by_its_int4_draft() -> None:
    messages = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about rain."]
    opts = dict(dtype="float32", max_total_tokens=4096)
    plain = Engine("smollm2", **opts)
    tok = plain.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}])) for m in messages]
    sampling = SamplingParams(max_new_tokens=32, temperature=0.0)
    ref = plain.generate(ids, sampling)
    plain.shutdown()
    spec = Engine("smollm2", **opts, speculative_algorithm="STANDALONE",
                  speculative_draft_model_path="smollm2:int4-g64", speculative_num_steps=3)
    out = spec.generate(ids, sampling)
    assert [r.output_ids for r in out] == [r.output_ids for r in ref]
    assert spec.stats()["speculative"]["accept_length"] > 1.5


# ---- what an operator sees ------------------------------------------------------------------
@pytest.mark.server
def test_usage_metrics_and_bench_report_the_accept_length(tmp_path: Path, capsys) -> None:
    import httpx

    from hicache.cli import main
    from hicache.server.serve import ServerThread

    engine = Engine(TARGET, **{**BASE, "max_total_tokens": 16384}, **SPEC)
    srv = ServerThread(engine, served_model_name="tiny")
    base_url = srv.start()
    try:
        # Sampled (OpenAI's default temperature) from a seed, never stopped by EOS: at least one
        # verify pass whatever the process's global random state (an unseeded draw once sampled
        # EOS as the first token, which ends a request before any verify pass).
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 12,
                "seed": 7, "ignore_eos": True}
        usage = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
        assert usage["spec_verify_steps"] >= 1 and 1.0 <= usage["spec_accept_length"] <= 4.0
        out = tmp_path / "report.json"
        rc = main(["bench", "--base-url", base_url, "--gsp-num-groups", "1", "--gsp-prompts-per-group", "2",
                   "--gsp-system-prompt-len", "100", "--gsp-question-len", "16", "--gsp-output-len", "12",
                   "--gsp-num-turns", "2", "--seed", "1", "--output-file", str(out), "--disable-tqdm"])
        assert rc == 0
        assert "Accept length:" in capsys.readouterr().out
        spec = json.loads(out.read_text())["speculative"]
        total = httpx.get(base_url + "/stats", timeout=10).json()["speculative"]
        # the bench's window is the whole run but the first request
        assert spec["verify_steps"] == total["request_verify_steps"] - usage["spec_verify_steps"]
        metrics = httpx.get(base_url + "/metrics", timeout=10).text
        assert 'hicache_spec_accept_length_bucket{le="4.0"} 5.0' in metrics  # 1 chat + 4 bench requests
    finally:
        srv.stop()


# ---- ranks ------------------------------------------------------------------------------------
def agent_session(engine: Engine) -> list[tuple[list[int], float]]:
    """Three agents, three turns each (one batch per turn), histories growing, then one seeded
    sampled request; every request's (output, acceptance length)."""
    history = [[(i * 31 + 7 * a) % 240 + 5 for i in range(40)] for a in range(3)]
    out = []
    for turn in range(3):
        prompts = [h + [(turn * 11 + i) % 240 + 5 for i in range(12)] for h in history]
        results = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
        out += [(r.output_ids, r.spec_accept_length) for r in results]
        history = [p + r.output_ids for p, r in zip(prompts, results)]
    # seeded sampling: the draft's draws and the target's have streams of their own, so any
    # rank layout draws the same
    sampled = engine.generate([history[0]], SamplingParams(max_new_tokens=10, temperature=0.9, seed=5))[0]
    return out + [(sampled.output_ids, sampled.spec_accept_length)]


RANKS_MODEL = "random:small"  # 4 layers, 4 heads, 2 KV heads: TP2 and PP2 fit
RANKS_OPTS = dict(dtype="float32", page_size=4, max_total_tokens=512, enable_hierarchical_cache=True,
                  speculative_algorithm="STANDALONE", speculative_draft_model_path="random:small:int4-g16",
                  speculative_num_steps=3)


@pytest.fixture(scope="module")
def one_rank_session() -> list[tuple[list[int], float]]:
    """``agent_session`` on one rank: what every rank layout must answer and accept."""
    one = Engine(RANKS_MODEL, **RANKS_OPTS)
    try:
        return agent_session(one)
    finally:
        one.shutdown()


@pytest.mark.multirank
@pytest.mark.parallel
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_ranks_accept_and_answer_like_one_rank(tp: int, pp: int, one_rank_session,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache import consensus_record

    reference = one_rank_session
    assert sum(a for _, a in reference) / len(reference) > 1.5
    monkeypatch.setenv(consensus_record.ENV_VAR, "1")  # the rank consensus checker
    ranks = Engine(RANKS_MODEL, tp_size=tp, pp_size=pp, **RANKS_OPTS)
    try:
        assert agent_session(ranks) == reference
        assert ranks.stats()["speculative"]["request_verify_steps"] > 0
    finally:
        ranks.shutdown()


# ---- DESIGN invariants 4 and 5 for the draft's KV ----------------------------------------------
@pytest.mark.cache
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_draft_waits_for_its_own_layers_of_a_slow_load_back(tmp_path: Path, cold, layout: str) -> None:
    """Ready before read: a load-back whose draft layers arrive late (each held 50 ms) still
    gives the cold run's acceptance: the draft's passes wait for their layers' events."""
    prompt, output, accept = cold
    engine = tiered(tmp_path, speculative_draft_kv_layout=layout)
    second_turn(engine)
    engine.cache.drain()
    engine.cache.tree.evict(10**6)
    target_layers = engine.loaded.spec.num_layers
    engine.cache.controller.delay_fn = lambda op, layer: 0.05 if op.kind == "load" and layer >= target_layers else 0.0
    res = engine.generate([prompt], GREEDY)[0]
    assert res.cached_tokens_details["host"] >= 208
    assert (res.output_ids, res.spec_accept_length) == (output, accept)
    engine.shutdown()


@pytest.mark.storage
def test_a_missing_sidecar_object_ends_the_hit_at_the_page_before(tmp_path: Path, cold) -> None:
    """Nothing half-restored is served: a page whose draft object is gone is no hit."""
    prompt, output, _ = cold
    writer = tiered(tmp_path, speculative_draft_kv_layout="sidecar")
    second_turn(writer)
    writer.shutdown()
    reader = tiered(tmp_path, speculative_draft_kv_layout="sidecar")
    from hicache.cache.storage.keys import page_hashes
    sixth = page_hashes(TURN1[:96], 16, reader.cache.keys.digest(reader.model_namespace))[5].hex()
    next(tmp_path.rglob(f"{sixth}-sidecar1")).unlink()
    res = reader.generate([prompt], GREEDY)[0]
    assert res.cached_tokens_details["storage"] == 5 * 16 and res.output_ids == output
    reader.shutdown()


# ---- a hybrid target (sliding-window layers) on shared blocks ------------------------------------
HYBRID = "random:gemma-small"  # 5 layers attending an 8-token window, 1 full layer
# two layers of the same rows (one KV head of 32): packed, its layers join the full group
HYBRID_DRAFT = 'random:{"preset": "gemma-small", "num_layers": 2, "layer_kinds": ["sliding", "full"]}'
HYBRID_BASE = dict(dtype="float32", kv_cache_dtype="float32", page_size=4, chunked_prefill_size=12)


@pytest.mark.cache
@pytest.mark.slow
def test_a_packed_draft_of_a_hybrid_target_shares_the_blocks_and_answers_as_the_plain_engine() -> None:
    """The draft's two layers keep every page, like the target's full layer: G = 3 tensors, the five sliding
    layers in two groups of them. Four two-turn conversations through a pool of a few blocks over host memory
    (histories come back from L2, the draft's layers with the full ones) give the plain engine's tokens."""
    # replies cached too (their draft KV with them): whole histories move through host memory
    options = dict(HYBRID_BASE, max_total_tokens=100, enable_hierarchical_cache=True, hicache_ratio=8.0,
                   cache_generated_kv="on")
    plain = conversations(Engine(HYBRID, **dict(options, max_total_tokens=4096)), agents=4, turns=2, together=True)
    engine = Engine(HYBRID, **options, speculative_algorithm="STANDALONE", speculative_draft_model_path=HYBRID_DRAFT,
                    speculative_num_steps=3)
    pool = engine.backend.core.pool
    assert pool.windows.shared and pool.windows.groups == 2 and len({b.data_ptr() for b in pool.k_buffers}) == 3
    assert len(pool.k_buffers) == 6 + 2 and not pool.windows.layers & {6, 7}  # the draft's layers follow, full
    outputs, _ = conversations(engine, agents=4, turns=2, together=True, keep=True)
    stats = engine.stats()
    engine.shutdown()
    assert outputs == plain[0]
    assert stats["hit_tokens"]["host"] > 0 and stats["speculative"]["request_verify_steps"] > 0


def test_a_sidecar_draft_of_a_hybrid_target_keeps_the_fixed_split(caplog) -> None:
    """A sidecar pool is indexed by page id: on shared blocks it would need a row per block, so the
    target takes the default ratio's two pools (one log line); an explicit ratio gives two pools too."""
    sidecar = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=DRAFT, speculative_num_steps=3)
    with caplog.at_level("INFO", logger="hicache.runtime.hybrid_pool"):
        engine = Engine(HYBRID, **HYBRID_BASE, max_total_tokens=1024, **sidecar)
    assert engine.cache.sidecar_view is not None and not engine.backend.core.pool.windows.shared
    assert engine.backend.core.pool.hybrid
    assert any("a sidecar draft model" in r.getMessage() for r in caplog.records)
    engine.shutdown()
