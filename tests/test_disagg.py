"""Prefill/decode disaggregation (issue 16, seed section 5): the decode server keeps its own
tiers, reports ``decode_prefix_len`` and receives only the suffix's KV."""

from __future__ import annotations

import threading

import pytest

from hicache import Engine, SamplingParams
from hicache.config import ConfigError
from hicache.disagg.bootstrap import Bootstrap

MODEL = "random:small"
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
OPTS = dict(dtype="float32", page_size=16, max_total_tokens=1024)
SPAN = 64  # tokens: four pages
A, B, C = ([(i * 31 + 7 * k) % 250 + 3 for i in range(SPAN)] for k in (1, 2, 3))


@pytest.fixture
def servers():
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **OPTS)
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True,
                    enable_hierarchical_cache=True, **OPTS)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def serve(prefill: Engine, decode: Engine, prompt: list[int], room: int):
    """What a router does: the same request to both servers with one bootstrap; the decode
    server's result is the answer (the prefill server's carries what it sent)."""
    boot = Bootstrap("127.0.0.1", prefill.scheduler.pd.port, room)
    sent = []
    side = threading.Thread(target=lambda: sent.append(prefill.generate(prompt, GREEDY, bootstrap=boot)[0]))
    side.start()
    got = decode.generate(prompt, GREEDY, bootstrap=boot)[0]
    side.join(timeout=60)
    return got, sent[0]


def test_figure5_only_the_missing_suffix_crosses(servers) -> None:
    """A on the decode device, B in its host memory, C new: decode_prefix_len = |A| + |B|,
    only C's KV crosses, and the answer equals the non-disaggregated engine's."""
    prefill, decode = servers
    plain = Engine(MODEL, **OPTS)
    expected = plain.generate(A + B + C, GREEDY)[0].output_ids
    plain.shutdown()
    serve(prefill, decode, A, room=1)
    serve(prefill, decode, A + B, room=2)
    decode.cache.drain()  # B's pages reach the host tier (write-through)...
    assert decode.cache.tree.evict(SPAN // 16) == SPAN // 16  # ...then leave the device: B is host-only
    got, sent = serve(prefill, decode, A + B + C, room=3)
    assert got.output_ids == expected and got.finish_reason == "length"
    assert got.decode_prefix_len == 2 * SPAN
    assert got.cached_tokens_details == {"device": SPAN, "host": SPAN, "storage": 0}
    spec = decode.loaded.spec
    row = spec.num_kv_heads * spec.head_dim * 4  # float32
    assert got.kv_transferred_tokens == sent.kv_transferred_tokens == SPAN  # C only, not 3 * SPAN
    assert got.kv_transferred_bytes == sent.kv_transferred_bytes == SPAN * row * 2 * spec.num_layers
    assert sent.output_ids == expected[:1]  # prefill computed the first token and stopped


def test_without_decode_side_reuse_the_whole_prompt_crosses() -> None:
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **OPTS)
    decode = Engine(MODEL, disaggregation_mode="decode", **OPTS)
    try:
        serve(prefill, decode, A + B, room=7)
        got, _ = serve(prefill, decode, A + B + C, room=8)
        assert got.decode_prefix_len == 0 and got.kv_transferred_tokens == 3 * SPAN
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_prefill_server_that_never_answers_fails_the_request_and_frees_its_pages(monkeypatch) -> None:
    from hicache.disagg import transfer

    monkeypatch.setattr(transfer, "RECEIVE_TIMEOUT_S", 0.5)
    monkeypatch.setattr("hicache.disagg.role.RECEIVE_TIMEOUT_S", 0.5)
    decode = Engine(MODEL, disaggregation_mode="decode", **OPTS)
    try:
        free = decode.cache.allocator.available
        got = decode.generate(A, GREEDY, bootstrap=Bootstrap("127.0.0.1", 9, 5))[0]  # nobody listens there
        assert got.finish_reason == "error" and "prefill server" in got.error and got.output_ids == []
        assert decode.cache.allocator.available == free
    finally:
        decode.shutdown()


def test_disaggregation_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="runs on one rank for now"):
        Engine(MODEL, disaggregation_mode="decode", tp_size=2)
    with pytest.raises(ConfigError, match="add --disaggregation-decode-enable-radix-cache"):
        Engine(MODEL, disaggregation_mode="decode", enable_hierarchical_cache=True)
    with pytest.raises(ConfigError, match="--disaggregation-mode must be one of"):
        Engine(MODEL, disaggregation_mode="both")


# ---- behind SGLang's own router ---------------------------------------------------------------
def test_sglang_router_serves_a_multi_turn_chat_through_a_pd_pair() -> None:
    """sglang-router (PD mode) sends each turn to both servers with a bootstrap; the decode
    server answers, as the one-engine server would, and later turns cross only their suffix."""
    import httpx

    from hicache.disagg.launch import pd_servers

    engine = Engine(MODEL, **OPTS)
    common = f"--model {MODEL} --dtype float32 --page-size 16 --max-total-tokens 2048"
    with pd_servers(common, decode_args="--disaggregation-decode-enable-radix-cache --enable-hierarchical-cache") as pd:
        messages = [{"role": "system", "content": "You plan trips. " * 8}]
        for turn, question in enumerate(("Lisbon in three days?", "And Porto?", "Which one in winter?")):
            messages.append({"role": "user", "content": question})
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
            got = httpx.post(f"{pd.url}/v1/chat/completions", json=body, timeout=60).json()
            answer = got["choices"][0]["message"]["content"]
            assert answer == engine.chat(messages, GREEDY).text, turn
            usage = got["usage"]
            assert usage["decode_prefix_len"] + usage["kv_transferred_tokens"] == usage["prompt_tokens"]
            if turn:  # the history is on the decode server: only the new turn crosses
                assert usage["decode_prefix_len"] >= previous // 16 * 16 - 16 > 0
            previous = usage["prompt_tokens"]
            messages.append({"role": "assistant", "content": answer})
        stats = httpx.get(f"{pd.decode_url}/stats", timeout=10).json()["disaggregation"]
        assert stats["mode"] == "decode" and stats["requests"] == 3 and stats["failed"] == 0
        assert "hicache_kv_transfer_total{field=\"bytes\"}" in httpx.get(f"{pd.decode_url}/metrics", timeout=10).text
    engine.shutdown()
