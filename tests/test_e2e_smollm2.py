"""End-to-end on the embedded SmolLM2-135M-Instruct (float32 so cached and recomputed logits
compare tightly): a multi-turn chat served from the cache says exactly what the cache-off
engine says."""

from __future__ import annotations

import pytest

from hicache import Engine, SamplingParams

pytestmark = [pytest.mark.engine, pytest.mark.slow]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def engines(smollm2_reference: Engine):
    """The cached engine, and the session's cache-off one (conftest.py: float32, 16-token pages,
    4096 tokens, as this one)."""
    cached = Engine("smollm2", dtype="float32", max_total_tokens=4096, page_size=16)
    yield cached, smollm2_reference
    cached.shutdown()


def test_multi_turn_chat_equals_cache_off(engines) -> None:
    cached, plain = engines
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    questions = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
    for turn, q in enumerate(questions):
        messages.append({"role": "user", "content": q})
        res = cached.chat(messages, GREEDY)
        ref = plain.chat(messages, GREEDY)
        assert res.output_ids == ref.output_ids, f"turn {turn}"
        if turn:
            assert res.cached_tokens >= prev_prompt - 16  # the previous turn's prompt, in whole pages
        prev_prompt = res.prompt_tokens
        messages.append({"role": "assistant", "content": res.text})
    assert "Paris" in messages[2]["content"]


def test_stop_string_on_real_text(engines) -> None:
    cached, _ = engines
    msgs = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    free = cached.chat(msgs, SamplingParams(max_new_tokens=30, temperature=0.0))
    needle = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    res = cached.chat(msgs, SamplingParams(max_new_tokens=30, temperature=0.0, stop=[needle]))
    assert res.finish_reason == "stop" and res.completion_tokens < free.completion_tokens
    assert res.text == free.text[: free.text.find(needle)]
