"""The warm-up pass at engine start (runtime/warmup.py): it runs before the server answers, counts
nowhere (``/stats``, ``/metrics``, the cache), leaves the pool as built, and changes no answer;
``skip_server_warmup`` turns it off."""

from __future__ import annotations

import logging

import httpx
import pytest

from hicache import Engine
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.warmup import PADDING_SLOT
from live_server import serving

pytestmark = [pytest.mark.engine, pytest.mark.server]

PROMPT = [5, 17, 42, 7, 99, 3, 61, 28, 14, 77, 2, 50, 33, 8, 19, 64, 90, 11, 45, 26]  # past a page: a cached page


def test_the_server_starts_warmed_up_with_every_counter_at_zero(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hicache.runtime.warmup")
    with serving("random:tiny", name="tiny") as srv:
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
        assert httpx.get(srv.base_url + "/health").json() == {"status": "ok"}
        stats = httpx.get(srv.base_url + "/stats").json()
        assert stats["prompt_tokens"] == 0 and stats["prefill_computed_tokens"] == 0
        assert stats["hit_tokens"] == {"device": 0, "host": 0, "storage": 0}
        pool = stats["device_pool"]
        assert pool["cached_pages"] == 0 and pool["free_pages"] == pool["capacity_pages"]
        metrics = httpx.get(srv.base_url + "/metrics").text
        assert "hicache_prompt_tokens_total 0.0" in metrics and "hicache_generation_tokens_total 0.0" in metrics
        assert 'hicache_requests_total{' not in metrics  # no request finished, of any reason
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                               "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(PROMPT)
        assert httpx.get(srv.base_url + "/stats").json()["prompt_tokens"] == len(PROMPT)


def test_the_warm_up_leaves_the_pool_as_built_and_changes_no_answer(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hicache.runtime.warmup")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    answers = []
    for skip in (False, True):
        engine = Engine("random:tiny", dtype="float32", skip_server_warmup=skip)
        try:
            kv = engine.runner.kv
            assert all(not b[PADDING_SLOT].any() for b in (*kv.k_buffers, *kv.v_buffers))  # zeroed after it ran
            answers.append([engine.generate([PROMPT, PROMPT[:5]], greedy)[i].output_ids for i in range(2)])
        finally:
            engine.shutdown()
    assert answers[0] == answers[1]
    ran = [r for r in caplog.records if r.getMessage().startswith("warm-up:")]
    assert len(ran) == 1  # the second engine skipped it
